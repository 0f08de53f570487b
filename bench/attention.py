"""Attention benchmark: torchkiln's attention vs SDPA vs naive math, side by side, in one run.

CUDA: Triton kernels vs each SDPA backend (flash, efficient, cuDNN) and naive math, bf16, forward and
forward+backward, ms and TFLOP/s, plus packed (Triton) vs padded (SDPA + key-padding mask).
CPU: `auto` vs direct SDPA on plain inputs, packed vs padded+mask, and peak RSS growth of the blockwise path
vs the naive path on packed/masked input (each measured in a fresh subprocess).
CPU `--short`: SDPA's kernel vs the short path (core/attention/cpu_bf16.py) across lengths, bf16 and fp32,
alternating and each side on its own, and which one `auto` takes for each shape on this host.
CPU `--blocks`: the short path's causal attention unblocked vs in query blocks of 64, 128 and 256
(core/attention/cpu_bf16_causal.py), bf16, alternating. Both keep the CPU heap as a training run does.

    PYTHONPATH=. python bench/attention.py [--device cpu|cuda] [--quick] [--short | --blocks]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from core.attention import attention

REPO = Path(__file__).resolve().parents[1]


def attention_flops(lengths: list[int], heads: int, dim: int, causal: bool, backward: bool) -> float:
    """Matmul FLOPs: 4*H*L^2*D forward per sequence (half when causal); backward is 2.5x forward."""
    fwd = sum(4.0 * heads * n * n * dim for n in lengths) * (0.5 if causal else 1.0)
    return fwd * (3.5 if backward else 1.0)


def measure_ms(fns: dict[str, Callable[[], object]], device: str, repeats: int) -> dict[str, float]:
    """Best wall time in ms of each closure, run round-robin after one warm-up each.

    Round-robin and the minimum (not the median): on a machine shared with other jobs, load swings hit all
    contenders alike and the fastest run of each is the one least disturbed.
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: min(ts) for name, ts in times.items()}


def step(run: Callable[..., torch.Tensor], inputs: list[torch.Tensor], backward: bool) -> Callable[[], None]:
    """A closure running forward (and backward with a ones upstream gradient) once."""

    def once() -> None:
        if backward:
            for t in inputs:
                t.grad = None
            run(*inputs).backward(torch.ones_like(inputs[0]))
        else:
            with torch.no_grad():
                run(*inputs)

    return once


def row(label: str, ms: float, flops: float, base_ms: float | None) -> str:
    """One table line: ms, TFLOP/s and speed relative to the row's baseline (>1 = faster than baseline)."""
    ratio = "" if base_ms is None else f"{base_ms / ms:6.2f}x"
    return f"  {label:<44} {ms:10.2f} ms {flops / ms / 1e9:9.3f} TFLOP/s {ratio}"


def qkv(shape_q, shape_kv, dtype, device, grad: bool, seed: int = 0) -> list[torch.Tensor]:
    """Random q, k, v leaves."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shapes = (shape_q, shape_kv, shape_kv)
    return [torch.randn(s, generator=gen).to(device, dtype).requires_grad_(grad) for s in shapes]


def length_mix(tokens: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Sequence lengths uniform in [lo, hi] until about `tokens` in total (last one trimmed)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(rng.randint(lo, hi))
    lengths[-1] -= sum(lengths) - tokens
    if lengths[-1] < lo:
        lengths[-2] += lengths.pop()
    return lengths


def padded_inputs(lengths, heads, dim, dtype, device, grad):
    """Padded (B, H, Lmax, D) q/k/v and the (B, Lmax) key-padding mask for a length mix."""
    lmax = max(lengths)
    tensors = qkv((len(lengths), heads, lmax, dim), (len(lengths), heads, lmax, dim), dtype, device, grad)
    mask = torch.arange(lmax, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return tensors, mask


def packed_inputs(lengths, heads, dim, dtype, device, grad):
    """Packed (T, H, D) q/k/v and int32 cu_seqlens for a length mix."""
    total = sum(lengths)
    tensors = qkv((total, heads, dim), (total, heads, dim), dtype, device, grad)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return tensors, cu


def padded_sdpa(mask: torch.Tensor, causal: bool) -> Callable[..., torch.Tensor]:
    """What a user does without packing: SDPA over padding with a full (B, 1, L, L) boolean mask."""
    lmax = mask.shape[1]
    full = mask[:, None, None, :]
    if causal:
        full = full & torch.ones(lmax, lmax, dtype=torch.bool, device=mask.device).tril()
    full = full | ~full.any(-1, keepdim=True)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=full)


def packed_vs_padded(lengths, heads, dim, dtype, device, repeats) -> None:
    """Padded SDPA with a full mask vs our padded+key_padding_mask vs our packed, fwd and fwd+bwd."""
    (pq, pk, pv), cu = packed_inputs(lengths, heads, dim, dtype, device, True)
    (dq, dk, dv), mask = padded_inputs(lengths, heads, dim, dtype, device, True)
    # on CUDA each backend `auto` can route masked input to is timed by name too: the routing's evidence
    backends = ("auto", "triton", "sdpa") if device == "cuda" else ("auto",)
    for backward in (False, True):
        flops = attention_flops(lengths, heads, dim, True, backward)
        fns = {"SDPA padded + (B,1,L,L) mask": step(padded_sdpa(mask, True), [dq, dk, dv], backward)}
        for b in backends:
            kpm = lambda q, k, v, b=b: attention(q, k, v, causal=True, key_padding_mask=mask, backend=b)
            packed = lambda q, k, v, b=b: attention(
                q, k, v, causal=True, cu_seqlens=cu, max_seqlen=max(lengths), backend=b
            )
            fns[f"torchkiln {b} padded + key_padding_mask"] = step(kpm, [dq, dk, dv], backward)
            fns[f"torchkiln {b} packed (cu_seqlens)"] = step(packed, [pq, pk, pv], backward)
        ms = measure_ms(fns, device, repeats)
        base = ms["SDPA padded + (B,1,L,L) mask"]
        print(f" {'fwd+bwd' if backward else 'fwd'} (TFLOP/s counts useful, unpadded work):")
        for name, value in ms.items():
            print(row(name, value, flops, None if value is base else base))


def bench_cpu(quick: bool) -> None:
    """CPU tables: plain auto vs SDPA, packed vs padded+mask, then peak RSS of blockwise vs naive."""
    repeats = 5
    heads, dim = 8, 64
    print(f"## CPU ({torch.get_num_threads()} threads), fp32, H={heads}, D={dim}")
    for length in (1024,) if quick else (1024, 2048):
        for causal in (False, True):
            tensors = qkv((1, heads, length, dim), (1, heads, length, dim), torch.float32, "cpu", True)
            sdpa = lambda q, k, v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c)
            ours = lambda q, k, v, c=causal: attention(q, k, v, causal=c)
            naive = lambda q, k, v, c=causal: attention(q, k, v, causal=c, backend="math")
            for backward in (False, True):
                flops = attention_flops([length], heads, dim, causal, backward)
                fns = {
                    "SDPA": step(sdpa, tensors, backward),
                    "torchkiln auto": step(ours, tensors, backward),
                    "naive math": step(naive, tensors, backward),
                }
                ms = measure_ms(fns, "cpu", repeats)
                print(f"plain L={length} causal={causal} {'fwd+bwd' if backward else 'fwd'}:")
                for name, value in ms.items():
                    print(row(name, value, flops, None if name == "SDPA" else ms["SDPA"]))
    tiny = qkv((1, 2, 16, 16), (1, 2, 16, 16), torch.float32, "cpu", False)
    calls = 200
    fns = {
        "SDPA": lambda: [F.scaled_dot_product_attention(*tiny, is_causal=True) for _ in range(calls)],
        "auto": lambda: [attention(*tiny, causal=True) for _ in range(calls)],
    }
    # One thread: with two, a tiny op waits on an OpenMP barrier, and on a loaded machine a descheduled
    # worker turns that into milliseconds of noise that swamps the Python dispatch being measured.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ms = measure_ms(fns, "cpu", 4 * repeats)
    torch.set_num_threads(threads)
    print(
        f"dispatch overhead of auto per call (tiny input): {(ms['auto'] - ms['SDPA']) / calls * 1e3:.1f} us"
    )
    tokens = 4096 if quick else 8192
    lengths = length_mix(tokens, 64, 2048)
    print(f"packed vs padded, {len(lengths)} sequences, lengths uniform 64..2048 ({tokens} tokens), causal:")
    packed_vs_padded(lengths, heads, dim, torch.float32, "cpu", repeats)
    print("peak RSS growth, fwd+bwd, fresh process each (an L^2 fp32 score matrix at 16k, 8 heads: 8 GiB):")
    for path, tokens in [("auto-packed", 16384), ("auto-masked", 16384), ("math-packed", 4096)]:
        print(f"  {path:<14} {tokens:6d} tokens: {rss_growth(path, tokens) / 2**20:8.0f} MiB")


SHORT_SHAPES = [  # (batch, q heads, kv heads, length, head dim): the LM at nanoGPT's shape first
    (12, 6, 6, 256, 64), (12, 6, 6, 128, 64), (16, 4, 4, 200, 24), (4, 8, 8, 512, 64), (4, 8, 2, 512, 64),
    (2, 12, 12, 1024, 64), (1, 16, 16, 2048, 64),
]  # fmt: skip


def bench_short(quick: bool) -> None:
    """SDPA vs the short path, forward+backward, causal and not, in bf16 and fp32; and `auto`'s pick."""
    import math

    from core.attention import cpu_bf16

    repeats = 5
    print(f"## CPU ({torch.get_num_threads()} threads): SDPA's kernel vs the short path, forward+backward")
    for b, hq, hk, length, dim in SHORT_SHAPES[:3] if quick else SHORT_SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            for causal in (True, False):
                tensors = qkv((b, hq, length, dim), (b, hk, length, dim), dtype, "cpu", True)
                scale = 1 / math.sqrt(dim)
                fns = {
                    "SDPA": step(
                        lambda q, k, v, c=causal: attention(q, k, v, causal=c, backend="sdpa"), tensors, True
                    ),
                    "short": step(
                        lambda q, k, v, c=causal, s=scale: cpu_bf16.short_attention(
                            q, k, v, causal=c, scale=s
                        ),
                        tensors,
                        True,
                    ),
                }
                ms = measure_ms(fns, "cpu", repeats)
                # each side on its own too: alternating with flash slows the short path (each call follows
                # the other's allocations), which a training step, where it follows GEMMs, does not see
                alone = {name: measure_ms({name: fn}, "cpu", repeats)[name] for name, fn in fns.items()}
                pick = ""
                if cpu_bf16.eligible(*tensors):
                    pick = "auto: " + ("short" if cpu_bf16.use_short(*tensors, causal) else "SDPA")
                print(
                    f"  B={b} H={hq}/{hk} L={length} D={dim} {str(dtype)[6:]:8} causal={causal!s:5} "
                    f"SDPA {ms['SDPA']:8.2f} ms  short {ms['short']:8.2f} ms  "
                    f"{ms['SDPA'] / ms['short']:5.2f}x | each alone {alone['SDPA']:8.2f} / "
                    f"{alone['short']:8.2f} ms {alone['SDPA'] / alone['short']:5.2f}x  {pick}",
                    flush=True,
                )


def bench_blocks(quick: bool, sizes: tuple[int, ...] = (64, 128, 256)) -> None:
    """The short path's causal attention unblocked vs in query blocks of each of `sizes` (at most
    cpu_bf16_causal.MAX_BLOCKS blocks), bf16, forward+backward, alternating."""
    import math

    from core.attention import cpu_bf16

    if cpu_bf16.cpu_bf16_causal is None:
        print("torch < 2.4: the short path has no query blocks here")
        return
    repeats, default = 7, cpu_bf16.QUERY_BLOCK
    print(
        f"## CPU ({torch.get_num_threads()} threads): the short path's causal attention, unblocked vs blocks"
    )
    for b, hq, hk, length, dim in SHORT_SHAPES[:3] if quick else SHORT_SHAPES:
        tensors = qkv((b, hq, length, dim), (b, hk, length, dim), torch.bfloat16, "cpu", True)

        def blocked(q, k, v, size: int) -> torch.Tensor:  # noqa: ANN001
            cpu_bf16.QUERY_BLOCK = size
            try:
                return cpu_bf16.short_attention(q, k, v, causal=True, scale=1 / math.sqrt(q.shape[-1]))
            finally:
                cpu_bf16.QUERY_BLOCK = default

        fns = {"unblocked": step(lambda q, k, v: blocked(q, k, v, 2**31), tensors, True)}
        fns |= {f"block {n}": step(lambda q, k, v, n=n: blocked(q, k, v, n), tensors, True) for n in sizes}
        ms = measure_ms(fns, "cpu", repeats)
        cells = "  ".join(f"{name} {t:7.2f} ms {ms['unblocked'] / t:4.2f}x" for name, t in ms.items())
        print(f"  B={b} H={hq}/{hk} L={length} D={dim}  {cells}", flush=True)


def rss_growth(path: str, tokens: int) -> int:
    """Bytes of peak RSS growth of one forward+backward of `path`, measured in a fresh interpreter."""
    cmd = [sys.executable, __file__, "--rss-worker", path, str(tokens)]
    out = subprocess.run(
        cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["growth"]


def rss_worker(path: str, tokens: int) -> None:
    """Child side of rss_growth: build inputs, note current RSS, run once, print peak growth as JSON."""
    heads, dim = 8, 64
    if path.endswith("packed"):
        lengths = length_mix(tokens, 64, 2048)
        inputs, cu = packed_inputs(lengths, heads, dim, torch.float32, "cpu", True)
        backend = "math" if path.startswith("math") else "auto"
        run = lambda q, k, v: attention(q, k, v, causal=True, cu_seqlens=cu, backend=backend)
    else:
        inputs = qkv((1, heads, tokens, dim), (1, heads, tokens, dim), torch.float32, "cpu", True)
        mask = torch.rand(1, tokens) > 0.1
        run = lambda q, k, v: attention(q, k, v, causal=True, key_padding_mask=mask)
    before = _status_kib("VmRSS")
    step(run, inputs, backward=True)()
    # VmHWM is this process's own high-water mark; getrusage's ru_maxrss would include the parent's peak,
    # which Linux carries across fork/exec.
    print(json.dumps({"growth": max(0, _status_kib("VmHWM") - before) * 1024}))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def bench_cuda(quick: bool, packed_only: bool = False) -> None:
    """CUDA tables: Triton vs SDPA backends vs math, bf16, fwd and fwd+bwd; packed vs padded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    repeats = 10
    dtype = torch.bfloat16
    tokens = 16384
    sdpa_backends = {
        "SDPA flash": SDPBackend.FLASH_ATTENTION,
        "SDPA efficient": SDPBackend.EFFICIENT_ATTENTION,
        "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION,
    }
    print(f"## CUDA {torch.cuda.get_device_name()}, bf16, {tokens} tokens per batch")
    for dim in () if packed_only else (64, 128):
        heads = 2048 // dim
        for causal in (False, True):
            for length in (1024, 4096) if quick else (1024, 2048, 4096, 8192, 16384):
                batch = max(1, tokens // length)
                tensors = qkv((batch, heads, length, dim), (batch, heads, length, dim), dtype, "cuda", True)
                for backward in (False, True):
                    flops = attention_flops([length] * batch, heads, dim, causal, backward)
                    mode = "fwd+bwd" if backward else "fwd"
                    print(f"B={batch} H={heads} L={length} D={dim} causal={causal} {mode}:")
                    fns = {}
                    for name, kind in sdpa_backends.items():

                        def run(q, k, v, kind=kind, c=causal):
                            with sdpa_kernel([kind]):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=c)

                        try:  # a backend that refuses this shape or GPU is left out of the table
                            step(run, tensors, backward)()
                        except RuntimeError:
                            continue
                        fns[name] = step(run, tensors, backward)
                    ours = lambda q, k, v, c=causal: attention(q, k, v, causal=c, backend="triton")
                    fns["torchkiln triton"] = step(ours, tensors, backward)
                    if length <= 4096:
                        naive = lambda q, k, v, c=causal: attention(q, k, v, causal=c, backend="math")
                        fns["naive math"] = step(naive, tensors, backward)
                    results = measure_ms(fns, "cuda", repeats)
                    best = min(ms for name, ms in results.items() if name.startswith("SDPA"))
                    for name, ms in results.items():
                        print(
                            row(
                                name + (" (ratio vs best SDPA)" if name == "torchkiln triton" else ""),
                                ms,
                                flops,
                                best,
                            )
                        )
                    torch.cuda.empty_cache()
    heads, dim = 16, 128
    lengths = length_mix(tokens * 2, 64, 2048)
    print(f"packed vs padded, {len(lengths)} sequences uniform 64..2048, H={heads} D={dim}, bf16, causal:")
    packed_vs_padded(lengths, heads, dim, dtype, "cuda", repeats)


def main() -> None:
    """Parse flags and run the tables for the chosen device."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu; default: the device plan's choice")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--packed-only", action="store_true", help="CUDA: only the packed vs padded table")
    parser.add_argument("--short", action="store_true", help="CPU: SDPA vs the short path across lengths")
    parser.add_argument(
        "--blocks", action="store_true", help="CPU: the short path's causal attention, unblocked vs blocks"
    )
    parser.add_argument("--rss-worker", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        from core.device import resolve

        args.device = resolve().device.type
    if args.rss_worker:
        rss_worker(args.rss_worker[0], int(args.rss_worker[1]))
    elif args.short or args.blocks:
        from core.device.allocator import retain_freed_memory

        # as in a training run on a CPU (BENCHMARKS.md § CPU heap): freed buffers are reused, not faulted in
        retain_freed_memory()
        bench_short(args.quick) if args.short else bench_blocks(args.quick)
    elif args.device == "cuda":
        bench_cuda(args.quick, args.packed_only)
    else:
        bench_cpu(args.quick)


if __name__ == "__main__":
    main()
