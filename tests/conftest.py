"""Shared fixtures: run the CLI in a subprocess against this checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.cpuload import usable_cpus
from tests.helpers import cli_env, logging_state, run_here

# Registered here rather than in pyproject.toml: the venvs are keyed by pyproject.toml's hash, and a marker
# is no reason to rebuild them.
MARKERS = (
    "gpu: needs a CUDA device (skipped without one; only `-m gpu` selects it: scripts/gpu_checks.sh)",
    "arm64: also runs on an emulated aarch64 userland via make test-arm64 (docs/graviton.md); a selection, "
    "not an exclusion: these stay in the default run as well",
)


#: the session's own cache root, made by the controlling process and inherited by xdist workers and every
#: process a test starts
SESSION_CACHE = "TORCHKILN_TEST_SESSION_CACHE"


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers that pyproject.toml does not list, and give the session a cache of its own."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    # The suite never reads or writes the user's caches (~/.cache/torchkiln or their TORCHKILN_CACHE): a
    # device probe taken while it loads the host, its signing key and compile and data caches stay here.
    if not hasattr(config, "workerinput"):
        os.environ[SESSION_CACHE] = tempfile.mkdtemp(prefix="torchkiln-tests-")
    os.environ["TORCHKILN_CACHE"] = os.environ[SESSION_CACHE]
    if hasattr(config, "workerinput"):
        share_the_cores(int(config.workerinput["workercount"]))


def share_the_cores(workers: int) -> None:
    """Each of `workers` xdist workers gets its share of this process's CPUs as torch's threads and as the
    OMP_NUM_THREADS the device plan, in-process runs and the processes tests start read: two workers of two
    threads each on two cores oversubscribe them, and OpenMP's spinning threads then wait on each other (the
    before and after: BENCHMARKS.md § Test suite and CI)."""
    import torch

    threads = max(1, usable_cpus() // max(1, workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's cache (in the controlling process, once every worker is done)."""
    if not hasattr(config, "workerinput") and SESSION_CACHE in os.environ:
        shutil.rmtree(os.environ.pop(SESSION_CACHE), ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu`-marked tests run only when `-m` names them, and skip where torch sees no CUDA device."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return  # torch stays unimported until a test needs it
    if "gpu" not in (config.getoption("markexpr") or ""):
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        return
    import torch

    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Each test leaves the loggers as it found them: a test that calls a recipe's main() directly (not
    through tests.helpers.in_process) would otherwise leave Hydra's handlers on a closed capture stream."""
    with logging_state(added_only=True):
        yield


@pytest.fixture
def ieee_matmuls() -> Iterator[None]:
    """fp32 matmuls in full fp32 for the test: a trainer's CUDA plan leaves TF32 on (10-bit mantissa)."""
    import torch

    api = hasattr(torch.backends.cuda.matmul, "fp32_precision")  # torch >= 2.9 refuses mixing the two
    before = torch.backends.cuda.matmul.fp32_precision if api else torch.backends.cuda.matmul.allow_tf32
    if api:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
    yield
    if api:
        torch.backends.cuda.matmul.fp32_precision = before
    else:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run `python -m MODULE ARGS...` in tmp_path; returns the completed process (text output)."""

    def run(
        *args: str,
        module: str = "recipes.train",
        env: dict[str, str] | None = None,
        timeout: int = 300,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=cwd or tmp_path,
            env=cli_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def cli_here(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """`cli`'s call, run in this process (tests.helpers.run_here): for tests of what a command computes and
    writes, where the process itself (exit on a signal, a traceback, a launch) is not what is checked."""

    def run(
        *args: str, module: str = "recipes.train", env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        return run_here(module, *args, env=env, cwd=cwd or tmp_path)

    return run


@pytest.fixture
def dynamo_only_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers compile with dynamo's eager backend: real tracing, guards and recompiles, and the same ATen
    ops as eager (bit for bit), in well under a second per graph instead of Inductor's minute of g++."""
    import dataclasses

    import core.distributed.group
    import core.loop.trainer

    real = core.loop.trainer.resolve
    eager = lambda *a, **k: dataclasses.replace(real(*a, **k), compile_backend="eager")  # noqa: E731
    # the trainer's plan comes from group.start_with_plan (one process or many); its dry run resolves its own
    monkeypatch.setattr(core.distributed.group, "resolve", eager)
    monkeypatch.setattr(core.loop.trainer, "resolve", eager)


@pytest.fixture
def torch_artifacts(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """torch's save/load of cache artifacts replaced: saving gives b"graphs", loading records its bytes."""
    import torch

    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"graphs", None), raising=False)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append, raising=False)
    return loaded
