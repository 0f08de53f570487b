"""The Triton kernels through real codegen (TTIR -> PTX -> cubin with the bundled ptxas) for sm_90, no GPU
needed; run by test_attention.py in a subprocess without TRITON_INTERPRET, not collected on its own."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TORCHKILN_CODEGEN_CASES") != "1" or os.environ.get("TRITON_INTERPRET", "0") != "0":
    pytest.skip(
        "run through tests/core/test_attention.py (real codegen, no interpreter)", allow_module_level=True
    )

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from core.attention import triton_flash  # noqa: E402

POINTERS = {"Q", "K", "V", "Out", "DO", "DK", "DV", "DQ"}
FP32_POINTERS = {"LSE", "DELTA", "SLOPES"}
FLOATS = {"scale_log2", "scale", "dropout_p"}
KERNELS = {
    "fwd": (triton_flash._fwd_kernel, False),
    "dkdv": (triton_flash._bwd_dkdv_kernel, True),
    "dq": (triton_flash._bwd_dq_kernel, True),
}
ALL_FEATURES = ("varlen", "causal", "window", "kpm", "alibi", "dropout")


def compile_kernel(kernel: str, dtype: str, head_dim: int, features: tuple[str, ...]):
    """Compile one kernel variant for an H100/H200-class target with the launcher's tile sizes."""
    fn, backward = KERNELS[kernel]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_flash, "interpreting", lambda: False)
        block_m, block_n, warps, stages = triton_flash.default_blocks(head_dim, backward)
    flags = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "VARLEN": "varlen" in features,
        "LIMIT_LEFT": "window" in features,
        "LIMIT_RIGHT": "causal" in features or "window" in features,
        "HAS_KPM": "kpm" in features,
        "HAS_ALIBI": "alibi" in features,
        "DROPOUT": "dropout" in features,
        "UPCAST": False,
        "IEEE": dtype == "fp32",
    }
    signature = {}
    for name in fn.arg_names:
        if name in flags:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = "*" + dtype
        elif name in FP32_POINTERS:
            signature[name] = "*fp32"
        else:
            signature[name] = {"CU": "*i32", "KPM": "*i8", "SEED": "*i64"}.get(
                name, "fp32" if name in FLOATS else "i32"
            )
    source = ASTSource(fn, signature, {k: v for k, v in flags.items()})
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_compile_for_sm90_bf16_all_features(kernel: str) -> None:
    compiled = compile_kernel(kernel, "bf16", 128, ALL_FEATURES)
    assert "cubin" in compiled.asm and compiled.metadata.shared <= 227 * 1024


# The sweep covers every pair of (dtype, head_dim, features) values, not every triple: shared memory and
# tile sizes are set by dtype x head_dim, all 12 of which are compiled; each feature set meets every dtype
# and every head_dim once (a Latin square, 12 compiles a kernel instead of 36). The largest case, fp32 x 256
# with every feature, is one of them.
DTYPES = ("bf16", "fp16", "fp32")
HEAD_DIMS = (16, 64, 96, 256)
FEATURE_SETS = ((), ("causal",), ALL_FEATURES)
PAIRWISE = [
    (dtype, head_dim, FEATURE_SETS[(i + j) % len(FEATURE_SETS)])
    for i, dtype in enumerate(DTYPES)
    for j, head_dim in enumerate(HEAD_DIMS)
]


def test_the_sweep_covers_every_pair_of_values() -> None:
    for a, b in ((0, 1), (0, 2), (1, 2)):
        seen = {(case[a], case[b]) for case in PAIRWISE}
        values = (DTYPES, HEAD_DIMS, FEATURE_SETS)
        assert seen == {(x, y) for x in values[a] for y in values[b]}
    assert ("fp32", 256, ALL_FEATURES) in PAIRWISE


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype,head_dim,features", PAIRWISE)
def test_kernels_compile_for_sm90_sweep(
    kernel: str, dtype: str, head_dim: int, features: tuple[str, ...]
) -> None:
    compiled = compile_kernel(kernel, dtype, head_dim, features)
    assert "cubin" in compiled.asm and compiled.metadata.shared <= 227 * 1024
