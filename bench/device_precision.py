"""fp32 vs bf16 autocast for one training step (forward, backward, AdamW) of each recipe's own default model
at its recipe's batch shape, interleaved step by step in one run, and what `precision=auto` chose.

The "auto vs best" column is the issue #14 target: `precision=auto` runs at that fraction of the faster of
fp32 and bf16 (1.00 when it picked the faster). On CPUs `auto` follows `core.device.probe`'s measurement,
whose own figures and cost are printed first. "recipe" is what the model's recipe runs: `auto`, unless
its config pins a precision; a training run's `auto` then times its own model (`core.device.model_precision`,
compared per recipe by `python -m bench.precision_auto`). For information it also times fp32
with oneDNN bf16 fast math (the Graviton3+ setting) on CPUs, and 1 thread against the plan's count.

Run: PYTHONPATH=. python -m bench.device_precision [--device auto] [--iters 20] [--models lm_gpt,...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from bench.compile import CASES, Case
from core.device import DevicePlan, resolve

#: each recipe's model (bench.compile builds them as their recipes configure them) -> the config that runs
#: it, under conf/: its task's, or the experiment that pins its precision (the Conformer's, since +task=asr
#: became the Whisper fine-tune)
RECIPE_MODELS = {
    "small_cnn": "task/image_classification",
    "asr_conformer_xs": "experiment/asr_conformer",
    "lm_gpt": "task/lm",
    "text_encoder": "task/text_classification",
}
CONF = Path(__file__).resolve().parents[1] / "conf"


def recipe_precision(case: str, auto: str) -> str:
    """The precision its recipe runs this case's model at: its config's pin, else auto's choice."""
    config = RECIPE_MODELS.get(case)
    pinned = yaml.safe_load((CONF / f"{config}.yaml").read_text()).get("precision") if config else None
    return auto if pinned in (None, "auto") else pinned


def make_step(case: Case, plan: DevicePlan, dtype: torch.dtype | None, fast_math: bool) -> Callable[[], None]:
    """One training step closure at autocast `dtype` (None = fp32), optionally with oneDNN bf16 fast math."""
    torch.manual_seed(0)
    model = case.build().to(plan.device).train()
    batch = case.batch(plan.device)
    fused = {plan.optimizer_impl: True} if plan.optimizer_impl != "default" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **fused)
    scaler = torch.amp.GradScaler(plan.device.type, enabled=dtype is torch.float16)

    def step() -> None:
        if fast_math:  # what the plan does on Graviton3+: fp32 math, bf16 inside oneDNN matmuls/convs
            torch.backends.mkldnn.matmul.fp32_precision = torch.backends.mkldnn.conv.fp32_precision = "bf16"
        with torch.autocast(plan.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = case.loss(model, batch)
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


def interleaved(steps: dict[str, Callable[[], None]], plan: DevicePlan, args: argparse.Namespace) -> dict:
    """Median ms per column, the columns alternating step by step so machine noise hits them alike."""
    times: dict[str, list[float]] = {col: [] for col in steps}
    for i in range(args.warmup + args.iters):
        for col, step in steps.items():
            sync(plan)
            t0 = time.perf_counter()
            step()
            sync(plan)
            if i >= args.warmup:
                times[col].append((time.perf_counter() - t0) * 1e3)
    return {col: statistics.median(t) for col, t in times.items()}


def main() -> None:
    """Time each recipe model at each precision and print one table row per model."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="auto")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--models", default=",".join(RECIPE_MODELS), help="comma-separated bench.compile cases"
    )
    parser.add_argument("--threads", type=int, default=0, help="override the plan's thread count (0 = keep)")
    args = parser.parse_args()
    plan = resolve(args.device)
    plan.apply()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(plan.summary(), f"(threads used: {torch.get_num_threads()})")
    print(f"host: {plan.detected['precision']}")
    print(f"precision: {plan.reasons['precision']}")
    columns: dict[str, tuple[torch.dtype | None, bool]] = {
        "fp32": (None, False),
        "bf16": (torch.bfloat16, False),
    }
    if plan.device.type == "cpu" and hasattr(torch.backends.mkldnn, "matmul"):
        columns["fast math (info)"] = (None, True)
    auto = "bf16" if plan.autocast_dtype is torch.bfloat16 else "fp32"
    print(f"median ms per training step over {args.iters} steps; speed-up = fp32 ms / column ms")
    header = [
        "model",
        *(f"{c} ms" for c in columns),
        "bf16 speed-up",
        "auto",
        "auto vs best",
        "recipe",
        "vs best",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in args.models.split(","):
        steps = {col: make_step(CASES[name], plan, dtype, fm) for col, (dtype, fm) in columns.items()}
        ms = interleaved(steps, plan, args)
        best = min(ms["fp32"], ms["bf16"])
        recipe = recipe_precision(name, auto)
        cells = [name, *(f"{v:.1f}" for v in ms.values()), f"{ms['fp32'] / ms['bf16']:.2f}x"]
        cells += [auto, f"{best / ms[auto]:.3f}", recipe, f"{best / ms[recipe]:.3f}"]
        print("| " + " | ".join(cells) + " |")
    if plan.device.type == "cpu" and plan.num_threads > 1:
        step = make_step(CASES["small_cnn"], plan, None, False)
        counts = {"1": 1, "plan": plan.num_threads}
        ms = interleaved({k: _at_threads(step, n) for k, n in counts.items()}, plan, args)
        torch.set_num_threads(plan.num_threads)
        print(
            f"small_cnn fp32 step: 1 thread {ms['1']:.1f} ms | {plan.num_threads} threads (plan) "
            f"{ms['plan']:.1f} ms | speed-up of the plan's threads {ms['1'] / ms['plan']:.2f}x"
        )


def _at_threads(step: Callable[[], None], n: int) -> Callable[[], None]:
    def run() -> None:
        torch.set_num_threads(n)
        step()

    return run


if __name__ == "__main__":
    main()
