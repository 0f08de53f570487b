"""The directory protocol both checkpoint formats share: step dirs, temporaries, completion, pruning, resume.

`RUN_DIR/checkpoints/step_00001234/` is one checkpoint. A writer fills `.tmp-step_00001234-PID` (PID: the
writing process's, or rank 0's under several), writes `meta.json` last, fsyncs every file and the directory,
and renames it into place, so a listed step dir is always whole; a crash leaves only the `.tmp-` directory,
which `complete_checkpoints` never lists and `remove_stale_temporaries` removes once its writer is gone. The
format inside (single-process `model.pt`, or DCP's `.metadata` and shards) is told by `is_sharded` alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from core.errors import CheckpointError
from core.files import fsync

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
#: written last; its presence marks a checkpoint complete
META = "meta.json"
#: the file DCP writes its index to; its presence tells a sharded checkpoint from a single-process one
METADATA = ".metadata"
#: the fix a failed checkpoint write names (the rename never happened, so nothing older was touched)
WRITE_FIX = "earlier checkpoints are intact (free disk space or set trainer.keep_last lower)"


def step_dir(ckpt_root: Path, step: int) -> Path:
    """Where checkpoint `step` lives once complete."""
    return ckpt_root / f"step_{step:08d}"


def temporary_dir(ckpt_root: Path, step: int, pid: int) -> Path:
    """Where process `pid` writes checkpoint `step` before the rename."""
    return ckpt_root / f".tmp-step_{step:08d}-{pid}"


def fresh_temporary(ckpt_root: Path, step: int) -> Path:
    """An empty temporary dir for this process to write checkpoint `step` into (a leftover is replaced)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = temporary_dir(ckpt_root, step, os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def is_sharded(path: Path) -> bool:
    """True when checkpoint dir `path` holds DCP's index (written by several processes, or `save_sharded`)."""
    return (path / METADATA).is_file()


def commit(tmp: Path, final: Path, meta: dict) -> None:
    """Write `meta` into `tmp`, flush every file and the directory, and rename `tmp` to `final`."""
    (tmp / META).write_text(json.dumps(meta, indent=1, default=str))
    for f in tmp.iterdir():  # the data, not only the names, survive a crash
        fsync(f)
    fsync(tmp)
    if final.exists():  # a re-save of the same step (e.g. after resume) replaces the old copy
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync(final.parent)


def read_meta(path: Path) -> dict:
    """The meta.json of checkpoint `path`; a missing or unreadable one is a one-line CheckpointError."""
    try:
        return json.loads((path / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: {META} is missing") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {first_line(e)}") from None


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints under `ckpt_root`, oldest first (half-written `.tmp-*` dirs are ignored)."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if _STEP_DIR.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def prune(ckpt_root: Path, *, keep_last: int, keep_best: int = 0, maximize: bool = True) -> list[Path]:
    """Delete complete checkpoints except the newest `keep_last` (0: keep all) and the best `keep_best` by
    the monitored value their meta records (`meta["monitor"]["value"]`); returns the kept ones, oldest
    first."""
    found = complete_checkpoints(ckpt_root)
    if keep_last <= 0:
        return found
    keep = set(found[-keep_last:])
    keep.update(best_checkpoints(found, maximize)[:keep_best])
    for old in found:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)
    return [p for p in found if p in keep]


def monitored_value(path: Path) -> float | None:
    """The monitored metric a checkpoint's meta records for its step (None: not evaluated at that step)."""
    try:
        value = json.loads((path / META).read_text()).get("monitor", {}).get("value")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value == value else None


def best_checkpoints(found: list[Path], maximize: bool) -> list[Path]:
    """The checkpoints among `found` that record a monitored value, best first (ties: the older first)."""
    scored = [(v, i, p) for i, p in enumerate(found) if (v := monitored_value(p)) is not None]
    scored.sort(key=lambda t: (-t[0] if maximize else t[0], t[1]))
    return [p for _, _, p in scored]


def remove_stale_temporaries(ckpt_root: Path) -> int:
    """Remove `.tmp-step_*-PID` directories whose writer is gone (a killed run's); returns how many."""
    removed = 0
    for tmp in ckpt_root.glob(".tmp-step_*-*") if ckpt_root.is_dir() else ():
        pid = tmp.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def resolve(spec: str, run_dir: Path) -> Path | None:
    """Turn `resume=` into a checkpoint dir: "auto" = newest in this run (or None), else a ckpt or run dir."""
    if spec == "auto":
        found = complete_checkpoints(run_dir / "checkpoints")
        return found[-1] if found else None
    path = Path(spec).expanduser()
    if (path / META).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointError(
        f"resume={spec}: no complete checkpoint there (expected a step_XXXXXXXX dir with meta.json, "
        "or a run dir holding checkpoints/); use resume=auto to resume the newest in this run dir",
        key="resume",
        value=str(spec),
    )


def first_line(err: BaseException) -> str:
    """`err`'s message on one line (at most 300 characters), or its type's name when it has none."""
    text = " ".join(str(err).split())
    return text[:300] if text else type(err).__name__
