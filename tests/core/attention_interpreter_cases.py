"""Triton kernels under TRITON_INTERPRET=1 against the float64 reference; run by test_attention.py in a
subprocess (the variable must be set before triton is imported), not collected on its own."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run through tests/core/test_attention.py (needs TRITON_INTERPRET=1)", allow_module_level=True
    )


from core.attention import attention  # noqa: E402
from core.attention.fused_op import fused_attention  # noqa: E402
from core.attention.triton_flash import dropout_keep_mask  # noqa: E402
from core.errors import ConfigError  # noqa: E402
from tests.core.attention_reference import max_abs_errors, packed_cu_seqlens, reference_attention  # noqa: E402
from tests.helpers import fault  # noqa: E402

# Max abs error on O(1) values against float64 (fp32: accumulation-order noise; fp16: rounding of inputs,
# probabilities and outputs).
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def nan_padded(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A strided view into a NaN-filled buffer, so any read outside the tensor poisons the result."""
    buf = torch.full((*shape[:-2], shape[-2] + 3, shape[-1] + 8), float("nan"), dtype=dtype)
    view = buf[..., : shape[-2], : shape[-1]]
    view.copy_(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))
    return view.requires_grad_()


def run_case(
    dense: tuple[int, ...] | None = None,
    lengths: list[int] | None = None,
    heads: tuple[int, int] = (2, 2),
    dim: int = 16,
    dtype: torch.dtype = torch.float32,
    kpm: bool = False,
    alibi: bool = False,
    blocks: tuple[int, int] | None = None,
    dropout_p: float = 0.0,
    **kw,
) -> None:
    """Build inputs, run the fused kernels (via attention() unless blocks are forced), compare all four."""
    gen = torch.Generator().manual_seed(0)
    hq, hk = heads
    if lengths is not None:
        total = sum(lengths)
        # Packed (T, H, D) views need the NaN margin on the token axis, not the head axis.
        qkv = [nan_padded((h, total, dim), dtype, gen).transpose(0, 1) for h in (hq, hk, hk)]
        kw["cu_seqlens"] = packed_cu_seqlens(lengths)
        batch_heads, max_q, max_k = len(lengths) * hq, max(lengths), max(lengths)
    else:
        batch, lq, lk = dense
        qkv = [
            nan_padded(s, dtype, gen)
            for s in ((batch, hq, lq, dim), (batch, hk, lk, dim), (batch, hk, lk, dim))
        ]
        batch_heads, max_q, max_k = batch * hq, lq, lk
    if kpm:
        mask = torch.rand(dense[0], dense[2], generator=gen) > 0.4
        mask[0, :3] = False
        mask[-1] = False
        kw["key_padding_mask"] = mask
    if alibi:
        kw["alibi_slopes"] = torch.rand(hq, generator=gen) * 0.5
    keep = None
    if dropout_p > 0.0:
        torch.manual_seed(7)
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        keep = dropout_keep_mask(seed, batch_heads, max_q, max_k, dropout_p)
        torch.manual_seed(7)
    if blocks is None:
        out = attention(*qkv, dropout_p=dropout_p, backend="triton", **kw)
    else:
        full = dict(causal=False, key_padding_mask=None, cu_seqlens=None, window=None, alibi_slopes=None)
        out = fused_attention(
            *qkv, **{**full, **kw}, max_seqlen=None, scale=dim**-0.5, dropout_p=dropout_p, blocks=blocks
        )
    ref_leaves = [t.detach().double().requires_grad_() for t in qkv]
    if kw.get("window") is not None and kw.get("causal"):
        kw["window"] = (kw["window"][0], 0)
    ref = reference_attention(*ref_leaves, dropout_p=dropout_p, keep=keep, **kw)
    errors = max_abs_errors(out, ref, qkv, ref_leaves)
    assert all(e == e for e in errors), f"NaN in (out, dq, dk, dv): {errors}"
    assert max(errors) < TOL[dtype], f"max abs error (out, dq, dk, dv) = {errors}"


CASES = {
    # lengths not multiples of the 16-wide interpreter tiles, head dim not a power of two
    "fp32_plain_L33_D24": dict(dense=(1, 33, 33), dim=24),
    "fp32_causal_gqa2_D64": dict(dense=(1, 40, 40), heads=(4, 2), dim=64, causal=True),
    "fp32_causal_kpm_dead_rows_gqa4": dict(dense=(2, 20, 20), heads=(4, 1), causal=True, kpm=True),
    "fp32_window_alibi": dict(dense=(1, 37, 37), window=(5, 3), alibi=True),
    "fp32_cross_causal_lq17_lk40": dict(dense=(1, 17, 40), causal=True),
    "fp32_length_one": dict(dense=(2, 1, 1), causal=True),
    "fp32_D256": dict(dense=(1, 20, 20), dim=256, causal=True),
    "fp32_packed_causal_gqa2": dict(lengths=[7, 33, 1, 20], heads=(4, 2), causal=True),
    "fp32_packed_window_alibi": dict(lengths=[12, 5, 30], window=(3, 1), alibi=True),
    "fp32_blocks_16x32_window_causal": dict(dense=(1, 40, 40), window=(9, 0), causal=True, blocks=(16, 32)),
    "fp32_dropout_causal_gqa2": dict(dense=(1, 24, 24), heads=(4, 2), causal=True, dropout_p=0.3),
    "fp32_dropout_packed": dict(lengths=[9, 20], dropout_p=0.5),
    "fp16_causal_D64": dict(dense=(1, 40, 40), dim=64, causal=True, dtype=torch.float16),
    "fp16_packed_causal_gqa2": dict(lengths=[7, 20, 1], heads=(4, 2), causal=True, dtype=torch.float16),
    "fp16_kpm_alibi_window": dict(
        dense=(2, 20, 20), kpm=True, alibi=True, window=(4, 4), dtype=torch.float16
    ),
}
SLOW_CASES = {
    "fp16_D256_gqa2": dict(dense=(1, 20, 20), heads=(4, 2), dim=256, dtype=torch.float16),
    "fp32_D128_packed": dict(lengths=[17, 40, 3], dim=128, causal=True),
    "fp32_blocks_32x16_alibi_kpm": dict(dense=(2, 40, 40), kpm=True, alibi=True, blocks=(32, 16)),
    "fp32_L128_causal": dict(dense=(1, 128, 128), causal=True, blocks=(32, 32)),
    "fp16_gqa1_window_causal": dict(dense=(1, 33, 33), window=(7, 3), causal=True, dtype=torch.float16),
    "fp16_dropout_kpm_alibi": dict(
        dense=(2, 20, 20), kpm=True, alibi=True, dropout_p=0.2, dtype=torch.float16
    ),
    "bf16_causal_upcast": dict(dense=(1, 24, 24), causal=True, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_matches_reference(name: str) -> None:
    run_case(**CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_CASES))
def test_fused_matches_reference_sweep(name: str) -> None:
    run_case(**SLOW_CASES[name])


def test_compile_fullgraph_traces_the_custom_op() -> None:
    # aot_eager: graph capture, fake kernels and autograd registration are under test here, not codegen.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen).requires_grad_() for _ in range(3))
    fn = torch.compile(
        lambda q, k, v: attention(q, k, v, causal=True, window=(5, 0), backend="triton"),
        fullgraph=True,
        backend="aot_eager",
    )
    out = fn(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_leaves, causal=True, window=(5, 0))
    ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOL[torch.float32])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=TOL[torch.float32])


def test_unsupported_triton_combinations_name_feature_and_backend() -> None:
    f64 = "torch.float64/torch.float64/torch.float64"
    for q, expected in [
        (torch.randn(1, 2, 4, 8), ("head_dim", "8", ("16..256",))),
        (
            torch.randn(1, 2, 4, 16, dtype=torch.float64),
            ("dtype", f64, ("torch.float16", "torch.bfloat16", "torch.float32")),
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            attention(q, q, q, backend="triton")
        assert fault(e.value) == expected


def test_decoder_cross_attention_over_padded_memory() -> None:
    # core.nn.decoder's cross-attention on the Triton kernels, against its float64 reference
    from tests.core.test_transformer_decoder import TOL_FP32, cross_case, cross_errors

    module, x, memory, lengths = cross_case()
    module.backend = "triton"
    errors = cross_errors(module, x, memory, lengths)
    assert max(errors) < TOL_FP32, f"max abs error (out, dx, dmemory, dparams...) = {errors}"
