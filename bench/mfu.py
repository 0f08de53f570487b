"""The MFU a run logs, beside an independent torch.mm peak taken in the same minutes (issue #41 point 1).

The LM recipe trains at nanoGPT's shape (bench/text_speed.py's SHAPE) in each precision; the bench reads
`train/mfu` and the peak the run measured for itself, and times torch.mm on its own, before and after the run,
at the sizes and repetitions a careful reader would use (up to 4096, the best of 10). The logged MFU must
never exceed 1, and should agree with the MFU against the independent peak.

    python -m bench.mfu [--steps 30] [--precisions fp32,bf16]

bf16 needs a CPU with bf16 matmul: where the device probe measured bf16 slower than fp32, the bf16 row says
so and is skipped (a bf16 run there measures emulation, not the loop).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.text_speed import SHAPE, recipe_loop
from core.device import resolve


def independent_peak(
    dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048, 4096), reps: int = 10
) -> float:
    """Best FLOP/s of torch.mm in `dtype` over `sizes` (each warmed up, then the best of `reps`), at the
    process's threads; sizes whose one matmul takes over 2 s are not tried."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if time.perf_counter() - t0 > 2.0:
            break
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def one(precision: str, steps: int) -> dict[str, float]:
    """Train `steps` steps in `precision`; the logged MFU and peak, and the independent peak around it."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    before = independent_peak(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        recipe_loop(steps, run, precision=precision, log_every=5)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    after = independent_peak(dtype)
    rows = [r for r in rows if "train/mfu" in r][1:]  # the first window holds the warm-up steps
    logged = max(r["train/mfu"] for r in rows)
    tflops = max(r["train/tflops"] for r in rows)
    peak = max(before, after)
    return {
        "logged_mfu_max": logged,
        "logged_tflops_max": tflops,
        "independent_peak_gflops": peak / 1e9,
        "mfu_vs_independent_peak": tflops * 1e12 / peak,
    }


def main() -> None:
    """Print one row per precision."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precisions", default="fp32,bf16")
    args = parser.parse_args()
    plan = resolve("cpu", "auto")
    bf16_speed = plan.probe.speedup("bf16") if plan.probe is not None else None
    print(f"host: {plan.facts.cpu.describe()}; {torch.get_num_threads()} threads; shape {SHAPE}")
    for precision in args.precisions.split(","):
        if precision == "bf16" and (bf16_speed is None or bf16_speed < 1.0):
            print(f"bf16: skipped, the device probe measured bf16 at {bf16_speed}x fp32 (no fast bf16 here)")
            continue
        out = one(precision, args.steps)
        print(
            f"{precision}: logged MFU (max over windows) {out['logged_mfu_max']:.3f} | "
            f"{out['logged_tflops_max'] * 1e3:.1f} GFLOP/s against an independent torch.mm peak of "
            f"{out['independent_peak_gflops']:.1f} GFLOP/s = MFU {out['mfu_vs_independent_peak']:.3f} | "
            f"ratio logged / independent {out['logged_mfu_max'] / out['mfu_vs_independent_peak']:.2f}"
        )


if __name__ == "__main__":
    main()
