"""Packing documents into rows: segment bookkeeping and within-document causal attention; the head-major fused
q/k/v projection and the loading of checkpoints written with the old layout; decoding through a KV cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.attention import attention
from core.errors import ConfigError
from core.nn.transformer import Block, KVCache, pack_documents
from tests.core.qkv_layout import old_qkv_layout
from tests.helpers import fault


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


def old_block_forward(state: dict[str, torch.Tensor], x: torch.Tensor, n_head: int) -> torch.Tensor:
    """The block as it computed before the head-major layout: q, k, v from rows (3, H, D), float64 math."""
    w = {k: v.double() for k, v in state.items()}
    b, n, c = x.shape
    h = F.layer_norm(x, (c,), w["ln1.weight"], w["ln1.bias"])
    q, k, v = F.linear(h, w["qkv.weight"], w["qkv.bias"]).view(b, n, 3, n_head, c // n_head).unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, c)
    x = x + F.linear(y, w["proj.weight"], w["proj.bias"])
    h = F.layer_norm(x, (c,), w["ln2.weight"], w["ln2.bias"])
    h = F.gelu(F.linear(h, w["fc.weight"], w["fc.bias"]))
    return x + F.linear(h, w["fc_out.weight"], w["fc_out.bias"])


def test_block_loads_an_old_layout_checkpoint_and_computes_what_the_old_block_did() -> None:
    torch.manual_seed(0)
    old = old_qkv_layout(Block(24, 3, 0.0, bias=True).state_dict(), n_head=3)
    assert "qkv.weight" in old and "qkv.bias" in old and "qkv_by_head.weight" not in old
    block = Block(24, 3, 0.0, bias=True).double()
    block.load_state_dict(old)  # strict: the old keys are renamed, nothing is missing or left over
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    # float64 both sides; the same products summed in the same order up to SDPA's kernel choice
    torch.testing.assert_close(block(x, causal=True), old_block_forward(old, x, 3), atol=1e-12, rtol=0)


def test_an_old_qkv_of_another_size_is_a_size_mismatch_not_a_crash() -> None:
    old = old_qkv_layout(Block(16, 2, 0.0, bias=False).state_dict(), n_head=2)
    with pytest.raises(RuntimeError, match="size mismatch for qkv_by_head.weight"):
        Block(24, 2, 0.0, bias=False).load_state_dict(old)


def test_block_decode_matches_the_cached_forward_one_token_at_a_time() -> None:
    torch.manual_seed(0)
    block = Block(32, 4, 0.0, bias=True).double().eval()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    general = KVCache(1, 2, 4, 12, 8, dtype=torch.float64)
    fast = KVCache(1, 2, 4, 12, 8, dtype=torch.float64)
    with torch.no_grad():
        block(x[:, :5], causal=True, cache=general.layer(0))
        block(x[:, :5], causal=True, cache=fast.layer(0))
        general.length = fast.length = 5
        for pos in range(5, 12):
            want = block(x[:, pos : pos + 1], causal=True, cache=general.layer(0))
            got = block.decode(x[:, pos : pos + 1], fast.keys[0], fast.values[0], pos)
            general.length = fast.length = pos + 1
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # the keys and values it cached are the general path's
    torch.testing.assert_close(fast.keys, general.keys, atol=0, rtol=0)
    torch.testing.assert_close(fast.values, general.values, atol=0, rtol=0)


def test_a_block_fed_in_chunks_through_a_kv_cache_matches_one_causal_pass() -> None:
    torch.manual_seed(0)
    block = Block(32, 4, 0.0, bias=True).double().eval()
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    cache = KVCache(1, 2, 4, 24, 8, dtype=torch.float64)
    outs = []
    # a prefill from position 0, single tokens, and chunks that start later (queries offset from the keys)
    for a, b in [(0, 6), (6, 7), (7, 12), (12, 13), (13, 20)]:
        outs.append(block(x[:, a:b], causal=True, cache=cache.layer(0)))
        cache.length = b
    with torch.no_grad():
        want = block(x, causal=True)
    # float64, the same math split differently: only reassociation differs
    torch.testing.assert_close(torch.cat(outs, 1), want, atol=1e-12, rtol=0)
    with pytest.raises(ConfigError) as e:
        block(x[:, :5], causal=True, cache=cache.layer(0))
    assert fault(e.value) == ("kv_cache", "25", ("<= 24",))


def test_a_left_padded_row_through_the_cache_computes_what_it_computes_alone() -> None:
    torch.manual_seed(0)
    block = Block(32, 4, 0.0, bias=True).double().eval()
    x = torch.randn(3, 14, 32, dtype=torch.float64)  # 10 prompt positions, then 4 tokens after them
    pads = torch.tensor([0, 4, 9])  # a full row, a shorter one, a one-token one
    cache = KVCache(1, 3, 4, 16, 8, dtype=torch.float64)
    cache.pad_left(pads)
    assert cache.positions(10)[:, -1].tolist() == [9, 5, 0]  # counted from each row's first real token
    outs = []
    with torch.no_grad():
        # a prefill, a chunk after it (the offset mask), a single token (the attention path's one query)
        for a, b in [(0, 10), (10, 12), (12, 13)]:
            outs.append(block(x[:, a:b], causal=True, cache=cache.layer(0)))
            cache.length = b
        # Block.decode, the GPT's one-token step, honours the padding too
        outs.append(block.decode(x[:, 13:], cache.keys[0], cache.values[0], 13, keep=cache.keep))
        got = torch.cat(outs, 1)
        for row, pad in enumerate(pads.tolist()):
            alone = block(x[row : row + 1, pad:], causal=True)[0]
            torch.testing.assert_close(got[row, pad:], alone, atol=1e-12, rtol=0)  # float64 reassociation
    assert torch.isfinite(got).all()  # the padding's queries see no key: zeros, not NaN


def test_a_cache_without_padding_carries_no_mask() -> None:
    cache = KVCache(1, 2, 4, 16, 8)
    cache.pad_left(torch.tensor([0, 0]))
    assert cache.keep is None and cache.pads is None and cache.layer(0).keep is None
    assert cache.positions(3).tolist() == [[0, 1, 2]]
    cache.pad_left(torch.tensor([0, 2]))
    cache.reset()  # forgetting the positions forgets their padding
    assert cache.keep is None and cache.positions(1).tolist() == [[0]]
