"""Tiny finished runs (one per task the commands after training are tested on), trained once per session
through the real CLI, for recipes.eval and recipes.predict."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import _env

#: a digits run evaluated at its last step (5), whose model.safetensors is that step's weights
DIGITS = [
    "+task=image_classification",
    "trainer=smoke",
    "model.width=16",
    "trainer.export=last",
    "logger=none",
]
#: the eSpeak corpus and Conformer at the sizes tests/audio/test_asr.py trains
ASR_SIZES = {"train": 8, "val": 2, "test": 2}
ASR = [
    "+task=asr",
    "trainer=smoke",
    *(f"data.{s}_size={n}" for s, n in ASR_SIZES.items()),
    "model.dim=64",
    "model.layers=2",
    "model.heads=2",
    "model.subsampling_channels=16",
    "logger=none",
]


def train(run: Path, overrides: list[str], env: dict[str, str] | None = None) -> Path:
    """`python -m recipes.train OVERRIDES` into `run`, in a subprocess; the run directory."""
    r = subprocess.run(
        [sys.executable, "-m", "recipes.train", *overrides, f"hydra.run.dir={run}"],
        cwd=run.parent,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def val_row(run: Path, step: int) -> dict[str, float]:
    """The `val/*` metrics the loop logged at `step` (metrics.jsonl)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["step"] == step and any(k.startswith("val/") for k in r))
    return {k: v for k, v in row.items() if k.startswith("val/")}


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 steps on digits, evaluated at step 5, exporting that step's weights."""
    return train(tmp_path_factory.mktemp("digits") / "run", DIGITS)


@dataclass(frozen=True)
class AsrRun:
    """A finished tiny ASR run, its corpus folder (manifests, wav/) and the environment it ran in."""

    run: Path
    corpus: Path
    env: dict[str, str]


@pytest.fixture(scope="session")
def asr_run(tmp_path_factory: pytest.TempPathFactory) -> AsrRun:
    """5 steps of a tiny Conformer on a tiny generated corpus, one thread (as tests/audio/test_asr.py)."""
    from audio import corpus

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHKILN_CACHE", str(cache))
        root = corpus.ensure_corpus(0, ASR_SIZES, progress=False)
    env = {"TORCHKILN_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return AsrRun(train(tmp_path_factory.mktemp("asr") / "run", ASR, env), root, env)
