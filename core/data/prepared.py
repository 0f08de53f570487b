"""The one way a prepared folder (shards and the manifest that lists them) is written, whatever it holds.

`prepare_folder` owns the steps every preparer shares, in this order: the inputs' fingerprint (a SHA-256 of
the caller's inputs and settings, as JSON with sorted keys); a file lock on the folder, so that prepares
started together (local ranks, a job array, a repeated command) take turns and the later ones find the work
done; the up-to-date check (the folder's manifest records this fingerprint and the caller finds its files
whole); the caller's build step; an fsync of the folder, so the outputs' renames are durable before the
manifest that lists them; the manifest, written atomically and last; then the removal of the outputs a former
prepare left that this manifest does not list, and of the build's scratch folder `WORK`.

A caller supplies only what differs: its inputs, how to read its finished folder, its build step, the file
patterns it writes and the files its manifest lists.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from core.errors import DataError
from core.files import fsync, locked, write_text_atomic

#: the file that makes a folder a finished set; written last
MANIFEST = "manifest.json"
#: a build's scratch files (a resumed prepare continues from them); removed once the manifest is written
WORK = ".work"
#: the file prepares of one folder take turns on
LOCK = ".prepare.lock"

#: the manifest of a finished folder, or None (or a DataError) when it holds no whole prepared set
ReadFinished = Callable[[Path], "dict[str, Any] | None"]
#: writes the outputs into the folder and returns the manifest, which records the fingerprint it is given
Build = Callable[[Path, str], "dict[str, Any]"]


def inputs_fingerprint(inputs: dict[str, Any]) -> str:
    """The SHA-256 of `inputs` as JSON with sorted keys: what a manifest's `inputs_sha256` records."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def prepare_folder(
    out: str | Path,
    inputs: dict[str, Any],
    *,
    finished: ReadFinished,
    build: Build,
    outputs: Iterable[str],
    listed: Callable[[dict[str, Any]], set[str]],
) -> dict[str, Any]:
    """Prepare `out` from `inputs` with `build` unless it already holds them (module docstring); the manifest,
    with `"status"`: "prepared", or "up to date". `outputs`: glob patterns of the files `build` writes;
    `listed(manifest)`: the names of those the manifest keeps."""
    dest = Path(out).expanduser()
    fingerprint = inputs_fingerprint(inputs)
    dest.mkdir(parents=True, exist_ok=True)
    with locked(dest / LOCK):
        done = up_to_date(dest, fingerprint, finished)
        if done is not None:
            return {**done, "status": "up to date"}
        (dest / MANIFEST).unlink(missing_ok=True)  # from here on the folder is not a finished set
        manifest = build(dest, fingerprint)
        fsync(dest)  # the outputs' renames are durable before the manifest that lists them
        write_text_atomic(dest / MANIFEST, json.dumps(manifest, indent=1))
        remove_stale(dest, listed(manifest), outputs)
        shutil.rmtree(dest / WORK, ignore_errors=True)
        return {**manifest, "status": "prepared"}


def up_to_date(dest: Path, fingerprint: str, finished: ReadFinished) -> dict[str, Any] | None:
    """The manifest of `dest` when `finished` reads it whole and it records `fingerprint`, else None."""
    try:
        manifest = finished(dest)
    except DataError:
        return None
    if manifest is None or manifest.get("inputs_sha256") != fingerprint:
        return None
    return manifest


def remove_stale(dest: Path, keep: set[str], outputs: Iterable[str]) -> None:
    """The files matching `outputs` (glob patterns) in `dest` that are not in `keep`: a former prepare's."""
    for pattern in outputs:
        for p in dest.glob(pattern):
            if p.name not in keep:
                p.unlink(missing_ok=True)
