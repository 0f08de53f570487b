"""Conformer-CTC: shapes, padding invariance, attention through core.attention, registry sizes."""

from __future__ import annotations

import pytest
import torch

import audio.conformer as conformer
from core.errors import ConfigError
from core.registry import MODELS
from tests.helpers import fault


def _tiny() -> conformer.ConformerCTC:
    torch.manual_seed(0)
    return MODELS.build(
        "conformer_ctc_xs", n_mels=40, dim=32, layers=2, heads=2, subsampling_channels=8, subsampling=4
    ).eval()


def test_output_shape_lengths_and_log_probs() -> None:
    model = _tiny()
    lp, n = model(torch.randn(3, 101, 40), torch.tensor([101, 60, 7]))
    assert lp.shape == (3, 26, 29)
    assert n.tolist() == [26, 15, 2]  # two stride-2 convs: ((n - 1) // 2) // 2 + 1
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3, 26), rtol=0, atol=1e-5)


def test_padding_does_not_change_an_utterance() -> None:
    model = _tiny()
    x = torch.randn(1, 57, 40)
    alone, n = model(x, torch.tensor([57]))
    padded = torch.cat([x, torch.randn(1, 43, 40) * 10], dim=1)  # garbage in the padding
    batch = torch.cat([padded, torch.randn(1, 100, 40)])
    out, _ = model(batch, torch.tensor([57, 100]))
    # reference: the same utterance run alone; fp32 tolerance for reordered reductions
    torch.testing.assert_close(out[0, : int(n)], alone[0], rtol=1e-4, atol=1e-4)


def test_attention_goes_through_core_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = conformer.attention

    def spy(q, k, v, **kw):
        calls.append((q.shape, kw["key_padding_mask"].shape))
        return real(q, k, v, **kw)

    monkeypatch.setattr(conformer, "attention", spy)
    _tiny()(torch.randn(2, 41, 40), torch.tensor([41, 30]))
    assert calls == [(torch.Size([2, 2, 11, 16]), torch.Size([2, 11]))] * 2


def test_registered_sizes_and_bad_heads() -> None:
    sizes = {
        n: sum(p.numel() for p in MODELS.build(n).parameters())
        for n in ("conformer_ctc_xs", "conformer_ctc_s")
    }
    assert 0.5e6 < sizes["conformer_ctc_xs"] < 3e6 and 7e6 < sizes["conformer_ctc_s"] < 14e6
    assert "conformer_ctc_m" in MODELS
    with pytest.raises(ConfigError) as e:
        MODELS.build("conformer_ctc_xs", dim=30, heads=4)
    assert fault(e.value) == ("model.heads", "4", ("1", "3", "5", "15"))  # 30 / h even: h in 1, 3, 5, 15
    with pytest.raises(ConfigError) as e:
        MODELS.build("conformer_ctc_xs", subsampling=3)
    assert fault(e.value) == ("model.subsampling", "3", ("2", "4"))


def test_subsampling_by_two_halves_frames_and_keeps_padding_invariance() -> None:
    torch.manual_seed(0)
    model = MODELS.build("conformer_ctc_xs", n_mels=40, dim=32, layers=1, heads=2, subsampling=2).eval()
    x = torch.randn(2, 101, 40)
    out, n = model(x, torch.tensor([101, 60]))
    assert out.shape == (2, 51, 29) and n.tolist() == [51, 30]
    alone, _ = model(x[1:, :60], torch.tensor([60]))
    torch.testing.assert_close(out[1, :30], alone[0], rtol=1e-4, atol=1e-4)
