"""One channel for what torchkiln tells the user while it runs.

With logging configured (the recipes configure it through Hydra: stdout and the run's `train.log` carry the
same lines), messages go to the `torchkiln` logger; a library user who configured nothing gets plain prints,
as before. A progress bar on a terminal routes both through its own writer so lines never tear it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("torchkiln")
_writer: Callable[[str], None] | None = None


def say(message: str, logger: logging.Logger = log) -> None:
    """Tell the user `message` (one line), through `logger` (a `torchkiln.*` one) when logging is set up."""
    if logger.hasHandlers():
        logger.info(message)
    elif _writer is not None:
        _writer(message)
    else:
        print(message, flush=True)


def warn(message: str) -> None:
    """Tell the user `message` as a warning: `warning: ` once in front, whatever the sink."""
    if log.hasHandlers():
        log.warning(f"warning: {message}")
    elif _writer is not None:
        _writer(f"warning: {message}")
    else:
        print(f"warning: {message}", flush=True)


def set_writer(writer: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Route unconfigured output through `writer` (None: print); returns the previous one."""
    global _writer
    previous, _writer = _writer, writer
    return previous
