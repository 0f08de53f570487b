"""The single-process checkpoint format: the whole state in three files, written by one process.

Inside a step dir (`core.checkpoint.layout` keeps it atomic):
  model.pt       model state dict (plain keys: never `_orig_mod.`)
  train.pt       optimizer, scheduler, grad scaler, RNG states, loop position (step, epoch, batch in epoch)
  meta.json      written last: step, epoch, metrics, torch version; its presence marks the checkpoint complete

Separate files per concern keep the format a small step from torch.distributed.checkpoint's sharded layout
(`core.checkpoint.sharded`). Everything loads with `torch.load(weights_only=True)`, so a checkpoint can never
execute code.
"""

from __future__ import annotations

import copy
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.checkpoint import layout
from core.checkpoint.weights import clean_state_dict, load_model_state
from core.errors import CheckpointError
from core.files import write_failure


def save(ckpt_root: Path, step: int, *, model: dict, train: dict, meta: dict, keep_last: int = 2) -> Path:
    """Write checkpoint `step` atomically and prune all but the newest `keep_last`; returns its path."""
    final = layout.step_dir(ckpt_root, step)
    tmp: Path | None = None
    try:
        tmp = layout.fresh_temporary(ckpt_root, step)
        torch.save(clean_state_dict(model), tmp / "model.pt")
        torch.save(train, tmp / "train.pt")
        layout.commit(tmp, final, {**meta, "step": step, "torch": torch.__version__})
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as a RuntimeError
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(final, e, kind="checkpoint ", fix=layout.WRITE_FIX) from None
    layout.prune(ckpt_root, keep_last=keep_last)
    return final


def load(path: Path) -> tuple[dict, dict, dict]:
    """Load (model state, training state, meta) from a single-process checkpoint dir with
    `weights_only=True`."""
    try:
        model = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        train_path = path / "train.pt"
        train = torch.load(train_path, map_location="cpu", weights_only=True) if train_path.exists() else {}
        meta = json.loads((path / layout.META).read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path} is incomplete: {e.filename} is missing") from None
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain containers; it was not loaded "
            "(torchkiln loads with weights_only=True so a checkpoint cannot run code)",
            key="checkpoint",
            value=str(path),
        ) from None
    except (RuntimeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {str(e).splitlines()[0]}") from None
    return clean_state_dict(model), train, meta


def load_into(
    path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[dict, dict]:
    """Load single-process checkpoint `path` into a plain `model` and `optimizer` in this process; returns
    (the training state without the optimizer's, meta)."""
    weights, train, meta = load(path)
    optim_state = train.pop("optimizer", None)
    load_model_state(model, weights, path)
    if optimizer is not None and optim_state is not None:
        moments_like_weights(model, list(weights), optim_state, optimizer)
        optimizer.load_state_dict(optim_state)
    return train, meta


def moments_like_weights(
    model: nn.Module, ckpt_keys: list[str], opt_state: dict[str, Any], opt: torch.optim.Optimizer
) -> None:
    """A checkpoint written with older parameter names or layouts (which the model's load hooks upgrade, e
    .g. core.nn.transformer's fused q/k/v rows) has optimizer moments in the old layout too: pass them through
    the same hooks, so resumed AdamW state stays aligned with the weights it belongs to."""
    new_keys = list(model.state_dict())
    if ckpt_keys == new_keys or len(ckpt_keys) != len(new_keys):
        return
    old_of = dict(zip(new_keys, ckpt_keys, strict=True))  # renaming keeps registration order
    name_of = {id(p): n for n, p in model.named_parameters()}
    params = [name_of[id(p)] for group in opt.param_groups for p in group["params"]]
    state = opt_state.get("state", {})
    for kind in ("exp_avg", "exp_avg_sq"):
        moments = {
            old_of[n]: state[i][kind]
            for i, n in enumerate(params)
            if kind in state.get(i, {}) and old_of[n] != n
        }
        if not moments:
            continue
        shadow = copy.deepcopy(model)
        shadow.load_state_dict(moments, strict=False)  # the hooks rename and permute, as for the weights
        upgraded = dict(shadow.named_parameters())
        for i, n in enumerate(params):
            if kind in state.get(i, {}) and old_of[n] != n:
                state[i][kind] = upgraded[n].detach().clone()
