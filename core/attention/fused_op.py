"""The Triton kernels as a torch.library custom op with a fake kernel and autograd, so compile sees one node.

`custom_op` (rather than `triton_op`) because it also traces under TRITON_INTERPRET=1, where the tests run;
`triton` itself is imported only when the op first executes.
"""

from __future__ import annotations

import torch
from torch import Tensor

if not hasattr(torch.library, "custom_op"):  # dispatch never picks Triton then (see dispatch._unsupported)
    raise ImportError(
        f"core.attention's Triton kernels need torch >= 2.4 (custom_op), not {torch.__version__}"
    )


@torch.library.custom_op("torchkiln::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor | None,
    key_padding_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    seed: Tensor | None,
    max_seqlen: int,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: float,
    dropout_p: float,
    block_m: int,
    block_n: int,
) -> tuple[Tensor, Tensor]:
    """Fused forward; returns (out, lse). window_* < 0 means unbounded, block_* <= 0 means the default."""
    from core.attention import triton_flash

    return triton_flash.flash_forward(
        q, k, v, cu_seqlens, _max_seqlen(cu_seqlens, max_seqlen), key_padding_mask, alibi_slopes, seed,
        causal, (window_left, window_right), scale, dropout_p, _blocks(block_m, block_n),
    )  # fmt: skip


@flash_attention_fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens, key_padding_mask, alibi_slopes, seed, max_seqlen, causal, *rest):
    if cu_seqlens is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return torch.empty_like(q), lse


@torch.library.custom_op("torchkiln::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor | None,
    key_padding_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    seed: Tensor | None,
    max_seqlen: int,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: float,
    dropout_p: float,
    block_m: int,
    block_n: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused backward; returns (dq, dk, dv)."""
    from core.attention import triton_flash

    return triton_flash.flash_backward(
        grad_out, q, k, v, out, lse, cu_seqlens, _max_seqlen(cu_seqlens, max_seqlen), key_padding_mask,
        alibi_slopes, seed, causal, (window_left, window_right), scale, dropout_p, _blocks(block_m, block_n),
    )  # fmt: skip


@flash_attention_bwd.register_fake
def _bwd_fake(grad_out, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, key_padding_mask, alibi_slopes, seed, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, key_padding_mask, alibi_slopes, seed)
    ctx.params = params


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens, key_padding_mask, alibi_slopes, seed = ctx.saved_tensors
    dq, dk, dv = flash_attention_bwd(
        grad_out, q, k, v, out, lse, cu_seqlens, key_padding_mask, alibi_slopes, seed, *ctx.params
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _max_seqlen(cu_seqlens: Tensor | None, max_seqlen: int) -> int:
    # Inside the op this host sync is invisible to torch.compile, so callers may leave max_seqlen unset.
    if cu_seqlens is None or max_seqlen > 0:
        return max_seqlen
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def _blocks(block_m: int, block_n: int) -> tuple[int, int] | None:
    return (block_m, block_n) if block_m > 0 and block_n > 0 else None


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_padding_mask: Tensor | None,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    window: tuple[int, int] | None,
    alibi_slopes: Tensor | None,
    scale: float,
    dropout_p: float,
    blocks: tuple[int, int] | None = None,
) -> Tensor:
    """Attention through the Triton kernels (inputs already validated by `core.attention.attention`)."""
    seed = None
    if dropout_p > 0.0:
        # Drawn from torch's generator so torch.manual_seed makes dropout reproducible.
        seed = torch.randint(0, 2**62, (1,), device=q.device, dtype=torch.int64)
    if k.stride(-1) != 1:
        k = k.contiguous()
    left, right = (-1, -1) if window is None else window
    out, _ = flash_attention_fwd(
        q if q.stride(-1) == 1 else q.contiguous(),
        k,
        v if v.stride(-1) == 1 else v.contiguous(),
        cu_seqlens,
        None if key_padding_mask is None else key_padding_mask.contiguous(),
        None if alibi_slopes is None else alibi_slopes.float().contiguous(),
        seed,
        max_seqlen or 0,
        causal,
        left,
        right,
        scale,
        dropout_p,
        *(blocks or (0, 0)),
    )
    return out
