"""The run's `train.log` handler: a write that fails (a full disk) warns once on stderr, then the log goes to
the console only, instead of Python's logging printing a traceback for every later line."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from core.files import write_failure


class RunLogFile(logging.FileHandler):
    """`logging.FileHandler` that reports its first failed write in one line and drops the rest."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        """Warn once, naming the file and the free space; later records go to the other handlers only."""
        err = sys.exc_info()[1]
        if isinstance(err, OSError) and not self.failed:
            self.failed = True
            msg = write_failure(Path(self.baseFilename), err, fix="the console keeps the log")
            print(f"warning: {msg}", file=sys.stderr, flush=True)
        elif not isinstance(err, OSError):
            super().handleError(record)

    def emit(self, record: logging.LogRecord) -> None:
        """Write `record` unless an earlier write failed, or this is not rank 0 of a multi-process run (all
        ranks share the run directory; rank 0 speaks for them)."""
        if not self.failed and os.environ.get("RANK", "0") == "0":
            super().emit(record)
