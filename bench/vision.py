"""Image classification step speed, side by side in one run: eager vs channels_last vs compiled, fp32 vs bf16.

    python -m bench.vision                                  # small_cnn, resnet18, vit; every variant
    python -m bench.vision --models resnet18 --size 64      # one model at 64 px
    python -m bench.vision --variants eager,channels_last   # no compiled ones (each compile takes minutes)

For each model (built by the registry as the recipe builds it, for 10 classes of `--size` px images with
`--channels` channels) and each variant, one training step = forward, cross-entropy, backward and an AdamW
step on a random batch. Variants: `eager` and `channels_last` (the model and its inputs in channels-last
memory format), each in fp32 and under bf16 autocast (the precision `precision=auto` picks on CPUs that
measure bf16 faster); `compiled` (torch.compile, Inductor, which picks its own layouts) in both. After
`--warmup` untimed steps (which include the compile), the variants take turns, one step each per round, for
`--steps` rounds, so drift in machine load hits them alike; images/s is batch / the median step time, and
each row's ratio is against eager fp32 of the same model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import vision  # noqa: F401  (registers the models)
from core.registry import MODELS

VARIANTS = ("eager", "channels_last", "compiled")
PRECISIONS = ("fp32", "bf16")


def make_step(
    model_name: str, variant: str, precision: str, size: int, channels: int, batch: int
) -> tuple[Callable[[], float], nn.Module]:
    """One training step of `model_name` in `variant` and `precision` on a fixed random batch, and the model
    it trains."""
    torch.manual_seed(0)
    model = MODELS.build(model_name, num_classes=10, in_channels=channels, image_size=size)
    x = torch.randn(batch, channels, size, size)
    y = torch.randint(0, 10, (batch,))
    if variant == "channels_last":
        model, x = (
            model.to(memory_format=torch.channels_last),
            x.contiguous(memory_format=torch.channels_last),
        )
    forward = torch.compile(model) if variant == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16")

    def step() -> float:
        with autocast:
            loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step, model


def measure(steps: dict[str, Callable[[], float]], rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each named step, timed in turns (one step of each per round)."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_model(
    model: str, variants: list[str], size: int, channels: int, batch: int, rounds: int, warmup: int
) -> list[dict[str, object]]:
    """Rows (model, variant, precision, images/s, ratio to eager fp32) for one model."""
    steps = {
        f"{v}/{p}": make_step(model, v, p, size, channels, batch)[0]
        for v in ["eager", *[v for v in variants if v != "eager"]]
        for p in PRECISIONS
    }
    med = measure(steps, rounds, warmup)
    base = med["eager/fp32"]
    return [
        {
            "model": model,
            "variant": name.split("/")[0],
            "precision": name.split("/")[1],
            "images_per_s": round(batch / s, 1),
            "vs_eager_fp32": round(base / s, 3),
        }
        for name, s in med.items()
    ]


def main() -> None:
    """Print one table row per (model, variant, precision), then the rows as one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small_cnn,resnet18,vit")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}")
    p.add_argument("--size", type=int, default=32, help="image side in pixels")
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of every variant each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (the compile among them)")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.size} px, batch {args.batch}")
    print(f"{'model':<10} {'variant':<14} {'precision':<9} {'images/s':>10} {'vs eager fp32':>14}")
    rows = []
    for model in args.models.split(","):
        for row in bench_model(
            model, variants, args.size, args.channels, args.batch, args.steps, args.warmup
        ):
            rows.append(row)
            print(
                f"{row['model']:<10} {row['variant']:<14} {row['precision']:<9} "
                f"{row['images_per_s']:>10} {row['vs_eager_fp32']:>14}",
                flush=True,
            )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
