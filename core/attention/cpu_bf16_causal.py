"""The bf16 CPU path's causal attention in query blocks, as a torch.library custom op with its own backward.

Under a causal mask a query sees only the keys up to its own position, yet the unblocked short path
materialises the whole (L, S) score matrix, computes its masked half and throws it away. Here the queries go
in blocks, each against the keys it can see: at two blocks the scores, their softmax and the batched GEMMs of
forward and backward cover 3/4 of the matrix, at four 5/8; only each diagonal block is masked. What a block
keeps for backward is its probabilities, in bf16 as before.

Backward writes the key and value gradients of the last block (which sees every key) and adds the earlier
blocks' shares in place: autograd through per-block slices would zero-fill and sum them instead. Each
addition rounds the sum to bf16 once, so the blocks are at most MAX_BLOCKS (4 roundings; SDPA's kernel
rounds once).

A custom op, not an autograd.Function: compiled code sees one opaque node with fake kernels, and the FLOP
counter counts it by the rule it uses for SDPA's kernels, which skip masked blocks too: the whole (L, S)
attention (core.logging.throughput).
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.attention.masks import causal_bias

if not hasattr(torch.library, "custom_op"):  # cpu_bf16 keeps the unblocked form there
    raise ImportError(
        f"core.attention's blocked bf16 CPU path needs torch >= 2.4 (custom_op), not {torch.__version__}"
    )


#: the most query blocks one call splits into (blocks grow past the requested size to stay within it)
MAX_BLOCKS = 4


def spans(length: int, keys: int, block: int) -> list[tuple[int, int, int]]:
    """(first query, end query, end key) of each block of `block` queries: query i sees keys 0..i
    (SDPA's top-left causal alignment), so a block ending at query r1 needs the first min(keys, r1)."""
    out = []
    for r0 in range(0, length, block):
        r1 = min(length, r0 + block)
        out.append((r0, r1, min(keys, r1)))
    return out


@torch.library.custom_op("torchkiln::short_causal_fwd", mutates_args=())
def short_causal_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, block: int) -> list[Tensor]:
    """softmax(q k^T * scale + causal mask) v for q (N, L, G, D) (the G queries of each position share one
    key/value head) and k, v (N, S, D), all contiguous; returns [out (N, L, G, D), then each block's
    probabilities (N, rows * G, keys)]."""
    n_, length, group, d = q.shape
    rows = q.view(n_, length * group, d)
    out = torch.empty_like(rows)
    probs = []
    for r0, r1, end in spans(length, k.shape[1], block):
        s = rows.new_empty(n_, (r1 - r0) * group, end)
        # the scale is the GEMM's alpha: applied in fp32 before the one rounding, no pass over q
        torch.baddbmm(
            s, rows[:, r0 * group : r1 * group], k[:, :end].transpose(1, 2), beta=0, alpha=scale, out=s
        )
        if r0 < end:  # the diagonal block: query r0+i sees key r0+j for j <= i
            mask = causal_bias(r1 - r0, end - r0, s.dtype, s.device)
            s.view(n_, r1 - r0, group, end)[..., r0:end].add_(mask.view(r1 - r0, 1, end - r0))
        p = torch.softmax(s, -1)
        torch.bmm(p, v[:, :end], out=out[:, r0 * group : r1 * group])
        probs.append(p)
    return [out.view_as(q), *probs]


@short_causal_fwd.register_fake
def _fwd_fake(q: Tensor, k: Tensor, v: Tensor, scale: float, block: int) -> list[Tensor]:
    n_, length, group, _ = q.shape
    blocks = spans(length, k.shape[1], block)
    return [torch.empty_like(q)] + [q.new_empty(n_, (r1 - r0) * group, end) for r0, r1, end in blocks]


@torch.library.custom_op("torchkiln::short_causal_bwd", mutates_args=())
def short_causal_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, probs: list[Tensor], scale: float, block: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `short_causal_fwd` for `grad_out` (N, L, G, D), from its inputs and probabilities."""
    n_, length, group, d = q.shape
    keys = k.shape[1]
    rows = q.view(n_, length * group, d)
    grad = grad_out.contiguous().view(n_, length * group, d)
    dq, dk, dv = torch.empty_like(rows), torch.empty_like(k), torch.empty_like(v)
    blocks = spans(length, keys, block)
    seen = blocks[-1][2]  # keys past the last query's position get no gradient (fewer queries than keys)
    if seen < keys:
        dk[:, seen:].zero_()
        dv[:, seen:].zero_()
    # The last block sees every key any block sees: its shares of dk and dv are written, the earlier blocks'
    # added in place (baddbmm: accumulated in fp32, rounded once per block; MAX_BLOCKS bounds the roundings)
    for i in reversed(range(len(blocks))):
        r0, r1, end = blocks[i]
        p, g_rows, q_rows = probs[i], grad[:, r0 * group : r1 * group], rows[:, r0 * group : r1 * group]
        first = i == len(blocks) - 1
        dv[:, :end].baddbmm_(p.transpose(1, 2), g_rows, beta=0 if first else 1)
        # the op autograd runs for softmax: fp32 inside, the same rounding as the unblocked path
        ds = torch.ops.aten._softmax_backward_data(
            torch.bmm(g_rows, v[:, :end].transpose(1, 2)), p, -1, p.dtype
        )
        dq_rows = dq[:, r0 * group : r1 * group]
        torch.baddbmm(dq_rows, ds, k[:, :end], beta=0, alpha=scale, out=dq_rows)
        dk[:, :end].baddbmm_(ds.transpose(1, 2), q_rows, beta=0 if first else 1, alpha=scale)
    return dq.view_as(q), dk, dv


@short_causal_bwd.register_fake
def _bwd_fake(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, probs: list[Tensor], scale: float, block: int
):  # noqa: ANN202
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, scale, block = inputs
    ctx.save_for_backward(q, k, v, *output[1:])
    ctx.scale, ctx.block = scale, block
    ctx.set_materialize_grads(False)  # the probabilities get no gradient: no zero tensors made for them


def _backward(ctx, grads):  # noqa: ANN001, ANN202
    q, k, v, *probs = ctx.saved_tensors
    if grads[0] is None:
        return None, None, None, None, None
    dq, dk, dv = short_causal_bwd(grads[0], q, k, v, probs, ctx.scale, ctx.block)
    return dq, dk, dv, None, None


short_causal_fwd.register_autograd(_backward, setup_context=_setup_context)


def blocked_causal_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, block: int) -> Tensor:
    """Causal softmax(q k^T * scale) v for dense (B, Hq, L, D) q and (B, Hk, S, D) k/v (Hk | Hq), queries in
    blocks of at least `block` and at most MAX_BLOCKS blocks; (B, Hq, L, D) out."""
    b, hq, length, d = q.shape
    block = max(block, -(-length // MAX_BLOCKS))
    hk, keys = k.shape[1], k.shape[2]
    group = hq // hk
    # rows ordered (position, group): one block's queries of every head sharing a k/v head are contiguous
    rows = q.view(b, hk, group, length, d).transpose(2, 3).contiguous().view(b * hk, length, group, d)
    kk, vv = (t.reshape(b * hk, keys, d).contiguous() for t in (k, v))
    out = short_causal_fwd(rows, kk, vv, scale, block)[0]
    return out.view(b, hk, length, group, d).transpose(2, 3).reshape(b, hq, length, d)
