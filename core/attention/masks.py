"""Who may attend to whom: visibility rules shared by the SDPA and math paths, built one tile at a time, and
the causal mask the bf16 CPU path adds to its scores (its whole and blocked forms both)."""

from __future__ import annotations

import math

import torch

_CAUSAL_MASKS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: tuple[int, int] | None
) -> torch.Tensor | None:
    """Bool (Lq, Lk) tile, True where query position i may see key position j; None when all may."""
    i, j = q_pos[:, None], k_pos[None, :]
    ok = None
    if causal:
        ok = j <= i
    if window is not None:
        near = j >= i - window[0]
        if not causal:
            near = near & (j <= i + window[1])
        ok = near if ok is None else ok & near
    return ok


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Float (H, Lq, Lk) ALiBi bias -slope[h] * |i - j|."""
    dist = (q_pos[:, None] - k_pos[None, :]).abs().to(slopes.dtype)
    return -slopes[:, None, None] * dist


def key_range(
    q_lo: int, q_hi: int, len_k: int, causal: bool, window: tuple[int, int] | None
) -> tuple[int, int]:
    """Smallest key interval [lo, hi) any query in [q_lo, q_hi) may see."""
    lo, hi = 0, len_k
    if window is not None:
        lo = max(0, q_lo - window[0])
        if not causal:
            hi = min(len_k, q_hi + window[1])
    if causal:
        hi = min(len_k, q_hi)
    return lo, max(lo, hi)


def causal_bias(length: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(L, S) additive mask, -inf above the diagonal (SDPA's is_causal alignment): the top-left corner of one
    square mask per dtype and device, grown to the longest seen (lengths vary by batch: one mask each would
    pile up); built in the graph when compiling."""
    if torch.compiler.is_compiling():
        return torch.full((length, keys), -math.inf, dtype=dtype, device=device).triu(1)
    mask = _CAUSAL_MASKS.get((dtype, device))
    if mask is None or mask.shape[0] < max(length, keys):
        mask = torch.full((max(length, keys),) * 2, -math.inf, dtype=dtype, device=device).triu(1)
        _CAUSAL_MASKS[(dtype, device)] = mask
    return mask[:length, :keys]
