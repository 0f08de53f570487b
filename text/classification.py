"""Text classification: the task, over text.datasets' labelled texts and padded, length-bucketed batches."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.data.samplers import ResumableBatchSampler
from core.errors import ConfigError, DataError
from core.files import write_text_atomic
from core.loop.task import ExportInputs, StepOutput, Task, batch_dim, ranked_classes
from core.registry import DATASETS, MODELS, TASKS
from text.corpus import read_texts
from text.datasets import BucketBatchSampler, EncodedTexts, LabelledTexts, pad_batch
from text.tokenizer import Tokenizer, TokenizerSpec, save_run_tokenizer, saved_run_tokenizer

#: the run's label names, index by index, beside its weights (as the image classifier's classes.json)
CLASSES_FILE = "classes.json"


@TASKS.register("text_classification")
class TextClassification(Task):
    """Cross-entropy over a registered model's class logits for padded token batches, with accuracy."""

    primary_metric = "val/accuracy"
    data_type = LabelledTexts
    model_inputs = ("vocab_size", "num_classes", "max_len")
    maximize = True
    loader_workers = 0  # tensors are in memory; collation is cheap
    prediction_format = "csv"

    def __init__(
        self,
        *,
        model: dict[str, Any],
        data: dict[str, Any],
        tokenizer: str = "bpe",
        bpe_vocab_size: Annotated[int, Bounds(ge=1)] = 4096,
        max_len: Annotated[int, Bounds(ge=1)] = 128,
    ) -> None:
        """`model`/`data` are config sections: a registered `name` plus that builder's keywords. Settings
        are checked here; the texts are read (and a BPE vocabulary fitted) when first needed.

        tokenizer: bytes, bpe (learned on the training text) or torchtext (legacy stack only); tokenizer=NAME
            sets it too
        bpe_vocab_size: vocabulary size the bpe tokenizer learns
        max_len: tokens kept of each text (longer ones are truncated)
        """
        if max_len < 1:
            raise ConfigError(f"task.max_len={max_len} must be positive")
        self.tokenizer_spec, self.max_len = TokenizerSpec(tokenizer, bpe_vocab_size), max_len
        self.data_cfg, self.model_cfg = dict(data), dict(model)
        DATASETS.check_section(self.data_cfg)
        # a trained run's own vocabulary and label names (load_artifacts), used in place of the data's
        self.run_tokenizer: Tokenizer | None = None
        self.run_labels: list[str] | None = None

    @functools.cached_property
    def data(self) -> LabelledTexts:
        """The labelled training and validation texts, read on first use."""
        return DATASETS.build_section(self.data_cfg)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer: a trained run's own, else fitted on the training texts on first use where it learns
        a vocabulary."""
        if self.run_tokenizer is not None:
            return self.run_tokenizer
        return self.tokenizer_spec.fit([t for t, _ in self.data.train])

    @property
    def labels(self) -> list[str]:
        """The class names, index by index: a trained run's own, else the training data's."""
        return self.run_labels if self.run_labels is not None else self.data.labels

    def save_artifacts(self, run_dir: Path) -> None:
        """classes.json (the label names) and a learned vocabulary (bpe) as tokenizer.json: predict and eval
        need the run directory, not the training data."""
        write_text_atomic(run_dir / CLASSES_FILE, json.dumps({"classes": self.data.labels}, indent=1))
        save_run_tokenizer(self.tokenizer, run_dir)

    def load_artifacts(self, run_dir: Path) -> None:
        """The run's classes.json and tokenizer.json where it saved them (runs from before read the data)."""
        self.run_tokenizer = saved_run_tokenizer(run_dir, self.tokenizer_spec)
        path = run_dir / CLASSES_FILE
        if path.is_file():
            self.run_labels = list(json.loads(path.read_text(encoding="utf-8"))["classes"])

    def build_model(self) -> nn.Module:
        """The configured model, sized for the tokenizer, labels and max_len."""
        return MODELS.build_section(
            self.model_cfg,
            vocab_size=self.tokenizer.vocab_size,
            num_classes=len(self.labels),
            max_len=self.max_len,
        )

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """Tokenized (train, val) texts."""

        # the data's label indices, as the run's: eval on other data may know the labels in another order
        data, index = self.data, {name: i for i, name in enumerate(self.labels)}
        unknown = sorted(set(data.labels) - index.keys())
        if unknown:
            raise DataError(
                f"labels {unknown[:5]} of the data are not among the run's {len(index)} classes "
                f"({', '.join(list(index)[:5])}{', ...' if len(index) > 5 else ''}): the model cannot "
                "predict them",
                key="label",
                value=unknown[0],
            )
        to_run = [index[name] for name in data.labels]

        def encode(rows: list[tuple[str, int]]) -> EncodedTexts:
            ids = self.tokenizer.encode_batch([t for t, _ in rows])
            return EncodedTexts(ids, [to_run[y] for _, y in rows], self.max_len)

        return encode(data.train), encode(data.val)

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """Right-pad each batch to its longest text."""
        return pad_batch(self.tokenizer.pad_id)

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> ResumableBatchSampler:
        """Length-bucketed batches (texts vary from a few to hundreds of tokens)."""
        if not isinstance(dataset, EncodedTexts):
            return super().batch_sampler(dataset, batch_size, train=train, seed=seed)
        return BucketBatchSampler([len(x) for x in dataset.ids], batch_size, shuffle=train, seed=seed)

    def prediction_inputs(self, source: Path) -> list[tuple[str, str]]:
        """(where, text): the rows of a .csv/.jsonl file with a `text` field, or .txt files, each one text."""
        return read_texts(source)

    def predict(
        self, model: nn.Module, items: Sequence[tuple[str, str]], *, top_k: Annotated[int, Bounds(ge=1)] = 5
    ) -> list[dict[str, Any]]:
        """Each text's `top_k` likeliest labels with their probabilities, tokenized and truncated as in
        training.

        top_k: labels listed per text, likeliest first
        """
        ds = EncodedTexts(self.tokenizer.encode_batch([t for _, t in items]), [0] * len(items), self.max_len)
        device = next(model.parameters()).device
        batch = self.collate_fn()([ds[i] for i in range(len(ds))])
        probs = model(batch["tokens"].to(device), batch["mask"].to(device)).float().softmax(-1)
        ranked = ranked_classes(probs, self.labels, top_k)
        return [{"id": where, **r} for (where, _), r in zip(items, ranked, strict=True)]

    def step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput:
        """Cross-entropy loss and top-1 accuracy for one batch."""
        logits = model(batch["tokens"], batch["mask"])
        y = batch["labels"]
        loss = F.cross_entropy(logits.float(), y)
        acc = (logits.argmax(-1) == y).float().mean()
        return StepOutput(loss=loss, count=len(y), metrics={"accuracy": acc.detach()})

    def export_inputs(self, model: nn.Module, batch: Any, *, length: int | None = None) -> ExportInputs:
        """Token ids and their mask (B, L) in, class logits (B, num_classes) out; any batch size and any
        length up to task.max_len (the position table's size). `length` truncates, as max_len does."""
        tokens, mask = batch["tokens"][:, :length], batch["mask"][:, :length]
        # one Dim object per dim shared by both inputs: the exporter then knows their shapes are equal
        dims = {0: batch_dim(), 1: torch.export.Dim("length", min=1, max=self.max_len)}
        return ExportInputs(
            model,
            (tokens, mask),
            ("tokens", "mask"),
            ("logits",),
            (dims, dims),
            f"int64 token ids of the run's {self.tokenizer_spec.name} tokenizer, right-padded with its pad "
            f"id {self.tokenizer.pad_id} to the batch's longest text (at most task.max_len={self.max_len}), "
            "and a bool mask, True on real tokens (an empty text: True on its first slot)",
            length=tokens.shape[1],
        )
