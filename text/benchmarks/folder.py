"""The folder of lm-eval task YAMLs and their JSONL data that `--include_path` (or lm-eval's
`TaskManager(include_path=...)`) reads: generated once per cache from the shipped KJV and task templates,
by `core.data.prepared.prepare_folder` (a lock, so ranks started together build it once; atomic writes; a
fingerprint of the inputs, so a change of data, template or version builds a fresh folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.data.prepared import MANIFEST, inputs_fingerprint, prepare_folder
from core.files import cache_root, file_sha256, write_text_atomic
from text.benchmarks.kjv_docs import SEED, TASKS, held_out_fractions, task_docs
from text.corpus import KJV_PATH

#: raise when the rows a template or seed cannot show change (e.g. a new distractor rule)
VERSION = 3
TEMPLATES = Path(__file__).resolve().parent / "tasks"
GROUP_FILE = "_kjv.yaml"
#: the templates' placeholders, each filled with a JSON-quoted absolute path (a valid YAML scalar)
DATA_FILE, DATASETS_CACHE = "DATA_FILE", "DATASETS_CACHE"
#: `datasets.load_dataset`'s cache, inside the folder: evaluating writes nothing under ~/.cache
HF_CACHE = "hf_datasets"


def _templates() -> dict[str, str]:
    """Each shipped YAML's file name and text."""
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.glob("*.yaml"))}


def _inputs() -> dict[str, Any]:
    """What the folder's contents are made from."""
    return {
        "version": VERSION,
        "seed": SEED,
        "kjv_sha256": file_sha256(KJV_PATH),
        "held_out": held_out_fractions(),
        "templates": _templates(),
    }


def _finished(dest: Path) -> dict[str, Any] | None:
    """The manifest of `dest` if it lists files that are all there, else None."""
    try:
        manifest = json.loads((dest / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if all((dest / f).is_file() for f in manifest.get("files", ())) else None


def _build(dest: Path, fingerprint: str) -> dict[str, Any]:
    """Write each task's JSONL and YAML (the group's too) into `dest`; the manifest listing them."""
    docs, templates = task_docs(), _templates()
    for task in TASKS:
        rows = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in docs[task])
        write_text_atomic(dest / f"{task}.jsonl", rows)
        yaml = templates[f"{task}.yaml"]
        yaml = yaml.replace(DATA_FILE, json.dumps(str(dest / f"{task}.jsonl")))
        write_text_atomic(
            dest / f"{task}.yaml", yaml.replace(DATASETS_CACHE, json.dumps(str(dest / HF_CACHE)))
        )
    write_text_atomic(dest / GROUP_FILE, templates[GROUP_FILE])
    files = sorted([GROUP_FILE, *(f"{t}.yaml" for t in TASKS), *(f"{t}.jsonl" for t in TASKS)])
    return {"inputs_sha256": fingerprint, "files": files, "docs": {t: len(docs[t]) for t in TASKS}}


def task_folder(root: Path | None = None) -> Path:
    """The folder of the embedded KJV benchmarks' lm-eval tasks (group `kjv`), generated under `root`
    (default: the cache's `benchmarks/`) on first use; the same bytes on every call and machine."""
    inputs = _inputs()
    parent = Path(root) if root is not None else cache_root() / "benchmarks"
    dest = parent / f"kjv-v{VERSION}-{inputs_fingerprint(inputs)[:12]}"
    # the folder's own path is an input too: the YAMLs name their data by absolute path
    prepare_folder(
        dest,
        {**inputs, "folder": str(dest)},
        finished=_finished,
        build=_build,
        outputs=("*.yaml", "*.jsonl"),
        listed=lambda manifest: set(manifest["files"]),
    )
    return dest
