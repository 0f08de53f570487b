"""The wrapper every after-training command's `main(argv)` is (eval, predict, generate, transcribe, export,
detect): `--help`, the usage line, and a user's mistake as one line on stderr with the exit code its
`core.errors` type declares (`exit_code`: 74 for a failed write, 70 for a dead DataLoader worker, ...; 2
for the rest: a ConfigError, a DataError, a CheckpointError), never a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from core.data.workers import report_failures
from core.errors import TorchkilnError

#: the exit code of a TorchkilnError that declares none (EX_USAGE-like: the command line or its inputs)
USER_ERROR = 2


def exit_code(error: TorchkilnError) -> int:
    """The process exit code `error` stands for: its type's `exit_code`, else 2."""
    return int(getattr(error, "exit_code", USER_ERROR))


def command(
    body: Callable[[list[str]], int], *, usage: str, describe: Callable[[], str]
) -> Callable[[list[str] | None], int]:
    """A CLI entry `main(argv)`: `-h`/`--help` prints `describe()` (exit 0), no argument prints `usage` (exit
    2), else `body(argv)`, with a user's mistake (a TorchkilnError, one raised in a DataLoader worker too) as
    one line `error: ...` on stderr and `exit_code(error)`."""

    def main(argv: list[str] | None = None) -> int:
        argv = sys.argv[1:] if argv is None else argv
        if any(a in ("-h", "--help") for a in argv):
            return emit(describe())
        if not argv:
            print(usage, file=sys.stderr)
            return USER_ERROR
        try:
            with report_failures():
                return body(argv)
        except TorchkilnError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return exit_code(e)

    return main


def emit(text: str) -> int:
    """Print `text`; 0, or 1 when the reader left early (`| head`), without a traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the exit's flush fails again
        return 1
    return 0
