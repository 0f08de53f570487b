"""Image classifiers by name: a small CNN, ResNet-18 (its stem fits the image size), a small ViT."""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torchvision
from torch import nn

from core.bounds import Bounds
from core.errors import ConfigError
from core.registry import MODELS
from core.transformer import Block


@MODELS.register("small_cnn")
def small_cnn(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    width: Annotated[int, Bounds(ge=1)] = 32,
    dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.1,
) -> nn.Module:
    """Two conv stages (3x3 conv-BN-GELU pairs, then pooling) and a linear head.

    width: channels of the first stage (the second has twice as many)
    dropout: dropout probability before the head
    """

    def stage(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU()]

    return nn.Sequential(
        *stage(in_channels, width),
        *stage(width, width),
        nn.MaxPool2d(2),
        *stage(width, 2 * width),
        *stage(2 * width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * width, num_classes),
    )


#: the largest image side that gets ResNet-18's small-input stem under `small_input=auto`
SMALL_INPUT_MAX = 32


@MODELS.register("resnet18")
def resnet18(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    small_input: Annotated[bool | Literal["auto"], Bounds(choices=("auto", True, False))] = "auto",
) -> nn.Module:
    """torchvision's ResNet-18 (random init); for small images the stem keeps full resolution.

    small_input: a 3x3 stride-1 stem without max-pooling (true), torchvision's 7x7 stride-2 stem (false), or
        auto: the small stem for images of 32 px or less
    """
    if small_input == "auto":
        # The ImageNet stem (7x7 stride 2, then a stride-2 max-pool) divides each side by 4 and the whole net
        # by 32: at CIFAR's 32 px and below its last stage would see 1x1 maps, so small images get the small
        # stem. Larger ones keep the ImageNet stem, which still leaves the last stage 2x2 or more, where the
        # small stem would run every stage on 16x the positions (issue #17: the ImageFolder recipe at 64 px).
        small_input = image_size <= SMALL_INPUT_MAX
    net = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if small_input or in_channels != 3:
        stride = 1 if small_input else 2
        net.conv1 = nn.Conv2d(
            in_channels, 64, 3 if small_input else 7, stride, 1 if small_input else 3, bias=False
        )
    if small_input:
        net.maxpool = nn.Identity()
    return net


@MODELS.register("vit")
class ViT(nn.Module):
    """A small Vision Transformer sized for tiny images: patch embedding, learned positions, a [CLS] token
    and a stack of core.transformer blocks."""

    def __init__(
        self,
        *,
        num_classes: int,
        in_channels: int,
        image_size: int,
        patch_size: Annotated[int, Bounds(ge=1)] = 2,
        dim: Annotated[int, Bounds(ge=1)] = 96,
        depth: Annotated[int, Bounds(ge=1)] = 4,
        heads: Annotated[int, Bounds(ge=1)] = 4,
        mlp_ratio: Annotated[float, Bounds(gt=0)] = 2.0,
        dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.0,
    ) -> None:
        """`num_classes`, `in_channels` and `image_size` come from the dataset.

        patch_size: side of the square patches in pixels (must divide the image size)
        dim: width of the patch embeddings and the blocks
        depth: transformer blocks
        heads: attention heads per block (must divide dim)
        mlp_ratio: hidden width of each block's MLP, as a multiple of dim
        dropout: dropout probability in the blocks
        """
        if image_size % patch_size or dim % heads:
            raise ConfigError(
                f"model.patch_size={patch_size} must divide the image size {image_size} and "
                f"model.heads={heads} must divide model.dim={dim}"
            )
        super().__init__()
        n = (image_size // patch_size) ** 2
        self.patch = nn.Conv2d(in_channels, dim, patch_size, patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(
            Block(dim, heads, dropout, bias=True, mlp_ratio=mlp_ratio) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def no_weight_decay(self) -> set[str]:
        """The class token and position embeddings: learned offsets, not weights (core.optim.param_groups
        leaves them undecayed, as timm and torchvision's reference do)."""
        return {"cls", "pos"}

    #: parameter names of the blocks before they were core.transformer's (vision had its own block)
    _OLD_BLOCK_KEYS = {"norm1.": "ln1.", "norm2.": "ln2.", "mlp.0.": "fc.", "mlp.2.": "fc_out."}

    def upgrade_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with block keys of checkpoints written before the shared block renamed to today's."""
        out = {}
        for key, value in state.items():
            parts = key.split(".", 2)  # blocks, i, rest
            if len(parts) == 3 and parts[0] == "blocks":
                for old, new in self._OLD_BLOCK_KEYS.items():
                    if parts[2].startswith(old):
                        key = f"blocks.{parts[1]}.{new}{parts[2][len(old) :]}"
            out[key] = value
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, C, H, W) -> logits (B, num_classes)."""
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x[:, 0]))
