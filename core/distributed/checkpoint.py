"""Deprecated: sharded checkpoints moved to `core.checkpoint` (`save_sharded`, `load_into`,
`full_model_state`) and `core.checkpoint.sharded`; this module re-exports the old names for one release."""

from __future__ import annotations

import warnings

from core.checkpoint import full_model_state, load_into, save_sharded
from core.checkpoint.layout import METADATA, is_sharded
from core.checkpoint.sharded import (
    SafePlanner,
    SafeReader,
    describe_layout,
    full_state_from_disk,
    read_metadata,
)

#: the old name of `core.checkpoint.load_into` (it always read single-process checkpoints too)
load_sharded = load_into

warnings.warn(
    "core.distributed.checkpoint is deprecated: import save_sharded, load_into (was load_sharded) and "
    "full_model_state from core.checkpoint",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "METADATA",
    "SafePlanner",
    "SafeReader",
    "describe_layout",
    "full_model_state",
    "full_state_from_disk",
    "is_sharded",
    "load_sharded",
    "read_metadata",
    "save_sharded",
]
