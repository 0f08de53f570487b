"""Layers of the Llama-style decoders, shared with any model that takes them: rotary position embeddings
(with Llama 3's frequency scaling), RMS normalisation and the SwiGLU feed-forward.

Rotary embeddings use the half-split layout: a head's first half of features pairs with its second half
(feature i with i + D/2), the layout the Conformer and Hugging Face's Llama/Qwen checkpoints use.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Llama3Scaling(NamedTuple):
    """Llama 3's rotary frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend between, judged against the context the model was first trained on."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int


def rope_frequencies(
    head_dim: int,
    theta: float = 10_000.0,
    scaling: Llama3Scaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The (head_dim/2,) fp32 angular frequencies theta^(-2i/head_dim), Llama 3 scaled with `scaling`."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv
    f, low, high, old = scaling
    wavelength = 2 * math.pi / inv
    # (old / wavelength) counts the turns a frequency makes over the original context: below low_freq_factor
    # turns it is slowed by `factor`, above high_freq_factor it is kept, in between the two are blended
    smooth = ((old / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv / f + smooth * inv


def rope_angles(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., L, D/2), fp32, of `positions` (..., L) times `freqs` (D/2,)."""
    angles = positions.to(torch.float32)[..., None] * freqs
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` (..., D) rotated by the angles whose cos/sin (broadcastable to (..., D/2)) are given."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, normalised in fp32 whatever the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        """A norm over `dim` features with a learned gain (ones) and `eps` inside the square root."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` normalised (its own dtype) times the gain."""
        # fp32 statistics: a bf16 mean of squares over thousands of features loses the small ones. Written
        # out rather than F.rms_norm, which torch 2.3 (the legacy profile) lacks
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the gated feed-forward of Llama and Qwen."""

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        """A feed-forward from `dim` features through `hidden` gated units back to `dim`."""
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=bias)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward of `x` (..., dim)."""
        return self.down(F.silu(self.gate(x)) * self.up(x))
