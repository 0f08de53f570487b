"""Gradient accumulation on 2 gloo ranks: the loop's one gradient reduction per group against one per
micro-batch (what every micro-batch cost before `core.distributed.parallelize.gradient_sync`).

`python -m bench.accumulation [--parallel ddp,fsdp] [--accum 4] [--steps 24] [--batch 32]` runs the LM recipe
under torchrun (2 ranks x 1 thread, bf16, compile off, the same global batch and steps) twice per style:
`group` (as shipped) and `always`, where this script's child replaces the loop's `gradient_sync` with one
that never turns the reduction off. It prints tokens/s of each and the ratio. Weights are equal either way
(tests/core/test_distributed.py::
test_an_accumulation_group_reduces_gradients_once_and_trains_as_if_synced_every_micro_batch); only the
communication differs, so on one CPU host the ratio is the gloo reductions' share of a step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _child(argv: list[str]) -> int:
    """Under torchrun: recipes.train with the loop's gradient sync forced on for every micro-batch."""
    sys.path.insert(0, str(REPO))
    import core.loop.trainer
    from recipes.train import main

    core.loop.trainer.gradient_sync = lambda model, enabled: contextlib.nullcontext()
    return main(argv)


def main() -> None:
    """Launch each style's two runs one after another and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parallel", default="ddp,fsdp")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=32, help="global micro-batch (sequences), split by the ranks")
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        sys.exit(_child(args.child))
    from omegaconf import OmegaConf

    from bench.scaling import Run, launch

    context = OmegaConf.load(REPO / "conf" / "task" / "lm.yaml").task.context
    root = Path(tempfile.mkdtemp(prefix="tk-accum-"))
    log_every = max(1, args.steps // 4)
    common = [
        "+task=lm",
        "device=cpu",
        "compile.policy=off",
        "precision=bf16",
        f"trainer.max_steps={args.steps}",
        f"trainer.batch_size={args.batch}",
        f"trainer.grad_accum={args.accum}",
        "trainer.eval_every=0",
        f"trainer.log_every={log_every}",
        "trainer.progress=false",
        "logger=none",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    print(f"LM recipe on 2 gloo ranks x 1 thread, {args.steps} steps of {args.accum} micro-batches of")
    print(f"{args.batch} x {context} tokens; runs under {root}; load before {os.getloadavg()[0]:.1f}")
    print("| style | reductions | tokens/s | vs one per micro-batch |")
    print("|---|---|---|---|")
    for parallel in args.parallel.split(","):
        rates = {}
        for sync in ("always", "group"):
            run_dir = root / f"{parallel}-{sync}"
            script = [str(Path(__file__)), "--child"] if sync == "always" else ["-m", "recipes.train"]
            argv = [*torchrun, *script, *common, f"trainer.parallel={parallel}", f"hydra.run.dir={run_dir}"]
            t0 = time.time()
            # tokens per optimizer step: the accumulated micro-batches of the global batch
            rates[sync] = launch(
                Run(f"{parallel} {sync}", argv, env, run_dir), args.accum * args.batch * context
            )
            print(f"  ({parallel} {sync}: {time.time() - t0:.0f} s wall)", file=sys.stderr, flush=True)
        for sync, label in (("always", "one per micro-batch"), ("group", "one per group")):
            print(f"| {parallel} | {label} | {rates[sync]:.0f} | {rates[sync] / rates['always']:.2f}x |")
    print(f"load after {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
