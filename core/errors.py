"""Typed user-facing errors: each carries a one-line message naming the key, file or value and the fix."""

from __future__ import annotations

from collections.abc import Iterable


class TorchkilnError(Exception):
    """Base class of errors caused by user input; the CLI prints the message, not a traceback. Where the
    error is about one setting it also carries it as fields: `key` (e.g. "trainer.batch_size"), `value` as
    given (its text) and `valid`, the values or keys that would be accepted where there is such a list (a
    range is one item, e.g. ">= 1"), so callers and tests read the fault without parsing the sentence."""

    def __init__(
        self,
        message: str = "",
        *,
        key: str | None = None,
        value: str | None = None,
        valid: Iterable[str] = (),
    ) -> None:
        super().__init__(message)
        self.key, self.value, self.valid = key, value, tuple(valid)


class ConfigError(TorchkilnError, ValueError):
    """A configuration key or value is unknown, malformed or unavailable here."""


class DataError(TorchkilnError):
    """A dataset path, file or sample cannot be used."""


class CheckpointError(TorchkilnError):
    """A checkpoint is missing, incomplete or does not match the model."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (full disk, I/O error); earlier ones are intact. The CLI exits 74."""

    exit_code = 74  # EX_IOERR


class ExportError(TorchkilnError):
    """A model cannot be exported in the format asked (an op or construct the exporter lacks), or its export
    does not reproduce the eager model; the message names the first such op or the error found."""


class Preempted(TorchkilnError):
    """SIGTERM/SIGUSR1/SIGUSR2 (a scheduler's preemption) stopped the run after a checkpoint; CLI exit 75."""

    exit_code = 75  # EX_TEMPFAIL: try again later (resume=auto continues)
    label = "stopped"


class TrainingError(TorchkilnError):
    """Training cannot go on (e.g. the loss stayed non-finite); the CLI exits with code 3, not 2."""

    exit_code = 3


class WorkerDied(DataError):
    """A DataLoader worker died (a signal: a decoder's segfault, the OOM killer) while loading a sample the
    message names; the CLI exits 70."""

    exit_code = 70  # EX_SOFTWARE: a process crashed; the sample (or the memory limit) is the suspect


def unknown_choice(key: str, value: object, valid: Iterable[object]) -> ConfigError:
    """The ConfigError for a setting outside its choices: `KEY=VALUE is unknown; valid: A, B`, with its
    key, value and valid fields."""
    choices = tuple(str(v) for v in valid)
    return ConfigError(
        f"{key}={value} is unknown; valid: {', '.join(choices)}", key=key, value=str(value), valid=choices
    )
