"""recipes.cli.omp_wait: the load a command starts under, measured in a fresh interpreter before torch
loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.load import background

REPO = Path(__file__).resolve().parents[2]

# what a command sees: the variables after `import recipes`, and whether torch was loaded by then
_PROBE = (
    "import json, os, sys, recipes\n"
    "print(json.dumps({k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'TORCHKILN_BUSY_CPUS')}"
    " | {'torch': 'torch' in sys.modules}))"
)


def _probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "TORCHKILN_BUSY_CPUS")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**base, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_start_beside_a_busy_process_waits_passively_before_torch_loads() -> None:
    with background("spin", 1):
        seen = _probe()
    assert seen["torch"] is False  # the policy is exported before OpenMP could read it
    assert seen["OMP_WAIT_POLICY"] == "PASSIVE"
    assert 0.6 <= float(seen["TORCHKILN_BUSY_CPUS"]) <= (os.cpu_count() or 1)  # our own time not counted


def test_the_users_policy_and_an_inherited_measurement_are_kept() -> None:
    with background("spin", 1):
        assert _probe(OMP_WAIT_POLICY="active")["OMP_WAIT_POLICY"] == "active"
        inherited = _probe(TORCHKILN_BUSY_CPUS="0.00")  # a torchrun agent measured for its workers
    assert inherited["OMP_WAIT_POLICY"] is None and inherited["TORCHKILN_BUSY_CPUS"] == "0.00"


def test_the_device_plan_reads_the_measurement_of_its_command() -> None:
    code = "import json\nfrom core.device import detect\nprint(json.dumps(detect().busy_cpus))"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHKILN_BUSY_CPUS": "1.25"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout) == 1.25, out.stderr
