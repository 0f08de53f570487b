"""`attention(...)`: validate once, pick a backend from the device plan and the requested features, run it."""

from __future__ import annotations

import importlib.util
import math

import torch

from core.attention import cpu_bf16
from core.attention.triton_support import Problem, triton_problem
from core.errors import ConfigError

BACKENDS = ("auto", "triton", "sdpa", "math")
_ORDER_CACHE: dict[str, tuple[str, ...]] = {}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Scaled dot-product attention, dense (B, H, L, D) or packed (T, H, D) + cu_seqlens, any mask mix."""
    _validate(q, k, v, key_padding_mask, cu_seqlens, window, alibi_slopes, dropout_p, backend)
    if window is not None:
        window = (int(window[0]), 0 if causal else int(window[1]))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    features = _features(causal, key_padding_mask, cu_seqlens, window, alibi_slopes, dropout_p)
    name = _choose(backend, q, k, v, features)
    kwargs = dict(
        causal=causal,
        key_padding_mask=key_padding_mask,
        cu_seqlens=cu_seqlens,
        window=window,
        alibi_slopes=alibi_slopes,
        scale=scale,
        dropout_p=dropout_p,
    )
    if name == "triton":
        from core.attention.fused_op import fused_attention

        return fused_attention(q, k, v, max_seqlen=max_seqlen, **kwargs)
    if name == "sdpa":
        from core.attention.blockwise_sdpa import sdpa_attention

        # short bf16 attention on a CPU: materialised scores where timing shows they beat SDPA's kernel
        plain = backend == "auto" and features in ((), ("causal",))
        if plain and cpu_bf16.eligible(q, k, v) and cpu_bf16.use_short(q, k, v, causal):
            return cpu_bf16.short_attention(q, k, v, causal=causal, scale=scale)

        return sdpa_attention(q, k, v, **kwargs)
    from core.attention.math_path import math_attention

    return math_attention(q, k, v, **kwargs)


def backend_order(device: torch.device) -> tuple[str, ...]:
    """Backends worth trying on `device`, best first: the applied device plan's list (the one the trainer
    resolved), else a plan resolved for this device type once, else derived from the device."""
    from core.device import applied_plan

    plan = applied_plan()
    if plan is not None and plan.device.type == device.type:
        return plan.attention_backends
    key = device.type
    order = _ORDER_CACHE.get(key)
    if order is None:
        if torch.compiler.is_compiling():
            # resolve() calls builtins (os.cpu_count) that dynamo cannot trace under fullgraph=True; while
            # tracing before any eager call, the device-derived order stands in for the plan.
            return _derived_order(key)
        plan_order = None
        try:
            from core.device import resolve

            # the attention order does not depend on precision: no CPU precision measurement needed
            plan_order = getattr(resolve(key, measure=False), "attention_backends", None)
        except ConfigError:
            plan_order = None
        order = _ORDER_CACHE[key] = tuple(plan_order or _derived_order(key))
    return order


def _derived_order(device_type: str) -> tuple[str, ...]:
    has_triton = importlib.util.find_spec("triton") is not None
    return ("triton", "sdpa") if device_type == "cuda" and has_triton else ("sdpa",)


def _features(causal, key_padding_mask, cu_seqlens, window, alibi_slopes, dropout_p) -> tuple[str, ...]:
    named = {
        "causal": causal,
        "key_padding_mask": key_padding_mask is not None,
        "cu_seqlens": cu_seqlens is not None,
        "window": window is not None,
        "alibi_slopes": alibi_slopes is not None,
        "dropout_p": dropout_p > 0.0,
    }
    return tuple(name for name, on in named.items() if on)


def _choose(backend: str, q, k, v, features: tuple[str, ...]) -> str:
    if backend != "auto":
        problem = _unsupported(backend, q, k, v)
        if problem:
            raise ConfigError(
                f"attention backend={backend!r} cannot run {problem.why}; use backend='auto' or 'sdpa'",
                key=problem.key,
                value=problem.value,
                valid=problem.valid,
            )
        return backend
    order = backend_order(q.device)
    # SDPA's own kernels (flash/cuDNN/efficient) win on plain inputs; the fused kernels win once packing,
    # windows, ALiBi or a key-padding mask would push SDPA off its fastest kernel.
    plain = not set(features) - {"causal", "dropout_p"}
    if plain and "sdpa" in order:
        return "sdpa"
    for name in order:
        if name in BACKENDS[1:] and not _unsupported(name, q, k, v):
            return name
    return "sdpa"


def _unsupported(backend: str, q, k, v) -> Problem | None:
    """What `backend` cannot do for these tensors (the feature, its value, what is supported), or None."""
    if backend != "triton":
        return None
    if not hasattr(torch.library, "custom_op"):
        why = f"torch {torch.__version__} (the Triton kernels need torch >= 2.4)"
        return Problem("torch", torch.__version__, (">= 2.4",), why)
    return triton_problem(q, k, v)


def _validate(q, k, v, key_padding_mask, cu_seqlens, window, alibi_slopes, dropout_p, backend) -> None:
    if backend not in BACKENDS:
        raise ConfigError(
            f"attention backend={backend!r} is unknown; valid: {', '.join(BACKENDS)}",
            key="backend",
            value=str(backend),
            valid=BACKENDS,
        )
    rank = 3 if cu_seqlens is not None else 4
    layout = "packed (T, H, D) with cu_seqlens" if rank == 3 else "dense (B, H, L, D)"
    if not q.dim() == k.dim() == v.dim() == rank:
        raise ConfigError(
            f"attention expects {layout} q/k/v; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    head_axis = 1
    hq, hk = q.shape[head_axis], k.shape[head_axis]
    if hk == 0 or hq % hk or v.shape[head_axis] != hk:
        raise ConfigError(
            f"attention needs q heads ({hq}) divisible by k/v heads ({hk}, {v.shape[head_axis]})",
            key="k/v heads",
            value=f"{hk}/{v.shape[head_axis]}",
            valid=tuple(f"{d}/{d}" for d in range(1, hq + 1) if hq % d == 0),
        )
    if k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ConfigError(
            f"attention got mismatched q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if cu_seqlens is not None:
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ConfigError(
                f"cu_seqlens must be int32 (N+1,) cumulative starts; "
                f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}",
                key="cu_seqlens",
                value=f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}",
                valid=("int32 (N+1,)",),
            )
        if key_padding_mask is not None:
            raise ConfigError(
                "key_padding_mask cannot be combined with cu_seqlens; packed sequences need no padding",
                key="key_padding_mask",
                valid=("None with cu_seqlens",),
            )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (q.shape[0], k.shape[2])
    ):
        raise ConfigError(
            f"key_padding_mask must be bool (B, Lk) = ({q.shape[0]}, {k.shape[2]}); got "
            f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )
    if window is not None and (len(window) != 2 or min(int(w) for w in window) < 0):
        raise ConfigError(f"window must be (left, right) non-negative ints; got {window}")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (hq,):
        raise ConfigError(
            f"alibi_slopes must have shape ({hq},) (one per query head); got {tuple(alibi_slopes.shape)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ConfigError(f"dropout_p must be in [0, 1); got {dropout_p}")
