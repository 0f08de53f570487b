"""AdamW with the device's fastest implementation, and a linear-warmup + cosine learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Annotated

import torch
from torch import nn

from core.bounds import Bounds, check_values

SCHEDULES = ("cosine", "constant")


@dataclass
class OptimConfig:
    """AdamW and schedule settings."""

    #: peak learning rate, reached after warmup
    lr: Annotated[float, Bounds(gt=0)] = 3e-3
    #: AdamW's decoupled weight decay, on weight matrices only (never biases, norm gains, embedding tables
    #: or a model's no_weight_decay() names)
    weight_decay: Annotated[float, Bounds(ge=0)] = 0.05
    #: AdamW's moving-average coefficients [beta1,beta2]
    betas: Annotated[tuple[float, float], Bounds(ge=0, lt=1, length=2)] = (0.9, 0.95)
    #: AdamW's denominator term
    eps: Annotated[float, Bounds(gt=0)] = 1e-8
    #: steps of linear warmup to lr; 0: warmup_ratio x the run's steps
    warmup_steps: Annotated[int, Bounds(ge=0)] = 0
    #: warmup as a fraction of the run's steps, when warmup_steps is 0
    warmup_ratio: Annotated[float, Bounds(ge=0, le=1)] = 0.05
    #: the cosine schedule's final learning rate, as a fraction of lr
    min_lr_ratio: Annotated[float, Bounds(ge=0, le=1)] = 0.05
    #: after warmup: "cosine" decays to min_lr_ratio x lr by the last step; "constant" stays at lr
    schedule: Annotated[str, Bounds(choices=SCHEDULES)] = "cosine"


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters: decay weight matrices; never biases or norm gains (1-D tensors), nn.Embedding
    tables, or what a module's `no_weight_decay()` names (timm's convention, e.g. a ViT's class and position
    tokens)."""
    exempt = _no_decay_ids(model)
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and id(p) not in exempt else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _no_decay_ids(model: nn.Module) -> set[int]:
    """ids of the embedding tables and of the parameters modules name in `no_weight_decay()` (names relative
    to that module); an embedding tied to another module's matrix (a language model's output head) decays,
    as that matrix does."""
    embeddings, matrices, declared = set(), set(), set()
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            embeddings.add(id(m.weight))
        else:
            matrices |= {id(p) for p in m.parameters(recurse=False) if p.ndim >= 2}
        names = getattr(m, "no_weight_decay", None)
        if callable(names):
            params = dict(m.named_parameters())
            unknown = sorted(set(names()) - set(params))
            if unknown:
                raise ValueError(f"{type(m).__name__}.no_weight_decay() names no parameter {unknown}")
            declared |= {id(params[n]) for n in names()}
    return (embeddings - matrices) | declared


def build_optimizer(model: nn.Module, cfg: OptimConfig, impl: str = "default") -> torch.optim.Optimizer:
    """AdamW; `impl` is the device plan's choice ("fused", "foreach" or "default")."""
    check_values("optim", dataclasses.asdict(cfg), OptimConfig)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": True} if impl == "foreach" else {}
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs
    )


def build_scheduler(
    opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak lr, then cosine (or constant) decay to `min_lr_ratio` x peak."""
    check_values("optim", dataclasses.asdict(cfg), OptimConfig)
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    total = max(total_steps, warmup + 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
