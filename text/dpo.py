"""Preference tuning (`+task=dpo`): a decoder (model=llama, usually `model.weights=DIR`, the run of
`+task=sft` exported) trained on preference pairs (`text.preference`), with the loss TRL's trainers compute:

- `task.loss=sigmoid`: DPO (Rafailov et al., 2023), -log sigmoid(beta * margin), the margin the chosen
  completion's log-ratio to the reference minus the rejected one's (TRL's DPOTrainer, loss_type="sigmoid";
  `task.label_smoothing` eps gives conservative DPO, -(1-eps) log sigmoid(beta m) - eps log sigmoid(-beta m));
- `ipo`: IPO (Azar et al., 2023), (m / tokens - 1 / (2 beta))^2, each log-ratio averaged over its completion's
  tokens as TRL's DPOTrainer does (loss_type="ipo");
- `simpo`: SimPO (Meng et al., 2024), reference-free, -log sigmoid(beta (chosen - rejected) - gamma) on
  log-probabilities averaged over each completion's tokens, gamma `task.simpo_gamma` (TRL's CPOTrainer,
  loss_type="simpo"; with label smoothing as there).

TRL's other DPO loss types (hinge, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired,
apo_zero, apo_down, discopop, sigmoid_norm), lists of them with weights, and f-DPO's divergences:
`text.preference_losses`.

`task.sft_weight` adds that weight times the mean negative log-likelihood of the chosen completions' tokens
(TRL's rpo_alpha: its "sft" loss term, CPO's cpo_alpha). The rewards logged are beta times each completion's
log-ratio (SimPO: beta times its mean log-probability); `rewards/accuracy` is the share of pairs whose
chosen reward is above the rejected one's.

Chosen and rejected rows go through one forward (a batch of 2B rows, `text.preference.collate_pairs`). The
loss is a mean over pairs, so the loop weights micro-batches by their pairs (`loss_units`): accumulating
1 x 8 pairs gives one batch of 8's gradient (the SFT term is a mean over each micro-batch's chosen tokens,
as in TRL).

The reference: under LoRA (`trainer.lora.rank > 0`) the model itself with its adapters switched off
(`core.nn.lora.adapters_off`: no second copy); otherwise a frozen copy of the model as built, built again
from the same weights folder or random state when first used (so a resumed run's is the first run's) and
moved beside the model. `task.precompute_reference=true` computes the reference
log-probabilities of every training and validation pair once, before the first step (each rank a share,
summed over ranks), and stores them in the run directory (`REFERENCE_FILE`, with a fingerprint of the pairs'
ids, the reference weights and the precision): a resumed run reads them back, a changed input computes them
again; the frozen copy is then freed.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.distributed import dist_env
from core.distributed import group as dgroup
from core.errors import DataError
from core.files import write_atomic
from core.logging.messages import say, warn
from core.loop.callbacks import Callback
from core.loop.task import StepOutput, Task
from core.nn.lora import adapters_off, is_adapter, lora_modules
from core.registry import TASKS
from text.chat import Conversation
from text.lm_data import IGNORE
from text.preference import (
    PreferenceCorpus,
    PreferencePair,
    PreferencePairs,
    encode_pair,
    pair_collate,
    pair_texts,
)
from text.preference_losses import F_DIVERGENCES, LOSSES, check_losses, pair_losses
from text.reference_sync import ReferenceSync
from text.sft import ChatFineTuning

#: task.rejected: the pairs' own rejected answers, or the model's own greedy answers where they are wrong
REJECTED = ("data", "model")
#: the precomputed reference log-probabilities in a run directory: (pairs, 2) chosen and rejected
REFERENCE_FILE = "reference_logps.safetensors"
#: the CPU random state a run's model of random init was built from, which its reference is built again from
INIT_FILE = "reference_init.safetensors"
#: pairs per forward when the reference log-probabilities are precomputed
PRECOMPUTE_PAIRS = 8


def completion_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each target's log-probability under `logits` (N, L, V), 0 where it is IGNOREd: (N, L), in float32 at
    least (float64 stays float64)."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return -F.cross_entropy(
        wide.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none"
    ).view(targets.shape)


def first_scored(targets: torch.Tensor) -> int:
    """The first position whose target is a completion token in any row of `targets` (N, L) (0 on the meta
    device, where no value is known): rows are right-padded, so no logit before it is ever read."""
    if targets.device.type == "meta" or not targets.numel():
        return 0
    # argmax is each row's first scored position (0 for a row with none: every position kept)
    return int((targets != IGNORE).int().argmax(1).min())


def scored_logps(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, *, square_mass: bool = False
) -> Any:
    """`completion_logps` of `model` on `tokens`, its head run from `first_scored(targets)` on (the model's
    `logits_to_keep`): (N, L - that position). The prompts' logits are never read, and the head (the
    vocabulary's matmul) with its log-softmax is the widest part of a small decoder (BENCHMARKS § DPO).
    With `square_mass`, also log sum_v p_v^2 at each of those positions (WPO's), without gradient."""
    first = first_scored(targets)
    logits = model(tokens, logits_to_keep=tokens.shape[1] - first)
    logps = completion_logps(logits, targets[:, first:])
    if not square_mass:
        return logps
    with torch.no_grad():
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        squares = torch.logsumexp(2 * wide.log_softmax(-1), dim=-1)
    return logps, squares


def desensitized_sums(per_token: torch.Tensor, mask: torch.Tensor, alpha: float | None) -> torch.Tensor:
    """Each row's summed log-probs `per_token` (2B, L) over its completion tokens `mask`: chosen rows then
    rejected; with `alpha` (LD-DPO, TRL's ld_alpha), the tokens past the pair's shorter completion weighed
    by it (1: plain sums; 0: only the shared length counts)."""
    if alpha is None:
        return (per_token * mask).sum(1)
    lengths = mask.sum(1)
    half = len(lengths) // 2
    shared = torch.minimum(lengths[:half], lengths[half:]).repeat(2)[:, None]
    position = mask.cumsum(1)  # each completion token's place in its completion, from 1
    inside = mask.bool() & (position <= shared)
    beyond = mask.bool() & (position > shared)
    return (per_token * inside).sum(1) + alpha * (per_token * beyond).sum(1)


def weights_sha256(model: nn.Module) -> str:
    """A SHA-256 of `model`'s tensors, names and values, its LoRA adapters left out (a sharded tensor is
    gathered whole: every rank calls this)."""
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        if is_adapter(name):
            continue
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        # a compiled or DDP-wrapped model's names carry its wrappers, which a resumed run may not choose alike
        digest.update(name.replace("_orig_mod.", "").removeprefix("module.").encode())
        digest.update(whole.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@TASKS.register("dpo")
class PreferenceTuning(ChatFineTuning):
    """Preference tuning of a decoder on chosen/rejected pairs: DPO, IPO or SimPO (module docstring)."""

    data_type = PreferenceCorpus

    def __init__(
        self,
        *,
        model: dict[str, Any],
        data: dict[str, Any],
        tokenizer: str = "bytes",
        bpe_vocab_size: Annotated[int, Bounds(ge=1)] = 2048,
        context: Annotated[int, Bounds(ge=1)] = 256,
        eval_questions: Annotated[int, Bounds(ge=0)] = 200,
        loss: Annotated[str | list[str], Bounds(choices=LOSSES)] = "sigmoid",
        loss_weights: list[float] = [],  # noqa: B006 - read only; the schema needs a plain default
        beta: Annotated[float, Bounds(gt=0)] = 0.1,
        simpo_gamma: Annotated[float, Bounds(ge=0)] = 0.5,
        label_smoothing: Annotated[float, Bounds(ge=0, lt=0.5)] = 0.0,
        f_divergence_type: Annotated[str, Bounds(choices=F_DIVERGENCES)] = "reverse_kl",
        f_alpha_divergence_coef: float = 0.5,
        discopop_tau: Annotated[float, Bounds(gt=0)] = 0.05,
        ld_alpha: Annotated[float | None, Bounds(ge=0, le=1)] = None,
        use_weighting: bool = False,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: Annotated[float, Bounds(ge=0, le=1)] = 0.6,
        ref_model_sync_steps: Annotated[int, Bounds(ge=1)] = 512,
        sft_weight: Annotated[float, Bounds(ge=0)] = 0.0,
        precompute_reference: bool = False,
        rejected: Annotated[str, Bounds(choices=REJECTED)] = "data",
    ) -> None:
        """`model`/`data` are config sections (a registered `name` plus that builder's keywords).

        tokenizer: bytes, bpe (learned on the training pairs) or pretrained (the model.weights folder's
            tokenizer.json, and its chat template); tokenizer=NAME sets it too
        bpe_vocab_size: vocabulary size the bpe tokenizer learns
        context: most tokens of a prompt and its completion (longer completions are cut to it)
        eval_questions: conversational validation pairs whose prompt is answered greedily for exact_match
            against the chosen answer (0: none)
        loss: sigmoid (DPO), ipo, simpo (reference-free), or another of TRL's DPO loss types (hinge,
            exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down,
            discopop, sigmoid_norm, sft); a list combines them (MPO: [sigmoid,bco_pair,sft])
        loss_weights: one weight per loss of a list (empty: 1 each), as TRL's
        beta: the loss's beta: DPO's KL weight, IPO's tau, SimPO's reward scale
        simpo_gamma: SimPO's target margin gamma (TRL's simpo_gamma)
        label_smoothing: the share of pairs taken as flipped: sigmoid (conservative DPO), simpo, robust,
            aot; exo_pair's epsilon (needed there)
        f_divergence_type: reverse_kl (DPO's), forward_kl, js_divergence or alpha_divergence: the
            f-divergence whose derivative replaces each log-ratio (f-DPO; sigmoid, ipo, hinge, ... only)
        f_alpha_divergence_coef: alpha_divergence's alpha
        discopop_tau: discopop's temperature of the blend of its two terms
        ld_alpha: LD-DPO's weight of each completion's tokens past the pair's shorter completion, in the
            policy's and the reference's log-probabilities (null: none, plain sums), as TRL's
        use_weighting: WPO's weights: each pair's losses times exp of each completion's mean over its tokens
            of log p - log sum_v p_v^2 (the policy's, detached), chosen times rejected, as TRL's
        sync_ref_model: every ref_model_sync_steps optimizer steps the reference becomes
            ref_model_mixup_alpha x the policy + (1 - that) x itself (TR-DPO's, TRL's; not with simpo, a
            precomputed reference or LoRA); the reference's weights are then checkpointed
        ref_model_mixup_alpha: the policy's share of the reference at each sync
        ref_model_sync_steps: optimizer steps between the reference's syncs
        sft_weight: weight of the chosen completions' negative log-likelihood added to the loss (TRL's
            rpo_alpha)
        precompute_reference: compute the reference log-probabilities once before training and keep them
            in the run directory (no reference model during training)
        rejected: data (the pairs' own) or model: each conversational training pair's rejected answer is
            the model's own greedy answer to its prompt where that is not the chosen one
        """
        super().__init__(
            model=model,
            data=data,
            tokenizer=tokenizer,
            bpe_vocab_size=bpe_vocab_size,
            context=context,
            eval_questions=eval_questions,
        )
        losses = [loss] if isinstance(loss, str) else list(loss)
        check_losses(
            losses,
            list(loss_weights),
            label_smoothing,
            f_divergence_type,
            ld_alpha=ld_alpha,
            use_weighting=use_weighting,
            sync_ref_model=sync_ref_model,
            precompute_reference=precompute_reference,
        )
        self.ld_alpha, self.use_weighting = ld_alpha, use_weighting
        sync = ReferenceSync(self._frozen_reference, ref_model_mixup_alpha, ref_model_sync_steps)
        self.reference_sync = sync if sync_ref_model else None
        weights = list(loss_weights) or [1.0] * len(losses)
        #: (pair loss, weight) of each loss but sft, whose weight joins sft_weight (the same term)
        self.losses = [(k, w) for k, w in zip(losses, weights, strict=True) if k != "sft"]
        self.reference_free = [k for k, _ in self.losses] == ["simpo"]
        self.beta, self.simpo_gamma = beta, simpo_gamma
        self.label_smoothing = label_smoothing
        self.sft_weight = sft_weight + sum(w for k, w in zip(losses, weights, strict=True) if k == "sft")
        self.divergence = (f_divergence_type, f_alpha_divergence_coef)
        self.discopop_tau = discopop_tau
        self.precompute_reference = precompute_reference and not self.reference_free
        self.rejected = rejected
        self.run_dir: Path | None = None
        self.build_rng: torch.Tensor | None = None  # the CPU random state build_model started from
        self.initial: nn.Module | None = None  # the model as built again: the frozen reference's source
        self.reference: nn.Module | None = None  # that copy, frozen, beside the model
        self.cached: torch.Tensor | None = None  # precomputed (pairs, 2) reference log-probabilities
        self.datasets: tuple[PreferencePairs, PreferencePairs] | None = None

    # ---- data -----------------------------------------------------------------------------------------
    def training_texts(self) -> list[str]:
        """The training pairs' prompts with each completion, rendered (what a bpe tokenizer learns from)."""
        return [t for p in self.corpus.train for t in pair_texts(p, self.template)]

    @functools.cached_property
    def val_conversations(self) -> list[Conversation]:
        """The conversational validation pairs as prompt + chosen answer (what exact_match asks)."""
        return [p.chosen_conversation() for p in self.corpus.val if p.conversational]

    @functools.cached_property
    def majority_answer(self) -> str:
        """The commonest chosen answer of the conversational training pairs (`majority_baseline`)."""
        answers = [p.chosen[-1]["content"].strip() for p in self.corpus.train if p.conversational]
        return collections.Counter(answers).most_common(1)[0][0] if answers else ""

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """The training and validation pairs, tokenized (`text.preference.PreferencePairs`); validation
        pairs are numbered after the training ones."""
        train_pairs = (
            self._models_rejected(self.corpus.train) if self.rejected == "model" else self.corpus.train
        )
        train, val = self._encode_splits(train_pairs)
        self._check_split("training", train)
        self._check_split("validation", val)
        self.datasets = (train, val)
        return train, val

    def build_val_dataset(self) -> Dataset:
        """The validation pairs, numbered as `build_datasets` numbers them, without the model's greedy answer
        to every training prompt (task.rejected=model) that only the training pairs take: a pair is left out
        for its prompt alone, so the training pairs' count is the same without them."""
        val = self._encode_splits(self.corpus.train)[1]
        self._check_split("validation", val)
        return val

    def _encode_splits(self, train_pairs: list[PreferencePair]) -> tuple[PreferencePairs, PreferencePairs]:
        """`train_pairs` and the corpus's validation pairs, tokenized; validation numbered after training."""
        tok, template = self.tokenizer, self.template
        train = PreferencePairs([encode_pair(p, template, tok) for p in train_pairs], self.context)
        val = PreferencePairs(
            [encode_pair(p, template, tok) for p in self.corpus.val], self.context, offset=len(train)
        )
        return train, val

    def _check_split(self, name: str, ds: PreferencePairs) -> None:
        """Stop when no pair of `ds` fits task.context; warn for the pairs left out or cut to it."""
        if not len(ds):
            raise DataError(
                f"no {name} pair keeps a completion token within task.context={self.context}; raise it",
                key="task.context",
                value=str(self.context),
            )
        if ds.dropped:
            warn(f"{ds.dropped} {name} pair(s) left out: their prompt fills task.context={self.context}")
        if ds.cut:
            warn(f"{ds.cut} {name} pair(s) longer than task.context={self.context} tokens were cut to it")

    def _models_rejected(self, pairs: list[PreferencePair]) -> list[PreferencePair]:
        """`pairs`, each conversational one's rejected answer the model's own greedy answer to its prompt
        (the model as built: the reference) where that answer is not the chosen one (task.rejected=model)."""
        model, out, replaced = self._initial_model().eval(), [], 0
        for pair in pairs:
            if pair.conversational:
                assert isinstance(pair.prompt, list) and isinstance(pair.chosen, list)
                want = pair.chosen[-1]["content"].strip()
                said = self.greedy_answer(model, pair.prompt, want)
                if said and said != want:
                    pair = dataclasses.replace(pair, rejected=[{"role": "assistant", "content": said}])
                    replaced += 1
            out.append(pair)
        if dist_env().is_main:
            say(
                f"task.rejected=model: the model's own answer is rejected in {replaced} of {len(pairs)} pairs"
            )
        self.initial = None  # built again if the reference needs it: none is held under LoRA
        return out

    def collate_fn(self) -> Any:
        """Pairs padded into one batch of chosen rows then rejected rows (`collate_pairs`)."""
        return pair_collate(self.tokenizer.pad_id)

    def loss_units(self, batch: Sequence[torch.Tensor]) -> int:
        """Pairs: the loss is a mean over them."""
        return int(batch[2].numel())

    def save_artifacts(self, run_dir: Path) -> None:
        """The tokenizer (the lm task's); for a model of random init (no model.weights), the random state it
        was built from (`INIT_FILE`), so a later command's reference is the run's. The run directory is where
        the precomputed reference is kept."""
        super().save_artifacts(run_dir)
        self.run_dir = Path(run_dir)
        if self.build_rng is not None and not self.model_cfg.get("weights"):
            from safetensors.torch import save

            data = save({"rng": self.build_rng})
            write_atomic(self.run_dir / INIT_FILE, lambda f: f.write(data))

    def load_artifacts(self, run_dir: Path) -> None:
        """The run's saved vocabulary and the random state its model was built from (`save_artifacts`)."""
        super().load_artifacts(run_dir)
        self.run_dir = Path(run_dir)
        if (self.run_dir / INIT_FILE).is_file():
            from safetensors.torch import load_file

            self.build_rng = load_file(self.run_dir / INIT_FILE)["rng"]

    # ---- model and reference --------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The configured model; the random state it was built from is kept, so that the frozen reference
        can be built again as this model was, when first needed (never under LoRA), with no copy held
        meanwhile and nothing drawn from the run's random stream."""
        if self.build_rng is None:  # (a finished run's, read by load_artifacts, stands)
            self.build_rng = torch.get_rng_state()
        return super().build_model()

    def _frozen_reference(self, model: nn.Module) -> nn.Module:
        """The model as built, frozen, in eval mode, on `model`'s device and in its dtype (a model on the
        meta device, a dry run's, gets one built there: no weights are read or made)."""
        p = next(model.parameters())
        if self.reference is None or next(self.reference.parameters()).device != p.device:
            synced = self.reference_sync is not None and self.reference is not None
            if synced and next(self.reference.parameters()).device.type != "meta":  # type: ignore[union-attr]
                source = self.reference  # moved, not built again: its syncs are in it
            elif p.device.type == "meta":
                with torch.device("meta"):
                    source = super().build_model()
            else:
                source = self._initial_model()
            self.reference = source.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)
        if self.reference_sync is not None:  # a resumed run's synced weights, loaded once
            self.reference_sync.restore(self.reference)
        return self.reference

    def _initial_model(self) -> nn.Module:
        """The model as `build_model` built it (the model.weights folder's weights, or the same random
        init), built whole on the host: a sharded run built its own on the meta device."""
        if self.initial is None:
            with torch.random.fork_rng(devices=[]), torch.device("cpu"):
                if self.build_rng is not None:
                    torch.set_rng_state(self.build_rng)
                self.initial = super().build_model()
        return self.initial

    @torch.no_grad()
    def reference_forward(
        self, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """The reference's summed completion log-probabilities of each row of `tokens` (N: chosen rows, then
        rejected; with task.ld_alpha, `desensitized_sums`)."""
        if lora_modules(model):
            self.reference = None  # the base weights under the adapters are the reference
            with adapters_off(model):
                per_token = scored_logps(model, tokens, targets)
        else:
            per_token = scored_logps(self._frozen_reference(model), tokens, targets)
        mask = (targets != IGNORE)[:, -per_token.shape[1] :].to(per_token.dtype)
        return desensitized_sums(per_token, mask, self.ld_alpha)

    def reference_logps(
        self, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """The reference's summed completion log-probabilities of the batch's rows (2B,): precomputed (the
        training run's `PrecomputedReference`), or computed now."""
        if self.cached is not None:
            pairs = self.cached.to(targets.device)[index]
            return torch.cat([pairs[:, 0], pairs[:, 1]])
        return self.reference_forward(model, tokens, targets)

    # ---- precomputed reference ------------------------------------------------------------------------
    def callbacks(self) -> list[Callback]:
        """With task.precompute_reference: the reference log-probabilities computed before the first step;
        with task.sync_ref_model, the reference's syncs."""
        out: list[Callback] = [PrecomputedReference(self)] if self.precompute_reference else []
        return out + ([self.reference_sync] if self.reference_sync is not None else [])

    def _fingerprint(self, model: nn.Module, precision: str) -> str:
        """What the precomputed log-probabilities depend on: the pairs' ids, the reference weights (under
        LoRA: `model`'s base), the precision."""
        assert self.datasets is not None, "build_datasets comes first"
        # with task.ld_alpha the sums cached are LD-DPO's (without, the string of the runs before it)
        ld = "" if self.ld_alpha is None else f" ld_alpha={self.ld_alpha}"
        digest = hashlib.sha256(f"{self.context} {precision}{ld}".encode())
        for ds in self.datasets:
            for pair in ds.pairs:
                for ids in pair:
                    digest.update(np.asarray([len(ids), *ids], dtype=np.int64).tobytes())
        reference = model if lora_modules(model) else self._initial_model()
        digest.update(weights_sha256(reference).encode())
        return digest.hexdigest()

    def _read_cache(self, fingerprint: str) -> torch.Tensor | None:
        """The run directory's precomputed log-probabilities if they were computed from `fingerprint`."""
        from safetensors import safe_open

        path = (self.run_dir or Path(".")) / REFERENCE_FILE
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("fingerprint") != fingerprint:
                warn(f"{path} was computed from other pairs, weights or precision: computing it again")
                return None
            return f.get_tensor("logps")

    def prepare_reference(self, model: nn.Module, precision: str) -> None:
        """The reference log-probabilities of every pair, read from the run directory or computed (each rank
        a share, summed) and written there; the frozen copy freed (module docstring)."""
        assert self.datasets is not None and self.run_dir is not None
        fingerprint = self._fingerprint(model, precision)
        cached = self._read_cache(fingerprint)
        if cached is None:
            cached = self._compute_reference(model)
            if dist_env().is_main:
                _write_cache(self.run_dir / REFERENCE_FILE, cached, fingerprint)
            dgroup.barrier()
        elif dist_env().is_main:
            path = self.run_dir / REFERENCE_FILE
            say(f"reference log-probabilities of {len(cached)} pairs read from {path}")
        self.cached, self.initial, self.reference = cached, None, None

    def _compute_reference(self, model: nn.Module) -> torch.Tensor:
        """(pairs, 2) reference log-probabilities of the training then validation pairs in chunks of
        PRECOMPUTE_PAIRS, rank r computing chunks r, r + world_size, ..., summed over ranks. Every rank runs
        as many forwards (one past the end repeats chunk 0, its result unused): a sharded model's forward is
        a collective."""
        assert self.datasets is not None
        env = dist_env()
        pairs = [(ds, i) for ds in self.datasets for i in range(len(ds))]
        out = torch.zeros(len(pairs), 2, dtype=torch.float64)
        device = next(model.parameters()).device
        collate = self.collate_fn()
        chunks = math.ceil(len(pairs) / PRECOMPUTE_PAIRS)
        for first in range(0, chunks, env.world_size):
            mine = first + env.rank
            start = PRECOMPUTE_PAIRS * (mine if mine < chunks else 0)
            tokens, targets, index = collate([ds[i] for ds, i in pairs[start : start + PRECOMPUTE_PAIRS]])
            logps = self.reference_forward(model, tokens.to(device), targets.to(device)).double().cpu()
            if mine < chunks:
                out[index] = torch.stack(logps.chunk(2), dim=1)
        if env.is_main:
            say(f"reference log-probabilities of {len(pairs)} pairs computed (task.precompute_reference)")
        summed = dgroup.all_reduce_sum(out.view(-1).tolist(), device) if env.distributed else None
        return out if summed is None else torch.tensor(summed, dtype=torch.float64).view(-1, 2)

    # ---- loss and evaluation --------------------------------------------------------------------------
    def step(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> StepOutput:
        """The preference loss of a batch of pairs, chosen and rejected in one forward (module docstring)."""
        tokens, targets, index = batch[:3]
        if self.use_weighting:
            per_token, squares = scored_logps(model, tokens, targets, square_mass=True)
        else:
            per_token = scored_logps(model, tokens, targets)
        counts = (targets != IGNORE).sum(1)
        mask = (targets != IGNORE)[:, -per_token.shape[1] :].to(per_token.dtype)
        summed = desensitized_sums(per_token, mask, self.ld_alpha)
        half = index.numel()
        if self.reference_free:
            reference = torch.zeros_like(summed)
        else:
            reference = self.reference_logps(model, tokens, targets, index).to(summed.dtype)
        policy, ref = (summed[:half], summed[half:]), (reference[:half], reference[half:])
        lengths = (counts[:half], counts[half:])
        loss = summed.new_zeros(())
        pair_weights = None
        if self.use_weighting:
            with torch.no_grad():
                weights = (((per_token - squares) * mask).sum(1) / mask.sum(1).clamp(min=1)).exp()
                pair_weights = weights[:half] * weights[half:]
        for kind, weight in self.losses:
            losses = pair_losses(
                kind,
                policy,
                ref,
                lengths,
                beta=self.beta,
                simpo_gamma=self.simpo_gamma,
                label_smoothing=self.label_smoothing,
                divergence=self.divergence[0],
                alpha=self.divergence[1],
                discopop_tau=self.discopop_tau,
            )
            if pair_weights is not None:
                losses = losses * pair_weights
            loss = loss + weight * losses.mean()
        # beta times each completion's log-ratio (SimPO: its mean log-probability), TRL's rewards
        if self.reference_free:
            chosen, rejected = (
                self.beta * lp.detach() / n.clamp(min=1) for lp, n in zip(policy, lengths, strict=True)
            )
        else:
            chosen, rejected = (self.beta * (p - r).detach() for p, r in zip(policy, ref, strict=True))
        if self.sft_weight:
            sft = -per_token[:half].sum() / counts[:half].sum().clamp(min=1)
            # TRL's sft loss is weighed per pair as the others are: by the pairs' mean weight
            loss = loss + self.sft_weight * sft * (1.0 if pair_weights is None else pair_weights.mean())
        metrics: dict[str, float | torch.Tensor] = {
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/margin": (chosen - rejected).mean(),
            "rewards/accuracy": (chosen > rejected).float().mean(),
            "logps/chosen": summed[:half].detach().mean(),
            "logps/rejected": summed[half:].detach().mean(),
        }
        return StepOutput(loss=loss, count=half, metrics=metrics)

    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """The loss and rewards averaged over the validation pairs, and exact-match answers of the
        conversational ones (`ChatFineTuning.exact_match`)."""
        out = Task.evaluate(self, model, batches)
        if self.eval_questions and self.val_conversations:
            out.update(self.exact_match(model, self.val_conversations[: self.eval_questions]))
        return out


class PrecomputedReference(Callback):
    """Computes (or reads back) the task's reference log-probabilities before the first step, under the
    run's precision, on every rank (each computes a share)."""

    def __init__(self, task: PreferenceTuning) -> None:
        """Serve `task`."""
        self.task = task

    def on_fit_start(self, trainer: Any) -> None:
        """Before the first step (and before `trainer.eval_on_start`'s evaluation)."""
        with trainer.plan.autocast():
            self.task.prepare_reference(trainer.model, trainer.plan.precision)


def _write_cache(path: Path, logps: torch.Tensor, fingerprint: str) -> None:
    """`logps` as safetensors at `path`, atomically, with the fingerprint they were computed from."""
    from safetensors.torch import save

    data = save({"logps": logps.contiguous()}, metadata={"fingerprint": fingerprint})
    write_atomic(path, lambda f: f.write(data))
