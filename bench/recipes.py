"""Time a recipe end to end: wall seconds of the whole command and time until a validation target is met.

python bench/recipes.py --task image_classification --metric val/accuracy --target 0.97 [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    """Run `python -m recipes.train +task=TASK` once and print wall time, final metric, time to target."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="image_classification")
    ap.add_argument("--metric", default="val/accuracy")
    ap.add_argument("--target", type=float, default=0.97)
    ap.add_argument("--lower-is-better", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="tk-bench-")) / "run"
    cmd = [
        sys.executable,
        "-m",
        "recipes.train",
        f"+task={args.task}",
        "trainer.progress=false",
        f"hydra.run.dir={run}",
        *args.overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0, cpu0 = time.time(), os.times()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall, cpu1 = time.time() - t0, os.times()
    cpu = (cpu1.children_user - cpu0.children_user) + (cpu1.children_system - cpu0.children_system)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if args.metric in r]
    hit = next(
        (
            r
            for r in evals
            if (r[args.metric] <= args.target if args.lower_is_better else r[args.metric] >= args.target)
        ),
        None,
    )
    to_target = f"{hit['time'] - t0:.1f}s (step {hit['step']})" if hit else "not reached"
    print(f"| task | overrides | wall s (process) | CPU s | final {args.metric} | time to {args.target} |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {args.task} | {' '.join(args.overrides) or '-'} | {wall:.1f} | {cpu:.1f} | "
        f"{evals[-1][args.metric]:.4f} | {to_target} |"
    )
    print(f"load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
