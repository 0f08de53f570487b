"""Atomic, resumable checkpoints: one directory per step, written aside and renamed into place.

- `layout`: the directory protocol both formats share (step dirs, temporaries, completion, pruning,
  `resume=` resolution, which format a dir holds);
- `single`: the single-process format (`model.pt`, `train.pt`);
- `sharded`: the multi-process format through `torch.distributed.checkpoint` (shards that reshard on load),
  imported only when a sharded checkpoint is written or read;
- `weights`: state-dict keys, a user's weights file, a strict load into a model.

This top calls down into them, never the reverse: `save` (one process) and `save_sharded` (every rank) write,
`load` reads either format's full state in one process, `load_into` restores either format into a live model
and optimizer, in one process or on every rank. Everything loads with `torch.load(weights_only=True)` or an
allow-listed unpickler, so a checkpoint can never execute code.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from core.checkpoint import single
from core.checkpoint.layout import (
    best_checkpoints,
    complete_checkpoints,
    is_sharded,
    monitored_value,
    prune,
    remove_stale_temporaries,
    resolve,
)
from core.checkpoint.single import save
from core.checkpoint.weights import (
    ORIG_MOD,
    clean_key,
    clean_state_dict,
    load_model_state,
    read_weights,
    save_model_weights,
    trainable_state,
    write_safetensors,
)

__all__ = [
    "ORIG_MOD",
    "best_checkpoints",
    "clean_key",
    "clean_state_dict",
    "complete_checkpoints",
    "full_model_state",
    "is_sharded",
    "load",
    "load_into",
    "load_model_state",
    "monitored_value",
    "newest_with_finite_weights",
    "prune",
    "read_weights",
    "trainable_state",
    "remove_stale_temporaries",
    "resolve",
    "save",
    "save_model_weights",
    "save_sharded",
    "write_safetensors",
]


def save_sharded(
    ckpt_root: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    train: dict,
    meta: dict,
    keep_last: int = 2,
    async_save: bool = False,
    trainable_only: bool = False,
) -> Path | Future[Path]:
    """Write checkpoint `step` from every rank (each calls this), sharded: `core.checkpoint.sharded.save`;
    `trainable_only` leaves the frozen parameters out."""
    from core.checkpoint import sharded

    return sharded.save(
        ckpt_root,
        step,
        model=model,
        optimizer=optimizer,
        train=train,
        meta=meta,
        keep_last=keep_last,
        async_save=async_save,
        trainable_only=trainable_only,
    )


def load(path: Path) -> tuple[dict, dict, dict]:
    """Load (model state, training state, meta) from a checkpoint dir in this process. A sharded
    checkpoint's full model state is gathered here from its shards; its training state is rank 0's, without
    the optimizer (`load_into` restores that into a live optimizer)."""
    if is_sharded(path):
        from core.checkpoint import sharded

        model, train, meta = sharded.read(path)
        return clean_state_dict(model), train, meta
    return single.load(path)


def load_into(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainable_only: bool = False,
) -> tuple[dict, dict]:
    """Load checkpoint `path` (sharded at any world size and layout, or single-process) into `model` and
    `optimizer`, in one process or on every rank (each calls this); returns (this rank's training state
    without the optimizer's, meta with `rank_state_from`: the rank whose training state this rank took).
    `trainable_only`: the checkpoint holds the trainable parameters alone, the model the frozen ones."""
    if is_sharded(path):
        from core.checkpoint import sharded

        return sharded.load(path, model=model, optimizer=optimizer, trainable_only=trainable_only)
    if not (dist.is_available() and dist.is_initialized()):
        train, meta = single.load_into(path, model=model, optimizer=optimizer)
        return train, {**meta, "rank_state_from": 0}
    from core.checkpoint import sharded

    weights, train, meta = single.load(path)
    optim_state = train.pop("optimizer", None)
    sharded.load_full_state(
        path,
        model=model,
        optimizer=optimizer,
        weights=weights,
        optim_state=optim_state,
        trainable_only=trainable_only,
    )
    return train, {**meta, "rank_state_from": 0}


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole (possibly sharded) model's state as plain CPU tensors on rank 0 (every rank calls this;
    others get {}), for `model.safetensors`: `core.checkpoint.sharded.full_model_state`."""
    from core.checkpoint import sharded

    return sharded.full_model_state(model)


def newest_with_finite_weights(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint under `ckpt_root` whose weights are all finite (after divergence)."""
    for path in reversed(complete_checkpoints(ckpt_root)):
        weights = load(path)[0]
        if all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point()):
            return path
    return None
