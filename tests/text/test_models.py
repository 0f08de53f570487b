"""The encoder classifier: padding never changes a text's logits."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from tests.helpers import fault
from text.models import TextClassifier


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_padding_does_not_change_logits(pooling: str) -> None:
    torch.manual_seed(0)
    model = TextClassifier(
        vocab_size=30, num_classes=3, max_len=16, n_layer=2, d_model=16, pooling=pooling
    ).eval()
    short = torch.randint(1, 30, (1, 5))
    padded = torch.cat([short, torch.zeros(1, 7, dtype=torch.long)], dim=1)
    mask = torch.arange(12)[None] < 5
    with torch.no_grad():
        alone = model(short, torch.ones(1, 5, dtype=torch.bool))
        batch = model(
            torch.cat([padded, torch.randint(1, 30, (1, 12))]), torch.cat([mask, torch.ones_like(mask)])
        )
    torch.testing.assert_close(batch[:1], alone, atol=1e-5, rtol=1e-5)  # fp32, reassociation only


def test_unknown_pooling_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as e:
        TextClassifier(vocab_size=30, num_classes=3, max_len=16, pooling="max")
    key, value, valid = fault(e.value)
    assert (key, value) == ("model.pooling", "max") and "mean" in valid
