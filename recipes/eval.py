"""`python -m recipes.eval ckpt=RUN_DIR|CKPT|HF_DIR [split=val|test] [out=FILE] [data.KEY=VALUE ...]
[task.KEY=VALUE ...]`: a trained
model's metrics on a held-out split, as the training loop computes them.

The weights are the run's exported model.safetensors (the best checkpoint's by default) or the given
checkpoints/step_* folder. The evaluation is the loop's own (`core.loop.evaluation`): the run's device plan
and
precision, its evaluation batch size and order (and debug limit on validation batches, if it set one), the
task's preprocessing, so the same weights reproduce the loop's validation numbers exactly (a compiled run's
within float rounding: this evaluates eagerly). The metrics go to RUN_DIR/eval.json (or `out`) and, as one
JSON line, to stdout. `split=` picks another held-out split where the dataset has one (data=espeak_words:
test); `data.KEY=VALUE` evaluates on other data, e.g. data.root=DIR for data=imagefolder (DIR/train and
DIR/val, with the run's classes). `task.KEY=VALUE` scores the same weights another way where the task has
inference settings, e.g. task.decoder=beam_lm for a speech run. `data=NAME` picks another dataset.

HF_DIR is a Hugging Face Llama/Qwen2/Qwen3 folder (config.json, safetensors, tokenizer.json), evaluated as the
lm task with its own tokenizer on the data the overrides name, e.g. `data=text_files data.root=DIR
task.context=512`; the metrics go to HF_DIR/eval.json unless `out` says otherwise.

A speech run's WER and CER come raw and after Whisper's English normaliser (`val/wer_normalized`,
`val/cer_normalized`), and each utterance's reference, hypothesis and errors go to eval_utterances.jsonl
beside the metrics file (`out`'s name + _utterances.jsonl).

`harness.tasks=[TASK,...]` scores a text run or an HF folder on lm-evaluation-harness tasks instead (the
`eval` extra; `text.harness`): the embedded benchmarks (group kjv, `text.benchmarks`) and the task YAMLs
of `harness.include=[DIR,...]`, whose data must be local files (nothing downloads); `harness.limit`,
`harness.num_fewshot`, `harness.apply_chat_template`, `harness.batch_size`. lm-eval's results JSON goes
to OUT/results_DATE.json (OUT: `out=DIR`, else RUN_DIR/eval/harness) and its table to stdout; under
torchrun each rank scores a share of the requests.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from core.bounds import bounds_of
from core.distributed.env import dist_env
from core.distributed.group import start, stop
from core.errors import ConfigError, DataError
from core.files import write_text_atomic
from core.loop.evaluation import eval_loader, evaluate
from core.loop.trainer import TrainerConfig
from core.registry import DATASETS
from core.rng import seed_everything
from recipes.cli.command import command
from recipes.cli.options import check, fields_of, help_text, parse_args, require
from recipes.cli.runs import apply_overrides, is_hf_folder, load_run, run_config

USAGE = (
    "usage: python -m recipes.eval ckpt=RUN_DIR|CKPT [split=val|test] [out=FILE] [data.KEY=VALUE ...] "
    "[task.KEY=VALUE ...] | ckpt=RUN_DIR|HF_DIR harness.tasks=[TASK,...] [harness.KEY=VALUE ...]"
)
#: the data builder keyword that picks which held-out split a dataset returns (its Bounds list them)
SPLIT_KEY = "eval_split"


@dataclass
class EvalOptions:
    """The command's keys."""

    #: the training run directory (its model.safetensors), or one of its checkpoints/step_* folders
    ckpt: str = ""
    #: the held-out split to evaluate (val, or test where the dataset has one); empty: the run's own
    split: str = ""
    #: where the metrics go (JSON); empty: RUN_DIR/eval.json
    out: str = ""
    #: cpu, cuda, cuda:N, mps or auto; empty: the run's own device setting (the same numbers need it)
    device: str = ""
    #: fp32, bf16, fp16 or auto; empty: the run's own precision setting (an HF folder's: auto)
    precision: str = ""


@dataclass
class HarnessOptions:
    """The harness.* keys: a text run's benchmark tasks through lm-evaluation-harness (the `eval` extra)."""

    #: the lm-eval tasks, groups or tags to run, [NAME,...]; their data must be local files
    tasks: str = ""
    #: more folders of lm-eval task YAMLs, [DIR,...]
    include: str = ""
    #: at most this many documents per task (a fraction of each below 1); null: all of them
    limit: float | None = None
    #: few-shot examples per prompt; null: each task's own
    num_fewshot: int | None = None
    #: render each prompt in the run's chat template (an sft run's, or an HF folder's own)
    apply_chat_template: bool = False
    #: requests scored per forward
    batch_size: int = 16


#: the harness keys as the command line spells them
HARNESS = "harness."


def splits_of(data: dict[str, Any]) -> tuple[str, ...]:
    """The held-out splits a data section's dataset can return: its `eval_split` choices, else val."""
    bounds = bounds_of(DATASETS.get(data["name"])).get(SPLIT_KEY)
    return tuple(bounds.choices) if bounds is not None else ("val",)


def split_overrides(split: str, cfg: dict[str, Any], overrides: list[str]) -> tuple[str, list[str]]:
    """(the split evaluated, the data overrides that select it); a split the dataset lacks is a one-line
    DataError naming those it has."""
    data = apply_overrides(cfg, overrides)["data"]
    current = str(data.get(SPLIT_KEY, "val"))
    if not split or split == current:
        return current, overrides
    splits = splits_of(data)
    if split not in splits:
        raise DataError(
            f"split={split}: data={data['name']} has no such split; its held-out splits: {', '.join(splits)}"
        )
    if any(o.startswith(f"data.{SPLIT_KEY}=") for o in overrides):
        raise ConfigError(f"split={split} and data.{SPLIT_KEY} disagree; give one of them")
    return split, [*overrides, f"data.{SPLIT_KEY}={split}"]


def write_utterances(task: Any, ds: Any, loader: DataLoader, out: Path) -> dict[str, Any]:
    """A task that scores utterances (the ASR task): its evaluation's rows beside `out` (eval.json ->
    eval_utterances.jsonl: reference, hypothesis, errors, raw and normalised) and, for the result, that
    file with the counts summed over it; other tasks: nothing."""
    if not hasattr(task, "write_utterances"):
        return {}
    path = out.with_name(f"{out.stem}_utterances.jsonl")
    totals = task.write_utterances(path, ds, [i for batch in loader.batch_sampler for i in batch])
    return {"utterances": {"file": str(path), **totals}}


def run(argv: list[str]) -> int:
    """The command: evaluate, write the JSON file, print it as one line (harness.*: the benchmark tasks)."""
    fields = {**fields_of(EvalOptions), **{HARNESS + k: v for k, v in fields_of(HarnessOptions).items()}}
    values, overrides = parse_args(argv, fields, usage=USAGE, sections=("data", "task"))
    harness = {k.removeprefix(HARNESS): values.pop(k) for k in list(values) if k.startswith(HARNESS)}
    opts = EvalOptions(**check(values, EvalOptions))
    require(values, ("ckpt",), USAGE)
    if any(a.startswith(HARNESS) for a in argv):
        return run_harness(opts, HarnessOptions(**check(harness, HarnessOptions)), overrides)
    split, overrides = split_overrides(opts.split, run_config(opts.ckpt), overrides)
    loaded = load_run(
        opts.ckpt, device=opts.device, precision=opts.precision, overrides=overrides, command="recipes.eval"
    )
    cfg, task = loaded.cfg, loaded.task
    known = {f.name for f in dataclasses.fields(TrainerConfig)}
    trainer_cfg = TrainerConfig(**{k: v for k, v in cfg.get("trainer", {}).items() if k in known})
    seed = int(cfg.get("seed", 0))
    seed_everything(seed)
    ds = task.build_val_dataset()
    loader = eval_loader(task, ds, trainer_cfg, loaded.plan, seed)
    metrics = evaluate(task, loaded.model, loader, loaded.plan)
    result = {
        "ckpt": opts.ckpt,
        "weights": str(loaded.weights),
        "split": split,
        "examples": sum(len(b) for b in loader.batch_sampler),
        "overrides": overrides,
        "metrics": metrics,
    }
    out = Path(opts.out).expanduser() if opts.out else loaded.run_dir / "eval.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        result |= write_utterances(task, ds, loader, out)
        write_text_atomic(out, json.dumps(result, indent=1) + "\n")
    except OSError as e:
        raise DataError(f"cannot write {out} ({e.strerror or e}); choose another out=FILE") from None
    print(json.dumps({**result, "written": str(out)}), flush=True)
    return 0


def _names(value: str) -> list[str]:
    """The names of a list key, [a,b] or a,b."""
    return [n.strip() for n in value.strip().removeprefix("[").removesuffix("]").split(",") if n.strip()]


def _check_harness(opts: HarnessOptions) -> list[str]:
    """The task names; one-line ConfigError naming a harness key whose value cannot run."""
    tasks = _names(opts.tasks)
    bad = [
        ("tasks", opts.tasks, not tasks, "[TASK,...]"),
        (
            "limit",
            opts.limit,
            opts.limit is not None and opts.limit <= 0,
            "> 0 (below 1: a fraction), or null",
        ),
        ("num_fewshot", opts.num_fewshot, opts.num_fewshot is not None and opts.num_fewshot < 0, ">= 0"),
        ("batch_size", opts.batch_size, opts.batch_size < 1, ">= 1"),
    ]
    for key, value, wrong, valid in bad:
        if wrong:
            raise ConfigError(
                f"{HARNESS}{key}={value}: must be {valid}",
                key=HARNESS + key,
                value=str(value),
                valid=(valid,),
            )
    return tasks


def _chat_template(loaded: Any, ckpt: str) -> Any:
    """The chat template harness.apply_chat_template renders in: an sft run's, or an HF folder's own; a run
    with none is a one-line ConfigError."""
    from text.chat import ChatTemplate

    if is_hf_folder(ckpt):
        template = ChatTemplate.of_folder(ckpt)
        if template.origin != "ChatML":  # of_folder's stand-in for a folder without one
            return template
    elif getattr(loaded.task, "template", None) is not None:
        return loaded.task.template
    raise ConfigError(
        f"{HARNESS}apply_chat_template=true: ckpt={ckpt} has no chat template (an lm run's tokenizer asks "
        "in plain text); use an sft run or an HF folder with one, or leave the key out",
        key=HARNESS + "apply_chat_template",
        value="true",
        valid=("false",),
    )


def _harness_module() -> Any:
    """text.harness (one line naming the `eval` extra where lm-evaluation-harness is missing)."""
    import text.harness

    return text.harness


def _load_ranked(opts: EvalOptions, overrides: list[str]) -> Any:
    """The text run `opts.ckpt` names, loaded for harness.*: under torchrun on CUDA, on its rank's GPU (the
    device plan picks cuda:LOCAL_RANK for `auto` and `cuda`)."""
    return load_run(
        opts.ckpt,
        device=opts.device,
        precision=opts.precision,
        overrides=overrides,
        tasks=("lm", "sft", "dpo", "grpo", "distill"),
        command="recipes.eval harness.tasks=...",
    )


def run_harness(opts: EvalOptions, harness: HarnessOptions, overrides: list[str]) -> int:
    """harness.*: lm-eval's results of the run on local benchmark tasks, written as lm-eval writes them
    (OUT/results_DATE.json; OUT: out=DIR, else RUN_DIR/eval/harness) and printed as its table."""
    tasks = _check_harness(harness)
    module = _harness_module()
    from text.benchmarks import task_folder

    # the embedded benchmarks (group kjv) first, as lm-eval's own tasks come before an --include_path
    folders = [task_folder(), *(Path(d).expanduser() for d in _names(harness.include))]
    manager = module.task_manager(tasks, folders)  # every task checked before the model loads
    env = dist_env()
    loaded = _load_ranked(opts, overrides)
    template = _chat_template(loaded, opts.ckpt) if harness.apply_chat_template else None
    # under torchrun each rank scores its share of the requests; lm-eval gathers them on rank 0
    start(loaded.plan.device.type, env)
    try:
        lm = module.HarnessLM(
            loaded.model,
            loaded.task.tokenizer,
            loaded.plan,
            batch_size=harness.batch_size,
            chat_template=template,
        )
        results = module.evaluate_tasks(
            lm,
            tasks,
            manager,
            limit=harness.limit,
            num_fewshot=harness.num_fewshot,
            apply_chat_template=harness.apply_chat_template,
        )
    finally:
        stop()
    if results is None:  # a data-parallel rank other than 0: rank 0 writes
        return 0
    results["config"]["model"] = str(opts.ckpt)
    out = Path(opts.out).expanduser() if opts.out else loaded.run_dir / "eval" / "harness"
    file = out / f"results_{datetime.now().isoformat().replace(':', '-')}.json"  # lm-eval's name
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(file, module.results_json(results))
    except OSError as e:
        raise DataError(f"cannot write {file} ({e.strerror or e}); choose another out=DIR") from None
    print(module.results_table(results), flush=True)
    print(f"written: {file}", flush=True)
    return 0


def describe() -> str:
    """`--help`: the keys."""
    doc = __doc__.split("\n\n", 1)[1].strip()
    return help_text(USAGE, doc, [("keys", EvalOptions), ("harness keys (harness.KEY)", HarnessOptions)])


main = command(run, usage=USAGE, describe=describe)

if __name__ == "__main__":
    sys.exit(main())
