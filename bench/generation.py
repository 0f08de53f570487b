"""Generation throughput against transformers (issue #59 point 5): new tokens per second of torchkiln's
KV-cached generator (`text.generation.greedy_rows`, the batched loop GRPO samples with) against
transformers' `generate` on the same weights and the same batch, side by side in one process.

`PYTHONPATH=. python -m bench.generation [--batches 1 8] [--new-tokens 128] [--prompt 32] [--repeats 3]
[--threads N] [--precisions fp32 bf16]`

The model is the `llama_125m` preset (12 layers x 768, 50,257 ids, tied head) as a new user meets it:
transformers builds a `LlamaForCausalLM` of that config with random weights and saves it as a Hugging Face
folder; `model.weights=FOLDER` (`text.pretrained.build_llama`) loads ours from it. Each batch holds
--prompt random ids a row; decoding is greedy with no end of text, so both sides make exactly --new-tokens
a row (their ids are compared in fp32). bf16 is autocast on both sides (ours under the run's device plan,
`core.device`), the weights fp32. A side's time is one whole generate call (prefill included); after one
untimed call each, the sides alternate, the order rotating each round; medians over rounds. The ratio is
ours over transformers' tokens/s (above 1: ours is faster); the last column is the same ratio of tokens per
CPU second of the process, steadier on a busy host (with one thread it leaves out the time others held it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.generate import load_average

PRESET, VOCAB, CONTEXT = "llama_125m", 50257, 512


def save_reference(folder: Path) -> Any:
    """transformers' LlamaForCausalLM of the preset's config, random weights (seed 0), saved to `folder`."""
    import transformers

    from core.registry import MODELS
    from text.checkpoints.hf import config_for

    config = config_for(MODELS.build(PRESET, vocab_size=VOCAB, context=CONTEXT))
    config.pop("architectures", None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="sdpa"))
    model.generation_config.eos_token_id = None  # no end of text: every row makes its --new-tokens
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return model.eval()


def sides(folder: Path, reference: Any, new_tokens: int) -> dict[str, Callable[[torch.Tensor], list]]:
    """Each side's greedy generate: batch ids (B, L) -> the new ids of each row."""
    from text.generation import greedy_rows
    from text.pretrained import build_llama

    ours = build_llama(weights=str(folder), vocab_size=VOCAB, context=CONTEXT).eval()

    def torchkiln(ids: torch.Tensor) -> list:
        return greedy_rows(ours, ids.tolist(), new_tokens)

    def transformers(ids: torch.Tensor) -> list:
        # as its users call it: generate runs under its own no_grad
        out = reference.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return out[:, ids.shape[1] :].tolist()

    return {"torchkiln greedy_rows": torchkiln, "transformers generate": transformers}


def measure(
    run: dict[str, Callable], ids: torch.Tensor, autocast: Any, repeats: int
) -> dict[str, tuple[float, float]]:
    """Median (tokens per wall second, per CPU second of this process) of each side on `ids` under
    `autocast`, over `repeats` rotated rounds after a warm-up; the ids each side made are compared
    (printed) too. On a busy host the CPU time leaves out the time other processes held the cores."""
    names = list(run)
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in run}
    made = {}
    for name in names:
        with autocast():
            made[name] = run[name](ids)
    for r in range(repeats):
        for name in names[r % 2 :] + names[: r % 2]:
            with autocast():
                t0, c0 = time.perf_counter(), time.process_time()
                tokens = sum(len(row) for row in run[name](ids))
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            rates[name].append((tokens / wall, tokens / cpu))
    same = made[names[0]] == made[names[1]]
    print(f"  same ids: {same}" if same else "  ids differ (expected only under bf16 rounding)")
    return {name: tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for name, v in rates.items()}


def main() -> None:
    """Print the model and host, then tokens/s of each side per precision and batch, and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    for flag, default in (("--new-tokens", 128), ("--prompt", 32), ("--repeats", 3), ("--threads", 0)):
        ap.add_argument(flag, type=int, default=default)  # --threads 0: torch's default
    args = ap.parse_args()
    from core.device import resolve

    folder = Path(tempfile.mkdtemp(prefix="bench-generation-")) / "hf"
    reference = save_reference(folder)
    run = sides(folder, reference, args.new_tokens)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    params = sum(p.numel() for p in reference.parameters())
    print(
        f"{PRESET}: {params / 1e6:.1f} M params, prompt {args.prompt} + {args.new_tokens} greedy tokens; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load_average()}"
    )
    rows = []
    for precision in args.precisions:
        autocast = resolve("cpu", precision).autocast
        for batch in args.batches:
            ids = torch.randint(
                1, VOCAB, (batch, args.prompt), generator=torch.Generator().manual_seed(batch)
            )
            print(f"{precision} batch {batch}:")
            rates = measure(run, ids, autocast, args.repeats)
            rows.append((precision, batch, *rates.values()))
    sides_ = " | ".join(f"{name} tokens/s" for name in run)
    print(f"| precision | batch | {sides_} | ratio | ratio of tokens per CPU second |")
    print("|---|---|---|---|---|---|")
    for precision, batch, ours, theirs in rows:
        wall, cpu = ours[0] / theirs[0], ours[1] / theirs[1]
        print(f"| {precision} | {batch} | {ours[0]:.1f} | {theirs[0]:.1f} | {wall:.2f}x | {cpu:.2f}x |")
    print(f"load average {load_average()} at the end; {args.repeats} rounds, order rotated each round")


if __name__ == "__main__":
    main()
