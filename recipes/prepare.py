"""`python -m recipes.prepare +task=lm data.root=DIR out=SHARDS`: a corpus into shards a run reads by offset.

+task=lm reads the .txt/.text/.md files (one document each), .jsonl and .parquet files (a `text` field per
row) under data.root, tokenizes them with the tokenizer a run would use (tokenizer=bytes, bpe or pretrained
with model.weights=DIR), and writes fixed-size uint16/uint32 token shards, their document indexes and
manifest.json into `out` (text.prepare). Train with `+task=lm data=tokens data.path=SHARDS`. With
`teacher=DIR teacher_top_k=K` (a run or a Hugging Face folder of the same tokenizer) it also stores that
teacher's top-K log-probabilities for every `task.context`-token window into `out/teacher` (text.teacher),
which `+task=distill data=tokens data.path=SHARDS task.teacher_logprobs=SHARDS/teacher` reads instead of
running the teacher.

+task=sft writes the conversations of data.train (JSONL; none: the embedded KJV questions), rendered by the
chat template a run would use and tokenized, with their loss masks, as the same token shards
(text.chat_shards); train with `+task=sft data=tokens data.path=SHARDS` and the same tokenizer.

+task=asr writes the LibriSpeech subsets under data.root (data.subsets, data.val_subsets), or the JSONL
manifests data.train and data.val, into tar shards of clips and transcripts (audio.shards); train with
`+task=asr data=speech_shards data.path=SHARDS`. +task=image_classification writes an ImageFolder tree
(data.root/train, data.root/val) into tar shards of images and labels (vision.shards); train with
`data=image_shards data.path=SHARDS`.

Run again with the same inputs it does nothing; after a kill it continues where it stopped (docs/data.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from core.bounds import Bounds
from core.data.bad_samples import ON_BAD_SAMPLE, BadSamplePolicy
from core.errors import DataError
from core.logging.messages import say
from recipes.cli.catalog import field_docs, show, table
from recipes.cli.command import command
from recipes.cli.options import ArgumentError, check, fields_of, parse_args, require
from text.prepare import PREPARE_TOKENIZERS, TokenizerChoice, prepare

USAGE = (
    "usage: python -m recipes.prepare +task=lm|sft|asr|image_classification data.root=DIR out=SHARDS "
    "[tokenizer=bytes workers=0 data.val_fraction=0.01 shard_tokens=67108864 shard_mb=256 ...]"
)
#: the tasks prepare writes shards for
PREPARE_TASKS = ("lm", "sft", "asr", "image_classification")


@dataclass
class PrepareOptions:
    """The command's keys; `KEYS` gives each its name on the command line."""

    #: the task whose data this is: lm or sft (token shards), asr or image_classification (tar shards)
    task: Annotated[str, Bounds(choices=PREPARE_TASKS)] = "lm"
    #: lm: a folder searched recursively for .txt/.text/.md/.jsonl/.parquet files, or one file; asr: the
    #: folder holding the LibriSpeech subsets; image_classification: the ImageFolder tree (train/, val/)
    root: str = ""
    #: asr: the LibriSpeech training subsets, comma-separated
    subsets: str = "train-clean-100"
    #: asr: the LibriSpeech validation subsets, comma-separated
    val_subsets: str = "dev-clean"
    #: asr: a JSONL manifest (audio_filepath, text) of the training clips, instead of LibriSpeech subsets;
    #: sft: the training conversations, .jsonl of {"messages": [...]} (empty: the embedded KJV questions)
    train: str = ""
    #: asr: the validation manifest that goes with data.train; sft: the validation conversations (empty: the
    #: last data.val_fraction of data.train's, default 0.1)
    val: str = ""
    #: asr, image_classification: megabytes per tar shard (a sample is never split; the last is shorter)
    shard_mb: Annotated[float, Bounds(gt=0)] = 256
    #: the folder the shards and manifest.json are written to
    out: str = ""
    #: tokenizing processes (0: one per core)
    workers: Annotated[int, Bounds(ge=0)] = 0
    #: tokens per shard file (the last is shorter)
    shard_tokens: Annotated[int, Bounds(ge=1)] = 1 << 26
    #: fraction of the documents held out for validation, chosen by a hash of file and row (sft: the last
    #: fraction of data.train's conversations, default 0.1, when no data.val is given)
    val_fraction: Annotated[float, Bounds(ge=0, lt=1)] = 0.01
    #: bytes, bpe (trained on a sample of the training documents) or pretrained (model.weights=DIR's)
    tokenizer: Annotated[str, Bounds(choices=PREPARE_TOKENIZERS)] = "bytes"
    #: vocabulary size tokenizer=bpe learns
    bpe_vocab_size: Annotated[int, Bounds(ge=258)] = 2048
    #: megabytes of training text tokenizer=bpe learns from
    bpe_sample_mb: Annotated[int, Bounds(ge=1)] = 256
    #: tokenizer=pretrained: the Hugging Face model folder holding tokenizer.json
    weights: str = ""
    #: skip a bad document (named, counted) or stop at the first
    on_bad_sample: Annotated[str, Bounds(choices=ON_BAD_SAMPLE)] = "skip"
    #: largest fraction of the documents that may be bad before prepare stops
    max_bad_fraction: Annotated[float, Bounds(ge=0, lt=1)] = 0.01
    #: show a progress bar
    progress: bool = True
    #: lm: a distillation teacher (run directory or Hugging Face folder) whose top-k log-probabilities are
    #: stored into out/teacher (empty: none)
    teacher: str = ""
    #: with teacher: how many of its likeliest next tokens are stored per position
    teacher_top_k: Annotated[int, Bounds(ge=1)] = 16
    #: with teacher: the window length the distillation run reads (its task.context)
    context: Annotated[int, Bounds(ge=1)] = 256


#: the command line's key for each option: the train config's names where a run has the same setting
KEYS = {
    "+task": "task",
    "task": "task",
    "data.root": "root",
    "data.subsets": "subsets",
    "data.val_subsets": "val_subsets",
    "data.train": "train",
    "data.val": "val",
    "shard_mb": "shard_mb",
    "out": "out",
    "workers": "workers",
    "shard_tokens": "shard_tokens",
    "data.val_fraction": "val_fraction",
    "tokenizer": "tokenizer",
    "task.tokenizer": "tokenizer",
    "task.bpe_vocab_size": "bpe_vocab_size",
    "bpe_sample_mb": "bpe_sample_mb",
    "model.weights": "weights",
    "data.on_bad_sample": "on_bad_sample",
    "data.max_bad_fraction": "max_bad_fraction",
    "progress": "progress",
    "teacher": "teacher",
    "task.teacher": "teacher",
    "teacher_top_k": "teacher_top_k",
    "task.context": "context",
}


def parse(argv: list[str]) -> PrepareOptions:
    """The options of a command line; a bad key or value is a one-line ArgumentError naming its key."""
    own = fields_of(PrepareOptions)
    fields = {key: own[name] for key, name in KEYS.items()}
    values, _ = parse_args(argv, fields, usage=USAGE)
    given = {a.partition("=")[0] for a in argv}
    mine = {}
    for key, name in KEYS.items():
        if key in given or name not in mine:
            mine[name] = values[key]
    try:
        checked = check(mine, PrepareOptions)
    except ArgumentError as e:
        key = next((k for k, n in KEYS.items() if n == e.key and k in given), e.key)
        raise ArgumentError(
            str(e).replace(f"{e.key}=", f"{key}=", 1), key=key, value=e.value, valid=e.valid
        ) from None
    # asr reads data.root or manifests; sft reads data.train (or its embedded questions)
    needs_root = checked["task"] in ("lm", "image_classification") or (
        checked["task"] == "asr" and not (checked["train"] or checked["val"])
    )
    require({"data.root": mine["root"] or (not needs_root), "out": mine["out"]}, ("data.root", "out"), USAGE)
    if checked["tokenizer"] == "pretrained" and not checked["weights"]:
        raise ArgumentError(
            "tokenizer=pretrained reads the tokenizer.json of model.weights=DIR; set model.weights",
            key="model.weights",
            value="",
            valid=("a Hugging Face model folder",),
        )
    return PrepareOptions(**checked)


def run(argv: list[str]) -> int:
    """The command: prepare, then say what was written (or that nothing needed doing)."""
    o = parse(argv)
    if o.task == "sft":
        given = {a.partition("=")[0] for a in argv}
        return _run_chat(o, o.val_fraction if "data.val_fraction" in given else 0.1)
    if o.task != "lm":
        return _run_samples(o)
    result = prepare(
        o.root,
        o.out,
        tokenizer=TokenizerChoice(o.tokenizer, o.bpe_vocab_size, o.weights, o.bpe_sample_mb),
        workers=o.workers,
        shard_tokens=o.shard_tokens,
        val_fraction=o.val_fraction,
        policy=BadSamplePolicy(o.on_bad_sample, o.max_bad_fraction),
        progress=o.progress,
    )
    splits = result["splits"]
    counts = ", ".join(
        f"{s}: {v['tokens']:,} tokens, {v['documents']:,} documents, {len(v['shards'])} shards"
        for s, v in splits.items()
    )
    if result["status"] == "up to date":
        say(f"{o.out} is up to date with data.root={o.root} (nothing to do); {counts}")
    else:
        bad = len(result["bad_documents"])
        say(f"prepared {o.out}: {counts}; {bad} bad documents skipped")
    if not splits["val"]["documents"]:
        # a training run of these shards alone refuses them: said here, where the fix is, not one step later
        if o.val_fraction > 0:
            raise DataError(
                f"none of the {splits['train']['documents']:,} documents under data.root={o.root} fell in "
                f"the validation split (data.val_fraction={o.val_fraction:g} holds out each whole document "
                "with that chance); prepare again with a larger data.val_fraction, or train with "
                "data.val_path=OTHER_SHARDS",
                key="data.val_fraction",
                value=f"{o.val_fraction:g}",
            )
        say(f"train with +task=lm data=tokens data.path={o.out} data.val_path=OTHER_SHARDS (no validation)")
    else:
        say(f"train with +task=lm data=tokens data.path={o.out}")
    if o.teacher:
        _store_teacher(o)
    return 0


def _store_teacher(o: PrepareOptions) -> None:
    """teacher=DIR: its top-k log-probabilities for every window of the shards, into out/teacher."""
    from text.teacher import prepare_teacher_topk

    result = prepare_teacher_topk(o.out, o.teacher, o.teacher_top_k, o.context, progress=o.progress)
    folder = Path(o.out).expanduser() / "teacher"
    done = "is up to date (nothing to do)" if result["status"] == "up to date" else "written"
    positions = sum(s["positions"] for s in result["splits"].values())
    run = (
        f"+task=distill data=tokens data.path={o.out} task.context={o.context} task.teacher_logprobs={folder}"
    )
    say(f"{folder} {done}: top-{o.teacher_top_k} of teacher={o.teacher} at {positions:,} positions")
    say(f"train with {run}")


def _run_samples(o: PrepareOptions) -> int:
    """+task=asr or image_classification: tar shards of clips or images."""
    policy = BadSamplePolicy(o.on_bad_sample, o.max_bad_fraction)
    settings = {"shard_mb": o.shard_mb, "workers": o.workers, "policy": policy, "progress": o.progress}
    if o.task == "asr":
        from audio.shards import prepare_speech, speech_sources

        sources = speech_sources(o.root, _names(o.subsets), _names(o.val_subsets), o.train, o.val)
        result, data, source = prepare_speech(o.out, sources, **settings), "speech_shards", "clips"
    else:
        from vision.shards import prepare_images

        result, data, source = prepare_images(o.root, o.out, **settings), "image_shards", "images"
    splits = result["splits"]
    counts = ", ".join(
        f"{s}: {v['samples']:,} {source}, {len(v['shards'])} shards" for s, v in splits.items()
    )
    if result["status"] == "up to date":
        say(f"{o.out} is up to date with its inputs (nothing to do); {counts}")
    else:
        bad = len(result["bad_samples"])
        say(
            f"prepared {o.out}: {counts}; {bad} bad {source} skipped; train with +task={o.task} data={data} "
            f"data.path={o.out}"
        )
    return 0


def _run_chat(o: PrepareOptions, val_fraction: float) -> int:
    """+task=sft: conversations rendered by the run's chat template, as token shards with loss masks."""
    from text.chat import CHATML, ChatTemplate, chat
    from text.chat_shards import prepare_chat
    from text.tokenizer import build_tokenizer

    policy = BadSamplePolicy(o.on_bad_sample, o.max_bad_fraction)
    corpus = chat(train=o.train, val=o.val, val_fraction=val_fraction, policy=policy)
    template = ChatTemplate.of_folder(o.weights) if o.tokenizer == "pretrained" else ChatTemplate(CHATML)
    texts = [template.render(m) for m in corpus.train] if o.tokenizer == "bpe" else []
    tok = build_tokenizer(o.tokenizer, texts, bpe_vocab_size=o.bpe_vocab_size, folder=o.weights)
    described: dict[str, object] = {"name": o.tokenizer}
    if o.tokenizer == "bpe":
        Path(o.out).expanduser().mkdir(parents=True, exist_ok=True)
        tok.backend.save(str(Path(o.out).expanduser() / "tokenizer.json"))  # type: ignore[attr-defined]
        described["bpe_vocab_size"] = o.bpe_vocab_size
    result = prepare_chat(
        corpus, o.out, template=template, tok=tok, tokenizer=described, shard_tokens=o.shard_tokens
    )
    splits = result["splits"]
    counts = ", ".join(
        f"{s}: {v['tokens']:,} tokens, {v['documents']:,} conversations" for s, v in splits.items()
    )
    if result["status"] == "up to date":
        say(f"{o.out} is up to date with its conversations (nothing to do); {counts}")
    else:
        say(
            f"prepared {o.out}: {counts}; train with +task=sft data=tokens data.path={o.out} "
            f"tokenizer={o.tokenizer}"
        )
    return 0


def _names(value: str) -> list[str]:
    """A comma-separated list as the command line gives it, with or without Hydra's brackets."""
    return [n.strip() for n in value.strip("[]").split(",") if n.strip()]


def describe() -> str:
    """`--help`: the keys, as the command line spells them."""
    doc = __doc__.split("\n\n", 1)[1].strip()
    docs, spelled = field_docs(PrepareOptions), {}
    for key, name in KEYS.items():
        spelled.setdefault(name, key)  # the first spelling of each: +task, data.root, model.weights, ...
    rows = [(spelled[n], show(d), docs.get(n, "")) for n, (_, d) in fields_of(PrepareOptions).items()]
    return "\n".join([USAGE, "", doc, "", "keys:", table(rows)])


main = command(run, usage=USAGE, describe=describe)

if __name__ == "__main__":
    sys.exit(main())
