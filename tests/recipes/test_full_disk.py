"""A full disk at each write of a recipe run is one line and exit 74, never a traceback (real tmpfs).

The tmpfs sizes put the first failing write at Hydra's files (4 KiB holds none of .hydra/ but the config),
at the metrics sinks (12-16 KiB: .hydra/ fits, TensorBoard's first event file or metrics.jsonl does not) and
at the first checkpoint (tests/core/test_checkpoint.py).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from pathlib import Path

import pytest

from recipes.cli.curves import write_curves
from tests.helpers import in_small_filesystem

TRACEBACKS = ("Traceback", "Exception in thread", "--- Logging error ---")


@pytest.mark.parametrize(("size", "where"), [("4k", ".hydra/"), ("12k", ""), ("16k", "")])
def test_a_full_disk_at_any_write_is_one_line_and_exit_74(tmp_path: Path, size: str, where: str) -> None:
    run = tmp_path / "fs" / "run"
    cmd = [sys.executable, "-m", "recipes.train", "+task=image_classification", "trainer=smoke"]
    proc = in_small_filesystem(size, *cmd, f"hydra.run.dir={run}", tmp_path=tmp_path)
    assert proc.returncode == 74, proc.stderr[-2000:]
    assert not any(t in proc.stderr + proc.stdout for t in TRACEBACKS), proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(rf"error: could not write (metrics |checkpoint )?{re.escape(f'{run}/{where}')}", last), (
        last
    )
    # the cause in the OS's words (torch's writer said "[enforce fail at inline_container.cc:672] ..."), and
    # the space left, in bytes on a nearly full disk
    assert f": {os.strerror(errno.ENOSPC)}; " in last and re.search(r"; \d+ bytes free there; ", last), last


def test_curves_skip_the_torn_last_line_of_a_killed_run(tmp_path: Path) -> None:
    rows = [{"step": s, "train/loss": 1.0 / s, "val/loss": 1.5 / s} for s in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "train/lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    out = write_curves(tmp_path, "val/loss")
    assert out is not None and out.stat().st_size > 1000
