"""JSON objects the loaders read: a model folder's config.json, a run's pretrained_sizes.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.errors import CheckpointError


def json_object(file: Path, key: str, value: str) -> dict[str, Any]:
    """The JSON object in `file` (a model folder's config, a run's saved sizes), or one CheckpointError
    naming `key=value`."""
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        data = e
    if not isinstance(data, dict):
        why = type(data).__name__ if isinstance(data, Exception) else "no JSON object"
        raise CheckpointError(
            f"{key}={value}: {file} is not a readable JSON object ({why})",
            key=key,
            value=value,
            valid=("a JSON object",),
        )
    return data


def saved_sizes(file: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The sizes a run's pretrained file gave its model, as the run saved them (JSON; {} when there is no
    such file): only the model's size keys (`keys`), or one CheckpointError naming the file."""
    if not file.is_file():
        return {}
    sizes = json_object(file, "checkpoint", str(file))
    if not set(sizes) <= set(keys):
        raise CheckpointError(
            f"{file} holds more than the pretrained model's size keys",
            key="checkpoint",
            value=str(file),
            valid=keys,
        )
    return sizes
