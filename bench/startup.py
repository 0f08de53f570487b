"""Process start-up: how long a command takes before it does any work, against `import torch` alone.

Every `python -m recipes.NAME`, each torchrun rank and its agent, each sweep job and each probe pays it; so
does a command stopped by a bad setting (exit 2 "before work starts"). Each row is a fresh interpreter,
timed from spawn to exit; rows are interleaved round by round so each sees the same host, and the table
gives each row's median, its excess over the `import torch` floor of the same run, and (with `--other`) the
same for another checkout, e.g. a worktree of an older commit, with the ratio of the two.

    PYTHONPATH=. python -m bench.startup [--rounds 7] [--other PATH]

A last column names the heavy libraries each command loaded (from `python -X importtime`): torchvision,
dynamo, sympy and Inductor cost seconds of a start and belong where they are used (a vision model, a
compile), not in every command's imports.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: (row, interpreter arguments): the floor, then commands that stop before any work
COMMANDS = (
    ("import torch", ["-c", "import torch"]),
    ("import recipes.train", ["-c", "import recipes.train"]),
    ("recipes.list", ["-m", "recipes.list"]),
    ("recipes.train, a bad setting (exit 2)", ["-m", "recipes.train", "+task=lm", "trainer.max_steps=x"]),
)
#: libraries whose import costs a start seconds: module -> the name shown
HEAVY = {
    "torchvision": "torchvision",
    "torch._dynamo": "dynamo",
    "sympy": "sympy",
    "torch._inductor": "Inductor",
}


def _env(tree: Path, cache: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "TORCHKILN_CACHE": cache, "OMP_NUM_THREADS": "1"}


def seconds(tree: Path, args: list[str], cache: str) -> float:
    """Wall seconds of one fresh interpreter running `args` in checkout `tree`, spawn to exit."""
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, *args], cwd=cache, env=_env(tree, cache), capture_output=True, check=False
    )
    return time.perf_counter() - t


def heavy_imports(tree: Path, args: list[str], cache: str) -> list[str]:
    """The HEAVY libraries that running `args` in checkout `tree` imports; SystemExit if it fails other than
    by a bad setting (exit 2)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args], cwd=cache, env=_env(tree, cache), capture_output=True
    )
    lines = done.stderr.decode(errors="replace").splitlines()
    if done.returncode not in (0, 2):
        tail = [line for line in lines if not line.startswith("import time:")][-20:]
        raise SystemExit(f"{' '.join(args)} exited {done.returncode}:\n" + "\n".join(tail))
    loaded = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    return [shown for module, shown in HEAVY.items() if module in loaded]


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Print the table; return {checkout: {row: median seconds}}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="fresh processes per row and checkout")
    parser.add_argument("--other", type=Path, help="another checkout to time beside this one")
    args = parser.parse_args(argv)
    trees = {"this": ROOT, **({"other": args.other.resolve()} if args.other else {})}
    times: dict[str, dict[str, list[float]]] = {t: {row: [] for row, _ in COMMANDS} for t in trees}
    with tempfile.TemporaryDirectory(prefix="startup-") as cache:  # runs write nothing the user keeps
        for tree in trees.values():  # a first start of each, untimed: the .pyc files are written
            for _, cmd in COMMANDS:
                seconds(tree, cmd, cache)
        for _ in range(args.rounds):
            for name, tree in trees.items():
                for row, cmd in COMMANDS:
                    times[name][row].append(seconds(tree, cmd, cache))
        heavy = {
            t: {row: heavy_imports(tree, cmd, cache) for row, cmd in COMMANDS} for t, tree in trees.items()
        }
    medians = {t: {row: statistics.median(v) for row, v in rows.items()} for t, rows in times.items()}
    floor = {t: m["import torch"] for t, m in medians.items()}
    head = "| command | this checkout (s) | over import torch (s) |"
    if args.other:
        head += " other checkout (s) | over import torch (s) | this / other |"
    print(f"{args.rounds} rounds, median seconds of a fresh process")
    print(head + " heavy libraries loaded (this checkout" + (" / other" if args.other else "") + ") |")
    print("|" + "---|" * (head.count("|") - 1 + 1))
    for row, _ in COMMANDS:
        cells = [f"{medians['this'][row]:.2f}", f"{medians['this'][row] - floor['this']:+.2f}"]
        if args.other:
            other = medians["other"][row]
            cells += [
                f"{other:.2f}",
                f"{other - floor['other']:+.2f}",
                f"{medians['this'][row] / other:.2f}x",
            ]
        loaded = " / ".join(", ".join(heavy[t][row]) or "none" for t in trees)
        print(f"| {row} | " + " | ".join(cells) + f" | {loaded} |")
    return medians


if __name__ == "__main__":
    main()
