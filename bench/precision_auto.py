"""`precision=auto` against fp32 and bf16 on each recipe's own training run (issue #41 point 4): auto must run
within 5% of the faster of the two, for each ASR model, the LM, the image models (the small CNN, ResNet-18,
ViT) and the text model.

    PYTHONPATH=. python -m bench.precision_auto [--steps 30]
        [--recipes whisper,conformer,lm,image,resnet18,vit,text]

For each recipe, `python -m recipes.train RECIPE` runs in fresh processes at precision=fp32, bf16 and auto,
--rounds times, each round in a rotated order (on this VM the later of two back-to-back runs stepped up to 15%
slower, whichever precision it ran): each run --steps optimizer steps with compile off (so the precision
alone differs) and a small validation set (the end-of-run evaluation is not timed).

Two figures per run. Throughput: samples (or tokens) over the time of its steps after the first --skip (the
harmonic mean of the logged per-step rates), a precision's the median over its rounds. It is what a user sees,
but whole runs of one configuration differed by up to 30% here, so it cannot resolve 5%. Paired: the runs of
a recipe draw the same batches in the same order (same seed; auto's model probe leaves the RNG as it was),
so step i of one precision is step i of another on the same data; a round's paired ratio is the median over
its steps of the per-step ratios, and a recipe's the median over rounds. That removes the batches' several-
fold spread in length and most of the host's drift. "auto / best" is auto's paired ratio against the faster
precision by the paired figure. Auto's pick is what its checkpoint's meta.json records; its model probe
(`core.device.model_precision`) runs once per model shape and is cached in the user's torchkiln cache, so
only the first auto run of a recipe pays it: "probe s" is that one-time cost, (1 + STEPS) steps of each
precision as its line reports them. Ratios are of runs in this one invocation, on this host.

    PYTHONPATH=. python -m bench.precision_auto --first-calls

times what a run whose batches vary in length pays at each new shape, and why the model probe times each pair
on a new batch: a Linear(384, 1536) at 30 row counts (200-3000, each new to the process), each count's first
call and its repeat, in fp32 and in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.data import host_facts
from core.device.model_precision import STEPS

#: recipe name -> the command line that runs it (small validation sets: the final evaluation is not timed)
RECIPES = {
    "whisper": ["+task=asr", "data.val_size=8", "data.test_size=8"],
    "conformer": ["experiment=asr_conformer", "data.val_size=20", "data.test_size=20"],
    "lm": ["+task=lm"],
    "image": ["+task=image_classification"],
    "resnet18": ["+task=image_classification", "model=resnet18"],
    "vit": ["+task=image_classification", "model=vit"],
    "text": ["+task=text_classification"],
}
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    """One recipe run's logged rows, its output and the page faults it took."""

    rows: list[dict]
    output: str
    minor_faults: int

    def rates(self) -> list[float]:
        """Per-step throughput (samples or tokens a second), as logged."""
        key = next(k for k in ("train/samples_per_s", "train/tokens_per_s") if any(k in r for r in self.rows))
        return [r[key] for r in self.rows if key in r]


def run_recipe(recipe: list[str], steps: int, folder: Path, env: dict[str, str] | None = None) -> Run:
    """Train `recipe` (overrides) for `steps` steps with compile off, logging every step, in a fresh process
    with `env` added to the environment; its rows, output and minor page faults."""
    cmd = [sys.executable, "-m", "recipes.train", *recipe, "compile.policy=off"]
    cmd += [f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.eval_on_start=false"]
    cmd += ["logger=none", "trainer.progress=false", f"hydra.run.dir={folder}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    done = subprocess.run(cmd, cwd=folder.parent, capture_output=True, text=True, env=env)
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return Run(rows, done.stdout + done.stderr, faults)


def run(recipe: list[str], precision: str, steps: int, folder: Path) -> tuple[list[float], str, str]:
    """(per-step throughput, the precision the run trained in, its precision line) of one run."""
    done = run_recipe([*recipe, f"precision={precision}"], steps, folder)
    metas = sorted((folder / "checkpoints").glob("step_*/meta.json"))
    trained = json.loads(metas[-1].read_text()).get("precision", "?") if metas else "?"
    line = next((m for m in done.output.splitlines() if "precision=auto:" in m), "")
    return done.rates(), trained, line


def paired(a: list[float], b: list[float]) -> float:
    """Median over steps of a's rate over b's, step by step (the same batch in both runs)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=False))


def probe_seconds(line: str) -> float:
    """The one-time cost of auto's model probe from its precision line (0 where it names no step times)."""
    found = re.search(r"step ([0-9.]+) ms fp32, ([0-9.]+) ms bf16", line)
    return (1 + STEPS) * (float(found[1]) + float(found[2])) / 1e3 if found else 0.0


def first_calls(shapes: int = 30, width: int = 384, out: int = 1536) -> dict[str, tuple[float, float]]:
    """Per dtype (fp32, bf16): total ms of a (width -> out) linear layer's first calls at `shapes` random row
    counts (200-3000, each new), and of each count's immediate repeat."""
    import random

    weight = torch.randn(out, width)
    rows = random.Random(0).sample(range(200, 3000), shapes)
    found: dict[str, tuple[float, float]] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        w, first, again = weight.to(dtype), 0.0, 0.0
        for m in rows:
            x = torch.randn(m, width, dtype=dtype)
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            t1 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            first, again = first + t1 - t0, again + time.perf_counter() - t1
        found[name] = (first * 1e3, again * 1e3)
    return found


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the recipes' three precisions; print the table; auto / best (paired) per recipe."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="runs per precision, in rotated orders")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--extra", default="", help="more overrides for every run, space-separated (tests)")
    p.add_argument("--first-calls", action="store_true", help="a GEMM's first call at a shape vs its repeat")
    a = p.parse_args(argv)
    print(host_facts())
    if a.first_calls:
        for name, (first, again) in first_calls().items():
            print(f"{name}: first calls {first:.1f} ms, repeats {again:.1f} ms ({first / again:.2f}x)")
        return {}
    print(
        f"throughput over steps {a.skip + 1}-{a.steps} (total samples / total time), median of {a.rounds} "
        "rounds, compile off; paired: median of per-step ratios on the same batches, median of rounds; "
        "auto / best: auto's paired ratio against the faster"
    )
    print("| recipe | fp32 | bf16 | auto | bf16/fp32 paired | auto picked | auto/best paired | probe s |")
    print("|---|---|---|---|---|---|---|---|")
    out: dict[str, float] = {}
    lines: list[str] = []
    spread: list[str] = []
    with tempfile.TemporaryDirectory(prefix="precision_auto_") as tmp:
        for name in a.recipes.split(","):
            recipe = RECIPES[name] + a.extra.split()
            figures: dict[str, list[float]] = {"fp32": [], "bf16": [], "auto": []}
            steps: dict[str, list[list[float]]] = {k: [] for k in figures}
            picked: set[str] = set()
            probe = 0.0
            order = list(figures)
            for r in range(a.rounds):
                for precision in order[r % 3 :] + order[: r % 3]:
                    folder = Path(tmp) / f"{name}-{precision}-{r}"
                    rates, trained, line = run(recipe, precision, a.steps, folder)
                    kept = rates[a.skip :] or rates
                    figures[precision].append(len(kept) / sum(1 / x for x in kept))
                    steps[precision].append(kept)
                    if precision == "auto":
                        picked.add(trained)
                        if r == 0:
                            lines.append(f"{name}: {line.strip()}")
                            probe = probe_seconds(line)
            med = {k: statistics.median(v) for k, v in figures.items()}
            rounds = range(a.rounds)
            bf16_fp32 = statistics.median(paired(steps["bf16"][r], steps["fp32"][r]) for r in rounds)
            best = "bf16" if bf16_fp32 >= 1 else "fp32"
            out[name] = statistics.median(paired(steps["auto"][r], steps[best][r]) for r in rounds)
            cells = [name, *(f"{med[k]:.1f}" for k in ("fp32", "bf16", "auto")), f"{bf16_fp32:.3f}"]
            cells += ["/".join(sorted(picked)), f"{out[name]:.3f}", f"{probe:.1f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
            spread.append(
                f"{name}: " + "; ".join(f"{k} {', '.join(f'{x:.1f}' for x in v)}" for k, v in figures.items())
            )
    print("each run's throughput, in round order:")
    for line in spread:
        print(line)
    for line in lines:
        print(re.sub(r"\s+", " ", line))
    return out


if __name__ == "__main__":
    main()
