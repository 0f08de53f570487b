"""Short attention in bf16 on a CPU: scores materialised in bf16, one softmax, two batched GEMMs, chosen over
SDPA's CPU flash kernel per shape by timing both.

SDPA's CPU flash kernel tiles queries and keys with fp32 accumulators and recomputes scores in backward;
at short lengths in bf16 its fixed tiling costs more than the whole score matrix does. Materialised, the
scores are GEMM work that bf16 kernels do at close to their peak, and one (B, H, L, S) softmax. On the Zen 4
class this path ran forward and backward 1.9-3.7x faster than flash at 128-512 positions and 1.15-1.6x at
the LM's nanoGPT shape (in that LM's training step 82 ms a step against flash's 205), and flash won again
past about 1k keys (BENCHMARKS.md § Attention). Causal queries longer than QUERY_BLOCK now go in blocks that
skip the masked part (core.attention.cpu_bf16_causal), which moved causal attention at 1k keys to this path
too. Which wins depends
on the host's bf16 kernels (AMX differs) and on the shape, so `use_short` times both once per shape class
and keeps the answer: in memory, in every checkpoint's meta (a resumed run adopts it), and in
$TORCHKILN_CACHE/device when it was measured on a quiet machine.
Code being compiled cannot time anything: there the choice already made eagerly for the shape class stands
(the trainer's FLOP count runs the first batch eagerly before a compiled step), else SDPA.

Numerics are those of Hugging Face transformers' eager attention in bf16: bf16 scores, a softmax computed
in fp32 and rounded to bf16, bf16 probabilities times V.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.attention.blockwise_sdpa import _sdpa
from core.attention.masks import causal_bias
from core.compile import torch_internals
from core.cpuload import OthersLoad, loaded
from core.files import cache_root, write_text_atomic

try:
    from core.attention import cpu_bf16_causal
except ImportError:  # torch < 2.4 has no custom ops: causal attention stays unblocked
    cpu_bf16_causal = None

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from core.device.facts import CpuFacts

#: bumped when what is timed changes, so older choices are measured again
VERSION = 3
#: the bytes of one call's bf16 score matrix this path may hold (it is kept for backward); past it, SDPA
SCORE_BYTES_LIMIT = 64 * 2**20
#: fewer scores than this (one call's B * Hq * L * S) go to SDPA untimed: a timing costs at least
#: core.cpuload.LOAD_WINDOW_S, and small shapes are the ones that come in many classes (a Whisper
#: fine-tune's decoder and decoding timed about 30, 7 s of a 97 s run, for calls of a few milliseconds)
MIN_SCORES = 2**20
#: timed calls per side, after one warm-up each
REPS = 3
#: this path is taken only when it beats SDPA by this much (noise near the crossover must not flip it)
MARGIN = 1.1
#: when the first timed pair takes longer than this (bf16 emulated on a CPU without bf16 instructions), it
#: is the timing: repeating it would cost seconds per shape class. Never the warm-ups: a process's first
#: SDPA call at 1k keys took 4x its later ones (one-time setup), and timed, that picked the short path
#: where SDPA is 1.6x faster (BENCHMARKS.md § Attention)
SLOW_MS = 500.0
#: causal queries longer than this go in blocks of this many (core.attention.cpu_bf16_causal); of 64, 128
#: and 256 timed on the Zen 4 class, 128 was the fastest or within 1% of it from 200 to 2k positions
#: (BENCHMARKS.md § Attention)
QUERY_BLOCK = 128
_CHOICES: dict[str, bool] = {}
#: the same choices by (shape class, kv heads, causal, grad) alone, for code being compiled to read
_DECIDED: dict[tuple, bool] = {}
#: whether a size is static, callable in code dynamo traces (core.compile.torch_internals); looked up with
#: the first decision (`_decide`), as compiled code takes this path only by one: the lookup imports sympy,
#: half a second of every process start otherwise (BENCHMARKS.md § Start-up)
_STATIC_SIZE: Callable[[Any], bool] | None = None


def short_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> torch.Tensor:
    """softmax(Q K^T * scale [+ causal mask]) V for dense (B, Hq, L, D) q and (B, Hk, S, D) k/v, Hk | Hq;
    causal is SDPA's: query i sees keys 0..i."""
    b, hq, length, d = q.shape
    hk, keys = k.shape[1], k.shape[2]
    group = hq // hk
    if causal and length > QUERY_BLOCK and cpu_bf16_causal is not None:
        # queries in blocks, each against the keys it can see: the masked part is never computed
        return cpu_bf16_causal.blocked_causal_attention(q, k, v, scale=scale, block=QUERY_BLOCK)
    # q heads h*group..h*group+group-1 share k/v head h: stack each group's queries as rows of one matrix,
    # so shared keys are multiplied once instead of repeated
    qg = (q * scale).reshape(b, hk, group * length, d)
    s = qg @ k.transpose(-1, -2)
    if causal:
        s = (s.view(b, hk, group, length, keys) + causal_bias(length, keys, s.dtype, s.device)).view_as(s)
    p = torch.softmax(s, -1)
    return (p @ v).view(b, hq, length, d)


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this path may run these tensors: plain bf16 CPU tensors, from MIN_SCORES scores to
    SCORE_BYTES_LIMIT bytes of them."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or not k.dtype == v.dtype == torch.bfloat16:
        return False
    if any(type(t) is not torch.Tensor for t in (q, k, v)):  # DTensor, fake and other subclasses keep SDPA
        return False
    scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    return scores >= MIN_SCORES and scores * 2 <= SCORE_BYTES_LIMIT


def use_short(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Whether this path beats SDPA by MARGIN for this shape class: remembered, read from the cache, or
    timed now."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    compiling = torch.compiler.is_compiling()
    if compiling and (not _DECIDED or not all(map(_STATIC_SIZE, (*q.shape, *k.shape)))):
        # nothing decided eagerly: SDPA. A dynamic dim has no one shape class; rounding it to one would pin
        # it to this call's size, and dynamo would then compile the graph again for every length it sees
        return False
    shape = _shape_class(q, k)
    decided = (shape, k.shape[1], causal, grad)
    if compiling:
        return _DECIDED.get(decided, False)
    key = _key(shape, k.shape[1], causal, grad)
    if key not in _CHOICES:
        timing = _cached(key)
        if timing is None:
            with torch_internals.no_dispatch_modes():  # a FLOP count around this call counts the call only
                timing = _measure(shape, k.shape[1], causal, grad)
            if not loaded(timing["others_cpus"]):
                with contextlib.suppress(OSError):
                    _cache_path(key).parent.mkdir(parents=True, exist_ok=True)
                    write_text_atomic(_cache_path(key), json.dumps(timing))
            else:  # measured while other processes kept CPUs busy: decides nothing, SDPA stays
                timing = {**timing, "short_ms": math.inf}
        _decide(key, decided, timing["sdpa_ms"] >= MARGIN * timing["short_ms"])
    return _CHOICES[key]


def _decide(key: str, decided: tuple, short: bool) -> None:
    """Remember a shape class's choice, by its cache key and by what compiled code looks it up by."""
    global _STATIC_SIZE
    if _STATIC_SIZE is None:
        _STATIC_SIZE = torch_internals.static_size_check()
    _CHOICES[key] = _DECIDED[decided] = short


def decisions() -> list[list]:
    """This process's choices as JSON rows [shape class, kv heads, causal, grad, short], for a checkpoint."""
    return [[list(shape), *rest, short] for (shape, *rest), short in _DECIDED.items()]


def adopt(rows: object) -> None:
    """Take a checkpoint's `decisions()` as this process's choices, before any timing: a resumed run keeps
    the paths it trained with, whatever a timing now would say (a run first timed under load kept SDPA);
    rows not of that form are skipped."""
    for row in rows if isinstance(rows, list) else []:
        ok = isinstance(row, list) and len(row) == 5 and isinstance(row[0], list) and len(row[0]) == 5
        if not ok or not all(type(n) is int for n in [*row[0], row[1]]):
            continue
        if not all(isinstance(flag, bool) for flag in row[2:]):
            continue
        shape, heads, causal, grad, short = tuple(row[0]), row[1], row[2], row[3], row[4]
        _decide(_key(shape, heads, causal, grad), (shape, heads, causal, grad), short)


def _shape_class(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(batch, q heads, L, S, D) with batch, L and S rounded up to powers of two: lengths that vary from
    batch to batch (text in an ASR decoder) share a few measurements instead of one each."""
    up = lambda n: 1 << max(0, n - 1).bit_length()  # noqa: E731
    return up(q.shape[0]), q.shape[1], up(q.shape[2]), up(k.shape[2]), q.shape[3]


def _key(shape: tuple[int, ...], kv_heads: int, causal: bool, grad: bool) -> str:
    from core.device.probe import fingerprint  # core.device imports late: the attention API does not need it

    # the machine as the device probe keys its own timing (CPU model and flags, torch, threads)
    machine = fingerprint(_cpu(), torch.__version__, torch.get_num_threads(), fast_math=False)
    parts = [VERSION, machine, shape, kv_heads, causal, grad]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=1)
def _cpu() -> CpuFacts:
    """This CPU's facts as the device plan read them (the trainer's plan), else detected once."""
    from core.device import applied_plan, detect

    plan = applied_plan()
    return plan.facts.cpu if plan is not None else detect().cpu


def _cache_path(key: str) -> Path:
    return cache_root() / "device" / f"attention-{key}.json"


def _cached(key: str) -> dict[str, float] | None:
    with contextlib.suppress(OSError, ValueError, TypeError):
        saved = json.loads(_cache_path(key).read_text())
        if isinstance(saved.get("sdpa_ms"), float) and isinstance(saved.get("short_ms"), float):
            return saved
    return None


def _measure(shape: tuple[int, ...], kv_heads: int, causal: bool, grad: bool) -> dict[str, float | None]:
    """Median ms of SDPA and of this path on random bf16 tensors of `shape`, forward (and backward with
    `grad`), alternating, after a warm-up each (the first timed pair alone where it exceeds SLOW_MS); and the
    CPUs other processes kept busy meanwhile."""
    b, hq, length, keys, d = shape
    gen = torch.Generator().manual_seed(0)  # the run's RNG streams are not touched
    q = torch.randn(b, hq, length, d, generator=gen).bfloat16()
    k, v = (torch.randn(b, kv_heads, keys, d, generator=gen).bfloat16() for _ in range(2))
    out_grad = torch.randn(b, hq, length, d, generator=gen).bfloat16()
    scale = 1.0 / math.sqrt(d)

    def sdpa(*t: torch.Tensor) -> torch.Tensor:
        return _sdpa(*t, is_causal=causal, scale=scale)

    def short(*t: torch.Tensor) -> torch.Tensor:
        return short_attention(*t, causal=causal, scale=scale)

    def once(fn) -> float:  # noqa: ANN001
        inputs = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        t0 = time.perf_counter()
        out = fn(*inputs)
        if grad:
            out.backward(out_grad)
        return (time.perf_counter() - t0) * 1e3

    with (
        torch.enable_grad() if grad else torch.no_grad(),
        torch.autocast("cpu", enabled=False),
        OthersLoad() as others,
    ):
        once(sdpa), once(short)  # warm-ups: one-time setup (kernels, thread pool, allocator) is not timed
        times = {"sdpa": [once(sdpa)], "short": [once(short)]}
        slow = times["sdpa"][0] + times["short"][0] > SLOW_MS
        for _ in range(0 if slow else REPS - 1):
            times["sdpa"].append(once(sdpa))
            times["short"].append(once(short))
    return {
        "sdpa_ms": statistics.median(times["sdpa"]),
        "short_ms": statistics.median(times["short"]),
        "others_cpus": others.cpus,
    }
