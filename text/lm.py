"""Language modelling: the `lm` task over the corpora and packed chunks of text.lm_data."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import ConcatDataset, Dataset, Subset

from core.bounds import Bounds
from core.data.samplers import PermutedBatchSampler, ResumableBatchSampler
from core.errors import ConfigError, DataError
from core.logging.messages import say
from core.loop.task import ExportInputs, StepOutput, Task, batch_dim
from core.registry import DATASETS, MODELS, TASKS
from text.generation import stream
from text.lm_data import IGNORE, LMData, MixedWindows, PackedChunks, TextCorpus, TokenCorpus, TokenWindows
from text.moe import router_balance
from text.tokenizer import (
    Tokenizer,
    TokenizerSpec,
    check_same_tokenizer,
    save_run_tokenizer,
    saved_run_tokenizer,
)


@TASKS.register("lm")
class LanguageModeling(Task):
    """Next-token prediction with a registered model over packed documents of a registered corpus."""

    primary_metric = "val/loss"
    throughput_unit = "tokens"
    data_type = LMData
    model_inputs = ("vocab_size", "context")
    maximize = False
    loader_workers = 0  # chunks are slices of one in-memory tensor: workers would only add copying

    def __init__(
        self,
        *,
        model: dict[str, Any],
        data: dict[str, Any],
        tokenizer: str = "bytes",
        bpe_vocab_size: Annotated[int, Bounds(ge=1)] = 2048,
        context: Annotated[int, Bounds(ge=1)] = 256,
        packing: bool = True,
        val_chunks: Annotated[int, Bounds(ge=0)] = 0,
    ) -> None:
        """`model`/`data` are config sections: a registered `name` plus that builder's keywords. Settings
        are checked here; the corpus is read (and a BPE vocabulary fitted) when first needed.

        tokenizer: bytes, bpe (learned on the training text), pretrained (the tokenizer.json of the
            model.weights folder) or torchtext (legacy stack only); tokenizer=NAME sets it too
        bpe_vocab_size: vocabulary size the bpe tokenizer learns
        context: tokens per training chunk, and the model's longest input
        packing: documents packed into a chunk attend only within themselves (positions restart at each)
        val_chunks: evaluate on this many evenly spaced validation chunks (0: all of them)
        """
        if context < 1:
            raise ConfigError(f"task.context={context} must be positive")
        folder = str(model.get("weights") or "") if tokenizer == "pretrained" else ""
        self.tokenizer_spec = TokenizerSpec(tokenizer, bpe_vocab_size, folder)
        self.data_cfg, self.model_cfg = dict(data), dict(model)
        DATASETS.check_section(self.data_cfg)
        self.context, self.packing, self.val_chunks = context, packing, val_chunks
        self.mixture: dict[str, float] = {}  # data.sources' names and target shares, once the data is built
        self.run_tokenizer: Tokenizer | None = None  # a trained run's own (load_artifacts)

    @functools.cached_property
    def corpus(self) -> LMData:
        """Training and validation documents (or prepared shards), read on first use."""
        corpus: LMData = DATASETS.build_section(self.data_cfg)
        if isinstance(corpus, TextCorpus) and not corpus.val:
            raise DataError("the corpus has no validation text; raise data.val_fraction or add text")
        return corpus

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, fitted on the training documents on first use where it learns a vocabulary (that
        of the prepared shards, checked against their manifest, with data=tokens)."""
        if self.data_cfg.get("name") != "tokens":
            if self.run_tokenizer is not None:  # a trained run's own vocabulary, not one fitted again
                return self.run_tokenizer
            if self.tokenizer_spec.name == "pretrained":
                # the folder's tokenizer.json learns nothing from the text: generating from an HF folder
                # reads no corpus (prepared shards still check theirs against the manifest, below)
                return self.tokenizer_spec.fit([])
        if isinstance(self.corpus, TokenCorpus):
            tok = self.corpus.tokenizer(self.tokenizer_spec)
            check_same_tokenizer(tok, self.run_tokenizer, f"data.path={self.corpus.shards.root}")
            return tok
        return self.tokenizer_spec.fit(self.corpus.train)

    def save_artifacts(self, run_dir: Path) -> None:
        """A vocabulary the run learned (tokenizer=bpe) as `run_dir`/tokenizer.json."""
        save_run_tokenizer(self.tokenizer, run_dir)

    def load_artifacts(self, run_dir: Path) -> None:
        """The run's saved vocabulary (bpe), so its later commands read it rather than fit one again on the
        data they are given: eval on other text keeps the run's ids, and generate and export need no
        training data. Runs from before it was saved fit it again, as they did."""
        self.run_tokenizer = saved_run_tokenizer(run_dir, self.tokenizer_spec)

    def build_model(self) -> nn.Module:
        """The configured model, sized for the tokenizer and context."""
        # the data the tokenizer may read first lives on the host even when the model is built on the meta
        # device (a sharded run): a bad-sample collector's flags are shared memory, which meta cannot hold
        with torch.device("cpu"):
            vocab_size = self.tokenizer.vocab_size
        return MODELS.build_section(self.model_cfg, vocab_size=vocab_size, context=self.context)

    def loads_after_sharding(self) -> bool:
        """A model.weights folder is read after FSDP/TP sharded the model built on the meta device, each rank
        its own slices (`text.pretrained.load_sharded`)."""
        return bool(self.model_cfg.get("weights"))

    def load_after_sharding(self, model: nn.Module, device: torch.device) -> None:
        """Each rank's slices of the model.weights folder's tensors, into `model`'s shards on `device`."""
        from text.pretrained import load_sharded

        load_sharded(model, device)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """Packed chunks of the tokenized training and validation documents (windows of the shards)."""
        tok, c = self.tokenizer, self.context
        if isinstance(self.corpus, TokenCorpus):
            return self._token_datasets(self.corpus)
        start = tok.doc_start_id
        train = PackedChunks(tok.encode_batch(self.corpus.train), c, tok.eos_id, start_id=start)
        val = PackedChunks(
            tok.encode_batch(self.corpus.val), c, tok.eos_id, max_chunks=self.val_chunks, start_id=start
        )
        return train, val

    def _token_datasets(self, corpus: TokenCorpus) -> tuple[Dataset, Dataset]:
        """Windows of prepared shards; several sources mixed by their weights, their targets logged."""
        c = self.context
        if len(corpus.train) == 1:
            return TokenWindows(corpus.train[0], c), TokenWindows(corpus.val[0], c, self.val_chunks)
        mixed = MixedWindows([TokenWindows(t, c) for t in corpus.train], corpus.weights)
        self.mixture = dict(zip(corpus.names, corpus.weights, strict=True))
        say(
            "data.sources, share of the training tokens (target / one epoch's): "
            + ", ".join(
                f"{n} {w:.3f} / {r:.3f}"
                for n, w, r in zip(corpus.names, corpus.weights, mixed.shares(), strict=True)
            )
        )
        val: Dataset = ConcatDataset([TokenWindows(v, c) for v in corpus.val if v.tokens > c])
        if 0 < self.val_chunks < len(val):
            val = Subset(val, torch.linspace(0, len(val) - 1, self.val_chunks).round().long().tolist())
        return mixed, val

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> ResumableBatchSampler:
        """The shuffled batches every task has; over shards, an order computed batch by batch, which holds
        nothing per window (a corpus's windows number in the millions: a list of them per rank would not)."""
        if not isinstance(self.corpus, TokenCorpus):
            return super().batch_sampler(dataset, batch_size, train=train, seed=seed)
        return PermutedBatchSampler(len(dataset), batch_size, shuffle=train, seed=seed, drop_last=False)

    def step(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> StepOutput:
        """Mean next-token cross-entropy (nats per token) over the batch; with data.sources, each source's
        share of the batch's tokens beside its target (`share/NAME`, `share_target/NAME`)."""
        x, y, d = batch[:3]
        logits = model(x, d) if self.packing else model(x)
        # the mean over the targets kept, taken as sum / count so a batch (or a rank's share of one) whose
        # targets are all IGNOREd has a zero loss, not torch's empty-mean NaN that would skip the whole step
        kept = (y != IGNORE).sum().clamp(min=1)
        loss = (
            F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
            / kept
        )
        metrics: dict[str, float | torch.Tensor] = {}
        if (balance := router_balance(model)) is not None:  # a mixture of experts' routers (text.moe)
            loss = loss + balance.loss if model.training else loss
            metrics |= balance.metrics
        if len(batch) == 4:  # MixedWindows' source index per row
            counts = torch.bincount(batch[3], minlength=len(self.mixture)).float() / len(batch[3])
            for j, (name, target) in enumerate(self.mixture.items()):
                metrics[f"share/{name}"], metrics[f"share_target/{name}"] = counts[j], target
        return StepOutput(loss=loss, count=y.numel(), metrics=metrics)

    def throughput_units(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
        """Input positions (ignored targets too: the model computes them all)."""
        return float(batch[0].numel())

    def loss_units(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> int:
        """The targets `step`'s cross-entropy averages over: those not IGNOREd (packing ignores the
        positions whose next token belongs to another document, so chunks hold different counts)."""
        return int((batch[1] != IGNORE).sum())

    def export_inputs(self, model: nn.Module, batch: Any, *, length: int | None = None) -> ExportInputs:
        """Token ids (B, L) in, next-token logits (B, L, V) out; any batch size and any length up to the
        context (the position table's size). Each row is one sequence from position 0, as `generate` feeds
        the model: the packed-documents path (`doc_ids`) finds its segments from the data, which no exported
        graph can hold, so it is left out."""
        tokens = batch[0][:, :length]
        return ExportInputs(
            model,
            (tokens,),
            ("tokens",),
            ("logits",),
            ({0: batch_dim(), 1: torch.export.Dim("length", min=1, max=self.context)},),
            f"int64 token ids of the run's {self.tokenizer_spec.name} tokenizer, at most task.context="
            f"{self.context} per row, rows of equal length (no padding mask); a document starts with the "
            f"id {self.tokenizer.doc_start_id}, as in training",
            length=tokens.shape[1],
        )

    def prediction_inputs(self, source: Path) -> list[str]:
        """The prompts of a text file, one per line (an empty line: a document's start)."""
        if not source.is_file():
            raise DataError(
                f"{source} is not a file; give a text file with one prompt per line",
                key="input",
                value=str(source),
                valid=("a text file, one prompt per line",),
            )
        try:
            return source.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read {source} as UTF-8 text ({type(e).__name__})") from None

    def predict(
        self,
        model: nn.Module,
        items: Sequence[str],
        *,
        max_new_tokens: Annotated[int, Bounds(ge=0)] = 200,
        temperature: Annotated[float, Bounds(ge=0)] = 0.8,
        top_k: Annotated[int, Bounds(ge=0)] = 0,
        top_p: Annotated[float, Bounds(gt=0, le=1)] = 1.0,
        min_p: Annotated[float, Bounds(ge=0, le=1)] = 0.0,
        repetition_penalty: Annotated[float, Bounds(gt=0)] = 1.0,
        stop: str = "",
        seed: Annotated[int, Bounds(ge=0)] = 0,
        overflow_keep: Annotated[int, Bounds(ge=0)] = 0,
    ) -> list[dict[str, Any]]:
        """Each prompt and its sampled continuation (`generate` with the model's KV cache, one prompt at a
        time).

        max_new_tokens: most tokens sampled after each prompt (fewer when a document ends)
        temperature: sampling temperature (0: always the likeliest token)
        top_k: sample among the k likeliest tokens only (0: the whole distribution)
        top_p: sample among the fewest likeliest tokens holding this much probability (1: all)
        min_p: sample among the tokens at least this share as likely as the likeliest (0: all)
        repetition_penalty: the tokens already in the text made less likely by this factor (1: none; as
            Hugging Face's, greedy too)
        stop: end each continuation before the first place it contains this text (\\n, \\t: newline, tab)
        seed: seed of the sampling; the same seed gives the same text for a prompt
        overflow_keep: tokens kept when the context is full (0: half of it)
        """
        stops = (
            [re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t"}.get(m[1], "\\"), stop)] if stop else []
        )
        return [
            {
                "prompt": p,
                "text": self.generate(
                    model,
                    p,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=top_k or None,
                    top_p=top_p,
                    min_p=min_p or None,
                    repetition_penalty=repetition_penalty,
                    stop=stops,
                    seed=seed,
                    overflow_keep=overflow_keep or None,
                ),
            }
            for p in items
        ]

    def benchmarks(self, names: Sequence[str], limit: float) -> Any:
        """trainer.evals: lm-evaluation-harness tasks on the model (`text.harness.training_evals`)."""
        from text.harness import training_evals

        return training_evals(self.tokenizer, names, limit)

    def generate(
        self,
        model: nn.Module,
        prompt: str,
        *,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        stop: str | Sequence[str] = (),
        seed: int = 0,
        overflow_keep: int | None = None,
    ) -> str:
        """The prompt and a sampled continuation, decoded together; the same seed gives the same text (the
        options' defaults are `predict`'s, which the command lines use).

        Sampling as in `text.generation.stream` (temperature 0: greedy; top_k, top_p, min_p: off when None;
        repetition_penalty 1: off).
        Generation ends at a document end, after `max_new_tokens`, or as soon as the continuation contains
        one of the `stop` strings, which is cut off together with anything decoded after it (one token can
        hold more). Decoding both together keeps word tokenizers (torchtext) from gluing the first new word
        onto the prompt; with bytes or BPE the result starts with the prompt exactly.
        """
        ids = [self.tokenizer.doc_start_id, *self.tokenizer.encode(prompt)]  # a prompt starts a document
        return self.continue_ids(
            model,
            ids,
            echo=True,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            stop=stop,
            seed=seed,
            overflow_keep=overflow_keep,
        )

    def continue_ids(
        self,
        model: nn.Module,
        ids: Sequence[int],
        *,
        echo: bool,
        end: Sequence[int] = (),
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        stop: str | Sequence[str] = (),
        seed: int = 0,
        overflow_keep: int | None = None,
    ) -> str:
        """Text `text.generation.stream` samples from `model` after the prompt `ids` (`generate`'s options):
        decoded together with the prompt when `echo`, else the new text alone. It ends at a document end, at
        the ids `end` (left out), after `max_new_tokens`, or as soon as it contains one of the `stop`
        strings, which is cut off together with anything decoded after it."""
        stops = [stop] if isinstance(stop, str) else list(stop)
        if "" in stops:
            raise ConfigError("stop='' would end generation before it starts; give a non-empty string")
        tok = self.tokenizer
        head = list(ids) if echo else []
        start = len(tok.decode(head))
        device = next(model.parameters()).device
        new: list[int] = []
        tokens = stream(
            model,
            torch.tensor(list(ids), device=device),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            eos_id=tok.eos_id,
            generator=torch.Generator().manual_seed(seed),
            overflow_keep=overflow_keep,
        )
        for token in tokens:
            new.append(token)
            if end and new[-len(end) :] == list(end):
                del new[-len(end) :]
                break
            if stops:
                text = tok.decode(head + new)
                cut = min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    return text[:cut]
        return tok.decode(head + new)
