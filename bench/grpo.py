"""Where a GRPO step's time goes (issue #59 point 5): the share of one `+task=grpo` step spent generating,
scoring and training, from one run.

`PYTHONPATH=. python -m bench.grpo [--sizes small 125m] [--group-size 8] [--prompts 1] [--new-tokens 64]
[--steps 3] [--threads N]`

The task is `text.grpo.GroupRelativePolicyOptimization` at its defaults (dapo loss, one update per
generation, no KL, the exact_match reward) on the embedded `reverse` prompts with the bytes tokenizer; the
model is of random init: `small` is the `llama` preset (the decoder's default sizes), `125m` the `llama_125m`
preset's layers (the bytes vocabulary, not its 50,257 ids), `tiny` a 2-layer llama of width 32 for the smoke
test. A step is what the loop runs: `task.step` (which samples --group-size completions of each of --prompts
prompts, scores them and packs the rollout, then the policy's forward and loss), backward, and an AdamW step.
The phases are timed inside that one call by wrapping the task's own methods on the instance:
generating = `task.sample` (the KV-cached `text.generation.sample_rows`), scoring = `task.score` with
`task.completion_text` (decoding the completions), packing = the rest of `task.generate_rollout`
(advantages, `pack_rollout`), training = the rest of the step (forward, loss, backward, optimizer step).
Shares are of the summed wall time of --steps steps after one untimed step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.generate import load_average

#: --sizes: the model section of each
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"name": "llama", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "hidden": 64},
    "small": {"name": "llama"},
    "125m": {"name": "llama_125m"},
}
PHASES = ("generating", "scoring", "packing", "training")


def clocked(fn: Callable[..., Any], spent: dict[str, float], phase: str) -> Callable[..., Any]:
    """`fn`, adding the wall seconds each call takes to `spent[phase]`."""

    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - t0

    return run


def phase_seconds(size: str, args: argparse.Namespace) -> tuple[dict[str, float], float, int]:
    """Seconds of each phase summed over --steps steps of `size`, the mean completion length, parameters."""
    from core.optim import OptimConfig, build_optimizer
    from text.grpo import GroupRelativePolicyOptimization
    from text.prompts import collate_prompts

    task = GroupRelativePolicyOptimization(
        model=dict(SIZES[size]),
        data={"name": "prompts", "count": 40},
        group_size=args.group_size,
        max_new_tokens=args.new_tokens,
    )
    torch.manual_seed(0)
    model = task.build_model().train()
    opt = build_optimizer(model, OptimConfig(lr=1e-6))
    rows = task.build_datasets()[0].rows
    spent = dict.fromkeys(("generating", "scoring", "rollout", "step"), 0.0)
    task.sample = clocked(task.sample, spent, "generating")
    task.score = clocked(task.score, spent, "scoring")
    task.completion_text = clocked(task.completion_text, spent, "scoring")
    task.generate_rollout = clocked(task.generate_rollout, spent, "rollout")
    lengths = []
    for i in range(args.steps + 1):
        if i == 1:  # the first step is a warm-up
            spent.update(dict.fromkeys(spent, 0.0))
            lengths.clear()
        batch = collate_prompts(rows[i * args.prompts : (i + 1) * args.prompts])
        t0 = time.perf_counter()
        out = task.step(model, batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        spent["step"] += time.perf_counter() - t0
        lengths.append(float(out.metrics["completion_length"]))
    phases = {
        "generating": spent["generating"],
        "scoring": spent["scoring"],
        "packing": spent["rollout"] - spent["generating"] - spent["scoring"],
        "training": spent["step"] - spent["rollout"],
    }
    return phases, sum(lengths) / len(lengths), sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Print, per model size, each phase's seconds per step and share of the step; return the shares."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["small", "125m"])
    for flag, default in (("--group-size", 8), ("--prompts", 1), ("--new-tokens", 64), ("--steps", 3)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--threads", type=int, default=0)  # 0: torch's default
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    import text  # noqa: F401  (registers the llama presets and the prompts data)

    print(
        f"GRPO step: {args.prompts} prompt(s) x group {args.group_size}, up to {args.new_tokens} new tokens, "
        f"fp32; torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load_average()}"
    )
    print("| model | params | mean completion tokens | step s | " + " | ".join(PHASES) + " |")
    print("|---|---|---|---|" + "---|" * len(PHASES))
    out = {}
    for size in args.sizes:
        phases, length, params = phase_seconds(size, args)
        total = sum(phases.values())
        shares = " | ".join(f"{phases[p] / args.steps:.3f} s, {phases[p] / total:.1%}" for p in PHASES)
        print(f"| {size} | {params / 1e6:.2f} M | {length:.1f} | {total / args.steps:.2f} | {shares} |")
        out[size] = {p: phases[p] / total for p in PHASES}
    print(f"load average {load_average()} at the end; {args.steps} steps after one untimed")
    return out


if __name__ == "__main__":
    main()
