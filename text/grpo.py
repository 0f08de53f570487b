"""RL with verifiable rewards (`+task=grpo`): Group Relative Policy Optimization and the variants TRL's
`GRPOTrainer` has (DAPO, Dr. GRPO, BNPO, CISPO, SAPO, LUSPO, VESPO; GSPO's sequence-level ratio), with its
semantics.

Each step takes a batch of prompts (JSONL rows: `prompt`, a message list rendered with the chat template,
or a text continued as it is, TRL's two forms; every other key is a field passed to the rewards), samples
`task.group_size` completions per prompt from the training weights (`rollout`, eagerly: compiled code would
recompile for every length), scores them (`text.rewards`), turns the weighted rewards into group-relative
advantages (`group_advantages`) and minimises the clipped token-level surrogate (`policy_loss`). A batch of
prompts is trained on `task.iterations` times in a row (mu): the sampler gives it that many times, and the
completions, advantages and the sampling policy's log-probabilities are kept between them
(`text.rollouts.PendingRollouts`; the sampling, the kept rollouts and the prompt data are shared with
on-policy distillation there).

Resume is bit-exact: the prompt order is the loop's (seed, epoch, batch), each generation's sampling seed
is derived from the run seed, the rank and the generation's number, and the number with the completions
still to be trained on are the `text.rollouts.RolloutState` callback's checkpointed state. Prompts are
sharded over the data-parallel ranks by the loop, a prompt's whole group on one rank, so a group's
statistics are one process's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.data.samplers import ResumableBatchSampler
from core.errors import ConfigError, DataError
from core.logging.messages import warn
from core.loop.callbacks import Callback
from core.loop.task import StepOutput
from core.registry import TASKS
from text import rewards as rw
from text.generation import Rollout
from text.policy_gradient import (
    LEVELS,
    LOSS_TYPES,
    TOKEN_MEAN_LOSSES,
    AdaptiveEntropy,
    batch_reward_stats,
    check_loss,
    group_advantages,
    high_entropy_mask,
    normalized_sum,
    policy_loss,
    token_logps,
)
from text.prompts import PromptCorpus, PromptRow
from text.reference_sync import ReferenceSync
from text.reward_model import RewardModel
from text.rollouts import (
    GREEDY,
    DrawnRollout,
    PendingRollouts,
    PromptSampling,
    RepeatedBatches,
    RolloutState,
    ScoredRollout,
    as_sampler,
    check_room,
    rollout_key,
)
from text.sft import ChatFineTuning

#: task.scale_rewards: TRL's values (True: "group", False: "none"), auto ("none" for dr_grpo, else "group")
SCALES = ("auto", True, False, "group", "batch", "mean", "none")
#: task.multi_objective_aggregation, TRL's: the weighted sum of the rewards made group-relative, or each
#: reward made group-relative first and their weighted sum then normalised over the generation batch (GDPO)
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
#: consecutive generations whose every group had equal rewards before the run warns of no learning signal
NO_SIGNAL_WARN_AFTER = 10


def _nanmean(values: torch.Tensor) -> float:
    """The mean of `values` that are not NaN (NaN: none)."""
    kept = values[~torch.isnan(values)]
    return float(kept.mean()) if len(kept) else math.nan


def _nanstd(values: torch.Tensor) -> float:
    """The Bessel-corrected std of `values` that are not NaN (NaN: fewer than two)."""
    kept = values[~torch.isnan(values)]
    return float(kept.std()) if len(kept) > 1 else math.nan


def check_settings(
    context: int,
    max_new_tokens: int,
    rewards: Sequence[str],
    reward_weights: Sequence[float],
    beta: float,
    weights: str,
    scale: str | bool = "group",
    *,
    sync_ref_model: bool = False,
    entropy_bounds: tuple[float, float] | None = None,
) -> None:
    """One-line ConfigError, naming the key, for +task=grpo settings that cannot work together
    (`entropy_bounds`: the adaptive entropy coefficient's (min, max), where it is on)."""
    check_room(max_new_tokens, context)
    if sync_ref_model and not beta:
        raise ConfigError(
            "task.sync_ref_model=true syncs the reference of the KL, which task.beta=0 leaves out: set "
            "task.beta > 0 or drop it",
            key="task.sync_ref_model",
            value="true",
        )
    if entropy_bounds is not None and entropy_bounds[0] > entropy_bounds[1]:
        raise ConfigError(
            f"task.entropy_coef_min={entropy_bounds[0]} is above task.entropy_coef_max={entropy_bounds[1]}",
            key="task.entropy_coef_min",
            value=str(entropy_bounds[0]),
        )
    if reward_weights and len(reward_weights) != len(rewards):
        raise ConfigError(
            f"task.reward_weights has {len(reward_weights)} values for {len(rewards)} rewards",
            key="task.reward_weights",
            value=str(list(reward_weights)),
        )
    if beta and not weights:
        raise ConfigError(
            "task.beta > 0 needs model.weights: the reference is the model those weights build",
            key="task.beta",
            value=str(beta),
        )
    if scale == "mean":  # the group's mean is the divisor: a negative reward would flip advantages' signs
        negative = [n for n, w in zip(rewards, reward_weights or [1.0] * len(rewards), strict=True) if w < 0]
        negative += ["length"] if "length" in rewards and "length" not in negative else []
        if negative:
            raise ConfigError(
                f"task.scale_rewards=mean needs rewards >= 0, and {', '.join(negative)} can be negative "
                "(the length reward, or a negative weight): use task.scale_rewards=group or drop it",
                key="task.scale_rewards",
                value="mean",
            )


# ---- the task -----------------------------------------------------------------------------------------
@TASKS.register("grpo")
class GroupRelativePolicyOptimization(PromptSampling, ChatFineTuning):
    """GRPO (and DAPO, Dr. GRPO, GSPO, CISPO, SAPO, ...) on prompts with verifiable rewards; evaluation:
    the greedy completions' mean reward over validation prompts."""

    data_type = PromptCorpus
    primary_metric = "val/reward"
    maximize = True
    throughput_unit = "completions"

    def __init__(
        self,
        *,
        model: dict[str, Any],
        data: dict[str, Any],
        tokenizer: str = "bytes",
        bpe_vocab_size: Annotated[int, Bounds(ge=1)] = 2048,
        context: Annotated[int, Bounds(ge=1)] = 256,
        eval_questions: Annotated[int, Bounds(ge=0)] = 200,
        group_size: Annotated[int, Bounds(ge=2)] = 8,
        max_new_tokens: Annotated[int, Bounds(ge=1)] = 64,
        temperature: Annotated[float, Bounds(gt=0)] = 1.0,
        top_p: Annotated[float, Bounds(gt=0, le=1)] = 1.0,
        top_k: Annotated[int, Bounds(ge=0)] = 0,
        min_p: Annotated[float, Bounds(ge=0, le=1)] = 0.0,
        repetition_penalty: Annotated[float, Bounds(gt=0)] = 1.0,
        loss_type: Annotated[str, Bounds(choices=LOSS_TYPES)] = "dapo",
        epsilon: Annotated[float, Bounds(gt=0, lt=1)] = 0.2,
        epsilon_high: Annotated[float, Bounds(ge=0)] = 0.0,
        delta: Annotated[float, Bounds(ge=0)] = 0.0,
        importance_sampling_level: Annotated[str, Bounds(choices=LEVELS)] = "token",
        sapo_temperature_pos: Annotated[float, Bounds(gt=0)] = 1.0,
        sapo_temperature_neg: Annotated[float, Bounds(gt=0)] = 1.05,
        vespo_k_pos: Annotated[float, Bounds(ge=0)] = 2.0,
        vespo_lambda_pos: Annotated[float, Bounds(ge=0)] = 3.0,
        vespo_k_neg: Annotated[float, Bounds(ge=0)] = 3.0,
        vespo_lambda_neg: Annotated[float, Bounds(ge=0)] = 2.0,
        off_policy_mask_threshold: Annotated[float | None, Bounds(ge=0)] = None,
        mask_truncated_completions: bool = False,
        top_entropy_quantile: Annotated[float, Bounds(ge=0, le=1)] = 1.0,
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_target: Annotated[float, Bounds(ge=0)] = 0.2,
        entropy_coef_delta: Annotated[float, Bounds(ge=0)] = 0.005,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        beta: Annotated[float, Bounds(ge=0)] = 0.0,
        use_bias_correction_kl: bool = True,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: Annotated[float, Bounds(ge=0, le=1)] = 0.6,
        ref_model_sync_steps: Annotated[int, Bounds(ge=1)] = 512,
        iterations: Annotated[int, Bounds(ge=1)] = 1,
        scale_rewards: Annotated[
            bool | Literal["auto", "group", "batch", "mean", "none"], Bounds(choices=SCALES)
        ] = "auto",
        multi_objective_aggregation: Annotated[str, Bounds(choices=AGGREGATIONS)] = "sum_then_normalize",
        rewards: list[str] = ["exact_match"],  # noqa: B006 - read only; the schema needs a plain default
        reward_weights: list[float] = [],  # noqa: B006
        answer_field: str = "answer",
        guidance: bool = False,
        dynamic_sampling: Annotated[int, Bounds(ge=0)] = 0,
        format_pattern: str = ".*",
        length_limit: Annotated[int, Bounds(ge=0)] = 0,
    ) -> None:
        """`model`/`data` are config sections (a registered `name` plus that builder's keywords).

        tokenizer: bytes, bpe (learned on the training prompts) or pretrained (the model.weights folder's
            tokenizer.json and chat template)
        bpe_vocab_size: vocabulary size the bpe tokenizer learns
        context: the model's positions: a prompt longer than context - max_new_tokens is skipped
        eval_questions: validation prompts answered greedily and scored (val/reward)
        group_size: completions sampled per prompt (TRL's num_generations)
        max_new_tokens: most tokens of a completion (TRL's max_completion_length)
        temperature: sampling temperature (the log-probs trained are of the logits over it)
        top_p: sample among the fewest likeliest tokens holding this much probability (1: all)
        top_k: sample among this many likeliest tokens (0: all), as TRL's
        min_p: sample among the tokens at least this share as likely as the likeliest (0: all), as TRL's
        repetition_penalty: the tokens already in the prompt and completion made less likely by this
            factor (1: none), as TRL's; the log-probs trained are still of the logits over temperature
        loss_type: dapo (mean over the step's completion tokens), grpo (per sequence), dr_grpo (constant
            normaliser), bnpo (mean over the micro-batch's tokens), cispo (the importance weight clipped,
            MiniMax-M1), sapo (a soft gate for the clip), luspo (per sequence, summed over its tokens) or
            vespo (each completion's log-probs weighed by a gamma function of its importance weight,
            aggregated as dapo)
        epsilon: the clip range's lower side (ratio >= 1 - epsilon)
        epsilon_high: the clip range's upper side (ratio <= 1 + epsilon_high; 0: epsilon); cispo: the
            importance weight's cap, which it needs (ScaleRL: 5)
        delta: cap of the ratio in the unclipped term (INTELLECT-2's two-sided clipping; 0: none)
        importance_sampling_level: token (a ratio per token) or sequence (GSPO: one per completion, the
            exp of its tokens' mean log-ratio)
        sapo_temperature_pos: sapo's gate temperature for completions with a positive advantage
        sapo_temperature_neg: sapo's gate temperature for the others
        vespo_k_pos: vespo's power of the importance weight w for completions of advantage >= 0 (how
            much w < 1 is damped)
        vespo_lambda_pos: vespo's decay for them (how much w > 1 is damped)
        vespo_k_neg: vespo's power for the others
        vespo_lambda_neg: vespo's decay for the others
        off_policy_mask_threshold: a completion of negative advantage whose tokens' mean KL from the
            sampling policy to the trained one is above this carries no policy loss (DeepSeek-V3.2's
            off-policy sequence masking; null: none)
        mask_truncated_completions: completions cut at max_new_tokens carry no loss (DAPO's overlong
            filtering)
        top_entropy_quantile: the share of each micro-batch's completion tokens, those of highest entropy,
            whose policy term is trained ("Beyond the 80/20 rule": 0.2; 1: all)
        entropy_coef: the loss less this times the mean entropy of the completion tokens (those of
            top_entropy_quantile), TRL's entropy bonus (0: none; > 0 keeps the policy from collapsing);
            with use_adaptive_entropy, its starting value
        use_adaptive_entropy: Skywork-OR1's adaptive control: after each optimizer step the coefficient
            rises by entropy_coef_delta if the step's counted tokens' mean entropy was at or below
            entropy_target, else falls by it, within entropy_coef_min..entropy_coef_max; a step applies it
            only where the previous step's entropy was at or below the target (TRL's)
        entropy_target: the adaptive control's target mean entropy per token, in nats
        entropy_coef_delta: the adaptive control's step of the coefficient
        entropy_coef_min: the adaptive coefficient's lower bound
        entropy_coef_max: the adaptive coefficient's upper bound
        beta: weight of the k3 KL to the reference (the model model.weights builds; 0: none computed)
        use_bias_correction_kl: the KL of each token times its importance weight (DeepSeek-V3.2's unbiased
            KL gradient; TRL's default, as here)
        sync_ref_model: every ref_model_sync_steps optimizer steps the reference becomes
            ref_model_mixup_alpha x the policy + (1 - that) x itself (TR-DPO's, TRL's; needs beta > 0 and
            no LoRA); the reference's weights are then checkpointed
        ref_model_mixup_alpha: the policy's share of the reference at each sync
        ref_model_sync_steps: optimizer steps between the reference's syncs
        iterations: updates on each generation's completions (mu), from the sampling policy's log-probs
        scale_rewards: divide advantages by their group's std (group, true), by the std of the whole
            generation batch (batch: the accumulation group on every rank), by their group's mean reward
            (mean: MaxRL's, rewards >= 0) or not (none, false); auto: none for dr_grpo, else group
        multi_objective_aggregation: sum_then_normalize (the weighted sum of the rewards is what
            scale_rewards makes group-relative) or normalize_then_sum (GDPO: each reward less its group's
            mean over its group's std, their weighted sum less the generation batch's mean over its std;
            scale_rewards does not apply), as TRL's
        rewards: reward functions: exact_match, number, format, length, or a user's module:function
        reward_weights: one weight per reward (empty: 1 each); the advantage is of their weighted sum
        answer_field: the prompt rows' key exact_match and number compare with
        guidance: a group whose every sampled completion scores below the prompt's answer_field (as a
            completion) trains on that answer in place of its last completion (off-policy guidance)
        dynamic_sampling: draws after the first in a generation (0: none; DAPO's dynamic sampling): a group
            whose completions all score alike (no signal) gives its place to a random training prompt's
            group that has unequal rewards, drawn anew each time for the places still without one
        format_pattern: the regular expression the format reward wants a whole completion to match
        length_limit: characters of a completion before the length reward penalises it
        """
        super().__init__(
            model=model,
            data=data,
            tokenizer=tokenizer,
            bpe_vocab_size=bpe_vocab_size,
            context=context,
            eval_questions=eval_questions,
        )
        weights = str(model.get("weights") or "")
        bounds = (entropy_coef_min, entropy_coef_max)
        check_settings(
            context,
            max_new_tokens,
            rewards,
            reward_weights,
            beta,
            weights,
            scale_rewards,
            sync_ref_model=sync_ref_model,
            entropy_bounds=bounds if use_adaptive_entropy else None,
        )
        check_loss(loss_type, epsilon_high, importance_sampling_level)
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.min_p, self.repetition_penalty = min_p, repetition_penalty
        self.loss_type, self.epsilon, self.epsilon_high = loss_type, epsilon, epsilon_high or None
        self.beta, self.iterations = beta, iterations
        self.delta, self.level = delta or None, importance_sampling_level
        self.sapo_temperatures = (sapo_temperature_pos, sapo_temperature_neg)
        self.vespo = ((vespo_k_pos, vespo_lambda_pos), (vespo_k_neg, vespo_lambda_neg))
        self.off_policy_threshold, self.kl_bias_correction = off_policy_mask_threshold, use_bias_correction_kl
        self.mask_truncated = mask_truncated_completions
        self.top_entropy_quantile, self.entropy_coef = top_entropy_quantile, entropy_coef
        #: the adaptive entropy coefficient's controller (a callback: it moves and is checkpointed per step)
        control = AdaptiveEntropy(entropy_coef, entropy_target, entropy_coef_delta, bounds)
        self.entropy_control = control if use_adaptive_entropy else None
        self.guidance, self.answer_field = guidance, answer_field
        self.dynamic_sampling = dynamic_sampling
        scale = {"auto": "none" if loss_type == "dr_grpo" else "group", True: "group", False: "none"}
        #: group, batch, mean or none
        self.scale_rewards: str = scale.get(scale_rewards, scale_rewards)  # type: ignore[call-overload]
        self.aggregation = multi_objective_aggregation
        #: advantages over statistics of the whole generation batch (the accumulation group on every rank)
        self.batch_level = self.scale_rewards == "batch" or self.aggregation == "normalize_then_sum"
        options = {"field": answer_field, "pattern": format_pattern, "limit": length_limit}
        #: (name, function) of each reward; user rewards imported now, from the config alone
        self.rewards = rw.resolve_all(rewards, options)
        self.reward_weights = torch.tensor(list(reward_weights) or [1.0] * len(rewards), dtype=torch.float64)
        self.rollouts = PendingRollouts()
        self._reference: nn.Module | None = None
        sync = ReferenceSync(self.reference, ref_model_mixup_alpha, ref_model_sync_steps)
        self.reference_sync = sync if sync_ref_model else None
        self._warned_unscored = False

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> ResumableBatchSampler:
        """Shuffled batches of prompts, each given `task.iterations` times in a row in training."""
        inner = super().batch_sampler(dataset, batch_size, train=train, seed=seed)
        return RepeatedBatches(inner, self.iterations) if train and self.iterations > 1 else inner

    def callbacks(self) -> list[Callback]:
        """The rollouts' checkpointed state and the completions written to the run; the adaptive entropy
        coefficient's controller; the reference's syncs."""
        more = [c for c in (self.entropy_control, self.reference_sync) if c is not None]
        return [RolloutState(self.rollouts, self.iterations), *more]

    def reference(self, model: nn.Module) -> nn.Module:
        """The frozen reference (beta > 0): the model model.weights builds, as the policy started (or as a
        resumed run's syncs left it: task.sync_ref_model)."""
        if self._reference is None:
            w = next(model.parameters())
            ref = self.build_model().to(device=w.device, dtype=w.dtype).eval()
            self._reference = ref.requires_grad_(False)
        if self.reference_sync is not None:  # a resumed run's synced weights, loaded once
            self.reference_sync.restore(self._reference)
        return self._reference

    def score(
        self,
        rows: Sequence[PromptRow],
        texts: Sequence[str],
        ids: Sequence[Sequence[int]],
        per_prompt: int,
    ) -> torch.Tensor:
        """Each reward of each completion (its text and sampled ids; `per_prompt` a row, in order),
        (N, rewards) float64, NaN where a reward does not apply."""
        state = self.rollouts.progress()
        scores = []
        for i, r in enumerate(rows):
            part = slice(i * per_prompt, (i + 1) * per_prompt)
            scores.append(
                rw.score_group(
                    self.rewards,
                    r.prompt,
                    texts[part],
                    r.fields,
                    r.index,
                    completion_ids=ids[part],
                    state=state,
                )
            )
        out = torch.cat(scores)
        unscored = torch.isnan(out).all(dim=1)
        if bool(unscored.any()) and not self._warned_unscored:
            self._warned_unscored = True
            index = rows[int(unscored.nonzero()[0]) // per_prompt].index
            warn(
                f"no reward applied to a completion of prompt {index} (every reward returned None): such "
                "completions are trained with advantage 0; make at least one reward score every prompt"
            )
        return out

    def total(self, scores: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each completion's rewards that apply (`rw.weighted_total`)."""
        return rw.weighted_total(scores, self.reward_weights)

    def generate_rollout(self, model: nn.Module, rows: Sequence[PromptRow]) -> ScoredRollout:
        """Sample, score and pack one batch's completions (advantages, the sampling policy's log-probs);
        batch-level statistics outside `prepare_group` (a probe's step): the batch's own."""
        drawn = self.draw(model, rows)
        stats = batch_reward_stats([self.advantage_input(drawn)], None) if self.batch_level else None
        return self.scored_rollout(model, drawn, stats)

    def advantage_input(self, drawn: DrawnRollout) -> torch.Tensor:
        """What the advantages are of: the weighted total (sum_then_normalize), or the weighted sum of the
        rewards made group-relative each (normalize_then_sum, `normalized_sum`)."""
        if self.aggregation == "normalize_then_sum":
            return normalized_sum(drawn.scores, self.reward_weights, self.group_size)
        return drawn.total

    def draw(self, model: nn.Module, rows: Sequence[PromptRow]) -> DrawnRollout:
        """One batch's completions sampled with the next generation's generator, and their rewards."""
        rows = list(rows)
        device = next(model.parameters()).device
        for _, fn in self.rewards:  # a reward model scores beside the policy
            if isinstance(fn, RewardModel):
                fn.to(device)
        sampled = self.sample(model, rows, self.rollouts.generator())
        texts = [self.completion_text(c) for c in sampled.ids]
        scores = self.score(rows, texts, sampled.ids, self.group_size)
        # the policy's own scores on the batch's prompts, before any group is replaced
        own = scores.clone() if self.guidance or self.dynamic_sampling else None
        refilled = self.refill(model, rows, sampled, texts, scores) if self.dynamic_sampling else 0
        total = self.total(scores)
        guided = self.guide(model, rows, sampled, texts, scores, total) if self.guidance else []
        if self.scale_rewards == "mean" and bool((total < 0).any()):
            j = int((total < 0).nonzero()[0])  # the first completion below 0, and its prompt
            raise DataError(
                f"task.scale_rewards=mean needs rewards >= 0; a completion of prompt "
                f"{rows[j // self.group_size].index} has the weighted reward {float(total[j]):g}: use "
                "task.scale_rewards=group, or rewards that are not negative",
                key="task.scale_rewards",
                value="mean",
            )
        return DrawnRollout(sampled, texts, scores, total, rows, len(guided), own, refilled)

    def refill(
        self,
        model: nn.Module,
        rows: list[PromptRow],
        sampled: Rollout,
        texts: list[str],
        scores: torch.Tensor,
    ) -> int:
        """task.dynamic_sampling: give each group whose rewards are all equal the place of a random training
        prompt's group with unequal ones, in `rows`, `sampled`, `texts` and `scores` alike; up to that many
        draws, each of as many prompts as places still flat (DAPO over-samples the prompt order instead:
        here the loop's order stays the checkpointed one, and each draw's prompts and completions come
        from the generation's seeded generator, so resume is bit-exact). Returns the groups replaced."""
        if self.prompt_sets is None:
            raise RuntimeError("task.dynamic_sampling draws training prompts: build_datasets() first")
        pool, g, refilled = self.prompt_sets[0], self.group_size, 0
        for _ in range(self.dynamic_sampling):
            flat = group_advantages(self.total(scores), g, scale="none")[1].nonzero().flatten()
            if not len(flat):
                break
            generator = self.rollouts.generator()
            picks = torch.randint(len(pool), (len(flat),), generator=generator).tolist()
            fresh = [pool[k] for k in picks]
            drawn = self.sample(model, fresh, generator)
            words = [self.completion_text(c) for c in drawn.ids]
            got = self.score(fresh, words, drawn.ids, g)
            still = group_advantages(self.total(got), g, scale="none")[1]
            for k, i in enumerate(flat.tolist()):
                if still[k]:
                    continue
                rows[i] = fresh[k]
                for a, b in zip(range(i * g, (i + 1) * g), range(k * g, (k + 1) * g), strict=True):
                    sampled.ids[a], sampled.logprobs[a] = drawn.ids[b], drawn.logprobs[b]
                    sampled.stopped[a], texts[a] = drawn.stopped[b], words[b]
                    scores[a] = got[b]
                refilled += 1
        return refilled

    def guide(
        self,
        model: nn.Module,
        rows: Sequence[PromptRow],
        sampled: Rollout,
        texts: list[str],
        scores: torch.Tensor,
        total: torch.Tensor,
    ) -> list[int]:
        """task.guidance: put each prompt's answer (`answer_ids`) in place of its group's last completion,
        in `sampled`, `texts`, `scores` and `total` alike, where it scores above every sampled one; returns
        the completions replaced. Its log-probs are the sampling policy's own (the model in eval mode, as it
        sampled), so it is trained as if drawn: the first update's ratio is 1 and the clip bounds the next."""
        g, replaced = self.group_size, []
        for i, row in enumerate(rows):
            ids = self.answer_ids(row, self.answer_field, "task.guidance=true")
            text = self.completion_text(ids)
            answer = self.score([row], [text], [ids], 1)
            mine, theirs = float(self.total(answer)[0]), total[i * g : (i + 1) * g]
            best = float(theirs.nan_to_num(-math.inf).max())
            if math.isnan(mine) or mine <= best:
                continue  # a sampled completion does as well (or no reward applies): the group's own signal
            j = i * g + g - 1
            eos = self.tokenizer.eos_id
            # stopped, as the sampler's: ended at the stop id (eos), not the template's end of turn
            sampled.ids[j], sampled.stopped[j], texts[j] = ids, eos is not None and ids[-1:] == [eos], text
            scores[j], total[j] = answer[0], mine
            replaced.append(j)
        if replaced:
            tokens, mask = self.packed(
                model, [rows[j // g] for j in replaced], [sampled.ids[j] for j in replaced]
            )
            with as_sampler(model) as policy, torch.no_grad():
                logps = token_logps(policy, tokens, self.temperature, context=self.context)[0].float().cpu()
            for k, j in enumerate(replaced):
                sampled.logprobs[j] = logps[k][mask[k].cpu()]
        return replaced

    def scored_rollout(
        self, model: nn.Module, drawn: DrawnRollout, batch: tuple[float, float] | None
    ) -> ScoredRollout:
        """The drawn completions packed for the loss, with their advantages (over the generation batch's
        (mean, std) of `advantage_input` where given: batch-level statistics)."""
        g, sampled, texts, scores = self.group_size, drawn.sampled, drawn.texts, drawn.scores
        total, rows = drawn.total, drawn.rows
        if self.aggregation == "normalize_then_sum":
            values = self.advantage_input(drawn)
            mean, std = batch if batch is not None else batch_reward_stats([values], None)
            # TRL's: over the batch's std (each reward is group-relative already, so the batch mean is ~0)
            advantages = ((values - mean) / (std + 1e-4)).nan_to_num(0.0)
            flat = group_advantages(total, g, scale="none")[1]
        else:
            batch_std = None if batch is None else batch[1]
            advantages, flat = group_advantages(total, g, scale=self.scale_rewards, batch_std=batch_std)
        tokens, mask = self.packed(model, rows, sampled.ids)
        device = tokens.device
        old = ref = None
        if self.iterations > 1:  # one update alone: the ratio is 1 exactly without them (TRL alike)
            old = torch.zeros(mask.shape, dtype=torch.float32, device=device)
            old[mask] = torch.cat([lp.clone() for lp in sampled.logprobs]).to(device)
        lengths = mask.sum(-1).double()
        cut = torch.tensor([self.end_length(ids) == 0 for ids in sampled.ids], dtype=torch.bool)
        if self.mask_truncated:  # DAPO's overlong filtering: a cut-off completion teaches nothing either way
            mask = mask & ~cut.to(device)[:, None]
        with torch.no_grad():
            if self.beta:
                ref = token_logps(self.reference(model), tokens, self.temperature, context=self.context)[0]
        # the reward figures are the policy's own samples' on the batch's prompts, before
        # task.dynamic_sampling or task.guidance replaced any
        own = scores if drawn.sampled_scores is None else drawn.sampled_scores
        own_total = self.total(own)
        # over the completions a reward applies to (TRL's nanmean, nanstd); NaN where none: the loop leaves
        # it out of the logged window's mean
        metrics = {
            "reward": _nanmean(own_total),
            "reward_std": _nanstd(own_total),
            "frac_reward_zero_std": float(flat.double().mean()),
            "completion_length": float(lengths.mean()),
            "truncated": float(cut.double().mean()),
        }
        if self.guidance:  # the share of groups given their prompt's answer
            metrics["guided"] = drawn.guided / len(rows)
        if self.dynamic_sampling:  # the share of groups another prompt's replaced: the first draw's flat
            metrics["refilled"] = drawn.refilled / len(rows)  # share is it plus frac_reward_zero_std
        for j, (name, _) in enumerate(self.rewards):
            metrics[f"rewards/{name}/mean"] = _nanmean(own[:, j])
            metrics[f"rewards/{name}/std"] = _nanstd(own[:, j])
        self._watch_signal(bool(flat.all()))
        self.rollouts.samples.append(
            {
                "prompt": rows[0].prompt,
                "completions": texts[:g],
                # JSON has no NaN: a completion no reward applied to is null
                "rewards": [None if math.isnan(v) else v for v in total[:g].tolist()],
            }
        )
        return ScoredRollout(tokens, mask, advantages.to(device), old, ref, metrics)

    def _watch_signal(self, flat: bool) -> None:
        """Warn once when NO_SIGNAL_WARN_AFTER generations in a row had equal rewards in every group."""
        r = self.rollouts
        r.flat_generations = r.flat_generations + 1 if flat else 0
        if r.flat_generations == NO_SIGNAL_WARN_AFTER:
            warn(
                f"the last {NO_SIGNAL_WARN_AFTER} generations gave every completion of each prompt the same "
                "reward: no learning signal (raise task.temperature or task.group_size, or check the rewards)"
            )

    def prepare_group(self, model: nn.Module, batches: list[Any]) -> None:
        """The token-mean losses (dapo, cispo, vespo): every micro-batch of the accumulation group sampled
        before the first is trained on, so each one's loss units are its completion tokens (`loss_units`):
        the loop then weighs its mean over them by its share of the group's tokens on every rank, and the
        step's gradient is that of the sum over all of them over their count, TRL's num_items_in_batch over
        the generation batch.
        scale_rewards=batch, normalize_then_sum: every micro-batch sampled and scored first, for the
        statistics of all their rewards on every rank (TRL's, over the generation batch gathered from all
        processes)."""
        if self.loss_type not in TOKEN_MEAN_LOSSES and not self.batch_level:
            return  # a mean over sequences or a constant normaliser: prompts are the units
        new: dict[tuple[int, ...], Sequence[PromptRow]] = {}
        for batch in batches:  # a batch given again (task.iterations) keeps its rollout
            key = rollout_key(batch["rows"])
            if key not in self.rollouts.pending:
                new.setdefault(key, batch["rows"])
        if not new:  # the group's batches were sampled before (task.iterations)
            return
        drawn = {key: self.draw(model, rows) for key, rows in new.items()}
        stats = None
        if self.batch_level:
            # every rank reduces once per accumulation group with new batches (the ranks' samplers repeat
            # batches alike: none has new ones when another has not); a probe steps one rank alone
            device = next(model.parameters()).device if self.rollouts.training else None
            stats = batch_reward_stats([self.advantage_input(d) for d in drawn.values()], device)
        for key, one in drawn.items():
            self.rollouts.pending[key] = self.scored_rollout(model, one, stats)

    def loss_units(self, batch: dict[str, Any]) -> int:
        """The token-mean losses: the completion tokens `prepare_group` sampled for the batch; otherwise its
        prompts."""
        token_mean = self.loss_type in TOKEN_MEAN_LOSSES
        roll = self.rollouts.pending.get(rollout_key(batch["rows"])) if token_mean else None
        return super().loss_units(batch) if roll is None else int(roll.mask.sum())

    def step(self, model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        """Sample (or reuse: `task.iterations`, `prepare_group`) the batch's completions, then the policy
        loss, the token-mean losses' a mean over this micro-batch's completion tokens (the loop weighs it
        by them)."""
        rows = batch["rows"]
        roll = self.rollouts.take(
            rollout_key(rows), self.iterations, lambda: self.generate_rollout(model, rows)
        )
        control = self.entropy_control
        coef = self.entropy_coef if control is None else control.applied()
        logps, entropy = token_logps(
            model, roll.tokens, self.temperature, context=self.context, entropy_grad=bool(coef)
        )
        old = roll.old_logps if roll.old_logps is not None else logps.detach()
        keep = None
        if self.top_entropy_quantile < 1.0:  # every rank steps together only in the loop (not a probe)
            device = entropy.device if self.rollouts.training else None
            keep = high_entropy_mask(entropy.detach(), roll.mask, self.top_entropy_quantile, device)
        loss, stats = policy_loss(
            logps,
            old,
            roll.advantages,
            roll.mask,
            loss_type=self.loss_type,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            ref_logps=roll.ref_logps,
            max_completion_length=self.max_new_tokens,
            level=self.level,
            delta=self.delta,
            sapo_temperatures=self.sapo_temperatures,
            vespo=self.vespo,
            keep=keep,
            entropy=entropy,
            entropy_coef=coef,
            kl_bias_correction=self.kl_bias_correction,
            off_policy_threshold=self.off_policy_threshold,
        )
        m = roll.mask.to(entropy.dtype)
        metrics: dict[str, float | torch.Tensor] = {**roll.metrics, **stats}
        if control is not None:
            if self.rollouts.training:  # the loop's steps move it; a probe's do not
                control.observe(entropy, roll.mask if keep is None else roll.mask & keep)
            metrics["entropy_coef"] = control.coef  # TRL logs it (and policy_loss) under adaptive control
            metrics.setdefault("policy_loss", loss.detach())
        metrics["entropy"] = (entropy.detach() * m).sum() / m.sum().clamp(min=1.0)
        return StepOutput(loss=loss, count=len(rows), metrics=metrics)

    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """The mean reward (and each reward's) of greedy completions of the first `eval_questions`
        validation prompts."""
        rows: list[PromptRow] = []
        for batch in batches:
            rows += batch["rows"][: self.eval_questions - len(rows)]
            if len(rows) >= self.eval_questions:
                break
        if not rows:
            return {}
        greedy = self.sample(model, rows, torch.Generator(), **GREEDY)
        scores = self.score(rows, [self.completion_text(c) for c in greedy.ids], greedy.ids, 1)
        # over the completions each reward applies to; a reward that applies to none is left out
        out = {"reward": _nanmean(self.total(scores))}
        if math.isnan(out["reward"]):
            raise DataError(
                f"no reward applied to any of the {len(rows)} validation prompts' completions (every reward "
                "returned None): a reward must score the validation prompts",
                key="task.rewards",
                value=",".join(name for name, _ in self.rewards),
            )
        for j, (name, _) in enumerate(self.rewards):
            out[f"rewards/{name}"] = _nanmean(scores[:, j])
        return {k: v for k, v in out.items() if not math.isnan(v)}
