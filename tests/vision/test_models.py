"""vision.models: every registered model maps images to logits, and bad shapes are config errors."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from core.registry import MODELS
from vision import models as _registers_vision_models  # noqa: F401


@pytest.mark.parametrize("name", ["small_cnn", "resnet18", "vit"])
@pytest.mark.parametrize(("channels", "size"), [(1, 8), (3, 16)])
def test_forward_backward_shapes(name: str, channels: int, size: int) -> None:
    model = MODELS.build(name, num_classes=7, in_channels=channels, image_size=size)
    x = torch.randn(2, channels, size, size, requires_grad=True)
    out = model(x)
    assert out.shape == (2, 7)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_vit_rejects_indivisible_patch() -> None:
    with pytest.raises(ConfigError, match="model.patch_size=3 must divide the image size 8"):
        MODELS.build("vit", num_classes=2, in_channels=1, image_size=8, patch_size=3)


def test_unknown_model_and_keyword_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown model 'nope'; valid choices: .*small_cnn"):
        MODELS.build("nope")
    with pytest.raises(ConfigError, match="model 'small_cnn': .*unexpected keyword argument 'depth'"):
        MODELS.build("small_cnn", num_classes=2, in_channels=1, image_size=8, depth=3)


def test_vit_checkpoints_from_before_the_shared_block_still_load() -> None:
    # ViT's blocks became core.transformer's: a checkpoint with the old names (norm1, norm2, mlp.0, mlp.2)
    # and the old fused q/k/v layout loads through core.checkpoint, and the model computes exactly what the
    # one that saved it did
    from core import checkpoint
    from tests.core.qkv_layout import old_qkv_layout

    torch.manual_seed(0)
    src = MODELS.build("vit", num_classes=3, in_channels=1, image_size=8)
    renames = {"ln1.": "norm1.", "ln2.": "norm2.", "fc.": "mlp.0.", "fc_out.": "mlp.2."}
    old = {}
    for key, value in src.state_dict().items():
        for new, before in renames.items():
            key = key.replace(f".{new}", f".{before}") if key.startswith("blocks.") else key
        old[key] = value
    old = old_qkv_layout(old, n_head=4)  # the ViT's default heads
    assert "blocks.0.norm1.weight" in old and "blocks.3.mlp.2.bias" in old and "blocks.0.qkv.weight" in old
    dst = MODELS.build("vit", num_classes=3, in_channels=1, image_size=8)
    checkpoint.load_model_state(dst, old, "old.pt")
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)
