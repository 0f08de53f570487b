"""State dicts across compiled and eager models: in-place compile never adds `_orig_mod.`, and models loaded
through `apply` accept keys saved through `torch.compile` wrappers (key cleaning: core.checkpoint.weights)."""

from __future__ import annotations

from typing import Any

from torch import nn

from core.checkpoint.weights import ORIG_MOD, clean_key
from core.compile import torch_internals


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module behind any `torch.compile(...)` wrappers (in-place compiled modules are their own)."""
    while hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
        model = model._orig_mod
    return model


def _strip_prefixed_keys(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and ORIG_MOD in k[len(prefix) :]]:
        state_dict[prefix + clean_key(key[len(prefix) :])] = state_dict.pop(key)


def accept_prefixed_keys(model: nn.Module) -> nn.Module:
    """Make `model.load_state_dict` accept keys saved through `torch.compile` wrappers (`_orig_mod.`)."""
    if not getattr(model, "_torchkiln_accepts_prefixed", False):
        # the root's pre-hook sees (and may rename keys in) the one dict every submodule then loads from
        torch_internals.add_load_state_dict_pre_hook(model, _strip_prefixed_keys)
        model._torchkiln_accepts_prefixed = True
    return model
