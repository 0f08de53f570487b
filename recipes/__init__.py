"""The commands: `python -m recipes.NAME` (train, eval, predict, generate, transcribe, export, detect, list,
report); what they share lives in `recipes.cli`. Importing it measures the load the command starts under
before torch loads OpenMP, which reads its wait policy only then (recipes.cli.omp_wait)."""

from recipes.cli.omp_wait import prefer_passive_wait

prefer_passive_wait()
