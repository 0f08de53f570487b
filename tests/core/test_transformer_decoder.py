"""core.nn.decoder: cross-attention against a float64 softmax(QK^T)V with padded encoder lengths on
every CPU backend (the Triton kernels in tests/core/attention_interpreter_cases.py), cached decoding against
the teacher-forced forward, target padding."""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import ConfigError
from core.nn.decoder import CrossAttention, TransformerDecoder
from tests.helpers import fault

# fp32 module against the same weights in float64; O(1) values, T <= 32: accumulation-order noise only.
TOL_FP32 = 2e-5
# logits of a 2-layer decoder, cached (one token at a time, other kernels) against the full forward
TOL_CACHED = 1e-5


def cross_attention_reference(
    module: CrossAttention, x: torch.Tensor, memory: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """The module's cross-attention in float64, written from its definition: per row and head,
    softmax(q k^T / sqrt(D)) v over the row's first `lengths[b]` memory frames, then the output projection.
    A row with no frames attends to nothing (zeros), as core.attention defines."""
    w = {name: p.double() for name, p in module.named_parameters()}
    h = module.n_head
    q = x.double() @ w["q.weight"].T + w["q.bias"]
    kv = memory.double() @ w["kv.weight"].T + w["kv.bias"]
    c = x.shape[-1]
    d = c // h
    k, v = kv[..., :c], kv[..., c:]  # kv rows are (2, H, D)
    rows = []
    for b in range(x.shape[0]):
        n = int(lengths[b])
        heads = []
        for i in range(h):
            cols = slice(i * d, (i + 1) * d)
            if n == 0:
                heads.append(torch.zeros(x.shape[1], d, dtype=torch.float64))
                continue
            s = q[b, :, cols] @ k[b, :n, cols].T / math.sqrt(d)
            heads.append(s.softmax(-1) @ v[b, :n, cols])
        rows.append(torch.cat(heads, -1))
    return torch.stack(rows) @ w["proj.weight"].T + w["proj.bias"]


def cross_case(seed: int = 0) -> tuple[CrossAttention, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2-head, 32-wide cross-attention with 7 queries over up to 19 memory frames: one row full, one
    padded, one with no frames at all."""
    torch.manual_seed(seed)
    module = CrossAttention(32, 2)
    x = torch.randn(3, 7, 32, requires_grad=True)
    memory = torch.randn(3, 19, 32, requires_grad=True)
    return module, x, memory, torch.tensor([19, 11, 0])


def cross_errors(module, x, memory, lengths) -> list[float]:
    """Max |ours - reference| of the output and of the gradients of x, memory and every parameter."""
    mask = torch.arange(memory.shape[1])[None, :] < lengths[:, None]
    out = module(x, module.memory_kv(memory), mask)
    ref = cross_attention_reference(module, x, memory, lengths)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = [x, memory, *module.parameters()]
    ours = torch.autograd.grad(out, leaves, grad.float())
    theirs = torch.autograd.grad(ref, leaves, grad)
    errors = [(out.double() - ref).abs().max().item()]
    return errors + [(a.double() - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)]


@pytest.mark.parametrize("backend", ["auto", "sdpa", "math"])
def test_cross_attention_matches_float64_reference_with_padded_memory(backend: str) -> None:
    module, x, memory, lengths = cross_case()
    module.backend = backend
    errors = cross_errors(module, x, memory, lengths)
    assert max(errors) < TOL_FP32, f"max abs error (out, dx, dmemory, dparams...) = {errors}"
    # padded frames are unseen: changing them changes nothing
    mask = torch.arange(19)[None, :] < lengths[:, None]
    noisy = torch.where(mask[..., None], memory, torch.randn_like(memory) * 100)
    with torch.no_grad():
        a = module(x, module.memory_kv(memory), mask)
        b = module(x, module.memory_kv(noisy), mask)
    assert torch.equal(a, b)


def decoder_case(seed: int = 0) -> tuple[TransformerDecoder, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2-layer decoder over 11 symbols, 3 rows of 9 tokens, memory of up to 13 frames (row 1 padded)."""
    torch.manual_seed(seed)
    decoder = TransformerDecoder(11, 32, 2, 2).eval()
    tokens = torch.randint(0, 11, (3, 9))
    memory = torch.randn(3, 13, 32)
    return decoder, tokens, memory, torch.tensor([13, 6, 10])


@torch.no_grad()
def test_cached_decoding_one_token_at_a_time_equals_the_full_forward() -> None:
    decoder, tokens, memory, lengths = decoder_case()
    full = decoder(tokens, memory, lengths)
    cache = decoder.start(memory, lengths, max_len=tokens.shape[1])
    steps = [decoder.step(tokens[:, i : i + 1], cache) for i in range(tokens.shape[1])]
    err = (torch.cat(steps, 1) - full).abs().max().item()
    assert err < TOL_CACHED, err
    assert cache.length == tokens.shape[1]
    # chunks after the first token (the cache's windowed path), then one token
    cache = decoder.start(memory, lengths, max_len=tokens.shape[1])
    parts = [decoder.step(tokens[:, a:b], cache) for a, b in ((0, 1), (1, 5), (5, 9))]
    assert (torch.cat(parts, 1) - full).abs().max().item() < TOL_CACHED


@torch.no_grad()
def test_cache_reorder_follows_hypotheses_within_their_source() -> None:
    # two sources, a beam of 2 each: after 4 tokens, row 0 takes row 1's history and row 3 takes row 2's
    decoder, tokens, memory, lengths = decoder_case()
    memory, lengths = memory[:2], lengths[:2]
    tokens = torch.randint(0, 11, (4, 6))
    cache = decoder.start(memory, lengths, max_len=6, group=2)
    decoder.step(tokens[:, :4], cache)
    order = torch.tensor([1, 1, 2, 2])
    cache.reorder(order)
    last = decoder.step(tokens[order, 4:6], cache)
    full = decoder(tokens[order], memory.repeat_interleave(2, 0), lengths.repeat_interleave(2, 0))
    assert (last - full[:, 4:6]).abs().max().item() < TOL_CACHED
    with pytest.raises(ValueError, match="group"):
        cache.reorder(torch.tensor([2, 1, 2, 3]))


@torch.no_grad()
def test_target_padding_changes_no_real_position() -> None:
    # each row alone, cut to its length, gives the padded batch's logits at its real positions
    decoder, tokens, memory, lengths = decoder_case()
    token_lengths = torch.tensor([9, 4, 1])
    batch = decoder(tokens, memory, lengths, token_lengths)
    for b, n in enumerate(token_lengths.tolist()):
        alone = decoder(tokens[b : b + 1, :n], memory[b : b + 1, : lengths[b]])
        assert (batch[b, :n] - alone[0]).abs().max().item() < TOL_CACHED


def test_decoder_gradients_reach_the_memory_only_through_real_frames() -> None:
    decoder, tokens, memory, lengths = decoder_case()
    memory.requires_grad_()
    decoder.train()
    decoder(tokens, memory, lengths).square().sum().backward()
    assert memory.grad[1, 6:].abs().max() == 0 and memory.grad[1, :6].abs().max() > 0


def test_odd_head_width_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as e:
        TransformerDecoder(11, 30, 2, 1)
    assert fault(e.value)[:2] == ("d_model", "30")
