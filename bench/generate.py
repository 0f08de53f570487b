"""Generation speed: time per new token of KV-cached decoding against a full forward per token (the path
before the cache), side by side in one process, at the LM recipe's default model on CPU.

`PYTHONPATH=. python -m bench.generate [--new-tokens 200] [--repeats 5] [--threads N] [OVERRIDE ...]`

The model is the one `+task=lm` builds (conf/task/lm.yaml and conf/model/gpt.yaml, plus any Hydra-style
OVERRIDEs such as task.context=512) with random weights: speed does not depend on the weights, and greedy
decoding with no end-of-document token makes every path produce exactly --new-tokens tokens. The paths run
round robin, their order rotating each round, so a busy host's drift reaches each alike; per-token time is a
generate call's wall time (prefill included) over the new tokens, and each ratio is a median of the per-round
ratios against the full forward of the same round. The process's CPU time per token is printed too: on a busy
host it leaves out the time other processes held the cores (not their effect on the caches).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from recipes.cli.config import CONF_DIR, register_configs
from recipes.cli.tasks import build_task
from text.generation import generate

PROMPT = "In the beginning God created the heaven and the earth."


def lm_task(overrides: list[str]) -> tuple[Any, DictConfig]:
    """The `+task=lm` recipe's task and config, composed from conf/ with `overrides` (bench.data's too)."""
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("train", overrides=["+task=lm", *overrides])
    finally:
        GlobalHydra.instance().clear()
    return build_task(cfg), cfg


def lm_default_model(overrides: list[str]) -> tuple[torch.nn.Module, list[int]]:
    """The `+task=lm` recipe's model (random weights, eval mode) and the prompt's ids as the task feeds it."""
    task, _ = lm_task(overrides)
    torch.manual_seed(0)
    model = task.build_model().eval()
    return model, [task.tokenizer.eos_id, *task.tokenizer.encode(PROMPT)]


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    """Print the model's shape, then ms per token for each path and its speed-up over the first path (the
    full forward per token over the last `context` tokens, as generation ran before the cache)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, prompt_ids = lm_default_model(args.overrides)
    prompt, n, context = torch.tensor(prompt_ids), args.new_tokens, model.context
    base, sliding = "full forward, last `context` tokens (before the cache)", "full forward, default window"
    # name: (generate options, the path whose tokens it must reproduce); the default window keeps half
    paths = {
        base: ({"use_cache": False, "overflow_keep": context}, base),
        "KV cache, exact window (overflow_keep=context)": ({"overflow_keep": context}, base),
        sliding: ({"use_cache": False}, sliding),
        "KV cache, default window": ({}, sliding),
    }
    params = sum(p.numel() for p in model.parameters())
    print(
        f"GPT {len(model.blocks)} layers x {model.blocks[0].n_head} heads x {model.tok_emb.embedding_dim} "
        f"wide, context {context}, vocabulary {model.tok_emb.num_embeddings}, {params / 1e6:.2f} M params; "
        f"prompt {len(prompt_ids)} tokens + {n} new, greedy; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {load_average()} at the start"
    )
    tokens: dict[str, list[int]] = {}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    generate(model, prompt, 8, temperature=0.0)  # warm-up: first-call allocations and kernel selection
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            out = generate(model, prompt, n, temperature=0.0, **paths[name][0]).tolist()
            seconds[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            tokens.setdefault(name, out)
    head = ["path", "ms/token, median (range)", "speed-up", "CPU ms/token", "CPU speed-up"]
    print("| " + " | ".join(head) + f" | same {n} tokens as |")
    print("|---|---|---|---|---|---|")
    for name, (_, ref) in paths.items():
        same = "itself" if ref == name else ("yes: " if tokens[name] == tokens[ref] else "NO: ") + ref
        cells = []
        for times in (seconds, cpu):
            ms = [s * 1e3 / n for s in times[name]]
            ratio = statistics.median(b / s for b, s in zip(times[base], times[name], strict=True))
            cells.append(f"{statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) | {ratio:.1f}x")
        print(f"| {name} | {' | '.join(cells)} | {same} |")
    print(f"load average {load_average()} at the end; {args.repeats} rounds, order rotated each round")


if __name__ == "__main__":
    main()
