"""Packing documents into rows: segment bookkeeping and within-document causal attention."""

from __future__ import annotations

import torch

from core.attention import attention
from core.transformer import pack_documents


def reference_block_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Float64 softmax attention with an explicit block-diagonal causal mask over (T, H, D)."""
    seg = torch.zeros(q.shape[0], dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        seg[a:b] = i
    t = torch.arange(q.shape[0])
    allowed = (seg[:, None] == seg[None, :]) & (t[None, :] <= t[:, None])
    q64, k64, v64 = (x.double().transpose(0, 1) for x in (q, k, v))
    scores = q64 @ k64.transpose(1, 2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v64).transpose(0, 1)


def test_pack_documents_segments_and_positions() -> None:
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [2, 2, 2, 2, 3, 3]])
    p = pack_documents(doc_ids)
    assert p is not None
    assert p.cu_seqlens.tolist() == [0, 3, 5, 6, 10, 12] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 4
    assert p.positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert pack_documents(torch.tensor([[5, 5, 5], [6, 6, 6]])) is None  # one document per row: plain causal


def test_core_packed_attention_with_packing_metadata_matches_block_diagonal_reference() -> None:
    torch.manual_seed(0)
    cu = [0, 7, 8, 40, 45]  # lengths 7, 1, 32, 5
    q, k, v = (torch.randn(45, 2, 8, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, causal=True, cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=32)
    ref = reference_block_causal(q, k, v, cu)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)  # fp32 vs float64 reference
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)  # ref grads land in fp32 leaves
