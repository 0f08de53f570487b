"""Moved: the EMA of the weights is `core.loop.ema.EMA` now, for every task and parallel style (issue #27);
`task.ema_decay`/`ema_every`/`ema_warmup` of image classification build it, as `trainer.ema_*` do for any
task. This name stays importable, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    """`vision.ema.EMA` is `core.loop.ema.EMA`."""
    if name == "EMA":
        warnings.warn("vision.ema.EMA moved to core.loop.ema.EMA", DeprecationWarning, stacklevel=2)
        from core.loop.ema import EMA

        return EMA
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
