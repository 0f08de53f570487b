"""`task.channels_last` on this host: eager training steps (forward, backward, AdamW) of the image task's
convolutional models, NCHW against channels-last (NHWC), fp32 and bf16 autocast, interleaved so both layouts
see the same load. Prints images/s ratios (NHWC / NCHW) and the load average before and after.

`PYTHONPATH=. python -m bench.channels_last [--rounds 5] [--steps 3]`
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vision.models import resnet18, small_cnn

#: (name, builder, channels, side, batch): resnet18 at the ImageFolder preset's 64 px, small_cnn on digits
CASES = (
    ("resnet18 64px", resnet18, 3, 64, 32),
    ("small_cnn digits 8px", small_cnn, 1, 8, 64),
)


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _steps(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int, bf16: bool
) -> float:
    """Images per second over `n` training steps."""
    amp = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()
    t0 = time.perf_counter()
    for _ in range(n):
        with amp:
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return n * len(x) / (time.perf_counter() - t0)


def main() -> None:
    """Measure each case and precision; print one line each."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, loadavg before {_loadavg()}")
    for name, build, ch, side, batch in CASES:
        for bf16 in (False, True):
            torch.manual_seed(0)
            x = torch.randn(batch, ch, side, side)
            y = torch.randint(0, 10, (batch,))
            runs = {}
            for last in (False, True):
                torch.manual_seed(0)
                model = build(num_classes=10, in_channels=ch, image_size=side)
                fmt = torch.channels_last if last else torch.contiguous_format
                model = model.to(memory_format=fmt)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                runs[last] = (model, opt, x.contiguous(memory_format=fmt))
                _steps(*runs[last], y, 1, bf16)  # warm-up
            rates: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)  # interleaved, alternating first
                for last in order:
                    model, opt, xi = runs[last]
                    rates[last].append(_steps(model, opt, xi, y, args.steps, bf16))
            ratios = [b / a for a, b in zip(rates[False], rates[True], strict=True)]
            print(
                f"{name:22s} {'bf16' if bf16 else 'fp32'}: channels_last / NCHW images/s = "
                f"{statistics.median(ratios):.2f}x (per-round {min(ratios):.2f}-{max(ratios):.2f})"
            )
    print(f"loadavg after {_loadavg()}")


if __name__ == "__main__":
    main()
