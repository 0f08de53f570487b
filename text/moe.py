"""Mixture-of-experts feed-forward for the Llama-style decoder (Qwen3-MoE's): a linear router scores
`n_experts` SwiGLU experts per token, the token goes to its `experts_per_token` best, and their outputs are
summed weighted by the router's softmax probabilities (renormalised over the chosen ones with
`norm_topk_prob`):

    p = softmax(router(x)),  (w, e) = topk(p, k),  y = sum_j w_j * down_e_j(silu(gate_e_j(x)) * up_e_j(x))

The experts run grouped: the (token, expert) pairs are sorted by expert so that each expert's tokens are one
contiguous slice, and each of the three projections is one `torch._grouped_mm` over all experts where this
build has it for the device and dtype (found by trying it once, BENCHMARKS.md § Mixture of experts), else a
loop over the experts' slices. Which blocks get experts is the config's (`moe_every`, `dense_layers`); the
others keep the dense SwiGLU.

Each MoE layer keeps the router statistics of its last forward (`RouterStats`), from which
`router_balance` computes Switch Transformer's auxiliary load-balancing loss as transformers'
`load_balancing_loss_func` does (counts and probabilities pooled over every MoE layer's tokens), scaled by
`router_aux_loss_coef`, and the experts' load: the language-modelling task adds the first to its loss when
training and logs both. A model without experts has no such layer and pays nothing.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from core.distributed.expert_parallel import expert_shards, run_on_expert_shards
from core.errors import ConfigError
from core.nn.layers import SwiGLU

if TYPE_CHECKING:  # (text.llama imports this module to build its blocks)
    from text.llama import DecoderConfig

#: how the experts' GEMMs run: "auto" (grouped where it works, found by trying), "grouped" or "loop"
EXPERT_PATHS = ("auto", "grouped", "loop")


def check_moe(config: DecoderConfig) -> None:
    """One-line ConfigError for expert options no router has; `dense_layers` made a tuple (the frozen
    config is hashable) and `expert_hidden` 0 made `hidden`."""
    object.__setattr__(config, "dense_layers", tuple(int(i) for i in config.dense_layers))
    object.__setattr__(config, "expert_hidden", config.expert_hidden or config.hidden)
    if config.n_experts and config.experts_per_token > config.n_experts:
        raise ConfigError(
            f"model.experts_per_token={config.experts_per_token} is more than the "
            f"model.n_experts={config.n_experts} there are",
            key="model.experts_per_token",
            value=str(config.experts_per_token),
            valid=(f"1 to {config.n_experts}",),
        )


def has_experts(config: DecoderConfig, layer: int) -> bool:
    """Whether block `layer` (from 0) of a `config` decoder routes to experts (Qwen3-MoE's rule: every
    `moe_every`-th block, counting from 1, unless `dense_layers` lists it)."""
    return bool(config.n_experts) and layer not in config.dense_layers and (layer + 1) % config.moe_every == 0


def feed_forward(config: DecoderConfig, layer: int) -> nn.Module:
    """Block `layer`'s feed-forward: the experts where the config routes it, else the dense SwiGLU."""
    if not has_experts(config, layer):
        return SwiGLU(config.d_model, config.hidden)
    c = config
    return MoE(
        c.d_model,
        c.expert_hidden,
        c.n_experts,
        c.experts_per_token,
        norm_topk_prob=c.norm_topk_prob,
        balance_coef=c.router_aux_loss_coef,
    )


@dataclass
class RouterStats:
    """One MoE layer's routing of its last forward: the router's probabilities summed over the tokens
    (differentiable: the balancing loss's gradient goes through it), the (token, expert) pairs per expert,
    and the tokens."""

    prob_sum: torch.Tensor  # (E,) float32
    counts: torch.Tensor  # (E,) int64
    tokens: int


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU feed-forwards from `dim` through `hidden` gated units, their weights stacked
    (expert, out, in) as each expert's `nn.Linear` would hold them, run on tokens sorted by expert."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        """Stacked gate/up (E, hidden, dim) and down (E, dim, hidden) weights, N(0, 0.02) until loaded."""
        super().__init__()
        self.gate = nn.Parameter(torch.randn(n_experts, hidden, dim) * 0.02)
        self.up = nn.Parameter(torch.randn(n_experts, hidden, dim) * 0.02)
        self.down = nn.Parameter(torch.randn(n_experts, dim, hidden) * 0.02)
        self.path = "auto"  # one of EXPERT_PATHS (the bench sets it)
        self.ep_group = None  # expert parallel: the group the experts are split over (trainer.ep)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's feed-forward of its rows of `x` (N, dim): rows sorted by expert, `counts` (E,)
        rows each; split over ranks (core.distributed.expert_parallel), on the rank holding the expert."""
        if self.ep_group is not None:
            return run_on_expert_shards(x, counts, self._run, self.ep_group)
        return self._run(x, counts)

    def _run(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts held here on their rows of `x`, sorted by expert, `counts` rows each."""
        dtype = compute_dtype(x)
        weights = self.weights()
        if self.ep_group is not None:
            weights = expert_shards(weights, self.ep_group, dtype)
        grouped = self.path == "grouped" or (
            self.path == "auto" and grouped_mm_works(x.device, dtype, self.gate.shape[2], self.gate.shape[1])
        )
        if grouped:
            ends = counts.cumsum(0).to(torch.int32)
            x, (gate, up, down) = x.to(dtype), (w.to(dtype).transpose(1, 2) for w in weights)
            h = F.silu(torch._grouped_mm(x, gate, offs=ends)) * torch._grouped_mm(x, up, offs=ends)
            return torch._grouped_mm(h, down, offs=ends)
        out, start = [], 0
        gate, up, down = weights
        for e, n in enumerate(counts.tolist()):  # the host reads the counts: the loop's one sync
            rows = x[start : start + n]
            out.append(F.linear(F.silu(F.linear(rows, gate[e])) * F.linear(rows, up[e]), down[e]))
            start += n
        return torch.cat(out)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down), each (E, out, in)."""
        return self.gate, self.up, self.down


class MoE(nn.Module):
    """A top-k softmax router over `GroupedExperts`: Qwen3-MoE's sparse block."""

    def __init__(
        self, dim: int, hidden: int, n_experts: int, top_k: int, *, norm_topk_prob: bool, balance_coef: float
    ) -> None:
        """A router over `n_experts` experts of `hidden` gated units each, `top_k` per token; with
        `norm_topk_prob` the chosen experts' probabilities are renormalised to sum to 1; `balance_coef`
        scales the balancing loss (`router_balance`)."""
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, n_experts)
        self.top_k, self.norm_topk_prob, self.balance_coef = top_k, norm_topk_prob, balance_coef
        self.stats: RouterStats | None = None  # the last forward's, read by `router_balance`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The mixture's output for `x` (..., dim)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        n_experts = probs.shape[-1]
        # scatter_add, not bincount: no device-to-host sync to size the result
        pairs = chosen.flatten()
        counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, pairs, torch.ones_like(pairs)
        )
        self.stats = RouterStats(probs.sum(0), counts, x.shape[0])
        # stable: a token's pairs stay in expert order, so its outputs are summed as transformers sums them
        order = pairs.argsort(stable=True)
        token = order // self.top_k
        out = self.experts(x[token], counts) * weights.to(logits.dtype).flatten()[order, None]
        y = torch.zeros(x.shape, dtype=out.dtype, device=x.device).index_add_(0, token, out)
        return y.to(x.dtype).view(shape)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype `x`'s matmuls run in: autocast's where it is on for `x`'s device, else `x`'s own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


#: (device type, dtype, dim, hidden) -> (runs eagerly, runs traced): torch.compile checks a call against the
#: kernel's meta rules, which may refuse what the eager kernel takes (torch 2.14: fp32 on the CPU)
_GROUPED_WORKS: dict[tuple[str, torch.dtype, int, int], tuple[bool, bool]] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    """Whether `torch._grouped_mm` runs the experts' three GEMMs forward and backward on `device` in
    `dtype` at these widths (kernels refuse some dtypes and strides), tried once on a few rows, and under
    torch.compile whether its meta rules take them too (the loop if eager never tried)."""
    key = (device.type, dtype, dim, hidden)
    compiling = torch.compiler.is_compiling()
    if key not in _GROUPED_WORKS:
        if compiling:
            return False
        _GROUPED_WORKS[key] = (
            _try_grouped_mm(device, dtype, dim, hidden),
            _try_grouped_mm("meta", dtype, dim, hidden),
        )
    eager, traced = _GROUPED_WORKS[key]
    return eager and (traced or not compiling)


def _try_grouped_mm(device: torch.device | str, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    """Run a two-expert SwiGLU (one expert given no rows) through `torch._grouped_mm`, forward and
    backward, and compare it with plain matmuls (on the meta device: only whether the shapes and dtype
    pass the kernel's meta rules)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device)
    try:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            kw = {"device": device, "dtype": dtype}
            x = torch.randn(5, dim, **kw, requires_grad=True)
            # stored (expert, out, in) and transposed, as `GroupedExperts` holds and passes them
            w1 = torch.randn(3, hidden, dim, **kw, requires_grad=True)
            w2 = torch.randn(3, dim, hidden, **kw, requires_grad=True)
            ends = torch.tensor([2, 2, 5], dtype=torch.int32, device=device)
            h = torch._grouped_mm(x, w1.transpose(1, 2), offs=ends)
            y = torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)
            (y * torch.randn_like(y)).sum().backward()  # a dense gradient, as the router's weights give
            if device.type == "meta":
                return True
            want = torch.cat([x[:2] @ w1[0].T @ w2[0].T, x[2:] @ w1[2].T @ w2[2].T])
            return bool(
                torch.allclose(y.float(), want.float(), rtol=0.05, atol=0.05 * want.abs().max().item())
            )
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@dataclass
class RouterBalance:
    """What the routers of one forward add to a training step: the balancing loss times its coefficient
    (`loss`, added to the task's), and the metrics logged beside it."""

    loss: torch.Tensor
    metrics: dict[str, float | torch.Tensor]


_LAYERS: weakref.WeakKeyDictionary[nn.Module, tuple[MoE, ...]] = weakref.WeakKeyDictionary()


def moe_layers(model: nn.Module) -> tuple[MoE, ...]:
    """`model`'s MoE layers (a dense model: none), found once per model."""
    layers = _LAYERS.get(model)
    if layers is None:
        layers = _LAYERS[model] = tuple(m for m in model.modules() if isinstance(m, MoE))
    return layers


def router_balance(model: nn.Module) -> RouterBalance | None:
    """The auxiliary load-balancing loss of `model`'s last forward, scaled by its config's
    `router_aux_loss_coef`, and the experts' load; None for a model without experts.

    The loss is transformers' `load_balancing_loss_func` without an attention mask: E * sum_e f_e P_e, with
    f_e the share of (token, expert) pairs and P_e the mean router probability of expert e, both pooled over
    every MoE layer's tokens (so not a sum of per-layer losses). Metrics: `moe/aux_loss` (unscaled) and
    `moe/load_max_over_mean`, the busiest expert's pairs over the mean expert's in the most uneven layer
    (1: balanced)."""
    layers = moe_layers(model)
    if not layers:
        return None
    stats = [m.stats for m in layers if m.stats is not None]
    if not stats:
        return None
    rows = sum(s.tokens for s in stats)
    counts = torch.stack([s.counts for s in stats]).float()
    probs = torch.stack([s.prob_sum for s in stats]).sum(0)
    aux = counts.shape[1] * torch.sum(counts.sum(0) / rows * probs / rows)
    load = (counts.amax(1) / counts.mean(1)).max()
    return RouterBalance(
        layers[0].balance_coef * aux,
        {"moe/aux_loss": aux.detach(), "moe/load_max_over_mean": load},
    )


def active_parameters(model: nn.Module) -> int:
    """Parameters one token's forward uses: all of them but the experts it is not routed to (the
    "A3B" of Qwen3-30B-A3B)."""
    total = sum(p.numel() for p in model.parameters())
    for layer in moe_layers(model):
        n_experts = layer.router.out_features
        idle = (n_experts - layer.top_k) / n_experts
        total -= round(idle * sum(w.numel() for w in layer.experts.weights()))
    return total
