"""`precision=auto` against fp32 and bf16 on each recipe's own training run (issue #41 point 4): auto must run
within 5% of the faster of the two, for each ASR model, the LM and the image and text models.

    PYTHONPATH=. python -m bench.precision_auto [--steps 30] [--recipes whisper,conformer,lm,image,text]

For each recipe, `python -m recipes.train RECIPE` runs in fresh processes at precision=fp32, bf16 and auto,
--rounds times, each round in a rotated order (on this VM the later of two back-to-back runs stepped up to 15%
slower, whichever precision it ran): each run --steps optimizer steps with compile off (so the precision
alone differs) and a small validation set (the end-of-run evaluation is not timed). A run's figure is its
throughput over its steps after the first --skip, as total samples over total time (the harmonic mean of
the logged per-step `train/samples_per_s` or `train/tokens_per_s`: batches of varying length make per-step
rates vary several-fold); a precision's figure is the median over its rounds. Auto's pick is what its
checkpoint's meta.json records. The model probe of `core.device.model_precision` that auto runs is cached
per model shape in the user's torchkiln cache, so later auto runs read the first one's measurement. Ratios
are of runs in this one invocation, on this host.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.data import host_facts

#: recipe name -> the command line that runs it (small validation sets: the final evaluation is not timed)
RECIPES = {
    "whisper": ["+task=asr", "data.val_size=8", "data.test_size=8"],
    "conformer": ["experiment=asr_conformer", "data.val_size=20", "data.test_size=20"],
    "lm": ["+task=lm"],
    "image": ["+task=image_classification"],
    "text": ["+task=text_classification"],
}
REPO = Path(__file__).resolve().parents[1]


def run(recipe: list[str], precision: str, steps: int, folder: Path) -> tuple[list[float], str, str]:
    """(per-step throughput, the precision the run trained in, its precision line) of one run."""
    cmd = [sys.executable, "-m", "recipes.train", *recipe, f"precision={precision}", "compile.policy=off"]
    cmd += [f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.eval_on_start=false"]
    cmd += ["logger=none", "trainer.progress=false", f"hydra.run.dir={folder}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=folder.parent, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    key = next(k for k in ("train/samples_per_s", "train/tokens_per_s") if any(k in r for r in rows))
    rates = [r[key] for r in rows if key in r]
    metas = sorted((folder / "checkpoints").glob("step_*/meta.json"))
    trained = json.loads(metas[-1].read_text()).get("precision", "?") if metas else "?"
    line = next(
        (m for m in done.stdout.splitlines() + done.stderr.splitlines() if "precision=auto:" in m), ""
    )
    return rates, trained, line


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the recipes' three precisions; print the table; auto / best per recipe."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="runs per precision, in rotated orders")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--extra", default="", help="more overrides for every run, space-separated (tests)")
    a = p.parse_args(argv)
    print(host_facts())
    print(
        f"throughput over steps {a.skip + 1}-{a.steps} (total samples / total time), median of {a.rounds} "
        "rounds, compile off; auto / best: auto over the faster"
    )
    print("| recipe | fp32 | bf16 | bf16 / fp32 | auto | auto picked | auto / best |")
    print("|---|---|---|---|---|---|---|")
    out: dict[str, float] = {}
    lines: list[str] = []
    spread: list[str] = []
    with tempfile.TemporaryDirectory(prefix="precision_auto_") as tmp:
        for name in a.recipes.split(","):
            recipe = RECIPES[name] + a.extra.split()
            figures: dict[str, list[float]] = {"fp32": [], "bf16": [], "auto": []}
            picked: set[str] = set()
            order = list(figures)
            for r in range(a.rounds):
                for precision in order[r % 3 :] + order[: r % 3]:
                    folder = Path(tmp) / f"{name}-{precision}-{r}"
                    rates, trained, line = run(recipe, precision, a.steps, folder)
                    kept = rates[a.skip :] or rates
                    figures[precision].append(len(kept) / sum(1 / x for x in kept))
                    if precision == "auto":
                        picked.add(trained)
                        if r == 0:
                            lines.append(f"{name}: {line.strip()}")
            med = {k: statistics.median(v) for k, v in figures.items()}
            best = max(med["fp32"], med["bf16"])
            out[name] = med["auto"] / best
            cells = [name, *(f"{med[k]:.1f}" for k in ("fp32", "bf16")), f"{med['bf16'] / med['fp32']:.2f}x"]
            cells += [f"{med['auto']:.1f}", "/".join(sorted(picked)), f"{out[name]:.3f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
            spread.append(
                f"{name}: " + "; ".join(f"{k} {', '.join(f'{x:.1f}' for x in v)}" for k, v in figures.items())
            )
    print("each run, in round order:")
    for line in spread:
        print(line)
    for line in lines:
        print(re.sub(r"\s+", " ", line))
    return out


if __name__ == "__main__":
    main()
