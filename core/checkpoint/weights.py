"""State dicts as files hold them: keys without torch.compile's `_orig_mod.`, a user's weights file read
safely, and a strict load into a model that fails in one line. Both checkpoint formats and the weights a
user names (`model.weights=`) go through here."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from core.errors import CheckpointError, ConfigError

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
            raise CheckpointError(
                f"state dict has both {key!r} and {new!r}; save it from one model only",
                key="state_dict",
                value=key,
                valid=(new,),  # one spelling per tensor
            )
        out[new] = value
    return out


def read_weights(path: str, key: str) -> dict[str, torch.Tensor]:
    """The state dict in a weights file a user names with config key `key` (e.g. published pretrained
    weights): `.safetensors`, or a torch.save'd dict read with `weights_only=True`, bare or under "model" /
    "state_dict" (a training script's checkpoint); any problem is a one-line error naming `key=path`."""
    return state_dict_in(read_weights_file(path, key), path, key)


def read_weights_file(path: str, key: str) -> Any:
    """Everything a weights file holds (the state dict and, in a training script's checkpoint, what is saved
    beside it, such as its config), read as read_weights reads it: nothing in the file runs."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"{key}={path}: no such file; give a local .pth/.pt or .safetensors weights file",
            key=key,
            value=str(path),
            valid=(".pth", ".pt", ".safetensors"),
        )
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(file))
        else:
            # fairseq-style checkpoints keep their command line as an argparse.Namespace: a plain attribute
            # bag (no __setstate__, no __reduce__ of its own), so allowing it runs nothing from the file
            with _namespace_allowed():
                state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        if zipfile.is_zipfile(file):  # torch.save's archive, holding what weights_only refuses
            raise CheckpointError(
                f"{key}={path} holds objects other than tensors and plain containers; it was not loaded "
                "(weights load with weights_only=True so a file cannot run code)",
                key=key,
                value=str(path),
                valid=("tensors", "plain containers"),
            ) from None
        raise CheckpointError(
            f"{key}={path} is not a weights file: neither torch.save's nor safetensors",
            key=key,
            value=str(path),
            valid=("a torch.save weights file", "safetensors"),
        ) from None
    except Exception as e:  # a foreign or truncated file: torch's zip reader and safetensors raise their own
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{key}={path} is not a weights file: {first}",
            key=key,
            value=str(path),
            valid=("a torch.save weights file", "safetensors"),
        ) from None
    return state


def _namespace_allowed() -> Any:
    """A context in which torch.load's weights_only unpickler accepts argparse.Namespace (torch >= 2.5; older
    torch refuses such a file as before)."""
    import argparse
    import contextlib

    allow = getattr(torch.serialization, "safe_globals", None)
    return allow([argparse.Namespace]) if allow is not None else contextlib.nullcontext()


def state_dict_in(state: Any, path: str, key: str) -> dict[str, torch.Tensor]:
    """The state dict in what a weights file holds (read_weights_file): the whole of it, or the dict under
    "model" / "state_dict"."""
    for nested in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(nested), dict):
            state = state[nested]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(
            f"{key}={path} does not hold a state dict (names -> tensors)",
            key=key,
            value=str(path),
            valid=("a state dict (names -> tensors)",),
        )
    return clean_state_dict(state)


def load_model_state(model: torch.nn.Module, state: dict[str, Any], source: Path | str) -> None:
    """Load weights strictly, turning key/shape mismatches into a one-line CheckpointError. A model whose
    parameter names changed since a checkpoint was written renames the old keys in `upgrade_state_dict`."""
    upgrade = getattr(model, "upgrade_state_dict", None)
    if callable(upgrade):
        state = upgrade(state)
    frozen = frozen_names(model)
    if frozen - state.keys():
        # a checkpoint of the trainable parameters alone (trainer.lora): the frozen ones the model holds
        # already (its model.weights) stand in; a missing trainable one still fails below
        own = model.state_dict()
        state = {k: state[k] if k in state else own[k] for k in own if k in state or k in frozen} | state
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(
            f"checkpoint {source} does not match the model (same model= and its settings?): {first}",
            key="checkpoint",
            value=str(source),
        ) from None


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of `model`'s parameters that do not train (requires_grad False)."""
    # every name of a tied parameter (a head sharing the embedding's matrix): state_dict lists each
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trainable_state(model: torch.nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` (`model.state_dict()`) without the frozen parameters: what a run with a frozen base (LoRA)
    checkpoints; `load_model_state` takes it back into a model holding that base."""
    frozen = frozen_names(model)
    return {k: v for k, v in state.items() if k not in frozen}


def write_safetensors(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Write a full state dict to `path` as safetensors, atomically (a temporary beside it, then a rename:
    a reader never sees half a file); tied weights (one tensor under two names) get a copy each, as
    safetensors refuses shared storage."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    seen: set[int] = set()
    whole = {}
    for k, v in state.items():
        ptr = v.data_ptr()
        whole[k] = v.clone().contiguous() if ptr in seen else v.contiguous()
        seen.add(ptr)
    try:
        save_file(whole, str(tmp))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no partial temporary behind
        raise


def save_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Write `model`'s weights to `path` as safetensors, tied weights stored once (safetensors' save_model
    finds them through the model, which a bare state dict cannot show)."""
    from safetensors.torch import save_model

    save_model(model, str(path))
