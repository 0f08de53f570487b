"""SDPA path: torch's fused kernels, fed masks one query block (or one packed sequence) at a time.

A mask built for the whole input would be O(L^2) (8 GiB of fp32 for 16k tokens, 8 heads); built per block
it stays within a fixed budget, and SDPA's CPU flash kernel never materialises scores either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from core.attention.masks import alibi_bias, key_range, visible
from core.errors import ConfigError

# SDPA learned enable_gqa in torch 2.5; before that, shared k/v heads are expanded (same result, more memory).
_SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """F.scaled_dot_product_attention with GQA (fewer k/v heads than q heads) on every supported torch."""
    if q.shape[1] != k.shape[1]:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


# Bytes of mask/bias one SDPA call may hold; bounds the query-block height.
MASK_BUDGET = 32 * 2**20
SAVED_MASK_LIMIT = 256 * 2**20
MIN_BLOCK = 64


def sdpa_attention(
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
    """Attention through F.scaled_dot_product_attention with bounded-size masks; packed input per sequence."""
    if cu_seqlens is None:
        return _dense(q, k, v, causal, key_padding_mask, window, alibi_slopes, scale, dropout_p)
    # Packed: self-attention never crosses sequences, so each sequence is its own dense (1, H, n, D) problem.
    # split (not slicing) so backward assembles each gradient with one concatenation.
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or min(lengths) < 0:
        raise ConfigError(
            f"cu_seqlens must rise from 0 to total_tokens={q.shape[0]}; got {bounds[:3]}...{bounds[-1:]}",
            key="cu_seqlens",
            value=str(bounds),
            valid=(f"rising from 0 to {q.shape[0]}",),
        )
    outs = []
    for seq in zip(*(t.split(lengths, 0) for t in (q, k, v)), strict=True):
        if seq[0].shape[0] == 0:
            outs.append(seq[0])
            continue
        dense = [t.transpose(0, 1)[None] for t in seq]
        out = _dense(*dense, causal, None, window, alibi_slopes, scale, dropout_p)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs, 0)


def _dense(q, k, v, causal, key_padding_mask, window, alibi_slopes, scale, dropout_p):
    whole = window is None and alibi_slopes is None and (key_padding_mask is None or not causal)
    if whole and dropout_p > 0.0 and q.device.type == "cpu" and torch.is_grad_enabled():
        # SDPA's CPU flash kernel has no dropout; its math fallback keeps B*H*Lq*Lk probabilities for
        # backward, so past SAVED_MASK_LIMIT the blockwise, recomputing path below takes over.
        whole = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4 <= SAVED_MASK_LIMIT
    if whole:
        # Whole-input call: no mask at all, or a (B, 1, 1, Lk) one that SDPA broadcasts without copying.
        if key_padding_mask is None:
            return _sdpa(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
        seen = key_padding_mask.any(-1)[:, None, None, None]
        mask = (key_padding_mask[:, None, None, :]) | ~seen
        out = _sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        return out * seen
    len_q, len_k = q.shape[2], k.shape[2]
    row_bytes = _mask_bytes_per_row(q, key_padding_mask, alibi_slopes, len_k)
    block = max(MIN_BLOCK, MASK_BUDGET // max(1, row_bytes) // MIN_BLOCK * MIN_BLOCK)
    # SDPA keeps each block's (float) mask for backward; past SAVED_MASK_LIMIT in all, blocks are recomputed
    # in backward instead, so memory stays O(one block) at any length. SDPA's CPU flash kernel has no
    # dropout either, and its math fallback would keep every block's probabilities: same cure.
    recompute = torch.is_grad_enabled() and (dropout_p > 0.0 or row_bytes * len_q > SAVED_MASK_LIMIT)
    pos = torch.arange(max(len_q, len_k), device=q.device)
    outs = []
    for q_lo, q_block in zip(range(0, len_q, block), q.split(block, 2), strict=True):
        q_hi = q_lo + q_block.shape[2]
        k_lo, k_hi = key_range(q_lo, q_hi, len_k, causal, window)
        args = (q_block, k[:, :, k_lo:k_hi], v[:, :, k_lo:k_hi], pos[q_lo:q_hi], pos[k_lo:k_hi])
        kpm = None if key_padding_mask is None else key_padding_mask[:, k_lo:k_hi]
        if recompute:
            out = checkpoint(
                _block, *args, kpm, causal, window, alibi_slopes, scale, dropout_p, use_reentrant=False
            )
        else:
            out = _block(*args, kpm, causal, window, alibi_slopes, scale, dropout_p)
        outs.append(out)
    return torch.cat(outs, 2)


def _mask_bytes_per_row(q, key_padding_mask, alibi_slopes, len_k) -> int:
    # SDPA turns a boolean mask into a float one of the query dtype, so count that size.
    batch = 1 if key_padding_mask is None else q.shape[0]
    heads = 1 if alibi_slopes is None else q.shape[1]
    return batch * heads * len_k * max(4, q.element_size())


def _block(q, k, v, pos_q, pos_k, kpm, causal, window, alibi_slopes, scale, dropout_p):
    """One query block against its key range, with the mask (or ALiBi bias) for just that tile."""
    ok = visible(pos_q, pos_k, causal, window)
    if kpm is not None:
        ok = kpm[:, None, None, :] if ok is None else ok[None, None] & kpm[:, None, None, :]
    elif ok is not None:
        ok = ok[None, None]
    if k.shape[2] == 0:
        return torch.zeros_like(q)
    seen = None if ok is None else ok.any(-1, keepdim=True)
    if seen is not None:
        # A row with no visible key is unmasked (so SDPA stays finite) and then zeroed.
        ok = ok | ~seen
    if alibi_slopes is None:
        mask = ok
    else:
        mask = alibi_bias(alibi_slopes.to(q.dtype), pos_q, pos_k)[None]
        if ok is not None:
            mask = mask.masked_fill(~ok, float("-inf"))
    out = _sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return out if seen is None else out * seen
