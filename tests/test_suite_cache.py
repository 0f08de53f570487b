"""The test suite never touches the user's caches: the session, its xdist workers and the processes its tests
start all share one temporary cache root (tests/conftest.py), removed when the session ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from core.files import cache_root
from tests.helpers import cli_env


def test_the_session_and_the_processes_it_starts_share_one_cache_that_is_not_the_user_s() -> None:
    here = cache_root()
    assert here != Path.home() / ".cache" / "torchkiln" and here.name.startswith("torchkiln-tests-")
    assert here.is_dir() and str(here) == os.environ["TORCHKILN_TEST_SESSION_CACHE"]
    code = "from core.files import cache_root; print(cache_root())"
    child = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True)
    assert child.returncode == 0 and Path(child.stdout.strip()) == here
