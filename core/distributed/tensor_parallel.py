"""Tensor-parallel plans, one per model family, registered by the domain that defines the model.

A plan is a function `(model, tp_mesh) -> model` that calls `parallelize_module` on the model's own
submodules (torchtitan's `parallelize.py`): models stay plain `nn.Module`s that know nothing of sharding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from core.errors import ConfigError

TPPlan = Callable[[nn.Module, Any], nn.Module]
_PLANS: dict[type, TPPlan] = {}


def register_tp_plan(model_cls: type) -> Callable[[TPPlan], TPPlan]:
    """Decorator: `fn(model, tp_mesh)` shards instances of `model_cls` (and subclasses) across `tp_mesh`."""

    def deco(fn: TPPlan) -> TPPlan:
        _PLANS[model_cls] = fn
        return fn

    return deco


def tp_plan_for(model: nn.Module) -> TPPlan | None:
    """The plan registered for `model`'s class (or its nearest registered base), if any."""
    for cls in type(model).__mro__:
        if cls in _PLANS:
            return _PLANS[cls]
    return None


def has_tp_plan(model_cls: type) -> bool:
    """Whether instances of `model_cls` (a registered model class) have a tensor-parallel plan."""
    return any(issubclass(model_cls, c) for c in _PLANS) if isinstance(model_cls, type) else False


def apply_tp(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Shard `model` across `tp_mesh` with its family's plan; a model without one is a ConfigError."""
    plan = tp_plan_for(model)
    if plan is None:
        known = ", ".join(sorted(c.__name__ for c in _PLANS)) or "none"
        raise ConfigError(
            f"{type(model).__name__} has no tensor-parallel plan (models with one: {known}); use "
            "trainer.parallel=ddp or fsdp"
        )
    return plan(model, tp_mesh)


def local_shard(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """(the tensor this rank writes, the slice of the whole tensor it holds; None: all of it) for a
    parameter that may be a DTensor (sharded by FSDP2 and/or tensor parallel)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, None
    # the offsets DCP itself uses (torch's sharding rules: uneven chunks, FSDP x TP on one dim), so the
    # slice is exactly what distribute_tensor would have handed this rank from the whole tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
