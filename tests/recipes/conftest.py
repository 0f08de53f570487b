"""Tiny finished runs (one per task the commands after training are tested on), trained once per session
through the real CLI, for recipes.eval and recipes.predict."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ASR, ASR_SIZES, DIGITS, AsrRun, train


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 steps on digits, evaluated at step 5, exporting that step's weights."""
    return train(tmp_path_factory.mktemp("digits") / "run", DIGITS)


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
