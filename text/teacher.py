"""A distillation teacher (`+task=distill task.teacher=DIR`): loaded from a torchkiln run directory or a
Hugging Face decoder folder, its vocabulary checked against the student's tokenizer; and its top-k
log-probabilities stored once beside prepared token shards (`python -m recipes.prepare ... teacher=DIR
teacher_top_k=K`), so a run reads them instead of running the teacher.

Nothing read executes code: a run's `.hydra/config.yaml` is parsed as plain YAML (`yaml.safe_load`, no
interpolation resolved: a file holding one is refused), its weights are `model.safetensors` or a checkpoint
read with `weights_only`; a Hugging Face folder loads through `text.checkpoints.hf` (safetensors only).

Stored top-k: for each window the task reads (`text.lm_data.TokenWindows`: stream tokens [i c, (i+1) c]
with `c` the context), the teacher's k likeliest next tokens at every input position, as int32 ids and
float32 log-probabilities (at temperature 1, over the whole vocabulary), in `OUT/teacher/{split}-ids.npy`
and `{split}-logprobs.npy` (N windows x c rows, k columns), memory-mapped when read. The folder is written
by the one prepare skeleton (`core.data.prepared.prepare_folder`): its fingerprint holds the token shards'
own fingerprint, the teacher's weights (their SHA-256) and tokenizer, k and the context.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from core import checkpoint
from core.data.prepared import MANIFEST, WORK, prepare_folder
from core.errors import ConfigError, DataError
from core.files import file_sha256
from core.nn.lora import LoRAConfig, apply_lora
from core.registry import MODELS
from text.checkpoints.hf import read_folder
from text.lm_data import TokenWindows
from text.token_shards import SPLITS, ShardSet
from text.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    PretrainedTokenizer,
    Tokenizer,
    TokenizerSpec,
    byte_level_backend,
    saved_run_tokenizer,
    tokenizer_hash,
)

#: the key every teacher error names
KEY = "task.teacher"
#: the stored top-k folder's format, and its name inside a prepared token folder
FORMAT = "torchkiln.teacher_topk/1"
FOLDER = "teacher"


def _fault(teacher: str, why: str) -> ConfigError:
    return ConfigError(
        f"task.teacher={teacher}: {why}",
        key=KEY,
        value=str(teacher),
        valid=("a torchkiln run directory", "a Hugging Face decoder folder (config.json, safetensors)"),
    )


@dataclass
class Teacher:
    """A loaded teacher: its model (eval mode, no gradients), its tokenizer, where its weights came from."""

    model: nn.Module
    tokenizer: Tokenizer
    weights: list[Path]

    @functools.cached_property
    def weights_sha256(self) -> str:
        """One SHA-256 over its weight files' own (stored top-k's fingerprint)."""
        return file_digest(self.weights)


def file_digest(files: list[Path]) -> str:
    """The SHA-256 of `files`' SHA-256s in order."""
    return hashlib.sha256("|".join(file_sha256(f) for f in files).encode()).hexdigest()


def load_teacher(path: str, context: int) -> Teacher:
    """The teacher `path` names, ready to score `context` positions; any failure is one ConfigError naming
    task.teacher (a missing folder, a foreign architecture, weights that do not fit, no tokenizer)."""
    folder = Path(path).expanduser()
    try:
        if (folder / ".hydra" / "config.yaml").is_file():
            teacher = _load_run(folder, context)
        elif (folder / "config.json").is_file():
            teacher = _load_hf(folder, context)
        else:
            raise _fault(path, "neither a run directory (.hydra/config.yaml) nor a Hugging Face folder")
    except Exception as e:  # whatever a foreign or damaged folder raises (safetensors' own errors too)
        if isinstance(e, ConfigError) and e.key == KEY:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _fault(path, f"cannot be loaded as a teacher ({first})") from None
    teacher.model.eval().requires_grad_(False)
    return teacher


def _load_hf(folder: Path, context: int) -> Teacher:
    """A Hugging Face decoder folder with its own tokenizer.json."""
    hf = read_folder(folder)
    tok = PretrainedTokenizer(folder)
    model = MODELS.build_section(
        {"name": "llama", "weights": str(folder)}, vocab_size=tok.vocab_size, context=context
    )
    return Teacher(model, tok, sorted(set(hf.files.values())))


def _load_run(run: Path, context: int) -> Teacher:
    """A torchkiln run: its config's model and tokenizer, its exported weights (else newest checkpoint)."""
    import yaml

    text = (run / ".hydra" / "config.yaml").read_text(encoding="utf-8")
    if "${" in text:  # an interpolation would read this machine's environment or run a resolver
        raise _fault(
            str(run), ".hydra/config.yaml holds an interpolation; a run config must hold plain values"
        )
    cfg = yaml.safe_load(text)
    task, model_cfg = dict(cfg["task"]), dict(cfg["model"])
    trained = int(task.get("context", context))
    rotary = str(model_cfg.get("name", "")).startswith("llama")  # the GPT learns a table of `trained` rows
    if not rotary and context > trained:
        raise _fault(
            str(run), f"it trained with task.context={trained}, shorter than the student's {context}"
        )
    tok = _run_tokenizer(run, task, model_cfg)
    model = MODELS.build_section(model_cfg, vocab_size=tok.vocab_size, context=max(context, trained))
    lora = cfg.get("trainer", {}).get("lora") or {}
    apply_lora(model, LoRAConfig(**lora), external_name=getattr(model, "external_name", None))
    exported = run / "model.safetensors"
    if exported.is_file():
        from safetensors.torch import load_model

        load_model(model, str(exported))
        return Teacher(model, tok, [exported])
    source = checkpoint.resolve("auto", run)
    if source is None:
        raise _fault(str(run), "no model.safetensors and no complete checkpoint in it")
    weights, _, _ = checkpoint.load(source)
    checkpoint.load_model_state(model, weights, source)
    return Teacher(model, tok, sorted(p for p in Path(source).rglob("*") if p.is_file()))


def _run_tokenizer(run: Path, task: dict[str, Any], model_cfg: dict[str, Any]) -> Tokenizer:
    """The tokenizer a run trained with: bytes, its saved bpe vocabulary, or its model folder's."""
    name = str(task.get("tokenizer", "bytes"))
    spec = TokenizerSpec(name, int(task.get("bpe_vocab_size", 2048)), str(model_cfg.get("weights") or ""))
    if name == "bpe":
        tok = saved_run_tokenizer(run, spec)
        if tok is None:
            raise _fault(str(run), "its bpe vocabulary (tokenizer.json) is not in the run directory")
        return tok
    if name not in ("bytes", "pretrained"):
        raise _fault(str(run), f"tokenizer={name} has no saved vocabulary to compare with the student's")
    return spec.fit([])


def vocabulary(tok: Tokenizer) -> dict[str, int]:
    """Token string -> id of `tok` (bytes: its byte-level form, as its Hugging Face export writes it)."""
    if isinstance(tok, ByteTokenizer):
        return byte_level_backend().get_vocab(with_added_tokens=True)
    if isinstance(tok, (BPETokenizer, PretrainedTokenizer)):
        return tok.backend.get_vocab(with_added_tokens=True)
    return {}


def check_vocabulary(teacher: Teacher, student: Tokenizer, teacher_path: str, width: int) -> None:
    """ConfigError naming task.teacher unless the teacher's tokenizer is the student's (the same rules, or
    the same token -> id table and end-of-document id: a bytes run and its Hugging Face export agree) and
    its logits cover the student's `width` ids."""
    same = tokenizer_hash(teacher.tokenizer) == tokenizer_hash(student) or (
        teacher.tokenizer.eos_id == student.eos_id
        and bool(vocabulary(student))
        and vocabulary(teacher.tokenizer) == vocabulary(student)
    )
    if not same:
        raise _fault(
            teacher_path,
            f"its tokenizer ({teacher.tokenizer.name}, {teacher.tokenizer.vocab_size} ids) is not the "
            f"student's ({student.name}, {student.vocab_size} ids); distil a teacher of the same vocabulary",
        )
    rows = logits_width(teacher.model)
    if rows < width:
        raise _fault(teacher_path, f"its logits have {rows} ids, fewer than the student's {width}")


def logits_width(model: nn.Module) -> int:
    """The number of ids a decoder's logits cover: its token embedding's rows."""
    emb = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    return int(emb.num_embeddings)


# -- stored top-k ----------------------------------------------------------------------------------------


class StoredTopK:
    """A stored top-k folder (module docstring), read: its manifest and per split the memory-mapped ids and
    log-probabilities."""

    def __init__(self, root: str | Path, key: str = "task.teacher_logprobs") -> None:
        """Read `root`/manifest.json; a missing or foreign folder is a one-line DataError naming `key`."""
        self.root = Path(root).expanduser()
        try:
            self.manifest = json.loads((self.root / MANIFEST).read_text(encoding="utf-8"))
            if self.manifest.get("format") != FORMAT:
                raise ValueError(f"format {self.manifest.get('format')!r}")
            self.k, self.context = int(self.manifest["k"]), int(self.manifest["context"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{key}={root}: not a finished teacher top-k folder ({type(e).__name__}: {e}); write one "
                "with python -m recipes.prepare +task=lm ... teacher=DIR teacher_top_k=K",
                key=key,
                value=str(root),
            ) from None

    def split(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, log-probabilities) of split `name`, each (windows x context, k), memory-mapped."""
        return tuple(  # type: ignore[return-value]
            np.load(self.root / f"{name}-{part}.npy", mmap_mode="r") for part in ("ids", "logprobs")
        )


class TeacherWindows(Dataset):
    """`TokenWindows` items with the stored teacher's top-k of each input position appended: (inputs,
    targets, doc_ids, top-k ids, top-k log-probabilities)."""

    def __init__(self, windows: TokenWindows, ids: np.ndarray, logprobs: np.ndarray) -> None:
        """`ids`/`logprobs`: the split's stored arrays, one row per stream position of a window."""
        if len(ids) != windows.n * windows.context:
            raise DataError(
                f"the stored teacher top-k hold {len(ids)} positions, the {windows.split.name} split's "
                f"windows {windows.n * windows.context}; prepare them again for these shards",
                key="task.teacher_logprobs",
                value=str(windows.split.root),
            )
        self.windows, self.ids, self.logprobs = windows, ids, logprobs

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        w = self.windows
        j = w.picked[i] if w.picked is not None else i % w.n
        rows = slice(j * w.context, (j + 1) * w.context)
        ids = torch.from_numpy(np.asarray(self.ids[rows], dtype=np.int64))
        return (*w[i], ids, torch.from_numpy(np.array(self.logprobs[rows], dtype=np.float32)))


def prepare_teacher_topk(
    shards: str | Path, teacher_path: str, k: int, context: int, batch_size: int = 8, progress: bool = False
) -> dict[str, Any]:
    """Store `teacher_path`'s top-`k` log-probabilities for every `context`-token window of the prepared
    token folder `shards` into `shards`/teacher (module docstring); its manifest, with `"status"`."""
    tokens = ShardSet(shards)
    if "chat" in tokens.manifest:
        raise ConfigError(
            "teacher_top_k stores a teacher's log-probabilities for +task=lm shards; conversations "
            "(+task=sft) are distilled with the online teacher",
            key="teacher_top_k",
            value=str(k),
        )
    teacher = load_teacher(teacher_path, context)
    prepared = tokens.tokenizer
    tok = ByteTokenizer() if prepared["name"] == "bytes" else teacher.tokenizer
    if tokenizer_hash(tok) != prepared["hash"]:
        raise _fault(teacher_path, f"its tokenizer is not the one {tokens.root} was prepared with")
    check_vocabulary(teacher, tok, teacher_path, tok.vocab_size)
    if k > logits_width(teacher.model):
        raise ConfigError(
            f"teacher_top_k={k} is more than the {logits_width(teacher.model)} ids of teacher={teacher_path}",
            key="teacher_top_k",
            value=str(k),
            valid=(f"1 to {logits_width(teacher.model)}",),
        )
    inputs = {
        "tokens": tokens.manifest["inputs_sha256"],
        "teacher": teacher.weights_sha256,
        "teacher_tokenizer": tokenizer_hash(teacher.tokenizer),
        "k": k,
        "context": context,
    }

    def build(dest: Path, fingerprint: str) -> dict[str, Any]:
        splits = {}
        for name in SPLITS:
            windows = TokenWindows(getattr(tokens, name), context)
            splits[name] = {
                "windows": windows.n,
                "positions": _score(teacher.model, windows, dest, k, batch_size, progress),
            }
        return {
            "format": FORMAT,
            "inputs_sha256": fingerprint,
            "k": k,
            "context": context,
            "teacher": str(teacher_path),
            "tokenizer_hash": tokenizer_hash(tok),
            "splits": splits,
        }

    files = {f"{s}-{p}.npy" for s in SPLITS for p in ("ids", "logprobs")}
    return prepare_folder(
        Path(tokens.root) / FOLDER,
        inputs,
        finished=lambda d: StoredTopK(d).manifest if (d / MANIFEST).is_file() else None,
        build=build,
        outputs=["*-ids.npy", "*-logprobs.npy"],
        listed=lambda _: files,
    )


@torch.no_grad()
def _score(
    model: nn.Module, windows: TokenWindows, dest: Path, k: int, batch_size: int, progress: bool
) -> int:
    """The teacher's top-k over every window of one split, into `dest`'s two arrays (written under WORK,
    then moved in); the positions stored."""
    work = dest / WORK
    work.mkdir(exist_ok=True)
    c, n = windows.context, windows.n
    name = windows.split.name
    ids = np.lib.format.open_memmap(work / f"{name}-ids.npy", mode="w+", dtype=np.int32, shape=(n * c, k))
    lps = np.lib.format.open_memmap(
        work / f"{name}-logprobs.npy", mode="w+", dtype=np.float32, shape=(n * c, k)
    )
    from tqdm import tqdm

    for a in tqdm(
        range(0, n, batch_size), desc=f"teacher top-{k}, {name}", unit="batch", disable=not progress
    ):
        items = [windows[i] for i in range(a, min(n, a + batch_size))]
        x, d = torch.stack([t[0] for t in items]), torch.stack([t[2] for t in items])
        top = torch.log_softmax(model(x, d).float(), dim=-1).topk(k, dim=-1)
        rows = slice(a * c, (a + len(items)) * c)
        ids[rows] = top.indices.flatten(0, 1).numpy()
        lps[rows] = top.values.flatten(0, 1).numpy()
    for arr in (ids, lps):
        arr.flush()
    del ids, lps
    for part in ("ids", "logprobs"):
        (work / f"{name}-{part}.npy").replace(dest / f"{name}-{part}.npy")
    return n * c
