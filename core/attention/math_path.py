"""The naive path: materialised scores and masks in plain PyTorch. O(L^2) memory; the baseline to beat."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.attention.masks import alibi_bias, visible


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    window: tuple[int, int] | None,
    alibi_slopes: torch.Tensor | None,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """Attention by explicit softmax(QK^T * scale + bias) V; packed input becomes one block-diagonal mask."""
    if cu_seqlens is not None:
        total = q.shape[0]
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths.long())
        pos = torch.arange(total, device=q.device) - cu_seqlens.long()[seq]
        same_seq = seq[:, None] == seq[None, :]
        out = _dense(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            pos, pos, same_seq[None, None], causal, window, alibi_slopes, scale, dropout_p,
        )  # fmt: skip
        return out[0].transpose(0, 1)
    pos_q = torch.arange(q.shape[2], device=q.device)
    pos_k = torch.arange(k.shape[2], device=q.device)
    kpm = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    return _dense(q, k, v, pos_q, pos_k, kpm, causal, window, alibi_slopes, scale, dropout_p)


def _dense(q, k, v, pos_q, pos_k, extra_mask, causal, window, alibi_slopes, scale, dropout_p):
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    # Half-precision scores overflow easily; the softmax runs in fp32 and the result is cast back.
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    s = (q.to(work) @ k.to(work).transpose(-1, -2)) * scale
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes.to(work), pos_q, pos_k)
    ok = visible(pos_q, pos_k, causal, window)
    if extra_mask is not None:
        ok = extra_mask if ok is None else ok & extra_mask
    if ok is None:
        p = s.softmax(-1)
    else:
        ok = ok.expand(s.shape)
        seen = ok.any(-1, keepdim=True)
        # Rows that see no key would softmax to NaN; they get zero weights (and so zero output and grads).
        p = s.masked_fill(~ok, float("-inf")).masked_fill(~seen, 0.0).softmax(-1) * seen
    if dropout_p > 0.0:
        p = F.dropout(p, dropout_p)
    return (p @ v.to(work)).to(q.dtype)
