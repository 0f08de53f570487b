"""The CPU heap policy (core.device.allocator): each recipe's training steps with glibc's defaults against
`retain` (freed memory kept for reuse), paired step by step, with the page faults and peak memory of each.

    PYTHONPATH=. python -m bench.cpu_heap [--steps 30] [--rounds 3]
        [--recipes lm_nanogpt,lm,whisper,conformer,image,resnet18,vit,text]

Each recipe runs in fresh processes with TORCHKILN_ALLOCATOR=system and =retain, --rounds times in
alternating order, at the recipe's own precision (auto; bf16 for lm_nanogpt, the LM at nanoGPT's shape),
compile off. The runs of a recipe draw the same batches in the same order, so step i of one is step i of the
other on the same data: a round's ratio is the median over steps (after the first --skip) of retain's
per-step rate over system's, and a recipe's the median over rounds (bench/precision_auto.py's pairing).
Page faults are the whole run's minor faults (startup and imports included, about the same in both) divided
by its steps (and, with lm_nanogpt, also counted for the steps alone, in a process of their own), and one
fault's cost is measured first (a fresh mapping's pages written once each); peak memory is the run's peak
resident set (`train/peak_mem_mib`). Ratios are of runs in this one invocation, on this host.
"""

from __future__ import annotations

import argparse
import json
import mmap
import resource
import statistics
import tempfile
import time
from pathlib import Path

from bench.data import host_facts, python_in_fresh_process
from bench.precision_auto import RECIPES, paired, run_recipe

POLICIES = ("system", "retain")
#: bench/precision_auto.py's recipes and the LM at nanoGPT's shape (issue #41 point 2's), in bf16
HEAP_RECIPES = {
    **RECIPES,
    "lm_nanogpt": [
        *RECIPES["lm"],
        *("model.n_layer=6", "model.n_head=6", "model.d_model=384", "task.context=256"),
        *("trainer.batch_size=12", "precision=bf16"),
    ],
}


#: the LM at nanoGPT's shape in bf16 (bench.text_speed.recipe_loop), the process's minor page faults counted
#: between one training step's start and the next's: the steps alone, without startup; after 3 steps
STEP_FAULTS = """
import json, resource, tempfile
from pathlib import Path
from bench.text_speed import recipe_loop

class Marks:
    def __init__(self):
        self.faults = []
    def __call__(self):
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    def steps(self):
        return []

marks = Marks()
with tempfile.TemporaryDirectory() as tmp:
    recipe_loop(STEPS, Path(tmp) / "run", "off", marks, "bf16", 100)
print(json.dumps([b - a for a, b in zip(marks.faults, marks.faults[1:])][3:]))
"""


def step_faults(policy: str, steps: int = 15) -> list[int]:
    """Minor page faults of each training step of the LM at nanoGPT's shape (bf16) under heap `policy`, in a
    fresh process (STEP_FAULTS)."""
    code = STEP_FAULTS.replace("STEPS", str(steps))
    return json.loads(python_in_fresh_process(code, {"TORCHKILN_ALLOCATOR": policy}))


def fault_cost_us(mib: int = 120, reps: int = 5) -> float:
    """Microseconds one minor page fault costs here (the kernel's fault path and its zeroing of the page):
    a fresh anonymous mapping's pages written once each, less a second pass over the same pages (the loop's
    own cost), per fault; the median of `reps`."""
    size = mib << 20
    costs = []
    for _ in range(reps):
        with mmap.mmap(-1, size) as m:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for off in range(0, size, mmap.PAGESIZE):
                m[off] = 1
            first = time.perf_counter() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            t0 = time.perf_counter()
            for off in range(0, size, mmap.PAGESIZE):
                m[off] = 2
            again = time.perf_counter() - t0
        costs.append((first - again) / max(1, faults) * 1e6)
    return statistics.median(costs)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run each recipe under both heap policies; print the table; retain / system (paired) per recipe."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="runs per policy, in alternating orders")
    p.add_argument("--recipes", default="lm_nanogpt,lm,whisper,conformer,image,resnet18,vit,text")
    p.add_argument("--extra", default="", help="more overrides for every run, space-separated (tests)")
    a = p.parse_args(argv)
    print(host_facts())
    print(f"one minor page fault: {fault_cost_us():.2f} us (a fresh mapping's pages written once each)")
    if "lm_nanogpt" in a.recipes.split(","):
        counts = {policy: step_faults(policy) for policy in POLICIES}
        each = (f"{k} median {statistics.median(v):.0f} ({min(v)}-{max(v)})" for k, v in counts.items())
        print("lm_nanogpt, the steps alone: minor page faults a step; " + "; ".join(each))
    print(
        f"paired: median over steps {a.skip + 1}-{a.steps} of retain's rate over system's on the same batch, "
        f"median of {a.rounds} rounds; faults: a run's minor page faults / its steps; peak: resident MiB"
    )
    cols = ["recipe", "retain / system, paired", "rounds", "faults a step, system", "retain"]
    print("| " + " | ".join([*cols, "peak MiB, system", "retain"]) + " |")
    print("|---|---|---|---|---|---|---|")
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="cpu_heap_") as tmp:
        for name in a.recipes.split(","):
            recipe = HEAP_RECIPES[name] + a.extra.split()
            rates: dict[str, list[list[float]]] = {k: [] for k in POLICIES}
            faults: dict[str, list[float]] = {k: [] for k in POLICIES}
            peak: dict[str, list[float]] = {k: [] for k in POLICIES}
            for r in range(a.rounds):
                for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                    folder = Path(tmp) / f"{name}-{policy}-{r}"
                    done = run_recipe(recipe, a.steps, folder, {"TORCHKILN_ALLOCATOR": policy})
                    rates[policy].append(done.rates()[a.skip :] or done.rates())
                    faults[policy].append(done.minor_faults / a.steps)
                    peak[policy].append(max(r.get("train/peak_mem_mib", 0) for r in done.rows))
            rounds = [paired(rates["retain"][r], rates["system"][r]) for r in range(a.rounds)]
            out[name] = statistics.median(rounds)
            cells = [name, f"{out[name]:.3f}", ", ".join(f"{x:.3f}" for x in rounds)]
            cells += [f"{statistics.median(faults[k]):.0f}" for k in POLICIES]
            cells += [f"{statistics.median(peak[k]):.0f}" for k in POLICIES]
            print("| " + " | ".join(cells) + " |", flush=True)
    return out


if __name__ == "__main__":
    main()
