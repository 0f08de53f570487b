"""`core.nn.layers` against float64 references written from the definitions: RMSNorm, SwiGLU, rotary
embeddings (a rotation: norms kept, q.k depending on the position offset only) and Llama 3's scaling."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from core.nn.layers import Llama3Scaling, RMSNorm, SwiGLU, apply_rope, rope_angles, rope_frequencies


def test_rmsnorm_equals_its_definition_in_float64_and_keeps_the_input_dtype() -> None:
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    x64 = x.double()
    want = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), want, atol=1e-6, rtol=1e-6)  # fp32 rounding only
    assert norm(x.bfloat16()).dtype == torch.float32  # fp32 gain times a bf16 normalised input: promoted
    assert norm.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


def test_swiglu_is_down_of_silu_gate_times_up() -> None:
    torch.manual_seed(0)
    mlp = SwiGLU(8, 12)
    x = torch.randn(4, 8)
    want = F.linear(F.silu(F.linear(x, mlp.gate.weight)) * F.linear(x, mlp.up.weight), mlp.down.weight)
    torch.testing.assert_close(mlp(x), want, atol=0, rtol=0)


def test_rope_is_a_rotation_whose_dot_products_depend_on_the_offset_only() -> None:
    g = torch.Generator().manual_seed(1)
    q, k = (
        torch.randn(32, generator=g, dtype=torch.float64),
        torch.randn(32, generator=g, dtype=torch.float64),
    )
    freqs = rope_frequencies(32, 10_000.0).double()

    def at(x: torch.Tensor, pos: int) -> torch.Tensor:
        cos, sin = rope_angles(freqs, torch.tensor([pos]))
        return apply_rope(x[None], cos.double(), sin.double())[0]

    torch.testing.assert_close(at(q, 7).norm(), q.norm(), atol=1e-12, rtol=0)
    # float64 all through but the fp32 angles: pos * freq rounded to fp32 moves a product by ~1e-6
    torch.testing.assert_close(at(q, 9) @ at(k, 4), at(q, 105) @ at(k, 100), atol=1e-5, rtol=0)
    assert torch.equal(at(q, 0), q)  # position 0 is no rotation


def test_llama3_scaling_keeps_fast_frequencies_slows_slow_ones_and_blends_between() -> None:
    plain = rope_frequencies(64, 500_000.0)
    scaled = rope_frequencies(64, 500_000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192))
    turns = 8192 * plain / (2 * math.pi)  # turns each frequency makes over the original context
    fast, slow = turns > 4.0, turns < 1.0
    mid = ~fast & ~slow
    assert fast.any() and slow.any() and mid.any()
    assert torch.equal(scaled[fast], plain[fast])
    torch.testing.assert_close(scaled[slow], plain[slow] / 8.0, rtol=1e-6, atol=0)
    # between, a linear blend of the two by how many turns: (turns - 1) / (4 - 1) of the unscaled one
    blend = (turns[mid] - 1.0) / 3.0
    torch.testing.assert_close(
        scaled[mid], blend * plain[mid] + (1 - blend) * plain[mid] / 8.0, rtol=1e-5, atol=0
    )
