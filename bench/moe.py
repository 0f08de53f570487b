"""Mixture-of-experts training speed (text/moe.py): the grouped experts (`torch._grouped_mm` over tokens
sorted by expert) against a loop over the experts' slices, and against a dense decoder of equal active
parameters (the same blocks with a SwiGLU of experts_per_token x expert_hidden units in place of the
experts), forward + backward tokens/s, fp32 on the CPU.

`python -m bench.moe [--experts 8,32 --top-k 2 --threads 1 --repeats 7]`: for each expert count, the three
models share every size but the feed-forward (--d-model 256, --layers 4, 8 heads, expert width
--expert-hidden); each repeat times one forward + backward of a batch of --batch x --context tokens per
model, round-robin, so drift on a shared host falls on all three alike; the median per model and the
ratios of the medians are printed as a Markdown table, one run giving every ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import text  # noqa: F401  (registers the decoders)
from core.registry import MODELS
from text.moe import active_parameters, grouped_mm_works, moe_layers

HEADER = "| experts (top-k) | model | active params | tokens/s | vs grouped | tokens/CPU-s | vs grouped |"


def build(path: str, args: argparse.Namespace, experts: int) -> torch.nn.Module:
    """The bench's decoder: MoE with the experts run `path` ("grouped", "loop"), or "dense"."""
    sizes = {"vocab_size": 256, "context": args.context, "n_layer": args.layers, "n_head": 8}
    sizes |= {"d_model": args.d_model, "n_kv_head": 4}
    if path == "dense":
        sizes |= {"n_experts": 0, "hidden": args.top_k * args.expert_hidden}
    else:
        sizes |= {"n_experts": experts, "experts_per_token": args.top_k, "expert_hidden": args.expert_hidden}
    torch.manual_seed(0)
    model = MODELS.build("qwen3_moe", **sizes).train()
    for layer in moe_layers(model):
        layer.experts.path = path
    return model


def step_seconds(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, float]:
    """One forward + backward of `tokens` (next-token loss): (wall seconds, this process's CPU seconds).
    On a host other jobs load, the CPU time is the steadier measure of the work."""
    t0, c0 = time.perf_counter(), time.process_time()
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    """Time the three models per expert count and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", default="8,32", help="expert counts, comma-separated")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--expert-hidden", type=int, default=256, help="gated units of each expert")
    p.add_argument("--d-model", type=int, default=256, help="width of every model (8 heads)")
    p.add_argument("--layers", type=int, default=4, help="blocks of every model")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7, help="timed steps per model (after one warm-up)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"command: python -m bench.moe {' '.join(sys.argv[1:])}")
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    grouped = grouped_mm_works(torch.device("cpu"), torch.float32, args.d_model, args.expert_hidden)
    print(f"torch._grouped_mm for fp32 on this CPU: {'works' if grouped else 'refused (grouped = loop)'}")
    print(HEADER)
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.context + 1), generator=g)
    n = args.batch * args.context
    for experts in (int(e) for e in args.experts.split(",")):
        models = {path: build(path, args, experts) for path in ("grouped", "loop", "dense")}
        times: dict[str, list[tuple[float, float]]] = {path: [] for path in models}
        for model in models.values():
            step_seconds(model, tokens)  # warm-up: allocator, the grouped_mm probe
        for _ in range(args.repeats):
            for path, model in models.items():
                times[path].append(step_seconds(model, tokens))
        for path, model in models.items():
            row = [f"{experts} ({args.top_k})", path, f"{active_parameters(model) / 1e6:.2f} M"]
            for i in (0, 1):  # wall, then CPU
                rate = {k: n / statistics.median(t[i] for t in v) for k, v in times.items()}
                row += [f"{rate[path]:.0f}", f"{rate[path] / rate['grouped']:.2f}x"]
            print("| " + " | ".join(row) + " |", flush=True)
    print(f"load after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
