"""On-policy sampling shared by the tasks that train on their own completions (`+task=grpo`, on-policy
`+task=distill`): completions sampled from the training weights (`rollout`, eagerly: compiled code would
recompile for every length) and packed for a training forward (`pack_rollout`); the completions scored
for a batch kept between the `task.iterations` updates on it (`PendingRollouts`), and with the generation
count checkpointed (`RolloutState`) so a resumed run samples what the whole run would have; and the
prompt-data side of such a task (`PromptSampling`)."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from core import compile as kc
from core.data.samplers import ResumableBatchSampler
from core.errors import ConfigError, DataError
from core.loop.callbacks import Callback
from core.loop.task import ExportInputs
from core.registry import DATASETS
from core.rng import derive_seed
from text.generation import Rollout, sample_rows
from text.lm import LanguageModeling
from text.prompts import PromptCorpus, PromptRow, PromptSet, collate_prompts, prompt_text, tokenize_prompts
from text.rewards import RewardState
from text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from core.loop.trainer import Trainer


# ---- sampling -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def as_sampler(model: nn.Module) -> Iterator[nn.Module]:
    """`model` as the sampler runs it: the module behind a DDP wrapper (which syncs gradients, and sampling
    has none), in eval mode, eagerly (lengths vary each step: compiled code would recompile for each); its
    mode is restored after."""
    model = model.module if isinstance(model, DistributedDataParallel) else model
    was_training = model.training
    model.eval()
    try:
        with kc.run_eagerly():
            yield model
    finally:
        model.train(was_training)


def rollout(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    end: Sequence[int],
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    eos_id: int | None,
    generator: torch.Generator,
) -> Rollout:
    """`group_size` completions of each of `prompts` (ids), prompt-major, sampled from `model` in eval mode
    as one batch (`text.generation.sample_rows`; temperature 0: greedy), with each token's sampling
    log-prob; one ends at the ids `end` or at `eos_id` (kept: the policy learns to stop) or after
    `max_new_tokens`."""
    end = list(end)
    with as_sampler(model) as policy:
        return sample_rows(
            policy,
            [list(p) for p in prompts],
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k or None,
            min_p=min_p or None,
            repetition_penalty=repetition_penalty,
            stop_ids=() if eos_id is None else (eos_id,),
            stop=(lambda ids: ids[-len(end) :] == end) if end else None,
            group_size=group_size,
            generator=generator,
        )


def pack_rollout(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, L), completion mask (B, L - 1)) of each prompt followed by its completion, right-padded
    with `pad_id`: the mask marks the next-token positions whose target is a completion token, so prompt
    and padding carry no loss."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), max(width - 1, 0), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[i, : len(p) + len(c)] = torch.tensor([*p, *c], dtype=torch.long)
        mask[i, len(p) - 1 : len(p) - 1 + len(c)] = True
    return tokens, mask


class RepeatedBatches(ResumableBatchSampler):
    """Each batch of `inner` given `times` times in a row: the mu updates on one generation's completions."""

    def __init__(self, inner: ResumableBatchSampler, times: int) -> None:
        """Wrap `inner`, which keeps its own order."""
        super().__init__(inner.seed)
        self.inner, self.times = inner, times

    def batches(self, epoch: int) -> list[list[int]]:
        """`inner`'s batches of `epoch`, each repeated."""
        return [b for b in self.inner.batches(epoch) for _ in range(self.times)]


# ---- the rollouts kept between steps ------------------------------------------------------------------
@dataclass
class ScoredRollout:
    """One batch's sampled completions, ready for the loss: what `task.iterations` updates share."""

    tokens: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    #: reward statistics logged at each update on these completions
    metrics: dict[str, float]
    uses: int = 0

    def state(self) -> dict[str, Any]:
        """The rollout as checkpoint state (tensors, numbers, dicts)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class DrawnRollout:
    """One batch's sampled completions and their rewards, before advantages (scale_rewards=batch waits for
    the generation batch's std)."""

    sampled: Rollout
    texts: list[str]
    #: (N, rewards) each reward of each completion; total: their weighted sum (N,)
    scores: torch.Tensor
    total: torch.Tensor
    #: the prompts the completions are of: the batch's, or in a refilled place the new prompt
    rows: list[PromptRow]
    #: completions task.guidance replaced by their prompt's answer
    guided: int = 0
    #: the first draw's scores, before task.dynamic_sampling or task.guidance replaced any (the policy's
    #: own rewards on the batch's prompts)
    sampled_scores: torch.Tensor | None = None
    #: groups task.dynamic_sampling replaced by another prompt's
    refilled: int = 0


def rollout_key(rows: Sequence[PromptRow]) -> tuple[int, ...]:
    """The key a batch's rollout is kept under: its prompts' indices."""
    return tuple(r.index for r in rows)


@dataclass
class PendingRollouts:
    """The completions still to be trained on, by the batch's prompt indices; the generations so far."""

    pending: dict[tuple[int, ...], ScoredRollout] = field(default_factory=dict)
    generations: int = 0
    seed: int = 0
    rank: int = 0
    #: consecutive generations without a group of unequal rewards
    flat_generations: int = 0
    #: the loop is training (every rank steps together): set-up probes step one rank alone, before it
    training: bool = False
    samples: list[dict[str, Any]] = field(default_factory=list)
    #: where the loop is, for the rewards' trainer_state (set by RolloutState; None before the loop)
    where: Callable[[], RewardState] | None = None

    def progress(self) -> RewardState:
        """The loop's position as the rewards receive it (all zeros outside the loop: set-up probes)."""
        return self.where() if self.where is not None else RewardState()

    def ensure(self, key: tuple[int, ...], make: Callable[[], ScoredRollout]) -> ScoredRollout:
        """The pending rollout of prompts `key`, made by `make` unless there is one (no use counted)."""
        roll = self.pending.get(key)
        if roll is None:
            roll = self.pending[key] = make()
        return roll

    def take(self, key: tuple[int, ...], iterations: int, make: Callable[[], ScoredRollout]) -> ScoredRollout:
        """The rollout of prompts `key`, made by `make` unless one is pending; dropped after `iterations`
        uses."""
        roll = self.ensure(key, make)
        roll.uses += 1
        if roll.uses >= iterations:
            del self.pending[key]
        return roll

    def generator(self) -> torch.Generator:
        """The next generation's sampling generator: seeded from (run seed, rank, generation number), so a
        resumed run draws what the first would have."""
        self.generations += 1
        return torch.Generator().manual_seed(
            derive_seed(self.seed, "grpo-sampling", self.rank, self.generations)
        )


class RolloutState(Callback):
    """Checkpoints the task's `PendingRollouts` (so resume is bit-exact) and writes sampled completions to
    the run directory (`completions.jsonl`, rank 0)."""

    def __init__(self, rollouts: PendingRollouts, iterations: int) -> None:
        """Keep the task's `rollouts`, trained on `iterations` times each."""
        self.rollouts, self.iterations, self.loaded = rollouts, iterations, False
        #: the data-parallel rank whose rollouts a resumed checkpoint holds
        self.loaded_rank: int | None = None
        self.out: Path | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        """Seed the sampling; forget the probes' rollouts (set-up steps the model) unless resumed."""
        if self.iterations > 1 and trainer.cfg.grad_accum > 1:
            # the sampler repeats each batch: with accumulation its repeats would share one update
            raise ConfigError(
                "task.iterations > 1 needs trainer.grad_accum=1 (raise trainer.batch_size instead)",
                key="trainer.grad_accum",
                value=str(trainer.cfg.grad_accum),
                valid=("1",),
            )
        # ranks of a sharded model must run every forward together; their rows end at different steps
        trainer.shape.require_whole(str(trainer.cfg.parallel), "sampling")
        r = self.rollouts
        # tensor-parallel peers hold one replica: they sample the same completions
        r.seed, r.rank = trainer.seed, trainer.shape.dp_rank(trainer.dist.rank)
        if not self.loaded:
            r.pending.clear()
            r.generations, r.flat_generations = 0, 0
        elif self.loaded_rank != r.rank:
            # another world size: this rank read rank 0's state (core.checkpoint.sharded), not its own
            r.pending.clear()
        r.samples.clear()
        r.training = True
        r.where = lambda: RewardState(trainer.state.step, trainer.total_steps, trainer.state.epoch)
        self.out = trainer.run_dir / "completions.jsonl" if trainer.dist.is_main else None

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Append the step's sampled completions to completions.jsonl."""
        samples, self.rollouts.samples[:] = list(self.rollouts.samples), []
        if self.out is not None and samples:
            with self.out.open("a", encoding="utf-8") as f:
                for s in samples:
                    f.write(json.dumps({"step": trainer.state.step, **s}) + "\n")

    def close(self) -> None:
        """The loop is over: a later step (a probe) is one rank's alone."""
        self.rollouts.training, self.rollouts.where = False, None

    def state_dict(self) -> dict[str, Any]:
        """The generation count and the pending rollouts."""
        r = self.rollouts
        pending = [{"key": list(k), **v.state()} for k, v in r.pending.items()]
        counts = {"generations": r.generations, "flat_generations": r.flat_generations, "rank": r.rank}
        return {**counts, "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s."""
        r = self.rollouts
        r.generations, r.flat_generations = int(state["generations"]), int(state["flat_generations"])
        self.loaded_rank = int(state.get("rank", 0))
        r.pending = {}
        for entry in state["pending"]:
            entry = dict(entry)
            key = tuple(entry.pop("key"))
            r.pending[key] = ScoredRollout(**entry)
        self.loaded = True


def check_room(max_new_tokens: int, context: int) -> None:
    """One line naming task.max_new_tokens when a completion of that many tokens leaves no room for a prompt
    in `context` positions."""
    if max_new_tokens >= context:
        raise ConfigError(
            f"task.max_new_tokens={max_new_tokens} leaves no room for a prompt in task.context={context}",
            key="task.max_new_tokens",
            value=str(max_new_tokens),
            valid=(f"< {context}",),
        )


# ---- what the tasks that sample prompts' completions share ---------------------------------------------
#: `PromptSampling.sample`'s overrides for evaluation: one plain greedy completion a prompt, so val/reward
#: measures the model alike whatever the training samples' settings (a repetition penalty's too)
GREEDY: dict[str, Any] = {"group_size": 1, "temperature": 0.0, "repetition_penalty": 1.0}


class PromptSampling:
    """The part of a task that samples its own completions of data=prompts (+task=grpo, on-policy
    distillation): the prompts read, tokenized and batched, and completions sampled with the task's
    settings. Mixed into a `ChatFineTuning` (its data_cfg, template, tokenizer_spec, run_tokenizer and
    context), whose `__init__` sets the sampling settings below."""

    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    #: sample among this many likeliest tokens (0: all; TRL's top_k)
    top_k: int = 0
    #: sample among the tokens at least this share as likely as the likeliest (0: all; TRL's min_p)
    min_p: float = 0.0
    #: the tokens already in a prompt and its completion made less likely by this factor (1: none)
    repetition_penalty: float = 1.0
    #: the tokenized (training, validation) prompts, once `build_datasets` has built them
    prompt_sets: tuple[PromptSet, PromptSet] | None = None

    @functools.cached_property
    def corpus(self) -> PromptCorpus:
        """Training and validation prompts, read once."""
        corpus = DATASETS.build_section(self.data_cfg)
        if not corpus.val:
            raise DataError("no validation prompts; give data.val or raise data.val_fraction", key="data.val")
        return corpus

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer (bpe: fitted on the rendered training prompts)."""
        if self.run_tokenizer is not None:
            return self.run_tokenizer
        if self.tokenizer_spec.name == "pretrained":
            return self.tokenizer_spec.fit([])
        return self.tokenizer_spec.fit([prompt_text(r["prompt"], self.template) for r in self.corpus.train])

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """The training and validation prompts, tokenized (`PromptSet`)."""
        sizes = {"context": self.context, "max_new_tokens": self.max_new_tokens}
        train, val = (
            tokenize_prompts(rows, self.template, self.tokenizer, split=split, **sizes)
            for rows, split in ((self.corpus.train, "training"), (self.corpus.val, "validation"))
        )
        self.prompt_sets = (train, val)
        return train, val

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """Batches of prompts (`collate_prompts`)."""
        return collate_prompts

    def loss_units(self, batch: dict[str, Any]) -> int:
        """Prompts (grpo's mean over sequences, dr_grpo's constant normaliser; dapo and on-policy
        distillation count the completion tokens `prepare_group` sampled instead)."""
        return len(batch["rows"])

    def throughput_units(self, batch: dict[str, Any]) -> float:
        """Completions sampled and trained on."""
        return float(len(batch["rows"]) * self.group_size)

    def export_inputs(
        self, model: nn.Module, batch: dict[str, Any], *, length: int | None = None
    ) -> ExportInputs:
        """As +task=lm exports (token ids in, logits out), on the batch's prompts cut to its shortest: a
        batch of prompts holds rows (`collate_prompts`), not the (tokens, targets) +task=lm's export reads."""
        shortest = min(len(r.ids) for r in batch["rows"])
        tokens = torch.tensor([r.ids[:shortest] for r in batch["rows"]], dtype=torch.long)
        return LanguageModeling.export_inputs(self, model, (tokens,), length=length)  # type: ignore[arg-type]

    def sample(
        self, model: nn.Module, rows: Sequence[PromptRow], generator: torch.Generator, **options: Any
    ) -> Rollout:
        """Completions of `rows` (`rollout` with the task's settings; `options` override them)."""
        settings = {
            "group_size": self.group_size,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            **options,
        }
        tok = self.tokenizer
        end = tok.encode(self.template.end_of_turn())
        return rollout(
            model, [r.ids for r in rows], end=end, eos_id=tok.eos_id, generator=generator, **settings
        )

    def answer_ids(self, row: PromptRow, field: str, needed_by: str) -> list[int]:
        """The ids of `row`'s `field` and the end a completion of its prompt would have (a message list's:
        the template's end of turn; a text's: the end of document), cut to max_new_tokens; a row without
        it: one line naming `needed_by` (the setting that reads it)."""
        if field not in row.fields:
            raise DataError(
                f"{needed_by} completes prompts with their answers; prompt {row.index} has no "
                f"'{field}' field",
                key="task.answer_field",
                value=field,
                valid=tuple(sorted(row.fields)),
            )
        tok = self.tokenizer
        if isinstance(row.prompt, str):
            end = [] if tok.eos_id is None else [tok.eos_id]
        else:
            end = tok.encode(self.template.end_of_turn())
        return (tok.encode(str(row.fields[field])) + end)[: self.max_new_tokens]

    def end_length(self, ids: Sequence[int]) -> int:
        """How many of a completion's last ids are its end of turn or document end (0: it was cut off at
        max_new_tokens)."""
        tok, ids = self.tokenizer, list(ids)
        end = tok.encode(self.template.end_of_turn())
        if end and ids[-len(end) :] == end:
            return len(end)
        return 1 if tok.eos_id is not None and ids[-1:] == [tok.eos_id] else 0

    def completion_text(self, ids: Sequence[int]) -> str:
        """A completion's text, its end of turn (or document end) left out."""
        ids = list(ids)
        return self.tokenizer.decode(ids[: len(ids) - self.end_length(ids)])

    def packed(
        self, model: nn.Module, rows: Sequence[PromptRow], completions: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, completion mask) of `rows` (each repeated for its share of `completions`) and
        `completions`, on the model's device (`pack_rollout`)."""
        per_row = len(completions) // len(rows)
        prompts = [r.ids for r in rows for _ in range(per_row)]
        tokens, mask = pack_rollout(prompts, completions, self.tokenizer.pad_id)
        device = next(model.parameters()).device
        return tokens.to(device), mask.to(device)
