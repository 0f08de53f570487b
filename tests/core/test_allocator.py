"""core.device.allocator in real processes: with `retain`, buffers a loop frees and allocates again are
served from the process's own memory, not as fresh pages; glibc's defaults fault every page of them anew."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# a step-like loop: two 48 MiB buffers (over glibc's largest dynamic mmap threshold, 32 MiB) and a 16 MiB one
# (under it), each written whole, then freed; the minor page faults of iterations 6-10 (the heap settles in
# the first few). argv[1]: "retain" sets the policy directly, "plan" applies the CPU device plan
# (TORCHKILN_ALLOCATOR decides), anything else leaves glibc's defaults
LOOP = """
import json, resource, sys
import torch
from core.device import resolve
from core.device.allocator import retain_freed_memory
if sys.argv[1] == "retain":
    chosen = "retain" if retain_freed_memory() else "refused"
elif sys.argv[1] == "plan":
    plan = resolve("cpu", "fp32", measure=False)
    plan.apply()
    chosen = plan.allocator
else:
    chosen = "system"
faults = []
for i in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [torch.empty(n, dtype=torch.uint8).fill_(i) for n in (48 << 20, 48 << 20, 16 << 20)]
    del bufs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"chosen": chosen, "faults": faults[5:]}))
"""
PAGES = (112 << 20) // 4096  # 28,672 pages written an iteration


def loop(how: str, allocator: str | None = None) -> tuple[str, list[int]]:
    """(the policy in force, minor faults of iterations 6-10) of LOOP in a fresh process."""
    # without the user's own allocator choices, which the plan would keep
    mine = ("TORCHKILN_ALLOCATOR", "LD_PRELOAD", "GLIBC_TUNABLES")
    env = {k: v for k, v in os.environ.items() if k not in mine}
    if allocator is not None:
        env["TORCHKILN_ALLOCATOR"] = allocator
    cmd = [sys.executable, "-c", LOOP, how]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    out = json.loads(done.stdout.splitlines()[-1])
    return out["chosen"], out["faults"]


def test_retained_memory_is_reused_without_page_faults():
    _, system = loop("none")
    chosen, retain = loop("retain")
    assert min(system) > PAGES // 2  # glibc's defaults: most pages come back fresh every iteration
    assert chosen == "retain" and max(retain) < 100  # retained: the same memory again


@pytest.mark.parametrize(("allocator", "fresh_pages"), [(None, False), ("system", True)])
def test_applying_the_cpu_plan_sets_the_policy(allocator, fresh_pages):
    chosen, faults = loop("plan", allocator)
    assert chosen == (allocator or "retain")
    assert (min(faults) > PAGES // 2) is fresh_pages and (max(faults) < 100) is not fresh_pages
