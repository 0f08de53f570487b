"""Throughput in the task's own unit, model FLOPs, MFU and peak memory, for every logged training row.

Model FLOPs are counted once per run by torch's flop counter over one forward and backward of a training
micro-batch, on the model as the task built it (before activation checkpointing, compile or sharding), so
they are the model's own arithmetic: recomputation is not counted, and attention counts its two matmuls
forward and four backward whatever kernel runs them (torch's table adds the flash kernels' recompute of the
scores; the 6N + 12LdT rule PaLM and nanoGPT use does not, and MFU is defined against that rule). MFU divides
the FLOPs the run did per second by a peak measured here, the best of a few square matmuls in the compute
dtype at the plan's threads: what the hardware gives this process, not a datasheet figure.

A peak measured too briefly reads low (threads not yet spun up, a size short of the plateau), and an MFU
above 1 follows (#41: 1.30-1.40 logged in fp32). So the matmuls grow until one takes long enough to time,
and when a window does more FLOP/s than the peak, the peak is measured again, longer, and is never below
what the run achieved: MFU cannot exceed 1.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

aten = torch.ops.aten


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs (forward + backward) per throughput unit, and the unit's name."""

    per_unit: float
    unit: str


def _dense_attention(q_shape: Any, k_shape: Any, v_shape: Any) -> int:
    """Forward FLOPs of softmax(q k^T) v for (B, H, Lq, D) shapes: two matmuls, 2 FLOPs a multiply-add."""
    b, h, lq, d = q_shape
    lk, dv = k_shape[-2], v_shape[-1]
    return 2 * b * h * lq * lk * d + 2 * b * h * lq * lk * dv


def _packed_attention(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> int:
    """Forward FLOPs of packed (T, H, D) attention: each document attends within itself."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.float64)
    h, d, dv = q.shape[1], q.shape[2], v.shape[2]
    return int(float((lengths * lengths).sum()) * 2 * h * (d + dv))


def _sdpa_forward(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return _dense_attention(query.shape, key.shape, value.shape)


def _sdpa_backward(
    grad: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kw: Any
) -> int:
    # the gradients of both matmuls (dq and dk of the scores, dP and dv of the output): twice the forward
    return 2 * _dense_attention(query.shape, key.shape, value.shape)


def _fused_forward(
    q: Any, k: Any, v: Any, cu_seqlens: Any, *args: Any, out_val: Any = None, **kw: Any
) -> int:
    if q.dim() == 3:
        return _packed_attention(q, v, cu_seqlens)
    return _dense_attention(q.shape, k.shape, v.shape)


def _fused_backward(
    grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, cu_seqlens: Any, *args: Any, **kw: Any
) -> int:
    return 2 * _fused_forward(q, k, v, cu_seqlens)


def _short_causal_forward(q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kw: Any) -> int:
    # q (N, L, G, D) against k, v (N, S, D): counted whole, as SDPA's causal kernels are, though its query
    # blocks skip the masked part
    n, length, group, d = q.shape
    return _dense_attention((n, group, length, d), k.shape, v.shape)


def _short_causal_backward(
    grad: Any, q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kw: Any
) -> int:
    return 2 * _short_causal_forward(q, k, v)


def _formulas() -> dict[Any, Callable[..., int]]:
    """Attention ops counted by the model-FLOPs rule, on every backend this project dispatches to."""
    table: dict[Any, Callable[..., int]] = {}
    for name in ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu"):
        op = getattr(aten, f"_scaled_dot_product_{name}", None)  # (an older torch lacks some)
        back = getattr(aten, f"_scaled_dot_product_{name}_backward", None)
        if op is not None:
            table[op] = _sdpa_forward
        if back is not None:
            table[back] = _sdpa_backward
    ours = getattr(torch.ops, "torchkiln", None)
    if ours is not None and hasattr(ours, "flash_attention_fwd"):
        table[ours.flash_attention_fwd] = _fused_forward
        table[ours.flash_attention_bwd] = _fused_backward
    if ours is not None and hasattr(ours, "short_causal_fwd"):
        table[ours.short_causal_fwd] = _short_causal_forward
        table[ours.short_causal_bwd] = _short_causal_backward
    for formula in table.values():
        formula._get_raw = True  # type: ignore[attr-defined]  # torch's flop counter: pass the tensors
    return table


def count_flops(run: Callable[[], object]) -> int:
    """FLOPs of what `run()` computes (e.g. a forward and its backward), by torch's flop counter."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_formulas()) as counter:
        run()
    return int(counter.get_total_flops())


#: measured peaks of this process, by (device, dtype, threads, n): a second Trainer in one process (a sweep's
#: in-process jobs, the tests) reuses the first's measurement
_PEAKS: dict[tuple[str, torch.dtype, int, int], float] = {}


#: the smallest square matmul the peak is measured with, and the time one must take for the size to stop
#: growing: long enough to time it well, short enough that a slow or emulated CPU (QEMU's aarch64 runs bf16
#: matmuls at tens of MFLOP/s: 7 of 1024^3 there take minutes) measures in seconds
_PEAK_MIN_N = 256
_PEAK_ENOUGH_S = 0.05
#: the largest size, and the repetitions, of a first measurement and of one taken again (`remeasure_peak`)
_PEAK_N = {"cuda": 8192, "cpu": 2048}
_PEAK_AGAIN = 4  # the second measurement: sizes up to 2x larger, 4x the repetitions


def matmul_peak(device: torch.device, dtype: torch.dtype, *, n: int | None = None, reps: int = 5) -> float:
    """Best FLOP/s of a square matmul in `dtype` on `device`, up to n x n, under the process's current
    threads and matmul mode (the applied device plan's): the peak MFU is measured against; once a process."""
    n = n or _PEAK_N.get(device.type, _PEAK_N["cpu"])
    key = (str(device), dtype, torch.get_num_threads(), n)
    if key not in _PEAKS:
        _PEAKS[key] = _measure_peak(device, dtype, n, reps)
    return _PEAKS[key]


def remeasure_peak(device: torch.device, dtype: torch.dtype, achieved: float, reps: int = 5) -> float:
    """The peak again, for a run that did `achieved` FLOP/s a device, more than its first measurement: a
    longer measurement (larger sizes, more repetitions), and never below `achieved`; it replaces the first
    for the rest of the process."""
    n = _PEAK_N.get(device.type, _PEAK_N["cpu"])
    again = max(_measure_peak(device, dtype, 2 * n, reps * _PEAK_AGAIN), achieved)
    key = (str(device), dtype, torch.get_num_threads(), n)
    _PEAKS[key] = max(_PEAKS.get(key, 0.0), again)
    return _PEAKS[key]


def _measure_peak(device: torch.device, dtype: torch.dtype, n_max: int, reps: int) -> float:
    """The best rate of square matmuls at every size doubling from _PEAK_MIN_N up to `n_max` (each warmed up,
    then the best of `reps`): the plateau wherever it lies. Sizes stop growing once one matmul takes
    _PEAK_ENOUGH_S, so a slow or emulated device is measured at the size that already takes that long."""
    g = torch.Generator().manual_seed(0)  # its own generator: the run's random stream stays untouched
    n, best = min(_PEAK_MIN_N, n_max), 0.0
    while True:
        a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        _time_mm(a, b, device)  # warm-up: the first call builds kernels and caches
        # every size, not only the last: on an AMX Xeon bf16 ran faster at 2048 than at 4096, and the
        # smaller sizes' repetitions are the larger's warm-up (docs/running.md § Throughput and MFU)
        fastest = min(_time_mm(a, b, device) for _ in range(reps))
        best = max(best, 2 * n**3 / fastest)
        if n >= n_max or fastest >= _PEAK_ENOUGH_S:
            return best
        n = min(2 * n, n_max)


def _time_mm(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    torch.mm(a, b)
    _sync(device)
    return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: the device allocator's peak on CUDA, the driver's current
    allocation on MPS (it keeps no peak), the process's peak resident set on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB


def row(
    flops: ModelFlops | None, units: float, seconds: float, *, devices: int, peak: float | None
) -> dict[str, float]:
    """The throughput columns of one logged window: `units` of the task's unit over all ranks in
    `seconds`, done by `devices` processes each with `peak` FLOP/s."""
    seconds = max(seconds, 1e-9)
    out: dict[str, float] = {}
    if flops is None:
        return out
    rate = units / seconds
    out[f"train/{flops.unit}_per_s"] = rate
    done = flops.per_unit * rate  # model FLOP/s over all ranks
    out["train/tflops"] = done / 1e12
    if peak:
        out["train/mfu"] = done / (devices * peak)
    return out


def measure_model(
    model: nn.Module,
    batch: Callable[[], Any],
    step: Callable[[Any], object],
    units: Callable[[Any], float],
    unit: str,
) -> ModelFlops | None:
    """FLOPs per unit of `step(b)` (a forward and its backward on `model`) for the batch `b = batch()`, which
    holds `units(b)` units, leaving no trace: gradients cleared, buffers (BatchNorm statistics) and every
    random generator (the batch's augmentation draws too) as they were."""
    from core.rng import rng_state, set_rng_state

    state = rng_state()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    training = model.training
    try:
        model.train()
        data = batch()
        flops = count_flops(lambda: step(data))
        amount = units(data)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        set_rng_state(state)
        model.train(training)
    return ModelFlops(per_unit=flops / amount, unit=unit) if amount > 0 else None
