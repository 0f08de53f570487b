"""AdamW with the device's fastest implementation, and a linear-warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from core.errors import ConfigError


@dataclass
class OptimConfig:
    """AdamW and schedule settings."""

    lr: float = 3e-3
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.05
    schedule: str = "cosine"


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters: decay matrices/embeddings, never biases or norm gains (1-D tensors)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, impl: str = "default") -> torch.optim.Optimizer:
    """AdamW; `impl` is the device plan's choice ("fused", "foreach" or "default")."""
    if cfg.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.lr} must be > 0")
    kwargs = {"fused": True} if impl == "fused" else {"foreach": True} if impl == "foreach" else {}
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs
    )


def build_scheduler(
    opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak lr, then cosine (or constant) decay to `min_lr_ratio` x peak."""
    if cfg.schedule not in ("cosine", "constant"):
        raise ConfigError(f"optim.schedule={cfg.schedule} is unknown; valid: cosine, constant")
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
