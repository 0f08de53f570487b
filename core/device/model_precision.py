"""`precision=auto` on a CPU, decided for the model at hand: its own training step timed in fp32 and in bf16
autocast, and the faster kept, bf16 only when it wins by the machine probe's `MARGIN`.

The machine probe (`core.device.probe`) times three small cases once per machine; whether bf16 pays for a
model depends on the model too. On the same Zen 4 host the Whisper fine-tune trained 1.25-1.61x faster in bf16
while the Conformer-CTC, with its depthwise convolutions and 24-wide heads, stepped slower (BENCHMARKS.md §
Device precision). So a CPU run with precision=auto times its model (rank 0 for several): a warm-up step
of each on the run's first batch, then one pair on each of the next `STEPS` batches, forward and backward,
leaving RNG, buffers and gradients as they were. Each pair's batch is new to both precisions, as every
step's is in a run whose batches vary in length: on an AMX Xeon a bf16 GEMM's first call at a shape ran
about 3x its repeat while fp32's did not, and a probe that repeated one batch picked bf16 for two recipes
that trained 0.83x as fast in it (BENCHMARKS.md § Device precision). The result is cached by the machine,
thread count, torch version, the model's parameter shapes and the batches' shapes, so the next run of that
shape reads it. A measurement taken while other processes kept CPUs busy decides nothing: the machine's
choice stays, and the plan's line says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import statistics
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.cpuload import OthersLoad, loaded
from core.device.plan import DevicePlan
from core.device.probe import MARGIN
from core.files import cache_root, write_text_atomic

#: timed pairs (fp32, bf16), one on each batch after the first (the warm-up's)
STEPS = 3
#: bumped when what is timed changes, so older results are measured again (2: a new batch for each pair)
VERSION = 2


def model_key(plan: DevicePlan, model: nn.Module, batch_shapes: Any) -> str:
    """The cache key of a model's measurement: machine, threads, torch, parameter and batch shapes."""
    machine = plan.probe.fingerprint if plan.probe is not None else plan.detected.get("precision", "")
    params = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    kind = type(model).__qualname__
    parts = [VERSION, machine, plan.num_threads, torch.__version__, kind, params, batch_shapes]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def cache_path(key: str) -> Path:
    """Where the measurement of `key` is kept."""
    return cache_root() / "device" / f"model-precision-{key}.json"


@dataclasses.dataclass(frozen=True)
class ModelTiming:
    """Mean ms of the model's step in each precision over the timed batches, and the other processes' load
    meanwhile."""

    fp32_ms: float
    bf16_ms: float
    others_cpus: float | None
    measured_at: str
    cached: bool = False

    @property
    def under_load(self) -> bool:
        """Whether other processes kept BUSY_CPUS or more CPUs busy while it was measured."""
        return loaded(self.others_cpus)

    @property
    def speedup(self) -> float:
        """fp32 ms / bf16 ms: above 1, bf16 is faster."""
        return self.fp32_ms / self.bf16_ms


def measure(model: nn.Module, step: Callable[[bool, int], None]) -> ModelTiming:
    """Time `step(bf16, i)` (one forward and backward of the run's batch i) in fp32 and in bf16 autocast:
    both on batch 0 untimed, then a pair on each batch 1..STEPS, the pair's order alternating."""
    from core.compile.apply import Preserved, time_ms

    times: dict[bool, list[float]] = {False: [], True: []}
    with Preserved(model), OthersLoad() as others:
        step(False, 0)  # warm-up: first-call allocations and oneDNN primitives
        step(True, 0)
        for i in range(1, STEPS + 1):
            for bf16 in (i % 2 == 0, i % 2 == 1):
                times[bf16] += time_ms(model, lambda _m, b=bf16, i=i: step(b, i), 1)
    model.zero_grad(set_to_none=True)
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return ModelTiming(statistics.mean(times[False]), statistics.mean(times[True]), others.cpus, stamp)


def timing(key: str, model: nn.Module, step: Callable[[bool, int], None]) -> ModelTiming:
    """The cached measurement of `key`, else a new one (cached unless it was taken under load)."""
    path = cache_path(key)
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        saved = json.loads(path.read_text())
        return ModelTiming(**{**saved, "cached": True})
    result = measure(model, step)
    if not result.under_load:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = {k: v for k, v in dataclasses.asdict(result).items() if k != "cached"}
        write_text_atomic(path, json.dumps(kept))
    return result


def decide(plan: DevicePlan, result: ModelTiming) -> DevicePlan:
    """`plan` with the precision the model's timing picks, and the reason in its `precision` line."""
    told = f"{result.fp32_ms:.1f} ms fp32, {result.bf16_ms:.1f} ms bf16 ({result.speedup:.2f}x)"
    where = "cached" if result.cached else "measured now"
    if result.under_load:
        why = (
            f"this model's step {told}, measured under load ({result.others_cpus:.1f} CPUs busy with other "
            f"processes): decides nothing; the machine's choice stays ({plan.reasons.get('precision', '')})"
        )
        return dataclasses.replace(plan, reasons={**plan.reasons, "precision": why})
    bf16 = result.speedup >= MARGIN
    verdict = "past" if bf16 else "short of"
    why = f"this model's step {told}, {where} {result.measured_at}: bf16 {verdict} the {MARGIN:.2f}x it must"
    why += " win by"
    return dataclasses.replace(
        plan, autocast_dtype=torch.bfloat16 if bf16 else None, reasons={**plan.reasons, "precision": why}
    )


def precision_of(plan: DevicePlan, name: str, why: str) -> DevicePlan:
    """`plan` with precision `name` (fp32 or bf16) and `why` as its reason (a resumed run's own)."""
    dtype = {"fp32": None, "bf16": torch.bfloat16}[name]
    return dataclasses.replace(plan, autocast_dtype=dtype, reasons={**plan.reasons, "precision": why})


def trained_in(plan: DevicePlan, saved: Any, where: str) -> DevicePlan | None:
    """`plan` in `saved`, the precision `where` (a checkpoint or run) recorded it trained in; None where the
    record names none (a checkpoint from before meta.json kept it trained in the machine's choice)."""
    if saved not in ("fp32", "bf16"):
        return None
    return precision_of(plan, saved, f"precision=auto: {saved}, the precision {where} trained in")


def batch_shapes(batch: Any) -> Any:
    """The shapes and dtypes of a batch's tensors, nested as the batch is (the cache key's part)."""
    if isinstance(batch, torch.Tensor):
        return [list(batch.shape), str(batch.dtype)]
    if isinstance(batch, dict):
        return {k: batch_shapes(v) for k, v in sorted(batch.items())}
    if isinstance(batch, (list, tuple)):
        return [batch_shapes(v) for v in batch]
    return type(batch).__name__


def timed_step(
    task: Any, model: nn.Module, batches: list[Any], device: torch.device
) -> Callable[[bool, int], None]:
    """One forward and backward of `task.step` on batch i of `batches` (cycled), in bf16 autocast when
    asked."""

    def step(bf16: bool, i: int) -> None:
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            out = task.step(model, batches[i % len(batches)])
        out.loss.backward()

    return step


def available(plan: DevicePlan) -> bool:
    """Whether the model probe applies: a CPU plan (a GPU's choice rests on its tensor cores, not timing)."""
    return plan.device.type == "cpu"
