"""Training-step speed under a background load: what slows 2-thread runs on a shared 2-core host.

Each cell is a fresh process (OpenMP reads its wait policy once, at start) timing eager training steps of a
small GPT (forward, backward, AdamW) at a thread count and an OpenMP wait policy, while N background
processes spin at normal priority: `spin` is a pure-Python loop (CPU time only), `stream` a NumPy copy loop
over 64 MB arrays (CPU time and memory bandwidth). Cells are interleaved round by round so every column sees
the same host; the table gives the median ms/step and each cell's ratio to 1 thread of the same load.

`PYTHONPATH=. python -m bench.load [--rounds 3] [--steps 12] [--loads none,spin,stream]`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

#: background loads: name -> the one-process program each of `--busy` copies runs
LOADS = {
    "none": None,
    "spin": "while True: pass",
    "stream": "import numpy as np\na = np.ones(8 << 20); b = np.empty_like(a)\nwhile True: np.copyto(b, a)",
}

_STEP = """
import json, statistics, sys, time, torch
from text.gpt import GPT
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[1]))
model = GPT(vocab_size=256, context=128, n_layer=4, n_head=4, d_model=256)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, 256, (8, 128))
times = []
for i in range(int(sys.argv[2]) + 2):
    t0 = time.perf_counter()
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i >= 2:  # the first steps allocate and warm oneDNN's primitive cache
        times.append(time.perf_counter() - t0)
print(json.dumps({"ms": 1000 * statistics.median(times)}))
"""


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:4])


@contextlib.contextmanager
def background(load: str, busy: int) -> Iterator[None]:
    """`busy` processes running `LOADS[load]` at normal priority until the block ends."""
    code = LOADS[load]
    procs = [] if code is None else [subprocess.Popen([sys.executable, "-c", code]) for _ in range(busy)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def cell(threads: int, policy: str, steps: int) -> float:
    """Median ms per training step in a fresh process with `threads` threads and OMP_WAIT_POLICY `policy`."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    env.pop("OMP_NUM_THREADS", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", _STEP, str(threads), str(steps)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return float(json.loads(out.stdout.strip().splitlines()[-1])["ms"])


def main() -> None:
    """Print one row per (load, threads, policy) with its median ms/step and ratio to 1 thread."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--busy", type=int, default=1, help="background processes per loaded column")
    ap.add_argument("--loads", default="none,spin,stream")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--policies", default="default,passive")
    args = ap.parse_args()
    loads = args.loads.split(",")
    cells = [(t, p) for t in map(int, args.threads.split(",")) for p in args.policies.split(",")]
    print(f"{os.cpu_count()} CPUs, loadavg before {_loadavg()}, {args.busy} background process(es) per load")
    ms: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for load in loads:
            with background(load, args.busy):
                for t, p in cells:
                    ms.setdefault((load, t, p), []).append(cell(t, p, args.steps))
    print(f"loadavg after {_loadavg()}")
    print(f"{'load':<8} {'threads':>7} {'wait policy':>12} {'ms/step':>9} {'vs 1 thread':>12}")
    for load in loads:
        base = statistics.median(ms[(load, 1, "default")]) if (load, 1, "default") in ms else None
        for t, p in cells:
            m = statistics.median(ms[(load, t, p)])
            ratio = f"{base / m:.2f}x" if base else "-"
            print(f"{load:<8} {t:>7} {p:>12} {m:>9.1f} {ratio:>12}")


if __name__ == "__main__":
    main()
