"""Logit distillation (`+task=distill`): a student decoder trained on a teacher's next-token distribution,
over the lm task's text data or the sft task's conversations (the loss on assistant tokens alone).

The teacher (`task.teacher=DIR`: a torchkiln run or a Hugging Face folder, `text.teacher`) must share the
student's vocabulary; it runs beside the student on each batch, without gradients (the online teacher,
the default), or its top-k log-probabilities are read from a folder `recipes.prepare` stored once beside
the token shards (`task.teacher_logprobs=SHARDS/teacher`).

The loss is TRL's generalised Jensen-Shannon divergence (GKD, Agarwal et al. 2024, eq. 1) per position,
with TRL's convention (`GKDTrainer.generalized_jsd_loss`, checked against it in tests/text/test_distill.py):
both distributions at `task.temperature`, the mixture M = (1 - beta) student + beta teacher, and
JSD_beta = beta KL(teacher || M) + (1 - beta) KL(student || M); beta 0 is the forward KL(teacher ||
student) and beta 1 the reverse KL(student || teacher) exactly (`task.loss=forward_kl|reverse_kl|jsd`).
It is a mean over the positions whose target is kept (text: within a document; chat: the assistant's), as
the lm task's cross-entropy, so accumulation and ranks weight it by token (`loss_units`). `task.hard_weight`
w mixes in that cross-entropy: (1 - w) divergence + w cross-entropy. No T^2 factor, as TRL.

Against stored top-k the divergence is taken over k + 1 categories: the k ids the teacher ranked highest
at each position, and one for the rest of the vocabulary. The teacher's rest is 1 minus its k stored
probabilities (they are over the whole vocabulary), the student's is the mass its softmax puts outside
those ids; both then are whole distributions, all three losses are defined, a student gains nothing by
moving mass out of the top k, and k = the vocabulary gives the full loss. `task.temperature` softens the
k + 1 categories (exact at 1; the rest's share at another temperature would need the whole vocabulary).

Evaluation reports `loss` (the training objective), `ce` (the student's cross-entropy on the kept targets,
nats per token: what a student trained without a teacher is compared on, the primary metric) and
`divergence`, each a mean over the kept targets.

On-policy (`task.on_policy=true data=prompts`: TRL's `GKDTrainer` with lmbda 1, Agarwal et al.'s on-policy
GKD): each batch's prompts (`text.prompts`, read and batched as +task=grpo reads them) are answered by the
student itself, `task.group_size` completions each, sampled with GRPO's generator (`text.rollouts.rollout`, at
`task.temperature`, `task.top_p`, `task.top_k`, `task.max_new_tokens`); the teacher scores those tokens,
and the loss is the divergence on the completion positions alone (`text.rollouts.pack_rollout`'s mask), a
mean over the completion tokens of the step's batch on every rank (each accumulation group's completions
are sampled before its first step, `prepare_group`, so the loop weighs each micro-batch by its tokens). With
`task.lmbda` < 1 a batch is the student's with that probability (TRL's lmbda), else its prompts'
`task.answer_field` completes them (off-policy; 0: always). Each generation's sampling seed, and that
draw, come from the run seed, the rank and the generation's number (`text.rollouts.PendingRollouts`),
checkpointed: resume is bit-exact.
Evaluation: every validation prompt answered greedily, `loss` = `divergence` per completion token of those
answers (the primary metric), and `exact_match` against the answer field where the prompts carry one.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core import compile as kc
from core.bounds import Bounds
from core.errors import ConfigError
from core.loop.callbacks import Callback
from core.loop.task import ExportInputs, StepOutput, Task
from core.registry import DATASETS, TASKS
from text.chat import ChatCorpus
from text.lm import LanguageModeling
from text.lm_data import IGNORE, LMData, TokenCorpus, TokenWindows
from text.prompts import PromptCorpus, PromptRow
from text.rollouts import GREEDY, PendingRollouts, PromptSampling, RolloutState, check_room, rollout_key
from text.sft import ChatFineTuning
from text.teacher import StoredTopK, Teacher, TeacherWindows, check_vocabulary, load_teacher
from text.token_shards import ShardSet
from text.tokenizer import Tokenizer, tokenizer_hash

#: task.loss -> the generalised JSD's beta (None: task.beta)
LOSSES: dict[str, float | None] = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": None}


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """The generalised JSD (module docstring) at each position: (..., V) logits in, (...) divergences out.
    Either input may be log-probabilities (a softmax ignores an offset per position)."""
    student = F.log_softmax(student_logits / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return _kl(teacher, student)
    if beta == 1:
        return _kl(student, teacher)
    mixture = torch.logsumexp(torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0)
    return beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim, from log-probabilities."""
    return F.kl_div(q, p, reduction="none", log_target=True).sum(-1)


#: log-probability standing for an empty remainder (a finite stand-in for log 0, so that 0 * log 0 is 0)
EMPTY = -1e4


def top_k_and_rest(
    student_logits: torch.Tensor, ids: torch.Tensor, teacher_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(student, teacher) log-probabilities over the k ids `ids` (..., k) and the rest of the vocabulary
    (..., k + 1), from the student's logits (..., V) and the teacher's log-probabilities at `ids`."""
    student = F.log_softmax(student_logits, dim=-1)
    outside = student.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    rest = 1 - teacher_logprobs.exp().sum(-1, keepdim=True)
    # a remainder within the sum's rounding is none: its log would weigh a rounding error as real mass
    teacher_rest = rest.masked_fill(rest < ids.shape[-1] * torch.finfo(rest.dtype).eps, 0).log()
    return (
        torch.cat([student.gather(-1, ids), outside.clamp(min=EMPTY)], -1),
        torch.cat([teacher_logprobs, teacher_rest.clamp(min=EMPTY)], -1),
    )


def kept_mean(values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean of per-position `values` where `targets` are not IGNOREd, as sum / max(count, 1) (a batch
    with none kept gives 0, not an empty mean's NaN)."""
    keep = targets != IGNORE
    return torch.where(keep, values, 0).sum() / keep.sum().clamp(min=1)


@TASKS.register("distill")
class Distillation(ChatFineTuning, PromptSampling):
    """A student trained on a teacher's next-token distribution (module docstring), on text or chat data, or
    on-policy on its own completions of prompts."""

    data_type = (LMData, ChatCorpus, PromptCorpus)
    #: the student's own cross-entropy: what a student trained without the teacher is compared on
    primary_metric = "val/ce"

    def __init__(
        self,
        *,
        model: dict[str, Any],
        data: dict[str, Any],
        loss: Annotated[str, Bounds(choices=tuple(LOSSES))] = "jsd",
        beta: Annotated[float, Bounds(ge=0, le=1)] = 0.5,
        temperature: Annotated[float, Bounds(gt=0)] = 1.0,
        hard_weight: Annotated[float, Bounds(ge=0, le=1)] = 0.0,
        teacher: str = "",
        teacher_logprobs: str = "",
        tokenizer: str = "bytes",
        bpe_vocab_size: Annotated[int, Bounds(ge=1)] = 2048,
        context: Annotated[int, Bounds(ge=1)] = 256,
        val_chunks: Annotated[int, Bounds(ge=0)] = 0,
        eval_questions: Annotated[int, Bounds(ge=0)] = 0,
        on_policy: bool = False,
        group_size: Annotated[int, Bounds(ge=1)] = 1,
        max_new_tokens: Annotated[int, Bounds(ge=1)] = 64,
        top_p: Annotated[float, Bounds(gt=0, le=1)] = 1.0,
        top_k: Annotated[int, Bounds(ge=0)] = 0,
        lmbda: Annotated[float, Bounds(ge=0, le=1)] = 1.0,
        answer_field: str = "answer",
    ) -> None:
        """`model`/`data` are config sections (a registered `name` plus that builder's keywords): the
        student, and text data (as +task=lm's), conversations (as +task=sft's) or, on-policy, prompts (as
        +task=grpo's).

        loss: forward_kl (KL(teacher||student)), reverse_kl (KL(student||teacher)) or jsd (TRL's generalised
            JSD with beta)
        beta: jsd's interpolation: 0 is forward_kl, 1 reverse_kl (TRL's GKD convention)
        temperature: both distributions are softened by it before the divergence
        hard_weight: w in (1 - w) divergence + w cross-entropy on the data's next tokens
        teacher: the teacher, a torchkiln run directory or a Hugging Face decoder folder, of the student's
            vocabulary (required unless teacher_logprobs is given)
        teacher_logprobs: a folder of the teacher's stored top-k log-probabilities (recipes.prepare ...
            teacher=DIR teacher_top_k=K writes DATA/teacher) read instead of running the teacher; empty: the
            online teacher
        tokenizer: bytes, bpe or pretrained (the student's; the teacher's must be the same)
        bpe_vocab_size: vocabulary size the bpe tokenizer learns
        context: tokens per training row (chunk of text or packed conversations)
        val_chunks: text data: evaluate on this many evenly spaced validation chunks (0: all of them)
        eval_questions: chat data: validation conversations answered greedily for exact_match (0: none)
        on_policy: the student samples completions of data=prompts and the teacher scores them (GKD)
        group_size: on-policy: completions sampled per prompt
        max_new_tokens: on-policy: most tokens of a completion
        top_p: on-policy: sample among the fewest likeliest tokens holding this much probability (1: all)
        top_k: on-policy: sample among this many likeliest tokens (0: all), as TRL's
        lmbda: on-policy: the share of batches the student completes; the others take the prompts'
            answer_field (TRL's lmbda)
        answer_field: on-policy: the prompt rows' key holding an answer (exact_match, lmbda's batches)
        """
        super().__init__(
            model=model,
            data=data,
            tokenizer=tokenizer,
            bpe_vocab_size=bpe_vocab_size,
            context=context,
            eval_questions=eval_questions,
        )
        self.teacher_path, self.teacher_logprobs = teacher, teacher_logprobs
        self.temperature, self.hard_weight = temperature, hard_weight
        fixed = LOSSES[loss]
        self.beta = beta if fixed is None else fixed
        self.val_chunks = val_chunks
        self._teacher_device: torch.device | None = None
        self.on_policy, self.group_size, self.max_new_tokens = on_policy, group_size, max_new_tokens
        self.top_p, self.top_k, self.lmbda, self.answer_field = top_p, top_k, lmbda, answer_field
        self.rollouts = PendingRollouts()
        #: on-policy: (tokens, completion mask) of the accumulation group's batches, by prompt indices
        self._completions: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        if on_policy:
            check_on_policy(self.prompts, teacher_logprobs, hard_weight, max_new_tokens, context)
            self.primary_metric, self.throughput_unit = "val/divergence", "completions"

    # -- text, chat or prompts: the lm task's data handling, the sft task's or grpo's ------------------------

    @functools.cached_property
    def chat(self) -> bool:
        """Whether the data are conversations (a chat dataset, or shards prepared with +task=sft)."""
        name = self.data_cfg.get("name", "")
        if name == "tokens" and self.data_cfg.get("path"):
            return "chat" in ShardSet(self.data_cfg["path"]).manifest
        return self._data_returns() is ChatCorpus

    @functools.cached_property
    def prompts(self) -> bool:
        """Whether the data are prompts (data=prompts: on-policy distillation's)."""
        return self._data_returns() is PromptCorpus

    def _data_returns(self) -> Any:
        builder = DATASETS.get(self.data_cfg.get("name", ""))
        return typing.get_type_hints(getattr(builder, "__wrapped__", builder)).get("return")

    @property
    def _data_task(self) -> type[Any]:
        """The base class whose data handling serves these data: +task=lm's, +task=sft's, or for prompts
        +task=grpo's (`PromptSampling`)."""
        if self.prompts:
            return PromptSampling
        return ChatFineTuning if self.chat else LanguageModeling

    @functools.cached_property
    def corpus(self) -> Any:  # type: ignore[override]
        """The training and validation data, read and checked as +task=sft or +task=lm reads them."""
        return self._data_task.__dict__["corpus"].func(self)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:  # type: ignore[override]
        """The student's tokenizer, as +task=sft or +task=lm makes it."""
        return self._data_task.__dict__["tokenizer"].func(self)

    def generate(self, model: nn.Module, prompt: str, **options: Any) -> str:
        """As +task=sft (a reply in the chat template: chat data, prompts) or +task=lm (a continuation)
        generates."""
        text = self._data_task is LanguageModeling
        return (LanguageModeling if text else ChatFineTuning).generate(self, model, prompt, **options)

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """Batches as +task=lm, +task=sft or (prompts) +task=grpo makes them."""
        return self._data_task.collate_fn(self)

    def export_inputs(self, model: nn.Module, batch: Any, *, length: int | None = None) -> ExportInputs:
        """The student as +task=lm exports it, from these data's batches (prompts: +task=grpo's)."""
        return self._data_task.export_inputs(self, model, batch, length=length)

    def prepare_group(self, model: nn.Module, batches: list[Any]) -> None:
        """On-policy: every micro-batch of the accumulation group completed before the first is trained
        on, so that each one's loss units are its completion tokens (`loss_units`), as GRPO's dapo."""
        if self.on_policy:
            for batch in batches:
                rows, key = batch["rows"], rollout_key(batch["rows"])
                if key not in self._completions:
                    self._completions[key] = self._complete(model, rows)

    def loss_units(self, batch: Any) -> int:
        """Kept targets (text, chat) or, on-policy, the completion tokens `prepare_group` sampled: the loop
        weighs each micro-batch's mean by them, so the step's loss is a mean over all of them."""
        done = self._completions.get(rollout_key(batch["rows"])) if self.on_policy else None
        return self._data_task.loss_units(self, batch) if done is None else int(done[1].sum())

    def throughput_units(self, batch: Any) -> float:
        """Input positions (text, chat) or completions sampled (on-policy)."""
        return self._data_task.throughput_units(self, batch)

    def callbacks(self) -> list[Callback]:
        """On-policy: the sampling state checkpointed (bit-exact resume) and completions.jsonl."""
        return [RolloutState(self.rollouts, 1)] if self.on_policy else super().callbacks()

    # -- the teacher ----------------------------------------------------------------------------------------

    @functools.cached_property
    def teacher(self) -> Teacher:
        """The online teacher, loaded and its vocabulary checked (one line naming task.teacher)."""
        if not self.teacher_path:
            raise ConfigError(
                "+task=distill needs a teacher: set task.teacher=DIR (a run or a Hugging Face folder) or "
                "task.teacher_logprobs=DIR (stored top-k)",
                key="task.teacher",
                value="",
                valid=("a torchkiln run directory", "a Hugging Face decoder folder"),
            )
        teacher = load_teacher(self.teacher_path, self.context)
        check_vocabulary(teacher, self.tokenizer, self.teacher_path, self.tokenizer.vocab_size)
        return teacher

    @functools.cached_property
    def stored(self) -> StoredTopK | None:
        """The stored top-k folder (task.teacher_logprobs), checked against the data and settings."""
        if not self.teacher_logprobs:
            return None
        stored = StoredTopK(self.teacher_logprobs)
        key, value = "task.teacher_logprobs", self.teacher_logprobs
        if self.chat or not isinstance(self.corpus, TokenCorpus) or len(self.corpus.train) != 1:
            raise ConfigError(
                "task.teacher_logprobs reads top-k stored for one +task=lm prepared folder: use data=tokens "
                "data.path=SHARDS (not data.sources, not conversations), or the online task.teacher",
                key=key,
                value=value,
            )
        if stored.context != self.context:
            raise ConfigError(
                f"task.teacher_logprobs={value} was stored for task.context={stored.context}; set it so",
                key="task.context",
                value=str(self.context),
                valid=(str(stored.context),),
            )
        if stored.manifest.get("tokenizer_hash") != tokenizer_hash(self.tokenizer):
            raise ConfigError(
                f"task.teacher_logprobs={value} was stored for another tokenizer than the student's",
                key=key,
                value=value,
            )
        return stored

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """The student's data as +task=lm or +task=sft builds it (with stored top-k, each window carries the
        teacher's), or on-policy the prompts as +task=grpo builds them. The teacher is loaded (and checked)
        here, before any training."""
        if self.prompts and not self.on_policy:
            # checked here, not when built: recipes.cli.validate builds each task with every data it accepts
            raise ConfigError(
                "data=prompts holds prompts alone: distil on the student's completions of them with "
                "task.on_policy=true (or give text or conversations)",
                key="task.on_policy",
                value="false",
                valid=("true",),
            )
        train, val = self._data_task.build_datasets(self)
        if self.stored is None:
            _ = self.teacher
            return train, val
        parts = []
        for ds, name in ((train, "train"), (val, "val")):
            if not isinstance(ds, TokenWindows):  # a validation set cut by val_chunks is still windows
                raise ConfigError(
                    "task.teacher_logprobs needs one prepared folder", key="task.teacher_logprobs"
                )
            parts.append(TeacherWindows(ds, *self.stored.split(name)))
        return parts[0], parts[1]

    def _teacher_logits(
        self, logits: torch.Tensor, batch: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """(student, teacher) logits over the same categories: the whole shared vocabulary (online), or the
        stored top-k ids and the rest (`top_k_and_rest`)."""
        if self.stored is not None:
            return top_k_and_rest(logits, batch[3], batch[4])
        model = self.teacher.model
        if self._teacher_device != logits.device:
            model.to(logits.device)
            self._teacher_device = logits.device
        x, d = batch[0], batch[2] if self.packing else None
        with torch.no_grad():
            teacher = model(x) if d is None else model(x, d)
        width = min(logits.shape[-1], teacher.shape[-1])
        return logits[..., :width], teacher[..., :width].float()

    # -- the loss -------------------------------------------------------------------------------------------

    def step(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> StepOutput:
        """The distillation loss (module docstring) over the batch's kept targets, with `ce` and
        `divergence` among the metrics; on-policy, over its completions' tokens."""
        if self.on_policy:
            return self._on_policy_step(model, batch["rows"])
        x, y, d = batch[:3]
        logits = (model(x, d) if self.packing else model(x)).float()
        ce = kept_mean(F.cross_entropy(logits.transpose(1, 2), y, ignore_index=IGNORE, reduction="none"), y)
        student, teacher = self._teacher_logits(logits, batch)
        divergence = kept_mean(
            generalized_jsd(student, teacher, beta=self.beta, temperature=self.temperature), y
        )
        loss = (1 - self.hard_weight) * divergence + self.hard_weight * ce if self.hard_weight else divergence
        metrics = {"ce": ce.detach(), "divergence": divergence.detach()}
        # weighted by the targets it is a mean over, so an evaluation's means are per kept target
        return StepOutput(loss=loss, count=int((y != IGNORE).sum()), metrics=metrics)

    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """`loss`, `ce` and `divergence` per kept target over `batches` (`step` weighs each batch by its kept
        targets); chat data: and exact_match; on-policy: of greedy completions (module docstring)."""
        if self.on_policy:
            return self._evaluate_greedy(model, batches)
        result = Task.evaluate(self, model, batches)
        if self.chat and self.eval_questions:
            result.update(self.exact_match(model, self.val_conversations[: self.eval_questions]))
        return result

    # -- on-policy ------------------------------------------------------------------------------------------

    def _divergences(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """The divergence (B, L - 1) at each next-token position of `tokens` (B, L), student against
        teacher, each row one sequence from position 0."""
        x = tokens[:, :-1]
        logits = model(kc.bucket_for_compiled(model, x, self.context))[:, : x.shape[1]]
        student, teacher = self._teacher_logits(logits.float(), (x, None, None))
        return generalized_jsd(student, teacher, beta=self.beta, temperature=self.temperature)

    def _on_policy_step(self, model: nn.Module, rows: Sequence[PromptRow]) -> StepOutput:
        """The divergence on the completion tokens of `rows` (`prepare_group`'s, or completed now), a mean
        over them."""
        done = self._completions.pop(rollout_key(rows), None)
        tokens, mask = self._complete(model, rows) if done is None else done
        divergence = torch.where(mask, self._divergences(model, tokens), 0).sum()
        metrics = {
            "divergence": divergence.detach() / mask.sum().clamp(min=1),
            "completion_length": float(mask.sum(-1).double().mean()),
        }
        return StepOutput(loss=divergence / mask.sum().clamp(min=1), count=len(rows), metrics=metrics)

    def _complete(self, model: nn.Module, rows: Sequence[PromptRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, completion mask) of `rows` completed by the student's samples, or with probability
        1 - lmbda by their answers."""
        generator = self.rollouts.generator()
        # drawn only when lmbda < 1, so that lmbda 1 samples what it would without the option
        if self.lmbda < 1 and float(torch.rand((), generator=generator)) > self.lmbda:
            completions = [self.answer_ids(r, self.answer_field, f"task.lmbda={self.lmbda}") for r in rows]
        else:
            completions = self.sample(model, rows, generator).ids
        per_row = len(completions) // len(rows)
        texts = [self.completion_text(c) for c in completions[:per_row]]
        self.rollouts.samples.append({"prompt": rows[0].prompt, "completions": texts})
        return self.packed(model, rows, completions)

    def _evaluate_greedy(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """`loss` = `divergence` per completion token of the student's greedy answers to the validation
        prompts; `exact_match` of those answers to the prompts' answer field, where they carry one."""
        total, count, right, asked = 0.0, 0, 0, 0
        for batch in batches:
            rows = batch["rows"]
            greedy = self.sample(model, rows, torch.Generator(), **GREEDY).ids
            tokens, mask = self.packed(model, rows, greedy)
            total += float(torch.where(mask, self._divergences(model, tokens), 0).sum())
            count += int(mask.sum())
            for row, ids in zip(rows, greedy, strict=True):
                if self.answer_field in row.fields:
                    asked += 1
                    right += self.completion_text(ids).strip() == str(row.fields[self.answer_field]).strip()
        out = {"loss": total / max(count, 1), "divergence": total / max(count, 1)}
        if asked:
            out["exact_match"] = right / asked
        return out


def check_on_policy(
    prompts: bool, teacher_logprobs: str, hard_weight: float, max_new_tokens: int, context: int
) -> None:
    """One-line ConfigError, naming the key, for on-policy settings that cannot work."""
    if not prompts:
        raise ConfigError(
            "task.on_policy=true samples the student's completions of prompts: use data=prompts",
            key="task.on_policy",
            value="true",
            valid=("false",),
        )
    if teacher_logprobs:
        raise ConfigError(
            "task.on_policy=true scores the student's own samples: the teacher must run (task.teacher), "
            "stored top-k cannot",
            key="task.teacher_logprobs",
            value=teacher_logprobs,
        )
    if hard_weight:
        raise ConfigError(
            "task.hard_weight needs the data's next tokens; on-policy completions are the student's own",
            key="task.hard_weight",
            value=str(hard_weight),
            valid=("0",),
        )
    check_room(max_new_tokens, context)
