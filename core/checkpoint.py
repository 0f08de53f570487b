"""Atomic, resumable checkpoints: one directory per step, written aside and renamed into place.

Layout of `RUN_DIR/checkpoints/step_00001234/`:
  model.pt       model state dict (plain keys: never `_orig_mod.`)
  train.pt       optimizer, scheduler, grad scaler, RNG states, loop position (step, epoch, batch in epoch)
  meta.json      written last: step, epoch, metrics, torch version; its presence marks the checkpoint complete

Separate files per concern keep the format a small step from torch.distributed.checkpoint's sharded layout
(`core.distributed.checkpoint`: DCP's `.metadata` and shards instead of model.pt, the same directory protocol,
so `complete_checkpoints`, `resolve` and `load` serve both). Everything loads with
`torch.load(weights_only=True)` or an allow-listed unpickler, so a checkpoint can never execute code.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from core.errors import CheckpointError, CheckpointWriteError, ConfigError
from core.paths import fsync

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
#: the key segment torch.compile's wrapper module adds (`model._orig_mod.layer.weight`)
ORIG_MOD = "_orig_mod."


def clean_key(key: str) -> str:
    """`key` without any `_orig_mod.` segment (left by torch.compile wrappers at any depth)."""
    return key.replace(ORIG_MOD, "")


def clean_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `state_dict` whose keys carry no `_orig_mod.` segments; two keys that clean to one name
    (a dict merged from a compiled and a plain model) are an error, never a silent overwrite."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        new = clean_key(key)
        if new in out:
            raise CheckpointError(f"state dict has both {key!r} and {new!r}; save it from one model only")
        out[new] = value
    return out


def save(ckpt_root: Path, step: int, *, model: dict, train: dict, meta: dict, keep_last: int = 2) -> Path:
    """Write checkpoint `step` atomically and prune all but the newest `keep_last`; returns its path."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-step_{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        torch.save(clean_state_dict(model), tmp / "model.pt")
        torch.save(train, tmp / "train.pt")
        meta = {**meta, "step": step, "torch": torch.__version__}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        for name in ("model.pt", "train.pt", "meta.json"):  # the data, not only the names, survive a crash
            fsync(tmp / name)
        fsync(tmp)
        if final.exists():  # a re-save of the same step (e.g. after resume) replaces the old copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync(ckpt_root)
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        fix = "earlier checkpoints are intact (free disk space or set trainer.keep_last lower)"
        raise write_failure(final, e, kind="checkpoint ", fix=fix) from None
    prune(ckpt_root, keep_last=keep_last)
    return final


def prune(ckpt_root: Path, *, keep_last: int, keep_best: int = 0, maximize: bool = True) -> list[Path]:
    """Delete complete checkpoints except the newest `keep_last` (0: keep all) and the best `keep_best` by
    the monitored value their meta records (`meta["monitor"]["value"]`); returns the kept ones, oldest
    first."""
    found = complete_checkpoints(ckpt_root)
    if keep_last <= 0:
        return found
    keep = set(found[-keep_last:])
    keep.update(best_checkpoints(found, maximize)[:keep_best])
    for old in found:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)
    return [p for p in found if p in keep]


def monitored_value(path: Path) -> float | None:
    """The monitored metric a checkpoint's meta records for its step (None: not evaluated at that step)."""
    try:
        value = json.loads((path / "meta.json").read_text()).get("monitor", {}).get("value")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value == value else None


def best_checkpoints(found: list[Path], maximize: bool) -> list[Path]:
    """The checkpoints among `found` that record a monitored value, best first (ties: the older first)."""
    scored = [(v, i, p) for i, p in enumerate(found) if (v := monitored_value(p)) is not None]
    scored.sort(key=lambda t: (-t[0] if maximize else t[0], t[1]))
    return [p for _, _, p in scored]


def remove_stale_temporaries(ckpt_root: Path) -> int:
    """Remove `.tmp-step_*-PID` directories whose writer is gone (a killed run's); returns how many."""
    removed = 0
    for tmp in ckpt_root.glob(".tmp-step_*-*") if ckpt_root.is_dir() else ():
        pid = tmp.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints under `ckpt_root`, oldest first (half-written `.tmp-*` dirs are ignored)."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if _STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def newest_with_finite_weights(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint under `ckpt_root` whose weights are all finite (after divergence)."""
    for path in reversed(complete_checkpoints(ckpt_root)):
        weights = load(path)[0]
        if all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point()):
            return path
    return None


def resolve(spec: str, run_dir: Path) -> Path | None:
    """Turn `resume=` into a checkpoint dir: "auto" = newest in this run (or None), else a ckpt or run dir."""
    if spec == "auto":
        found = complete_checkpoints(run_dir / "checkpoints")
        return found[-1] if found else None
    path = Path(spec).expanduser()
    if (path / "meta.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointError(
        f"resume={spec}: no complete checkpoint there (expected a step_XXXXXXXX dir with meta.json, "
        "or a run dir holding checkpoints/); use resume=auto to resume the newest in this run dir"
    )


def load(path: Path) -> tuple[dict, dict, dict]:
    """Load (model state, training state, meta) from a checkpoint dir with `weights_only=True`. A sharded
    checkpoint's full model state is gathered here from its shards; its training state is rank 0's, without
    the optimizer (`core.distributed.checkpoint.load_sharded` restores that into a live optimizer)."""
    try:
        if (path / ".metadata").is_file():  # written by core.distributed.checkpoint.save_sharded
            from core.distributed.checkpoint import full_state_from_disk

            model = full_state_from_disk(path)
        else:
            model = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        train_path = path / "train.pt"
        train = torch.load(train_path, map_location="cpu", weights_only=True) if train_path.exists() else {}
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path} is incomplete: {e.filename} is missing") from None
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain containers; it was not loaded "
            "(torchkiln loads with weights_only=True so a checkpoint cannot run code)"
        ) from None
    except (RuntimeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {str(e).splitlines()[0]}") from None
    return clean_state_dict(model), train, meta


def read_weights(path: str, key: str) -> dict[str, torch.Tensor]:
    """The state dict in a weights file a user names with config key `key` (e.g. published pretrained
    weights): `.safetensors`, or a torch.save'd dict read with `weights_only=True`, bare or under "model" /
    "state_dict" (a training script's checkpoint); any problem is a one-line error naming `key=path`."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{key}={path}: no such file; give a local .pth/.pt or .safetensors weights file")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        if zipfile.is_zipfile(file):  # torch.save's archive, holding what weights_only refuses
            raise CheckpointError(
                f"{key}={path} holds objects other than tensors and plain containers; it was not loaded "
                "(weights load with weights_only=True so a file cannot run code)"
            ) from None
        raise CheckpointError(
            f"{key}={path} is not a weights file: neither torch.save's nor safetensors"
        ) from None
    except Exception as e:  # a foreign or truncated file: torch's zip reader and safetensors raise their own
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{key}={path} is not a weights file: {first}") from None
    for nested in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(nested), dict):
            state = state[nested]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(f"{key}={path} does not hold a state dict (names -> tensors)")
    return clean_state_dict(state)


def load_model_state(model: torch.nn.Module, state: dict[str, Any], source: Path | str) -> None:
    """Load weights strictly, turning key/shape mismatches into a one-line CheckpointError. A model whose
    parameter names changed since a checkpoint was written renames the old keys in `upgrade_state_dict`."""
    upgrade = getattr(model, "upgrade_state_dict", None)
    if callable(upgrade):
        state = upgrade(state)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(
            f"checkpoint {source} does not match the model (same model= and its settings?): {first}"
        ) from None


def write_failure(
    path: Path, err: BaseException, *, kind: str = "", fix: str = "free disk space"
) -> CheckpointWriteError:
    """The one-line error for a failed write of `path` (a `kind` of output): the cause, the free space
    where it was written, and `fix`."""
    why = err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split())[:160]
    return CheckpointWriteError(
        f"could not write {kind}{path}: {why}; {_free(path.parent)} free there; {fix}"
    )


def _free(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"
