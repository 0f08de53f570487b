"""What the commands at the top of `recipes/` share: the `key=value` options and the command wrapper of the
after-training commands, the training command line's checks, config schemas, run loading, sweeps, loggers,
the cluster and torchrun plumbing. Nothing here is a command; importing this package loads no torch
(`recipes/__init__` imports `recipes.cli.omp_wait` before torch)."""
