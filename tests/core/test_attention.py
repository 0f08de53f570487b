"""core.attention against a float64 reference: every feature on the native paths (sdpa, math, auto); the
Triton kernels run under TRITON_INTERPRET=1 in a subprocess (tests/core/attention_interpreter_cases.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import core.attention.blockwise_sdpa as blockwise
from core.attention import attention, backend_order
from core.errors import ConfigError
from tests.core.attention_reference import max_abs_errors, packed_cu_seqlens, reference_attention
from tests.helpers import fault

REPO = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
# fp32 inputs against a float64 reference; O(1) values, L <= 64.
TOL_FP32 = 2e-5

# name -> (dense shape spec or packed lengths, keyword features)
DENSE_CASES = {
    "plain": dict(shape=(2, 2, 2, 19, 19, 16), kw={}),
    "causal": dict(shape=(2, 2, 2, 19, 19, 16), kw=dict(causal=True)),
    "causal_cross_lq_lt_lk": dict(shape=(1, 2, 2, 7, 23, 16), kw=dict(causal=True)),
    "key_padding": dict(shape=(3, 2, 2, 13, 17, 16), kw=dict(kpm=True)),
    "causal_key_padding_dead_rows": dict(shape=(3, 2, 2, 13, 13, 16), kw=dict(causal=True, kpm=True)),
    "window": dict(shape=(1, 2, 2, 29, 29, 16), kw=dict(window=(4, 2))),
    "window_causal": dict(shape=(1, 2, 2, 29, 29, 16), kw=dict(window=(4, 7), causal=True)),
    "alibi": dict(shape=(1, 4, 4, 21, 21, 16), kw=dict(alibi=True)),
    "alibi_causal_key_padding": dict(shape=(2, 4, 2, 21, 21, 16), kw=dict(alibi=True, causal=True, kpm=True)),
    "gqa2_causal": dict(shape=(1, 4, 2, 17, 17, 32), kw=dict(causal=True)),
    "gqa4_window_alibi": dict(shape=(1, 8, 2, 17, 17, 16), kw=dict(window=(3, 3), alibi=True)),
    "mqa": dict(shape=(2, 4, 1, 11, 11, 16), kw={}),
    "length_one": dict(shape=(2, 2, 2, 1, 1, 16), kw=dict(causal=True)),
}
PACKED_CASES = {
    "packed": dict(lengths=[7, 33, 1, 20], heads=(2, 2), kw={}),
    "packed_causal_gqa2": dict(lengths=[7, 33, 1, 20], heads=(4, 2), kw=dict(causal=True)),
    "packed_window_alibi": dict(lengths=[12, 5, 30], heads=(2, 2), kw=dict(window=(3, 1), alibi=True)),
    "packed_empty_sequence": dict(lengths=[5, 0, 9], heads=(2, 1), kw=dict(causal=True)),
}


def make_case(spec: dict, dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], dict, dict]:
    """Random q/k/v plus the attention kwargs and the reference kwargs for one named case."""
    gen = torch.Generator().manual_seed(seed)
    kw = dict(spec["kw"])
    ref_kw: dict = {}
    if "lengths" in spec:
        hq, hk = spec["heads"]
        total = sum(spec["lengths"])
        shapes = [(total, hq, 16), (total, hk, 16), (total, hk, 16)]
        ref_kw["cu_seqlens"] = packed_cu_seqlens(spec["lengths"])
    else:
        b, hq, hk, lq, lk, d = spec["shape"]
        shapes = [(b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d)]
    qkv = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]
    if kw.pop("kpm", False):
        b, lk = shapes[1][0], shapes[1][2]
        mask = torch.rand(b, lk, generator=gen) > 0.4
        mask[0, :3] = False  # early rows of a causal case then see nothing
        mask[-1] = False  # one whole sequence padded out
        ref_kw["key_padding_mask"] = mask
    if kw.pop("alibi", False):
        ref_kw["alibi_slopes"] = torch.rand(hq, generator=gen) * 0.5
    ref_kw.update(kw)
    return qkv, ref_kw, kw


def check(qkv: list[torch.Tensor], ref_kw: dict, backend: str, tol: float, **extra) -> None:
    """Compare output and dq/dk/dv of `backend` with the float64 reference."""
    out = attention(*qkv, backend=backend, **ref_kw, **extra)
    ref_leaves = [t.detach().double().requires_grad_() for t in qkv]
    ref = reference_attention(*ref_leaves, **ref_kw)
    assert out.shape == ref.shape and out.dtype == qkv[0].dtype
    errors = max_abs_errors(out, ref, qkv, ref_leaves)
    assert max(errors) < tol, f"max abs error (out, dq, dk, dv) = {errors}"


@pytest.mark.arm64
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("case", sorted(DENSE_CASES) + sorted(PACKED_CASES))
def test_matches_float64_reference(case: str, backend: str) -> None:
    spec = DENSE_CASES.get(case) or PACKED_CASES[case]
    qkv, ref_kw, _ = make_case(spec, torch.float32)
    check(qkv, ref_kw, backend, TOL_FP32)


@pytest.mark.arm64
@pytest.mark.parametrize("case", ["causal_key_padding_dead_rows", "gqa4_window_alibi", "packed_causal_gqa2"])
def test_auto_on_cpu_is_the_sdpa_path(case: str) -> None:
    spec = DENSE_CASES.get(case) or PACKED_CASES[case]
    qkv, ref_kw, _ = make_case(spec, torch.float32)
    assert backend_order(torch.device("cpu"))[0] == "sdpa"
    assert torch.equal(attention(*qkv, **ref_kw), attention(*qkv, backend="sdpa", **ref_kw))


@pytest.mark.arm64
@pytest.mark.parametrize("recompute", [False, True])
def test_blockwise_sdpa_tiles_queries_and_keys(monkeypatch: pytest.MonkeyPatch, recompute: bool) -> None:
    # A tiny mask budget forces many query blocks, each against only its causal/window key range; past the
    # saved-mask limit each block runs again in backward (checkpointed) and grads must not change.
    monkeypatch.setattr(blockwise, "MASK_BUDGET", 64)
    monkeypatch.setattr(blockwise, "SAVED_MASK_LIMIT", 0 if recompute else 2**40)
    monkeypatch.setattr(blockwise, "MIN_BLOCK", 8)
    calls = []
    real = blockwise.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(blockwise.F, "scaled_dot_product_attention", spy)
    spec = dict(shape=(2, 2, 2, 50, 50, 16), kw=dict(causal=True, kpm=True, window=(9, 0), alibi=True))
    qkv, ref_kw, _ = make_case(spec, torch.float32)
    check(qkv, ref_kw, "sdpa", TOL_FP32)
    assert len(calls) == 7 * (2 if recompute else 1) and max(lk for _, lk in calls) <= 8 + 9


@pytest.mark.arm64
def test_sdpa_paths_exact_in_float64() -> None:
    spec = dict(shape=(2, 4, 2, 21, 21, 16), kw=dict(alibi=True, causal=True, kpm=True, window=(5, 0)))
    qkv, ref_kw, _ = make_case(spec, torch.float64)
    check(qkv, ref_kw, "sdpa", 1e-12)


@pytest.mark.arm64
def test_dropout_is_unbiased_and_reproducible() -> None:
    # 600 copies in the batch: the mean over dropout draws must approach the dropout-free output.
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen).expand(600, -1, -1, -1) for _ in range(3))
    for padded in (False, True):
        kw = dict(causal=True, key_padding_mask=torch.ones(600, 9, dtype=torch.bool) if padded else None)
        ref = attention(q[:1], k[:1], v[:1], causal=True)
        torch.manual_seed(0)
        out = attention(q, k, v, dropout_p=0.5, **kw)
        torch.manual_seed(0)
        again = attention(q, k, v, dropout_p=0.5, **kw)
        assert torch.equal(out, again)
        assert not torch.allclose(out[0], ref[0])
        # std of one draw <= ~1 here, so the mean of 600 is within ~0.05; 0.2 is > 4 sigma.
        assert (out.mean(0) - ref[0]).abs().max() < 0.2


@pytest.mark.parametrize("kw", [dict(causal=True, window=(6, 0)), dict(causal=True), dict(kpm=True)])
def test_blockwise_dropout_recompute_gives_same_grads(monkeypatch: pytest.MonkeyPatch, kw: dict) -> None:
    # The checkpointed blocks must replay the forward's dropout masks in backward; a zero limit sends even
    # plain and padding-only inputs with dropout down the blockwise path.
    monkeypatch.setattr(blockwise, "SAVED_MASK_LIMIT", 0)
    monkeypatch.setattr(blockwise, "MIN_BLOCK", 8)
    monkeypatch.setattr(blockwise, "MASK_BUDGET", 64)
    spec = dict(shape=(2, 2, 2, 19, 19, 16), kw=kw)
    qkv, ref_kw, _ = make_case(spec, torch.float32)
    torch.manual_seed(3)
    grads = torch.autograd.grad(attention(*qkv, dropout_p=0.3, **ref_kw).sum(), qkv)
    monkeypatch.setattr(blockwise, "checkpoint", lambda fn, *a, use_reentrant: fn(*a))
    torch.manual_seed(3)
    plain = torch.autograd.grad(attention(*qkv, dropout_p=0.3, **ref_kw).sum(), qkv)
    for a, b in zip(grads, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(backend="flash"), "backend='flash' is unknown"),
        (dict(backend="triton"), "backend='triton' cannot run"),
        (dict(key_padding_mask=torch.ones(2, 5, dtype=torch.bool)), "key_padding_mask must be bool (B, Lk)"),
        (dict(window=(-1, 2)), "window must be"),
        (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape (4,)"),
        (dict(dropout_p=1.0), "dropout_p must be in [0, 1)"),
        (dict(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)), "packed (T, H, D)"),
    ],
)
def test_user_mistakes_raise_one_line_config_errors(kwargs: dict, message: str) -> None:
    q = torch.randn(2, 4, 8, 16)
    with pytest.raises(ConfigError) as err:
        attention(q, q, q, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_packed_rejects_bad_cu_seqlens_and_padding_mask() -> None:
    q = torch.randn(8, 2, 16)
    with pytest.raises(ConfigError) as e:
        attention(q, q, q, cu_seqlens=torch.tensor([0, 8]))
    assert fault(e.value) == ("cu_seqlens", "torch.int64 (2,)", ("int32 (N+1,)",))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ConfigError) as e:
        attention(q, q, q, cu_seqlens=cu, key_padding_mask=torch.ones(1, 8, dtype=torch.bool))
    assert fault(e.value)[0] == "key_padding_mask"
    with pytest.raises(ConfigError) as e:
        attention(q, q, q, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    assert fault(e.value) == ("cu_seqlens", "[0, 3, 7]", ("rising from 0 to 8",))
    with pytest.raises(ConfigError) as e:
        attention(q, q[:, :1].expand(8, 3, 16), q[:, :1].expand(8, 3, 16), cu_seqlens=cu)
    assert fault(e.value) == ("k/v heads", "3/3", ("1/1", "2/2"))  # q has 2 heads


def test_import_and_cpu_attention_never_import_triton() -> None:
    code = (
        "import sys, torch, core, core.attention as A; q = torch.randn(1, 2, 5, 16); "
        "A.attention(q, q, q, causal=True); A.attention(q, q, q, window=(1, 1)); "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)


def _run_cases(file: str, marker: str, interpret: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHKILN_CODEGEN_CASES": "1"}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cases = Path(__file__).with_name(file)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", marker, str(cases)]
    run = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]


@needs_triton
def test_triton_kernels_under_interpreter() -> None:
    # A subprocess, because TRITON_INTERPRET must be set before triton is first imported and must not leak.
    _run_cases("attention_interpreter_cases.py", "not slow", interpret=True)


@pytest.mark.slow
@needs_triton
def test_triton_kernels_under_interpreter_sweep() -> None:
    _run_cases("attention_interpreter_cases.py", "slow", interpret=True)


@needs_triton
def test_triton_kernels_compile_for_sm90() -> None:
    # Real Triton codegen down to a cubin (bundled ptxas), no GPU needed: catches what the interpreter
    # tolerates but the compiler rejects (types, layouts, shared memory).
    _run_cases("attention_codegen_cases.py", "not slow", interpret=False)


@pytest.mark.slow
@needs_triton
def test_triton_kernels_compile_for_sm90_sweep() -> None:
    _run_cases("attention_codegen_cases.py", "slow", interpret=False)


@pytest.mark.parametrize(
    "kw", [dict(causal=True), dict(causal=True, kpm=True), dict(window=(3, 1), alibi=True)]
)
def test_dense_sdpa_path_compiles_fullgraph(kw: dict) -> None:
    # Models compile each block with fullgraph=True, so the dense CPU path must trace without a break.
    qkv, ref_kw, _ = make_case(dict(shape=(2, 4, 2, 13, 13, 16), kw=kw), torch.float32)
    fn = torch.compile(lambda q, k, v: attention(q, k, v, **ref_kw), fullgraph=True, backend="aot_eager")
    ref_leaves = [t.detach().double().requires_grad_() for t in qkv]
    errors = max_abs_errors(fn(*qkv), reference_attention(*ref_leaves, **ref_kw), qkv, ref_leaves)
    assert max(errors) < TOL_FP32, f"max abs error (out, dq, dk, dv) = {errors}"


@pytest.mark.slow
@pytest.mark.parametrize("path", ["auto-packed", "auto-masked"])
def test_16k_tokens_peak_rss_growth_under_1gib(path: str) -> None:
    # 16k tokens, 8 heads, D=64, fp32, causal, forward+backward: an L^2 score matrix alone would be 8 GiB.
    cmd = [sys.executable, str(REPO / "bench" / "attention.py"), "--rss-worker", path, "16384"]
    run = subprocess.run(
        cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    growth = json.loads(run.stdout.strip().splitlines()[-1])["growth"]
    assert growth < 2**30, f"{path}: peak RSS grew by {growth / 2**20:.0f} MiB"


def test_dispatch_follows_the_applied_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import core.device.plan as plan_mod
    from core.device import applied_plan, resolve

    monkeypatch.setattr(plan_mod, "_applied", None)  # restored after the test
    plan = resolve("cpu", "fp32")
    plan.apply()  # what the trainer does before building the model
    assert applied_plan() is plan and backend_order(torch.device("cpu")) == plan.attention_backends
    math_only = dataclasses.replace(plan, attention_backends=("math",))
    monkeypatch.setattr(plan_mod, "_applied", math_only)
    assert backend_order(torch.device("cpu")) == ("math",)
    assert backend_order(torch.device("meta")) != ("math",)  # another device type: its own order


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_auto_routes_plain_input_to_sdpa_and_masked_input_down_the_plans_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a CUDA plan's order on the CPU, the Triton kernels allowed by the interpreter's variable; both backends
    # replaced by spies (no kernel runs): which one `auto` calls for each input is the whole question
    import dataclasses

    import core.attention.blockwise_sdpa as sdpa_mod
    import core.attention.fused_op as fused_mod
    import core.device.plan as plan_mod
    from core.device import resolve

    calls: list[str] = []
    monkeypatch.setattr(fused_mod, "fused_attention", lambda q, *a, **kw: calls.append("triton") or q)
    monkeypatch.setattr(sdpa_mod, "sdpa_attention", lambda q, *a, **kw: calls.append("sdpa") or q)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cuda_like = dataclasses.replace(resolve("cpu", "fp32"), attention_backends=("triton", "sdpa", "math"))
    monkeypatch.setattr(plan_mod, "_applied", cuda_like)
    q = torch.randn(2, 4, 16, 16)
    attention(q, q, q, causal=True)
    attention(q, q, q, causal=True, key_padding_mask=torch.ones(2, 16, dtype=torch.bool))
    packed = torch.randn(32, 4, 16)
    attention(packed, packed, packed, causal=True, cu_seqlens=torch.tensor([0, 10, 32], dtype=torch.int32))
    attention(q, q, q, window=(4, 4))
    assert calls == ["sdpa", "triton", "triton", "triton"]
    monkeypatch.setattr(
        plan_mod, "_applied", dataclasses.replace(cuda_like, attention_backends=("sdpa", "math"))
    )
    calls.clear()
    attention(q, q, q, causal=True, key_padding_mask=torch.ones(2, 16, dtype=torch.bool))
    assert calls == ["sdpa"]


# --- on a CUDA device (pytest -m gpu; skipped without one, tests/conftest.py) -----------------------------
# bf16 inputs against float64 on the same rounded inputs: probabilities and outputs are rounded to bf16 (8
# mantissa bits), gradients of O(1) values accumulate that; the interpreter cases' bf16 bound.
TOL_BF16 = 6e-2
GPU_TOL = {torch.float32: TOL_FP32, torch.bfloat16: TOL_BF16}
# every case in fp32; in bf16 the mixes a model meets (each feature at least once, packed twice)
BF16_CASES = [
    "plain", "causal", "window_causal", "alibi_causal_key_padding", "gqa4_window_alibi", "packed_causal_gqa2",
    "packed_window_alibi",
]  # fmt: skip
GPU_BACKENDS = [pytest.param("triton", marks=needs_triton), "sdpa"]


def on_cuda(qkv: list[torch.Tensor], ref_kw: dict) -> tuple[list[torch.Tensor], dict]:
    """CUDA copies of a case's inputs: differentiable copies, so gradients land on the CPU leaves."""
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in ref_kw.items()}
    return [t.cuda() for t in qkv], kw


def cuda_errors(qkv: list[torch.Tensor], ref_kw: dict, fn: object) -> list[float]:
    """Max abs error (out, dq, dk, dv) of `fn(q, k, v, **kw)` run on CUDA against the float64 reference."""
    inputs, kw = on_cuda(qkv, ref_kw)
    out = fn(*inputs, **kw).cpu()
    ref_leaves = [t.detach().double().requires_grad_() for t in qkv]
    return max_abs_errors(out, reference_attention(*ref_leaves, **ref_kw), qkv, ref_leaves)


def sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
    """A dense case through SDPA's math backend: masks and ALiBi as one additive bias, GQA: repeated k/v."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    i = torch.arange(lq, device=q.device)[:, None]
    j = torch.arange(lk, device=q.device)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if kw.get("causal"):
        allowed &= j <= i
    if kw.get("window") is not None:
        left, right = kw["window"]
        allowed &= (j >= i - left) & (j <= i + (0 if kw.get("causal") else right))
    bias = torch.zeros(hq, lq, lk, device=q.device).masked_fill(~allowed, float("-inf"))
    if kw.get("alibi_slopes") is not None:
        bias = bias - kw["alibi_slopes"][:, None, None].float() * (i - j).abs()
    k, v = (t.repeat_interleave(hq // t.shape[1], dim=1) for t in (k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    ("case", "dtype"),
    [(c, torch.float32) for c in sorted(DENSE_CASES) + sorted(PACKED_CASES)]
    + [(c, torch.bfloat16) for c in BF16_CASES],
)
def test_cuda_matches_float64_reference(
    case: str, dtype: torch.dtype, backend: str, ieee_matmuls: None
) -> None:
    spec = DENSE_CASES.get(case) or PACKED_CASES[case]
    qkv, ref_kw, _ = make_case(spec, dtype)
    errors = cuda_errors(qkv, ref_kw, lambda *t, **kw: attention(*t, backend=backend, **kw))
    assert max(errors) < GPU_TOL[dtype], f"max abs error (out, dq, dk, dv) = {errors}"


# dense cases SDPA's math backend can express with one bias (no key padding: rows with no key are another
# convention there)
MATH_ORACLE_CASES = [c for c in sorted(DENSE_CASES) if not DENSE_CASES[c]["kw"].get("kpm")]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", MATH_ORACLE_CASES)
def test_cuda_is_as_accurate_as_sdpa_math_backend(
    case: str, dtype: torch.dtype, backend: str, ieee_matmuls: None
) -> None:
    # torch's own math backend in the same dtype as the oracle: ours within twice its error against float64
    # (plus a floor of a tenth of the dtype's bound, for cases where both are at rounding level)
    qkv, ref_kw, _ = make_case(DENSE_CASES[case], dtype)
    ours = cuda_errors(qkv, ref_kw, lambda *t, **kw: attention(*t, backend=backend, **kw))
    torch_math = cuda_errors([t.detach().requires_grad_() for t in qkv], ref_kw, sdpa_math)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, torch_math, strict=True):
        assert a <= 2 * b + GPU_TOL[dtype] / 10, f"{name}: ours {a:.3g} vs SDPA math {b:.3g}"


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(("case", "expected"), [("causal", "sdpa"), ("gqa4_window_alibi", "triton")])
def test_auto_on_cuda_routes_plain_to_sdpa_and_masked_to_triton(case: str, expected: str) -> None:
    spec = DENSE_CASES[case]
    qkv, ref_kw, _ = make_case(spec, torch.bfloat16)
    inputs, kw = on_cuda(qkv, ref_kw)
    assert backend_order(torch.device("cuda"))[0] == "triton"
    assert torch.equal(attention(*inputs, **kw), attention(*inputs, backend=expected, **kw))


@pytest.mark.gpu
@needs_triton
def test_triton_op_under_inductor_fullgraph_matches_eager() -> None:
    # Inductor around the custom op on CUDA (CPU runs only aot_eager): one node, the same kernels; the
    # wrapper's own ops around them (GQA's sum over a group's dk/dv) may fuse in another order: bf16 rounding
    qkv, ref_kw, _ = make_case(PACKED_CASES["packed_causal_gqa2"], torch.bfloat16)
    inputs, kw = on_cuda(qkv, ref_kw)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: attention(q, k, v, backend="triton", **kw), fullgraph=True)
    eager = [t.detach().requires_grad_() for t in inputs]
    compiled = [t.detach().requires_grad_() for t in inputs]
    out_e, out_c = attention(*eager, backend="triton", **kw), fn(*compiled)
    grad = torch.randn_like(out_e)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-2)
    grads = zip(
        torch.autograd.grad(out_c, compiled, grad), torch.autograd.grad(out_e, eager, grad), strict=True
    )
    for a, b in grads:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2)
    torch._dynamo.reset()
