"""Activation checkpointing's memory and time: one GPT training step per mode, peak activation memory and
step time against `none`.

`python -m bench.activation_checkpointing` (default: 12 x 768, 12 heads, context 1024, batch 4, fp32, the
issue's LM shape; `--layers 2 --d-model 64 --heads 2 --context 64 --batch 2` checks it end to end in
seconds). The goal (issue 27): peak activation memory <= 45% of `none` at <= 1.35x its step time.

Method. Each mode runs in a process of its own (`--child`), so no mode inherits another's heap. There the
model (`text.gpt.GPT`, through `core.distributed.parallelize`) and AdamW take one warm-up step, which
allocates the gradients and moments; `zero_grad(set_to_none=False)` keeps them. What remains to measure is
what a step allocates on top, activations above all:
- CUDA: `torch.cuda.max_memory_allocated()` over the timed steps minus `memory_allocated()` before them
  (the caching allocator's own count of live tensor bytes);
- CPU: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) minus its resident set
  before the timed steps. glibc would otherwise keep freed blocks on its heap (its mmap threshold grows
  with use), so the child fixes `MALLOC_MMAP_THRESHOLD_` at 64 KiB: every tensor of that size or more is
  its own mapping, returned on free, and the resident set follows the live tensors.
Step time is the median over `--steps` timed steps (forward, backward, AdamW), after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("none", "full", "selective", "full:2")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}: the CPU measurement needs Linux")


def child(args: argparse.Namespace) -> dict[str, float]:
    """One mode's warm-up and timed steps; returns its peak activation MiB and median step seconds."""
    import torch
    import torch.nn.functional as F

    from core.device import resolve
    from core.distributed import MeshShape
    from core.distributed.parallelize import parallelize
    from text.gpt import GPT

    # the device the plan picks (CUDA where there is one), unless --cpu; measure=False: no precision probe
    device = torch.device("cpu") if args.cpu else resolve(measure=False).device
    mode, _, every = args.child.partition(":")
    torch.manual_seed(0)
    model = GPT(
        vocab_size=258, context=args.context, n_layer=args.layers, n_head=args.heads, d_model=args.d_model
    ).to(device)
    model = parallelize(model, MeshShape(), activation_checkpointing=mode, checkpoint_every=int(every or 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 258, (args.batch, args.context + 1), generator=gen).to(device)

    def step() -> None:
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay allocated: part of the baseline

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()
    sync()
    if device.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_kib("VmHWM") * 1024
    return {"peak_mib": (peak - base) / 2**20, "step_s": statistics.median(times), "device": device.type}


def main(argv: list[str] | None = None) -> None:
    """Run every mode in its own process and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode, after one warm-up step")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated; MODE:N checkpoints every N-th")
    p.add_argument("--cpu", action="store_true", help="measure on the CPU even where CUDA is present")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    shape = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ("layers", "d-model", "heads", "context")]
    shape += [f"--batch={args.batch}", f"--steps={args.steps}"] + (["--cpu"] if args.cpu else [])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    results = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, "-m", "bench.activation_checkpointing", *shape, f"--child={mode}"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{mode}: {proc.stderr.strip().splitlines()[-1]}")
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    first = next(iter(results.values()))
    print(
        f"GPT {args.layers} x {args.d_model}, {args.heads} heads, context {args.context}, batch "
        f"{args.batch}, fp32 on {first['device']}; peak = memory a training step adds above weights, "
        "gradients and AdamW"
    )
    ref = results.get("none")
    print(f"{'mode':<12}{'peak MiB':>10}{'of none':>9}{'step s':>9}{'of none':>9}")
    for mode, r in results.items():
        mem = f"{r['peak_mib'] / ref['peak_mib']:.0%}" if ref and ref["peak_mib"] > 0 else "-"
        time_ratio = f"{r['step_s'] / ref['step_s']:.2f}x" if ref else "-"
        print(f"{mode:<12}{r['peak_mib']:>10.1f}{mem:>9}{r['step_s']:>9.3f}{time_ratio:>9}")
    print("goal (issue 27): peak <= 45% of none at <= 1.35x its step time")


if __name__ == "__main__":
    main()
