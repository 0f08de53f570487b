"""fp32 vs the device plan's precision for one training step (forward, backward, AdamW) of a small CNN on
8x8 images, of a pre-norm transformer block and of the ASR recipe's Conformer-CTC XS, in one interleaved
run. For information it also times bf16 autocast when the plan did not pick it, and on CPU fp32 with
oneDNN bf16 fast math (the Graviton3+ setting).

Run: PYTHONPATH=. python bench/device_precision.py [--device auto] [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from audio.conformer import conformer_ctc_xs
from core.device import DevicePlan, resolve
from vision.models import Block


class SmallCNN(nn.Module):
    """Digits-sized CNN: two conv blocks and a linear head on 1x8x8 inputs."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.GELU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.GELU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(64 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for (B, 1, 8, 8) images."""
        return self.head(self.features(x).flatten(1))


class ConformerFrames(nn.Module):
    """The ASR recipe's model on unpadded utterances: log-mel (B, T, 80) -> log-probs (B, T/2, 29)."""

    def __init__(self) -> None:
        """conformer_ctc_xs with its registry defaults."""
        super().__init__()
        self.model = conformer_ctc_xs()

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Every frame is real (no padding), so the step is the model's own cost."""
        lengths = torch.full((feats.shape[0],), feats.shape[1], device=feats.device)
        return self.model(feats, lengths)[0]


def make_step(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype | None,
    plan: DevicePlan,
    fast_math: bool = False,
) -> Callable[[], None]:
    """One training step closure at autocast `dtype` (None = fp32), optionally with oneDNN bf16 fast math."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, **{plan.optimizer_impl: True} if plan.optimizer_impl != "default" else {}
    )
    scaler = torch.amp.GradScaler(plan.device.type, enabled=dtype is torch.float16)
    x, y = batch

    def step() -> None:
        if fast_math:  # what the plan does on Graviton3+: fp32 math, bf16 inside oneDNN matmuls/convs
            torch.backends.mkldnn.matmul.fp32_precision = torch.backends.mkldnn.conv.fp32_precision = "bf16"
        with torch.autocast(plan.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x)
            loss = F.cross_entropy(out, y) if out.ndim == 2 else F.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if fast_math:
            torch.backends.mkldnn.matmul.fp32_precision = torch.backends.mkldnn.conv.fp32_precision = "none"

    return step


def sync(plan: DevicePlan) -> None:
    """Wait for queued device work so timings are real."""
    if plan.device.type == "cuda":
        torch.cuda.synchronize(plan.device)
    elif plan.device.type == "mps":
        torch.mps.synchronize()


def matmul_times(
    plan: DevicePlan, columns: dict[str, tuple[torch.dtype | None, bool]], args: argparse.Namespace
) -> dict[str, float]:
    """The same columns for one bare 1024^3 matmul: the ceiling of what each precision can gain."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1024, 1024, generator=g).to(plan.device) for _ in range(2))
    times: dict[str, list[float]] = {col: [] for col in columns}
    for i in range(args.warmup + args.iters):
        for col, (dtype, fast_math) in columns.items():
            x, y = (a, b) if dtype is None else (a.to(dtype), b.to(dtype))
            if fast_math:
                torch.backends.mkldnn.matmul.fp32_precision = "bf16"
            sync(plan)
            t0 = time.perf_counter()
            x @ y
            sync(plan)
            if i >= args.warmup:
                times[col].append((time.perf_counter() - t0) * 1e3)
            if fast_math:
                torch.backends.mkldnn.matmul.fp32_precision = "none"
    return {col: statistics.median(t) for col, t in times.items()}


def main() -> None:
    """Time each model at each precision, interleaved so machine noise hits all columns alike."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="auto")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="override the plan's thread count (0 = keep)")
    args = parser.parse_args()
    plan = resolve(args.device)
    plan.apply()
    if args.threads:  # on a shared, oversubscribed machine one thread avoids OpenMP barrier stalls
        torch.set_num_threads(args.threads)
    dev = plan.device
    print(plan.summary(), f"(threads used: {torch.get_num_threads()})")
    print(f"precision: {plan.reasons['precision']}")
    g = torch.Generator().manual_seed(0)
    cases = {
        "small CNN, 8x8 images, batch 64": (
            SmallCNN,
            (torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)),
        ),
        "transformer block d=256 h=4, seq 128, batch 8": (
            lambda: Block(256, 4, causal=True),
            (torch.randn(8, 128, 256, generator=g), torch.randn(8, 128, 256, generator=g)),
        ),
        # the asr recipe's batch: 16 utterances of ~1.6 s (160 frames of 10 ms)
        "conformer_ctc_xs (asr recipe), 16 x 160 frames": (
            ConformerFrames,
            (torch.randn(16, 160, 80, generator=g), torch.randn(16, 80, 29, generator=g)),
        ),
    }
    columns: dict[str, tuple[torch.dtype | None, bool]] = {
        "fp32": (None, False),
        f"plan ({plan.precision})": (plan.autocast_dtype, plan.matmul_fp32_precision == "bf16"),
    }
    if plan.autocast_dtype is not torch.bfloat16:
        columns["bf16 autocast (info)"] = (torch.bfloat16, False)
    if dev.type == "cpu" and hasattr(torch.backends.mkldnn, "matmul"):
        columns["fp32 + oneDNN bf16 fast math (info)"] = (None, True)
    rows = []
    for name, (cls, batch) in cases.items():
        batch = tuple(t.to(dev) for t in batch)
        steps = {}
        for col, (dtype, fast_math) in columns.items():
            torch.manual_seed(0)
            steps[col] = make_step(cls().to(dev), batch, dtype, plan, fast_math)
        times: dict[str, list[float]] = {col: [] for col in columns}
        for i in range(args.warmup + args.iters):
            for col, step in steps.items():
                sync(plan)
                t0 = time.perf_counter()
                step()
                sync(plan)
                if i >= args.warmup:
                    times[col].append((time.perf_counter() - t0) * 1e3)
        rows.append((name, {col: statistics.median(t) for col, t in times.items()}))
    rows.append(("matmul 1024x1024x1024, forward only", matmul_times(plan, columns, args)))
    print(f"median ms per step over {args.iters} steps; speed-up = fp32 ms / column ms")
    header = ["model"] + [f"{c} ms" for c in columns] + [f"speed-up {c}" for c in list(columns)[1:]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, ms in rows:
        fp32 = ms["fp32"]
        cells = (
            [name] + [f"{v:.1f}" for v in ms.values()] + [f"{fp32 / v:.2f}x" for v in list(ms.values())[1:]]
        )
        print("| " + " | ".join(cells) + " |")
    if dev.type == "cpu" and plan.num_threads > 1:
        threads_table(plan, cases["small CNN, 8x8 images, batch 64"], args)


def threads_table(plan: DevicePlan, case: tuple, args: argparse.Namespace) -> None:
    """fp32 CNN step at 1 thread vs the plan's thread count, interleaved: shows what a shared host costs."""
    cls, batch = case
    torch.manual_seed(0)
    step = make_step(cls(), batch, None, plan)
    counts = (1, plan.num_threads)
    times: dict[int, list[float]] = {n: [] for n in counts}
    for i in range(args.warmup + args.iters):
        for n in counts:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            step()
            if i >= args.warmup:
                times[n].append((time.perf_counter() - t0) * 1e3)
    torch.set_num_threads(plan.num_threads)
    one, many = (statistics.median(times[n]) for n in counts)
    print(
        f"small CNN fp32 step: 1 thread {one:.1f} ms | {counts[1]} threads (plan) {many:.1f} ms | "
        f"speed-up of the plan's threads {one / many:.2f}x"
    )


if __name__ == "__main__":
    main()
