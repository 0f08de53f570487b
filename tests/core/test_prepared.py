"""core.data.prepared: the fingerprint a manifest records is the one folders were prepared with before (they
stay up to date), a folder is built once and then left as it is, prepares started together build it once,
changed inputs rebuild it and remove what the new manifest does not list, and a build that dies leaves no
finished set."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from core.data.prepared import MANIFEST, WORK, inputs_fingerprint, prepare_folder
from core.errors import DataError

INPUTS = {"shard_tokens": 256, "sources": [["a.txt", 10, 7]], "kind": "speech"}


def test_the_fingerprint_is_the_one_manifests_already_on_disk_record() -> None:
    # the SHA-256 of the inputs as JSON with sorted keys, as each preparer computed it before the skeleton
    # existed: pinned, so a change that would make every prepared folder stale fails here first
    assert inputs_fingerprint(INPUTS) == "68e5bf18a07567558e97cbf48415e8e1b06bf8de1a2cd4aa3b848fe4bf1dd801"
    assert inputs_fingerprint(dict(reversed(INPUTS.items()))) == inputs_fingerprint(INPUTS)


class Folder:
    """A toy preparer: writes `part-N.bin` files (N from the inputs' `parts`) and counts its builds."""

    def __init__(self, pause: float = 0.0, fail: bool = False) -> None:
        self.builds, self.pause, self.fail = 0, pause, fail

    def finished(self, dest: Path) -> dict[str, Any] | None:
        try:  # as the real readers: a missing or corrupt manifest is a DataError
            manifest = json.loads((dest / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{dest}: not a finished folder ({e})") from None
        return manifest if all((dest / f).is_file() for f in manifest["files"]) else None

    def prepare(self, out: Path, parts: int) -> dict[str, Any]:
        def build(dest: Path, fingerprint: str) -> dict[str, Any]:
            self.builds += 1
            (dest / WORK).mkdir(exist_ok=True)
            time.sleep(self.pause)
            files = [f"part-{n}.bin" for n in range(parts)]
            for f in files:
                (dest / f).write_bytes(b"x" * parts)
            if self.fail:
                raise RuntimeError("killed mid-build")
            return {"inputs_sha256": fingerprint, "files": files}

        return prepare_folder(
            out,
            {"parts": parts},
            finished=self.finished,
            build=build,
            outputs=("part-*.bin",),
            listed=lambda m: set(m["files"]),
        )


def test_a_folder_is_built_once_then_up_to_date(tmp_path: Path) -> None:
    folder = Folder()
    first = folder.prepare(tmp_path / "out", 3)
    again = folder.prepare(tmp_path / "out", 3)
    assert (first["status"], again["status"], folder.builds) == ("prepared", "up to date", 1)
    assert first["inputs_sha256"] == inputs_fingerprint({"parts": 3}) == again["inputs_sha256"]
    assert not (tmp_path / "out" / WORK).exists()


def test_changed_inputs_rebuild_and_remove_what_the_new_manifest_does_not_list(tmp_path: Path) -> None:
    folder = Folder()
    folder.prepare(tmp_path / "out", 3)
    (tmp_path / "out" / "notes.txt").write_text("mine")  # not an output: kept
    assert folder.prepare(tmp_path / "out", 2)["status"] == "prepared"
    left = sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith("."))
    assert left == [MANIFEST, "notes.txt", "part-0.bin", "part-1.bin"] and folder.builds == 2


def test_a_folder_whose_files_are_not_whole_is_rebuilt(tmp_path: Path) -> None:
    folder = Folder()
    folder.prepare(tmp_path / "out", 2)
    (tmp_path / "out" / "part-1.bin").unlink()
    assert folder.prepare(tmp_path / "out", 2)["status"] == "prepared" and folder.builds == 2
    (tmp_path / "out" / MANIFEST).write_text("{not json")
    assert folder.prepare(tmp_path / "out", 2)["status"] == "prepared" and folder.builds == 3


def test_a_build_that_dies_leaves_no_finished_set(tmp_path: Path) -> None:
    Folder().prepare(tmp_path / "out", 2)
    with pytest.raises(RuntimeError):
        Folder(fail=True).prepare(tmp_path / "out", 3)
    assert not (tmp_path / "out" / MANIFEST).exists()
    folder = Folder()
    assert folder.prepare(tmp_path / "out", 3)["status"] == "prepared" and folder.builds == 1


def test_prepares_started_together_build_once(tmp_path: Path) -> None:
    folder = Folder(pause=0.3)
    statuses: list[str] = []
    threads = [
        threading.Thread(target=lambda: statuses.append(folder.prepare(tmp_path / "out", 2)["status"]))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert folder.builds == 1 and sorted(statuses) == ["prepared", "up to date", "up to date"]
