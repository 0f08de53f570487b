"""Optimizers (AdamW, SGD, RMSprop) with the device's fastest implementation, and learning-rate schedules: a
linear or constant warmup, then cosine, constant, step or exponential decay.

The schedules are torchvision's classification reference (`references/classification/train.py`: a
LinearLR/ConstantLR warmup chained to CosineAnnealingLR/StepLR/ExponentialLR by SequentialLR), written as one
closed-form factor of the step in a LambdaLR: the lr at a step does not depend on how the steps before it
were run, and the scheduler's checkpointed state is the step count alone.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Optional

import torch
from torch import nn

from core.bounds import Bounds, check_values
from core.errors import ConfigError

OPTIMIZERS = ("adamw", "sgd", "rmsprop")
SCHEDULES = ("cosine", "constant", "step", "exponential")
WARMUP_METHODS = ("linear", "constant")
#: the lr factor of each drop of schedule=step when optim.gamma is null (torchvision's reference)
STEP_GAMMA = 0.1


@dataclass
class OptimConfig:
    """Optimizer and schedule settings."""

    #: the optimizer, picked with optim=NAME (conf/optim/NAME.yaml also sets its usual weight_decay, eps):
    #: adamw, sgd or rmsprop
    name: Annotated[str, Bounds(choices=OPTIMIZERS)] = "adamw"
    #: peak learning rate, reached after warmup
    lr: Annotated[float, Bounds(gt=0)] = 3e-3
    #: AdamW's decoupled weight decay, on weight matrices only (never biases, norm gains, embedding tables
    #: or a model's no_weight_decay() names)
    weight_decay: Annotated[float, Bounds(ge=0)] = 0.05
    #: AdamW's moving-average coefficients [beta1,beta2]
    betas: Annotated[tuple[float, float], Bounds(ge=0, lt=1, length=2)] = (0.9, 0.95)
    #: AdamW's and RMSprop's denominator term
    eps: Annotated[float, Bounds(gt=0)] = 1e-8
    #: SGD's and RMSprop's momentum
    momentum: Annotated[float, Bounds(ge=0, lt=1)] = 0.9
    #: SGD: Nesterov momentum (needs momentum > 0)
    nesterov: bool = False
    #: RMSprop's smoothing constant of the squared gradients (torchvision's reference: 0.9; torch's: 0.99)
    alpha: Annotated[float, Bounds(ge=0, lt=1)] = 0.9
    #: steps of warmup to lr; 0: warmup_ratio x the run's steps
    warmup_steps: Annotated[int, Bounds(ge=0)] = 0
    #: warmup as a fraction of the run's steps, when warmup_steps is 0
    warmup_ratio: Annotated[float, Bounds(ge=0, le=1)] = 0.05
    #: "linear": lr rises to its peak over the warmup; "constant": lr is warmup_decay x lr until it ends
    warmup_method: Annotated[str, Bounds(choices=WARMUP_METHODS)] = "linear"
    #: lr factor at the warmup's first step (torchvision's lr_warmup_decay): linear rises from it to 1 at step
    #: warmup_steps, constant holds it (required); null: linear rises as (step+1)/warmup_steps
    warmup_decay: Annotated[Optional[float], Bounds(gt=0, le=1)] = None  # noqa: UP045  (OmegaConf)
    #: the cosine schedule's final learning rate, as a fraction of lr
    min_lr_ratio: Annotated[float, Bounds(ge=0, le=1)] = 0.05
    #: after warmup: "cosine" decays to min_lr_ratio x lr by the last step; "constant" stays at lr; "step"
    #: multiplies lr by gamma every step_every steps; "exponential" multiplies it by gamma every step
    schedule: Annotated[str, Bounds(choices=SCHEDULES)] = "cosine"
    #: schedule=step: steps between lr drops; 0: a third of the steps after warmup (two drops in the run)
    step_every: Annotated[int, Bounds(ge=0)] = 0
    #: step: the factor of each drop (null: 0.1); exponential: the factor per step (null: the one that
    #: reaches min_lr_ratio x lr at the last step)
    gamma: Annotated[Optional[float], Bounds(gt=0, le=1)] = None  # noqa: UP045  (OmegaConf)


def check_config(cfg: OptimConfig) -> None:
    """Raise ConfigError naming the first bad value: each key's Bounds, then the keys that depend on each
    other (recipes.cli.validate runs this before any work)."""
    check_values("optim", dataclasses.asdict(cfg), OptimConfig)
    if cfg.name == "sgd" and cfg.nesterov and cfg.momentum == 0:
        raise ConfigError(
            "optim.nesterov=true needs optim.momentum > 0 (e.g. optim.momentum=0.9)",
            key="optim.momentum",
            value=str(cfg.momentum),
            valid=("> 0",),
        )
    if cfg.warmup_method == "constant" and cfg.warmup_decay is None:
        raise ConfigError(
            "optim.warmup_method=constant needs optim.warmup_decay, the fraction of lr held during warmup "
            "(torchvision's reference uses 0.01)",
            key="optim.warmup_decay",
            value="None",
            valid=("> 0 and <= 1",),
        )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters: decay weight matrices; never biases or norm gains (1-D tensors), nn.Embedding
    tables, or what a module's `no_weight_decay()` names (timm's convention, e.g. a ViT's class and position
    tokens). Parameters a module's `lr_scale()` gives a learning-rate factor other than 1 (e.g. a pretrained
    encoder under a new head) go in further groups carrying that `lr_scale`; the first two groups stay the
    full-rate decay and no-decay ones."""
    exempt, scales = _no_decay_ids(model), _lr_scales(model)
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {(1.0, True): [], (1.0, False): []}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((scales.get(id(p), 1.0), p.ndim >= 2 and id(p) not in exempt), []).append(p)
    return [
        {
            "params": ps,
            "weight_decay": weight_decay if decay else 0.0,
            **({} if s == 1.0 else {"lr_scale": s}),
        }
        for (s, decay), ps in groups.items()
    ]


def _lr_scales(model: nn.Module) -> dict[int, float]:
    """id -> learning-rate factor of the parameters modules name in `lr_scale()` (names relative to that
    module, as no_weight_decay's are)."""
    out: dict[int, float] = {}
    for m in model.modules():
        scale = getattr(m, "lr_scale", None)
        if callable(scale):
            params = dict(m.named_parameters())
            unknown = sorted(set(scale()) - set(params))
            if unknown:
                raise ValueError(f"{type(m).__name__}.lr_scale() names no parameter {unknown}")
            out |= {id(params[n]): float(f) for n, f in scale().items()}
    return out


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
    """The optimizer `cfg.name` names; `impl` is the device plan's choice ("fused", "foreach" or "default"),
    used where that optimizer has it (RMSprop has no fused kernel: torch picks its own)."""
    check_config(cfg)
    cls, hyper = {
        "adamw": (torch.optim.AdamW, {"betas": tuple(cfg.betas), "eps": cfg.eps}),
        "sgd": (torch.optim.SGD, {"momentum": cfg.momentum, "nesterov": cfg.nesterov}),
        "rmsprop": (torch.optim.RMSprop, {"alpha": cfg.alpha, "eps": cfg.eps, "momentum": cfg.momentum}),
    }[cfg.name]
    if impl in ("fused", "foreach") and impl in inspect.signature(cls).parameters:
        hyper[impl] = True
    groups = param_groups(model, cfg.weight_decay)
    for g in groups:  # a scaled group's own peak lr; the schedule's factor multiplies each group's alike
        if "lr_scale" in g:
            g["lr"] = cfg.lr * g["lr_scale"]
    return cls(groups, lr=cfg.lr, **hyper)


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """The warmup's length in steps: warmup_steps, or warmup_ratio of the run."""
    return cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)


def lr_factor(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """The lr at step s (0-based, counted in optimizer steps) as a fraction of `cfg.lr`: a function of s."""
    warmup = warmup_steps(cfg, total_steps)
    total = max(total_steps, warmup + 1)
    after = max(1, total - warmup)  # steps of the schedule proper
    step_every = cfg.step_every or max(1, after // 3)
    if cfg.gamma is not None:
        gamma = cfg.gamma
    elif cfg.schedule == "exponential":
        gamma = cfg.min_lr_ratio ** (1 / after)
    else:
        gamma = STEP_GAMMA

    def factor(step: int) -> float:
        if step < warmup:
            if cfg.warmup_method == "constant":
                return cfg.warmup_decay
            if cfg.warmup_decay is None:
                return (step + 1) / warmup
            return cfg.warmup_decay + (1 - cfg.warmup_decay) * step / warmup
        k = step - warmup
        if cfg.schedule == "constant":
            return 1.0
        if cfg.schedule == "step":
            return gamma ** (k // step_every)
        if cfg.schedule == "exponential":
            return gamma**k
        progress = min(1.0, k / after)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup (linear or constant) to the peak lr, then `cfg.schedule` over the rest of `total_steps`."""
    check_config(cfg)
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg, total_steps))
