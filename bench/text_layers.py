"""Forward + backward ms per layer of the LM step's parts that are not GEMMs (attention, GELU), with the
alternatives, at the speed shape: where the step's time goes. `python -m bench.text --parts layer` runs it."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from bench.text_speed import SHAPE


def layer_parts(reps: int = 15) -> dict[str, float]:
    """Median forward + backward ms per layer of the step's non-GEMM parts at SHAPE, with alternatives."""
    from core.attention import attention

    s = SHAPE
    b, t, h, d = s["batch"], s["context"], s["n_head"], s["d_model"]
    torch.manual_seed(0)
    qkv = torch.randn(b, t, 3, h, d // h, requires_grad=True)  # as the model's qkv projection lays it out
    g_att = torch.randn(b, h, t, d // h)
    hidden = torch.randn(b * t, 4 * d, requires_grad=True)
    g_hidden = torch.randn(b * t, 4 * d)

    def att(**kw: object) -> None:
        q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
        attention(q, k, v, **kw).backward(g_att)
        qkv.grad = None

    def gelu(approximate: str) -> None:
        F.gelu(hidden, approximate=approximate).backward(g_hidden)
        hidden.grad = None

    cases = {
        "sdpa_causal": lambda: att(causal=True, backend="sdpa"),
        "sdpa_noncausal": lambda: att(causal=False, backend="sdpa"),
        "math_causal": lambda: att(causal=True, backend="math"),
        "gelu_erf": lambda: gelu("none"),
        "gelu_tanh": lambda: gelu("tanh"),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(reps):  # round robin, so drift hits every case alike
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    out = {f"layer_{name}_ms": statistics.median(v) for name, v in times.items()}
    print("layer  fwd+bwd ms per layer: " + " | ".join(f"{n} {out[f'layer_{n}_ms']:.2f}" for n in cases)
          + f" (x{s['n_layer']} layers per step)", flush=True)  # fmt: skip
    return out
