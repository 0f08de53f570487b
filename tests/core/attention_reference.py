"""Float64 plain-PyTorch attention straight from the API's definitions, one (sequence, head) at a time.

Shared by tests/core/test_attention.py and the interpreter cases; deliberately independent of core.attention.
"""

from __future__ import annotations

import math

import torch


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in float64; `keep` (B*Hq, Lq_max, Lk_max) bool replays a dropout mask when dropout_p > 0."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        outs = []
        for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seq = [t[s:e].transpose(0, 1)[None] for t in (q, k, v)]
            sub_keep = None
            if keep is not None:
                h = q.shape[1]
                sub_keep = keep[n * h : (n + 1) * h, : e - s, : e - s]
            out = reference_attention(
                *seq, causal=causal, window=window, alibi_slopes=alibi_slopes, scale=scale,
                dropout_p=dropout_p, keep=sub_keep,
            )  # fmt: skip
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs, 0)
    batch, hq, len_q, dim = q.shape
    hk, len_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    i = torch.arange(len_q)[:, None]
    j = torch.arange(len_k)[None, :]
    rows = []
    for b in range(batch):
        heads = []
        for h in range(hq):
            kv = h // (hq // hk)
            s = (q[b, h].double() @ k[b, kv].double().T) * scale
            allowed = torch.ones(len_q, len_k, dtype=torch.bool)
            if causal:
                allowed &= j <= i
            if window is not None:
                right = 0 if causal else window[1]
                allowed &= (j >= i - window[0]) & (j <= i + right)
            if key_padding_mask is not None:
                allowed &= key_padding_mask[b][None, :]
            if alibi_slopes is not None:
                s = s - alibi_slopes[h].double() * (i - j).abs().double()
            s = s.masked_fill(~allowed, float("-inf"))
            seen = allowed.any(-1, keepdim=True)
            p = torch.where(seen, s, torch.zeros_like(s)).softmax(-1) * seen
            if keep is not None:
                p = p * keep[b * hq + h, :len_q, :len_k] / (1.0 - dropout_p)
            heads.append(p @ v[b, kv].double())
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def packed_cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """int32 cumulative starts (N+1,) for sequence lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def max_abs_errors(
    ours: torch.Tensor,
    ref: torch.Tensor,
    leaves: list[torch.Tensor],
    ref_leaves: list[torch.Tensor],
    seed: int = 0,
) -> list[float]:
    """Max |ours - ref| for the output and for each input gradient under the same random upstream grad."""
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ours_grads = torch.autograd.grad(ours, leaves, grad.to(ours.dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad)
    errors = [(ours.double() - ref).abs().max().item()]
    errors += [(a.double() - b).abs().max().item() for a, b in zip(ours_grads, ref_grads, strict=True)]
    return errors
