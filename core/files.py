"""Files on disk: writing them atomically and durably, the one-line error when a write fails (checkpoints,
metrics, logs and run artifacts alike), and where torchkiln keeps what it can rebuild (corpora, tokenizers,
compile caches, device measurements)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from core.errors import CheckpointWriteError


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically and durably (`write_atomic`)."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write `path` by `write(binary file)` through a fsynced temporary file and a rename, so a reader never
    sees half of it, even after a power loss; on failure (e.g. a full disk) the temporary file is removed and
    the error raised, naming `path` (its `filename`) when the OS did not name a file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:  # a failed write() names no file; the caller's one-line error should
            e.filename = str(path)
        raise
    fsync(path.parent)


def fsync(path: Path) -> None:
    """Flush a file's bytes, or a directory's entries (a rename is durable only once its directory is
    flushed), to the disk; a path that cannot be opened is left alone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_failure(
    path: Path, err: BaseException, *, kind: str = "", fix: str = "free disk space"
) -> CheckpointWriteError:
    """The one-line error for a failed write of `path` (a `kind` of output): the cause, the free space
    where it was written, and `fix`; its fields: `kind` (or "file") and the path."""
    return CheckpointWriteError(
        f"could not write {kind}{path}: {_cause(path.parent, err)}; {_free(path.parent)} free there; {fix}",
        key=kind.strip() or "file",
        value=str(path),
    )


def _cause(directory: Path, err: BaseException) -> str:
    """The OS's words for the failure: the error's own errno text, else that of a small write made now in
    `directory`. A writer that wraps the OS error says only where in its own code it failed (torch's zip
    writer on a full disk: "[enforce fail at inline_container.cc:672] . unexpected pos ...")."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    try:
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(bytes(1 << 16))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        if e.strerror:
            return e.strerror
    return " ".join(str(err).split())[:160]


def _free(path: Path) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown space"
    return f"{free} bytes" if free < 2**20 else f"{free / 2**20:.1f} MiB"


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file at `path`, read 1 MiB at a time (a shard or source of any size)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def cache_root() -> Path:
    """Root of torchkiln's caches: $TORCHKILN_CACHE, else ~/.cache/torchkiln."""
    env = os.environ.get("TORCHKILN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "torchkiln"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing): processes started together (local
    ranks, sweep jobs) build a shared cache entry once, one at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: no flock; concurrent builders only cost time
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
