"""The legacy stack (torch 2.3, torchtext 0.18, numpy<2): what `make test-legacy` promises still works."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
import torch.nn.functional as F

import core
from core.attention import attention

pytestmark = pytest.mark.legacy


def test_the_venv_is_the_legacy_stack() -> None:
    import numpy
    import torchtext

    assert torch.__version__.startswith("2.3."), torch.__version__
    assert torchtext.__version__.startswith("0.18."), torchtext.__version__
    assert int(numpy.__version__.split(".")[0]) < 2, numpy.__version__


def test_every_core_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(core.__path__, "core.")]
    assert "core.attention" in names
    for name in names:
        importlib.import_module(name)


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
