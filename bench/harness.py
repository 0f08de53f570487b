"""Benchmark-eval throughput: requests per second of torchkiln's lm-eval adapter (`text.harness.HarnessLM`)
against lm-eval's own Hugging Face model (`HFLM`) on the same Hugging Face folder and the same local tasks,
side by side in one process.

`PYTHONPATH=. python -m bench.harness [--docs 200] [--batch-size 32] [--repeats 3] [--threads N] [OVERRIDE]`

The model is the one `+task=lm model=llama` builds (plus Hydra-style OVERRIDEs such as task.context=256) with
random weights, written as the folder `recipes.export format=hf` writes; both sides score it in fp32 on the
CPU. The tasks are `write_tasks`' made-up local rows (a multiple-choice task of --docs documents x 3 choices,
a generate_until task and a loglikelihood_rolling task of --docs/10 each). Each side runs lm-eval's
`simple_evaluate` on all three; a request type's time is its model calls' wall time (what the evaluator
spends in `loglikelihood`, `generate_until`, `loglikelihood_rolling`); after one untimed round each, the
sides alternate, the order rotating each round, so a busy host's drift reaches each alike. Medians over
rounds; the ratio is ours/HFLM's requests per second (above 1: the adapter is faster); `all` is every
request over the three calls' time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.generate import lm_task, load_average

#: the model interface's request types, as lm-eval names its calls
REQUEST_TYPES = ("loglikelihood", "generate_until", "loglikelihood_rolling")


def write_tasks(folder: Path, docs: int = 6) -> Path:
    """Three lm-eval task YAMLs over made-up local JSONL rows in `folder` and the group tiny_all of them:
    tiny_mc (multiple choice, `docs` documents x 3 choices), tiny_gen (generate_until, until "." or 8 new
    tokens) and tiny_ppl (loglikelihood_rolling over texts longer than a 32-token context), each of the
    last two max(2, docs // 10) documents; `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    few = max(2, docs // 10)
    words = ("light", "a firmament", "lights", "grass")
    rows = {
        "mc": [
            {
                "question": f"Day {i}: which came first?",
                "choices": ["light", "darkness", "the waters"],
                "answer": i % 3,
            }
            for i in range(docs)
        ],
        "gen": [
            {"question": f"And God said, let there be {words[i % 4]}", "answer": " light"} for i in range(few)
        ],
        "ppl": [
            {"text": f"Day {i}. In the beginning God created the heaven and the earth."} for i in range(few)
        ],
    }
    for name, items in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    common = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n    test: {file}\n"
    specs = {
        "mc": 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n',
        "gen": 'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
        "ppl": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
    }
    for name, spec in specs.items():
        head = f"task: tiny_{name}\n" + common.format(file=folder / f"{name}.jsonl")
        (folder / f"tiny_{name}.yaml").write_text(head + spec)
    (folder / "tiny_all.yaml").write_text("group: tiny_all\ntask: [tiny_mc, tiny_gen, tiny_ppl]\n")
    return folder


def write_model(folder: Path, overrides: list[str]) -> tuple[Any, Any]:
    """(the random-weight `+task=lm model=llama` model, its tokenizer), written to `folder` as format=hf."""
    from text.checkpoints.hf import write_folder
    from text.tokenizer import write_hf_tokenizer

    task, _ = lm_task(["model=llama", *overrides])
    torch.manual_seed(0)
    model = task.build_model().eval()
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_hf_tokenizer(task.tokenizer, folder, context=model.context)
    write_folder(model, folder, base_config=ids)
    return model, task.tokenizer


def timed(lm: Any, seconds: dict[str, float], counts: dict[str, int]) -> Any:
    """`lm` with each request type's call timed into `seconds` and counted into `counts`."""

    def wrap(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(requests: list[Any], *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = call(requests, *args, **kwargs)
            seconds[name] += time.perf_counter() - t0
            counts[name] += len(requests)
            return out

        return run

    for name in REQUEST_TYPES:
        setattr(lm, name, wrap(name, getattr(lm, name)))
    return lm


def main() -> None:
    """Print the model and host, then requests/s of each side per request type and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--docs", 200), ("--batch-size", 32), ("--repeats", 3), ("--threads", 0)):
        ap.add_argument(flag, type=int, default=default)  # --threads 0: torch's default
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from lm_eval.models.huggingface import HFLM

    from core.device import resolve
    from text.harness import HarnessLM, evaluate_tasks, task_manager

    root = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    model, tok = write_model(root / "hf", args.overrides)
    manager = task_manager(["tiny_all"], [write_tasks(root / "tasks", args.docs)])
    plan = resolve("cpu", "fp32")
    plan.apply()  # the run's plan sets the thread count: --threads after it
    torch.set_num_threads(args.threads or torch.get_num_threads())
    sides = {
        "torchkiln HarnessLM": HarnessLM(model, tok, plan, batch_size=args.batch_size),
        "lm-eval HFLM": HFLM(
            pretrained=str(root / "hf"), dtype="float32", device="cpu", batch_size=args.batch_size
        ),
    }
    params = sum(p.numel() for p in model.parameters())
    print(
        f"Llama {len(model.blocks)} layers x {model.config.d_model} wide, context {model.context}, "
        f"{params / 1e6:.2f} M params, fp32 CPU, batch {args.batch_size}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {load_average()} at the start"
    )
    rates: dict[str, dict[str, list[float]]] = {s: {r: [] for r in (*REQUEST_TYPES, "all")} for s in sides}
    names = list(sides)
    for lm in sides.values():  # warm-up: first-call allocations, kernel selection, the datasets cache
        evaluate_tasks(lm, ["tiny_all"], manager)
    for r in range(args.repeats):
        for side in names[r % 2 :] + names[: r % 2]:
            seconds, counts = dict.fromkeys(REQUEST_TYPES, 0.0), dict.fromkeys(REQUEST_TYPES, 0)
            evaluate_tasks(timed(sides[side], seconds, counts), ["tiny_all"], manager)
            for kind in REQUEST_TYPES:
                rates[side][kind].append(counts[kind] / seconds[kind])
            rates[side]["all"].append(sum(counts.values()) / sum(seconds.values()))
    print("| request type | " + " | ".join(f"{s} requests/s" for s in names) + " | ratio |")
    print("|---|---|---|---|")
    counts["all"] = sum(counts.values())
    for kind in (*REQUEST_TYPES, "all"):
        ours, theirs = (statistics.median(rates[s][kind]) for s in names)
        print(f"| {kind} ({counts[kind]}) | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")
    print(f"load average {load_average()} at the end; {args.repeats} rounds, order rotated each round")


if __name__ == "__main__":
    main()
