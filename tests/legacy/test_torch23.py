"""The legacy stack (torch 2.3, torchtext 0.18, numpy<2): what `make test-legacy` promises still works."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import core
from core.attention import attention
from core.errors import ConfigError

pytestmark = pytest.mark.legacy


def test_the_venv_is_the_legacy_stack() -> None:
    import numpy
    import torchtext

    assert torch.__version__.startswith("2.3."), torch.__version__
    assert torchtext.__version__.startswith("0.18."), torchtext.__version__
    assert int(numpy.__version__.split(".")[0]) < 2, numpy.__version__


# Modules that need a newer torch must say so on import (and nothing may import them on torch 2.3).
NEEDS_NEWER_TORCH = {
    "core.attention.fused_op": "need torch >= 2.4",
    "core.attention.cpu_bf16_causal": "needs torch >= 2.4",
}


def test_every_core_module_imports_or_names_the_torch_it_needs() -> None:
    names = [m.name for m in pkgutil.walk_packages(core.__path__, "core.")]
    assert "core.attention" in names and "core.loop.trainer" in names
    for name in names:
        if name in NEEDS_NEWER_TORCH:
            with pytest.raises(ImportError, match=NEEDS_NEWER_TORCH[name]):
                importlib.import_module(name)
        else:
            importlib.import_module(name)


def test_triton_backend_is_refused_with_the_reason() -> None:
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ConfigError, match="torch >= 2.4"):
        attention(q, q, q, backend="triton")


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_float64_softmax(causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 8) for _ in range(3))
    scores = q.double() @ k.double().transpose(-1, -2) / 8**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(17, 17, dtype=torch.bool).triu(1), float("-inf"))
    ref = scores.softmax(-1) @ v.double()
    torch.testing.assert_close(attention(q, k, v, causal=causal).double(), ref, atol=1e-5, rtol=1e-5)


def test_attention_key_padding_matches_sdpa_with_a_float_mask() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 8) for _ in range(3))
    keep = torch.arange(9)[None] < torch.tensor([[9], [4]])
    bias = torch.zeros(2, 1, 1, 9).masked_fill(~keep[:, None, None, :], float("-inf"))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(attention(q, k, v, key_padding_mask=keep), ref, atol=1e-6, rtol=1e-6)


def _tiny_gpt_and_probe() -> tuple[torch.nn.Module, torch.Tensor, Callable[[torch.nn.Module], None]]:
    from text.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=40, context=16, n_layer=2, n_head=2, d_model=16)
    x = torch.randint(0, 40, (2, 16))

    def probe(m: torch.nn.Module) -> None:
        m(x).float().sum().backward()

    return model, x, probe


def test_regional_compile_traces_the_gpt_and_matches_eager() -> None:
    from core.compile import CompileConfig, apply

    model, x, probe = _tiny_gpt_and_probe()
    with torch.no_grad():
        ref = model(x)
    apply(model, CompileConfig(policy="regional"), probe=probe, backend="eager")  # dynamo only: no C++ build
    assert model.compile_report.compiled == "regional", model.compile_report.reason
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)


def test_a_failing_compiler_falls_back_to_eager() -> None:
    from core.compile import CompileConfig, apply

    def broken(gm: torch.fx.GraphModule, inputs: list) -> Callable:
        raise RuntimeError("backend exploded")

    model, x, probe = _tiny_gpt_and_probe()
    with torch.no_grad():
        ref = model(x)
    apply(model, CompileConfig(policy="regional"), probe=probe, backend=broken)
    assert model.compile_report.compiled == "none"
    assert "exploded" in model.compile_report.reason
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, atol=0, rtol=0)


def test_gqa_without_enable_gqa_matches_repeated_heads() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(attention(q, k, v, causal=True), ref, atol=1e-6, rtol=1e-6)


def test_cpu_precision_probe_measures_on_torch23(tmp_path, monkeypatch) -> None:
    # the probe's child runs on this torch too (no mkldnn fp32_precision API here: fast math not timed)
    from core.device import detect, resolve
    from core.device.probe import MARGIN

    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path))
    facts = detect()
    plan = resolve("cpu", facts=facts)
    assert plan.probe is not None and set(plan.probe.ms) == {"fp32", "bf16"}
    assert (plan.precision == "bf16") == (plan.probe.speedup("bf16") >= MARGIN)
    assert list(tmp_path.glob("device/precision-probe-*.json"))


def test_compile_needs_no_private_torch_api_this_torch_lacks() -> None:
    from core.compile import torch_internals

    assert torch_internals.missing(include_optional=False) == []


def test_full_activation_checkpointing_matches_and_selective_is_refused() -> None:
    import copy

    from core.distributed import MeshShape
    from core.distributed.activation_checkpoint import check_mode
    from core.distributed.parallelize import parallelize
    from tests.core.ac_model import TinyLM, loss_and_grads, tokens

    torch.manual_seed(0)
    ref = TinyLM().double()
    model = parallelize(copy.deepcopy(ref), MeshShape(), activation_checkpointing="full")
    got, want = loss_and_grads(model, tokens())[1], loss_and_grads(ref, tokens())[1]
    for name in want:  # float64, the same ops on the same values: bit for bit
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    with pytest.raises(ConfigError) as err:  # torch 2.3 has no create_selective_checkpoint_contexts
        check_mode("selective")
    assert "trainer.activation_checkpointing" in str(err.value)
