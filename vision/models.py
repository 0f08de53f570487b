"""Image classifiers registered by name: a small CNN, ResNet-18 for small inputs, and a small ViT."""

from __future__ import annotations

import torch
import torchvision
from torch import nn

from core.attention import attention
from core.registry import MODELS


@MODELS.register("small_cnn")
def small_cnn(
    *, num_classes: int, in_channels: int, image_size: int, width: int = 32, dropout: float = 0.1
) -> nn.Module:
    """Two conv stages (3x3 conv-BN-GELU pairs, then pooling) and a linear head."""

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


@MODELS.register("resnet18")
def resnet18(*, num_classes: int, in_channels: int, image_size: int, small_input: bool = True) -> nn.Module:
    """torchvision's ResNet-18 (random init); for small images the stem keeps full resolution."""
    net = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if small_input or in_channels != 3:
        stride = 1 if small_input else 2
        net.conv1 = nn.Conv2d(
            in_channels, 64, 3 if small_input else 7, stride, 1 if small_input else 3, bias=False
        )
    if small_input:
        net.maxpool = nn.Identity()
    return net


class Block(nn.Module):
    """Pre-norm transformer encoder block; attention goes through `core.attention`."""

    def __init__(
        self, dim: int, heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0, causal: bool = False
    ) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim), nn.Dropout(dropout)
        )
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, dim)."""
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = attention(q, k, v, causal=self.causal, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch embedding, learned positions, a [CLS] token and a stack of `Block`s."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        image_size: int,
        patch_size: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_ratio: float,
        dropout: float,
    ) -> None:
        super().__init__()
        n = (image_size // patch_size) ** 2
        self.patch = nn.Conv2d(in_channels, dim, patch_size, patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, C, H, W) -> logits (B, num_classes)."""
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x[:, 0]))


@MODELS.register("vit")
def vit(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    patch_size: int = 2,
    dim: int = 96,
    depth: int = 4,
    heads: int = 4,
    mlp_ratio: float = 2.0,
    dropout: float = 0.0,
) -> nn.Module:
    """A small Vision Transformer sized for tiny images."""
    if image_size % patch_size or dim % heads:
        from core.errors import ConfigError

        raise ConfigError(
            f"model.patch_size={patch_size} must divide the image size {image_size} and model.heads={heads} "
            f"must divide model.dim={dim}"
        )
    return ViT(num_classes, in_channels, image_size, patch_size, dim, depth, heads, mlp_ratio, dropout)
