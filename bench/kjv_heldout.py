"""The LLM pipeline's "which book holds this verse?" yardstick (issue #59 point 2, docs/llm.md § RL with
verifiable rewards): greedy exact match of Hugging Face folders on every held-out KJV question, answer by
answer, and how two models differ on the same questions, so a gap between two runs is read with its
significance rather than from two accuracies.

`PYTHONPATH=. python -m bench.kjv_heldout NAME=FOLDER [NAME=FOLDER|NAME=ANSWERS.json ...] [--split val|train]
[--count N] [--precision bf16|fp32] [--out DIR] [--all-pairs] [--threads N] [--group G]`

- The questions are the embedded prompts +task=grpo trains on (`data=prompts data.embedded=kjv`): --split
  val (default) with --count 20000 (default for val) is every held-out verse of the five books no longer than
  150 characters (543), the held-out split every pipeline run shares (it is chosen by a hash of the verse's
  reference); --split train with --count 2000 (default for train) is the 1,617 training prompts the
  pipeline's runs train on (`experiment=llm_grpo`'s data.count).
- Each FOLDER (a `recipes.export format=hf` folder of a run trained with the bytes tokenizer, as the
  pipeline's are) answers each question greedily with up to 24 new tokens, through +task=grpo's own sampler
  and exact_match reward (`text.grpo`), so its accuracy is what the run's val/reward reports on the same
  questions (`recipes.eval ckpt=RUN data.count=20000 task.eval_questions=1000`). --precision bf16 (default)
  is autocast on the CPU, what precision=auto picked for the KJV runs on the Zen 4 host (BENCHMARKS.md).
- A FOLDER that is a run's own export (RUN/export/hf, from `recipes.export ckpt=RUN`) holds the run's
  checkpoint best by its monitored metric, for the KJV runs val/reward on the first 180/200 of the val
  split scored here; where that is not the run's last checkpoint a note on stderr names both and the
  command exporting the last (`best_not_last`), since a score on the questions that chose it flatters it.
- --out DIR writes each model's answers to DIR/NAME.json; NAME=ANSWERS.json reads such a file back, so
  models scored once are compared again without their folders.
- Printed: per model, the right answers, the exact match and its standard error, recall per book and its
  mean over the books asked (the exact match were each book asked equally often), how often each book is
  said; the mean probability of each book's whole answer (its name and the end of turn,
  teacher-forced as training scores it), by the verse's book: a soft confusion matrix, what sampling at
  temperature 1 draws; the right answer's probability, over all questions, is the expected reward of one
  such sample (GRPO's objective), the chance that a group of --group samples holds the right answer (1 -
  (1 - p)^G per question, by the verse's book: whether GRPO's groups have an answer to learn from), the
  mass on no book's answer (samples that score 0 whatever the verse), and the gradients of that reward
  and of the log-likelihood on each answer's logit, summed over the questions (`answer_gradients`), say
  which answers each objective pushes up; then, per pair (each against the first named; --all-pairs:
  every pair), the paired counts (both right, only one, neither), McNemar's z = (b - c) / sqrt(b + c) on
  the discordant answers and its exact two-sided p (the binomial test of b of b + c at 1/2).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.generate import load_average
from core.checkpoint import complete_checkpoints

BOOKS = ("Genesis", "Psalms", "Proverbs", "Matthew", "Revelation")
#: --count's default per split: every held-out verse; the pipeline's training prompts (llm_grpo's data.count)
COUNTS = {"val": 20000, "train": 2000}
#: the answer's new tokens at most: a book name and the end of turn (llm_grpo's task.max_new_tokens)
MAX_NEW_TOKENS = 24
#: --group's default: completions sampled per prompt (llm_grpo's task.group_size)
GROUP = 8


class BenchInputError(ValueError):
    """A bad NAME=PATH argument: printed as one line, exit 2."""


def answers(folder: str, split: str, count: int, precision: str, batch: int = 64) -> list[dict[str, Any]]:
    """Each question of `split` answered greedily by the HF `folder`: {prompt, answer, said, ok, p (each
    book's whole answer's probability)}."""
    import text  # noqa: F401  (registers the llama presets and the prompts data)
    from text.grpo import GroupRelativePolicyOptimization

    task = GroupRelativePolicyOptimization(
        model={"name": "llama", "weights": folder},
        data={"name": "prompts", "embedded": "kjv", "count": count},
        context=256,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    model = task.build_model().eval()
    train, val = task.build_datasets()
    rows = (val if split == "val" else train).rows
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    end = task.template.end_of_turn()
    books = [task.tokenizer.encode(book + end) for book in BOOKS]
    out: list[dict[str, Any]] = []
    with torch.no_grad(), autocast:
        for start in range(0, len(rows), batch):
            part = rows[start : start + batch]
            greedy = task.sample(model, part, torch.Generator(), group_size=1, temperature=0.0)
            said = [task.completion_text(ids) for ids in greedy.ids]
            ok = task.score(part, said, greedy.ids, 1)[:, 0].tolist()
            probs = answer_probs(model, [r.ids for r in part], books, task.tokenizer.pad_id)
            out += [
                {
                    "prompt": r.prompt,
                    "answer": r.fields["answer"],
                    "said": s,
                    "ok": bool(k),
                    "p": dict(zip(BOOKS, p.tolist(), strict=True)),
                }
                for r, s, k, p in zip(part, said, ok, probs, strict=True)
            ]
    return out


def answer_probs(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], candidates: Sequence[Sequence[int]], pad_id: int
) -> torch.Tensor:
    """(len(prompts), len(candidates)) fp32: each candidate answer's probability after each prompt,
    teacher-forced (`text.policy_gradient.token_logps` at temperature 1, as a training forward scores a
    completion)."""
    from text.policy_gradient import token_logps
    from text.rollouts import pack_rollout

    n = len(candidates)
    tokens, mask = pack_rollout(
        [p for p in prompts for _ in range(n)], list(candidates) * len(prompts), pad_id
    )
    logps = token_logps(model, tokens, 1.0)[0].float()
    return (logps * mask).sum(dim=-1).exp().view(len(prompts), n)


def paired(a: Sequence[bool], b: Sequence[bool]) -> dict[str, float]:
    """Paired counts of two models' right answers to the same questions, McNemar's z on the discordant ones
    (no continuity correction; 0 when none differ) and its exact two-sided p."""
    both = sum(x and y for x, y in zip(a, b, strict=True))
    only_a = sum(x and not y for x, y in zip(a, b, strict=True))
    only_b = sum(y and not x for x, y in zip(a, b, strict=True))
    n = only_a + only_b
    z = (only_a - only_b) / math.sqrt(n) if n else 0.0
    # the binomial test of only_a of n at 1/2, two-sided: twice the smaller tail, at most 1
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    return {
        "both": both,
        "only_a": only_a,
        "only_b": only_b,
        "neither": len(a) - both - n,
        "z": z,
        "p": min(1.0, 2 * tail),
    }


def summary(res: Sequence[dict[str, Any]], group: int = GROUP) -> dict[str, Any]:
    """Right answers, exact match and its standard error, recall per book, each answer's count, and where
    the answers files hold each book's probability, what sampling at temperature 1 draws (module
    docstring)."""
    right = sum(r["ok"] for r in res)
    acc = right / len(res)
    recall = {}
    for book in BOOKS:
        asked = [r["ok"] for r in res if r["answer"] == book]
        recall[book] = sum(asked) / len(asked) if asked else float("nan")
    asked_books = [v for v in recall.values() if not math.isnan(v)]
    said = collections.Counter(r["said"] if r["said"] in BOOKS else "other" for r in res)
    probs: dict[str, dict[str, float]] = {}
    sampled: dict[str, Any] = {}
    if all("p" in r for r in res):  # answers files of older runs may lack them
        for book in BOOKS:
            asked_p = [r["p"] for r in res if r["answer"] == book]
            if asked_p:
                probs[book] = {b: sum(p[b] for p in asked_p) / len(asked_p) for b in BOOKS}
        covered = {
            book: [1 - (1 - r["p"][book]) ** group for r in res if r["answer"] == book] for book in BOOKS
        }
        sampled = {
            "expected_reward": sum(r["p"][r["answer"]] for r in res) / len(res),
            "group_right": {
                **{book: sum(c) / len(c) for book, c in covered.items() if c},
                "all": sum(map(sum, covered.values())) / len(res),
            },
            "no_book": sum(max(0.0, 1 - sum(r["p"].values())) for r in res) / len(res),
            **answer_gradients(res),
        }
    return {
        "right": right,
        "questions": len(res),
        "exact_match": acc,
        "stderr": math.sqrt(acc * (1 - acc) / len(res)),
        "recall": recall,
        # the exact match were every book asked equally often: what the model tells apart, without the
        # questions' book shares (the 543 are 45% Psalms: always "Psalms" scores 0.448 there, 0.2 here)
        "mean_recall": sum(asked_books) / len(asked_books),
        "said": {name: said.get(name, 0) for name in (*BOOKS, "other")},
        "p": probs,
        **sampled,
    }


def answer_gradients(res: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Summed over the questions, the gradient on each book's answer logit, the five answers taken as one
    softmax (their probabilities renormalised): of the expected 0/1 reward of a sample at temperature 1
    (GRPO's objective without std scaling: q_b (1[b right] - q_right)) and of the right answer's
    log-likelihood (SFT's: 1[b right] - q_b). A book's sum is what a bias on its answer would move by."""
    reward = dict.fromkeys(BOOKS, 0.0)
    likelihood = dict.fromkeys(BOOKS, 0.0)
    for r in res:
        total = sum(r["p"][b] for b in BOOKS)
        q = {b: r["p"][b] / total for b in BOOKS}
        for b in BOOKS:
            right = float(b == r["answer"])
            reward[b] += q[b] * (right - q[r["answer"]])
            likelihood[b] += right - q[b]
    return {"reward_gradient": reward, "likelihood_gradient": likelihood}


def load_answers(path: Path) -> list[dict[str, Any]]:
    """Answers `--out` wrote (a list of {prompt, answer, said, ok})."""
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BenchInputError(f"{path}: not an answers file --out writes ({e})") from e
    keys = {"prompt", "answer", "said", "ok"}
    if not res or not isinstance(res, list) or not all(isinstance(r, dict) and keys <= set(r) for r in res):
        raise BenchInputError(
            f"{path}: not an answers file --out writes (a non-empty list of {{prompt, answer, said, ok}})"
        )
    return [{**r, "ok": bool(r["ok"])} for r in res]


def best_not_last(folder: Path) -> tuple[str, str] | None:
    """(the checkpoint a run's own export holds, the run's last checkpoint) where they differ: `folder` is
    RUN/export/hf written from RUN (its model.safetensors, the checkpoint best by the run's monitor, e.g.
    val/reward on the first questions of the val split this bench scores), not from a checkpoint."""
    export, run = folder.parent / "export.json", folder.parent.parent
    try:
        weights = Path(json.loads(export.read_text())["hf"]["weights"])
        best = Path(json.loads((run / "result.json").read_text())["exported"]).name
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a run's own export, or one without the run beside it: nothing to say
    steps = [p.name for p in complete_checkpoints(run / "checkpoints")]  # oldest first
    if weights.name != "model.safetensors" or not steps or steps[-1] == best:
        return None
    return best, steps[-1]


def score_all(specs: Sequence[str], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """NAME=FOLDER (scored here) or NAME=ANSWERS.json (read) for each spec, by name; every spec is checked
    and every file read before the first folder is scored (minutes each)."""
    folders: dict[str, Path] = {}
    read: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        name, sep, where = spec.partition("=")
        if not sep or not name or not where:
            raise BenchInputError(f"{spec!r}: give NAME=FOLDER or NAME=ANSWERS.json")
        if name in folders or name in read:
            raise BenchInputError(f"{name}: named twice; give each model its own NAME")
        path = Path(where)
        if path.is_file() and path.suffix == ".json":
            read[name] = load_answers(path)
        elif (path / "config.json").is_file():
            folders[name] = path
            picked = best_not_last(path) if args.split == "val" else None
            if picked:  # val/reward chose those weights on these questions: the score would flatter them
                print(
                    f"note: {name}={where} holds {picked[0]}, its run's best by the monitored metric on this "
                    f"split, not the last ({picked[1]}); to score the last: python -m recipes.export "
                    f"ckpt={path.parent.parent / 'checkpoints' / picked[1]} format=hf out=DIR",
                    file=sys.stderr,
                )
        else:
            raise BenchInputError(
                f"{name}={where}: neither a Hugging Face folder (no config.json) nor a .json file"
            )
    out: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:  # in the order named: the first is the pairs' baseline
        name = spec.partition("=")[0]
        out[name] = (
            read[name]
            if name in read
            else answers(str(folders[name]), args.split, args.count, args.precision)
        )
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.json").write_text(json.dumps(out[name]))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Score and compare the named models; print the tables; return {"models": ..., "pairs": ...}."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", metavar="NAME=FOLDER|NAME=ANSWERS.json")
    ap.add_argument("--split", choices=tuple(COUNTS), default="val")
    ap.add_argument("--count", type=int, default=0)  # 0: COUNTS[split]
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--all-pairs", action="store_true")
    ap.add_argument("--threads", type=int, default=0)  # 0: torch's default
    ap.add_argument("--group", type=int, default=GROUP)
    args = ap.parse_args(argv)
    args.count = args.count or COUNTS[args.split]
    torch.set_num_threads(args.threads or torch.get_num_threads())
    try:
        if args.group < 1:
            raise BenchInputError(f"--group {args.group}: give the completions sampled per prompt, 1 or more")
        scored = score_all(args.models, args)
        names = list(scored)
        first = scored[names[0]]
        for name in names[1:]:
            if [r["prompt"] for r in scored[name]] != [r["prompt"] for r in first]:
                raise BenchInputError(
                    f"{name}: its questions are not {names[0]}'s (score both with one --split and --count)"
                )
    except BenchInputError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    print(
        f"KJV 'which book' questions, {args.split} split (data.count={args.count}): {len(first)} questions; "
        f"{args.precision} on the CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"load average {load_average()}"
    )
    models = {name: summary(res, args.group) for name, res in scored.items()}
    print("| model | right | exact match (± s.e.) | recall: " + " / ".join(BOOKS) + " (mean) | said: "
          + " / ".join((*BOOKS, "other")) + " |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, s in models.items():
        recall = " / ".join(f"{s['recall'][b]:.2f}" for b in BOOKS) + f" ({s['mean_recall']:.3f})"
        said = " / ".join(str(s["said"][b]) for b in (*BOOKS, "other"))
        print(f"| {name} | {s['right']} | {s['exact_match']:.3f} ± {s['stderr']:.3f} | {recall} | {said} |")

    for name, s in models.items():
        if not s["p"]:
            continue
        print(f"\n{name}: mean probability of each whole answer, by the verse's book")
        print("| verse's book | " + " | ".join(BOOKS) + " |")
        print("|---|" + "---|" * len(BOOKS))
        for book, probs in s["p"].items():
            print(f"| {book} | " + " | ".join(f"{probs[b]:.3f}" for b in BOOKS) + " |")
        print(f"| expected reward at temperature 1 | {s['expected_reward']:.3f} |")
        covered = " / ".join(f"{s['group_right'].get(b, float('nan')):.2f}" for b in BOOKS)
        print(
            f"| one of {args.group} samples right, by the verse's book ({' / '.join(BOOKS)}) | {covered} "
            f"| all {s['group_right']['all']:.3f} |"
        )
        print(f"| a sample that is no book's answer | {s['no_book']:.3f} |")
        for key in ("reward_gradient", "likelihood_gradient"):
            print(
                f"| {key.replace('_', ' ')}, summed | "
                + " | ".join(f"{s[key][b]:+.1f}" for b in BOOKS)
                + " |"
            )

    pairs_of = itertools.combinations(names, 2) if args.all_pairs else ((names[0], n) for n in names[1:])
    pairs = {}
    for a, b in pairs_of:
        pairs[(a, b)] = paired([r["ok"] for r in scored[a]], [r["ok"] for r in scored[b]])
    if pairs:
        print("\n| A | B | both right | only A | only B | neither | McNemar z | exact p |")
        print("|---|---|---|---|---|---|---|---|")
        for (a, b), p in pairs.items():
            print(
                f"| {a} | {b} | {p['both']} | {p['only_a']} | {p['only_b']} | {p['neither']} "
                f"| {p['z']:.2f} | {p['p']:.3g} |"
            )
    return {"models": models, "pairs": pairs}


if __name__ == "__main__":
    main()
