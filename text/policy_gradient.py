"""The policy-gradient math of the GRPO family (TRL's `GRPOTrainer` semantics): group-relative
advantages, the clipped (or gated, or capped) token-level surrogate with its aggregations, the token
log-probs and entropies it is of, and the high-entropy token mask. `text.grpo` is the task that samples,
scores and trains with them; tests check each against TRL's own loss code."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from core import compile as kc
from core.distributed.group import all_gather_cat, all_reduce_sum
from core.errors import ConfigError
from core.logging.messages import warn
from core.loop.callbacks import Callback
from text import rewards as rw

if TYPE_CHECKING:
    from core.loop.trainer import Trainer

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
#: the aggregations whose normaliser is the completion tokens of the whole accumulation group (TRL's
#: num_items_in_batch): sampled before the group's first forward, weighed by their tokens
TOKEN_MEAN_LOSSES = ("dapo", "cispo", "vespo")
#: vespo's gamma weights (k, lambda) for completions of advantage >= 0 and for the others: TRL's defaults
VESPO_DEFAULTS = ((2.0, 3.0), (3.0, 2.0))
# bounds of the log importance weights vespo's gamma weight is of, per token and per completion (TRL's)
_VESPO_TOKEN_BOUND, _VESPO_LOW = 20.0, math.log(1e-8)
#: task.importance_sampling_level: a ratio per token, or one per completion (GSPO)
LEVELS = ("token", "sequence")


def _group_statistics(groups: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mean, values less it, std, count) over dim 1 of `groups` (groups, group size, ...), NaN values left
    out (centred: 0 there); the std Bessel-corrected, as torch.std and TRL's nanstd (0 below two values)."""
    scored = ~torch.isnan(groups)
    count = scored.sum(dim=1, keepdim=True)
    mean = groups.nan_to_num(0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = (groups - mean).masked_fill(~scored, 0.0)
    std = (centred.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    return mean, centred, std, count


# ---- advantages ------------------------------------------------------------------------------------------
def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: str = "group", batch_std: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (N,), which groups have no signal (N // group_size,)) of `rewards` (N,), groups of
    `group_size` in a row: each reward less its group's mean, then by `scale`: over the group's std +
    1e-4 (group: TRL's scale_rewards="group"), over `batch_std` + 1e-4 (batch: the generation batch's std,
    which must be given), over the group's mean (mean: MaxRL's, for rewards >= 0) or as it is (none: Dr.
    GRPO's). A NaN reward (a completion no reward applies to) is left out of its group's mean and std and
    has advantage 0, as TRL's; a group with fewer than two rewards that are not NaN, or all of them equal,
    has no signal: advantages of exactly 0."""
    mean, adv, std, count = _group_statistics(rewards.view(-1, group_size))
    flat = (count < 2) | torch.isclose(std, torch.zeros_like(std))
    if scale == "batch":
        if batch_std is None:
            raise ValueError("scale='batch' needs batch_std")
        adv = adv / (batch_std + 1e-4)
    elif scale == "group":
        adv = adv / (std + 1e-4)
    elif scale == "mean":
        # (r - p) / p has the expected gradient grad p / p = grad log p for a 0/1 reward of mean p: the
        # success probability's log-likelihood (MaxRL), where std scaling's, grad p / sqrt(p (1 - p)),
        # tilts toward the prompts already mostly right (docs/llm.md § RL, "GRPO gives up the book").
        # Rewards are >= 0 here (score's check), so a group with variance has a mean > 0.
        adv = adv / mean.clamp_min(torch.finfo(mean.dtype).tiny)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}")
    return adv.masked_fill(flat, 0.0).flatten(), flat.flatten()


def batch_reward_stats(totals: Sequence[torch.Tensor], device: torch.device | None) -> tuple[float, float]:
    """(mean, std: Bessel-corrected, as TRL's nanstd) of the rewards `totals` hold, NaN ones (no reward
    applied) left out, on every data-parallel rank together when `device` is given (the collectives'
    device; None: this process's alone), the std centred on the mean first."""

    def summed(values: list[float]) -> list[float]:
        return values if device is None else all_reduce_sum(values, device)

    kept = [t[~torch.isnan(t)] for t in totals]
    n, total = summed([float(sum(len(t) for t in kept)), float(sum(t.sum() for t in kept))])
    mean = total / max(n, 1)
    (squares,) = summed([float(sum(((t - mean) ** 2).sum() for t in kept))])
    return mean, (squares / (n - 1)) ** 0.5 if n > 1 else 0.0


def normalized_sum(scores: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """TRL's normalize_then_sum (GDPO): each reward of `scores` (N, rewards) less its group's mean over its
    group's std + 1e-4 (NaN ones left out; a reward with fewer than two values in a group adds nothing
    there), then their weighted sum (N,), NaN for a completion no reward applies to."""
    _, centred, std, count = _group_statistics(scores.view(-1, group_size, scores.shape[1]))
    normalized = (centred / (std + 1e-4)).masked_fill(count < 2, 0.0).view_as(scores)
    return rw.weighted_total(normalized.masked_fill(torch.isnan(scores), math.nan), weights)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    max_completion_length: int = 1,
    level: str = "token",
    delta: float | None = None,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    vespo: tuple[tuple[float, float], tuple[float, float]] = VESPO_DEFAULTS,
    keep: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    kl_bias_correction: bool = False,
    off_policy_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of completions' token log-probs `logps` (B, T) under the policy trained, `old_logps`
    under the one that sampled them, `advantages` (B,), on the tokens of `mask` (B, T) alone; with `beta` > 0
    plus beta times the k3 estimate of KL to the reference (`ref_logps`).

    The importance weight is each token's ratio of the two policies (`level` token) or, GSPO's (sequence),
    one per completion: the exp of its tokens' mean log-ratio. Per token (`loss_type`): the clipped
    surrogate `-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)`, with `r` capped at `delta` where given
    (INTELLECT-2's two-sided clipping); cispo, `-min(r, epsilon_high) A log p` with the capped weight
    detached (MiniMax-M1); sapo, the soft gate `-4 sigmoid(tau (r - 1)) / tau A`, tau the first of
    `sapo_temperatures` where A > 0, else the second; vespo, `-phi(w) A log p` with phi VESPO's gamma
    weight of each completion's importance weight w (`vespo_weights`; `vespo` its (k, lambda) for A >= 0,
    then for A < 0), detached. Aggregation: grpo and sapo, the mean over each
    sequence's tokens, then over sequences; dapo, cispo and vespo, the sum over the batch's completion tokens
    over their count (the loop weighs micro-batches and ranks by those tokens, so a step's is TRL's
    num_items_in_batch); bnpo, the same over this micro-batch's tokens (the loop weighs it by prompts);
    dr_grpo, the sum over B * `max_completion_length`; luspo, each sequence's sum, then the mean over
    sequences. `keep` (B, T), where given, is the tokens whose policy term counts (the top entropy
    quantile's); the KL and the normalisers still count every token of `mask`, as TRL's. With
    `entropy_coef`, less that times the mean of `entropy` (B, T, with its gradient) over the tokens of `mask`
    (and `keep`), whatever the loss type: TRL's entropy bonus. `kl_bias_correction` multiplies each token's
    KL by the importance weight (DeepSeek-V3.2's unbiased KL gradient; TRL's use_bias_correction_kl).
    `off_policy_threshold`, where given, drops the policy term of each completion whose advantage is
    negative and whose tokens' mean of `old_logps - logps` (the sampler's KL to the policy) is above it
    (DeepSeek-V3.2's off-policy sequence masking). Returns the loss and its statistics (clip_ratio, except
    for sapo and vespo; vespo/phi_seq_mean; off_policy_masked, the share of completions dropped; kl;
    policy_loss, the loss before the bonus), detached."""
    if loss_type not in LOSS_TYPES:
        raise ConfigError(
            f"task.loss_type={loss_type} is not one of {', '.join(LOSS_TYPES)}",
            key="task.loss_type",
            value=loss_type,
            valid=LOSS_TYPES,
        )
    m = mask.to(logps.dtype)
    kept = m.sum().clamp(min=1.0)  # the statistics' mean is over this batch's completion tokens
    adv = advantages[:, None].to(logps.dtype)
    stats: dict[str, torch.Tensor] = {}
    dropped: torch.Tensor | None = None
    if off_policy_threshold is not None:
        drift = ((old_logps - logps.detach()).nan_to_num(0.0) * m).sum(-1, keepdim=True)
        dropped = (adv < 0) & (drift / m.sum(-1, keepdim=True).clamp(min=1.0) > off_policy_threshold)
        stats["off_policy_masked"] = dropped.to(m.dtype).mean().detach()
    token_log_ratio = log_ratio = logps - old_logps
    if level == "sequence":  # one weight a completion, broadcast over its tokens
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    elif level != "token":
        raise ValueError(f"unknown importance sampling level {level!r}")
    ratio = torch.exp(log_ratio)
    high = epsilon if epsilon_high is None else epsilon_high
    clipped: torch.Tensor | None = None
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=high).detach() * adv * logps
        clipped = (ratio > high) & (adv > 0)
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, adv.new_tensor(sapo_temperatures[0]), adv.new_tensor(sapo_temperatures[1]))
        per_token = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv
    elif loss_type == "vespo":
        phi = vespo_weights(adv, token_log_ratio.detach(), m, vespo)
        per_token = -phi * adv * logps
        stats["vespo/phi_seq_mean"] = phi.mean().detach()
    else:
        bounded = torch.clamp(ratio, 1 - epsilon, 1 + high)
        capped = ratio if delta is None else torch.clamp(ratio, max=delta)
        per_token = -torch.min(capped * adv, bounded * adv)
        clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    if dropped is not None:
        per_token = per_token * (~dropped).to(per_token.dtype)
    if keep is not None:
        per_token = per_token * keep.to(per_token.dtype)
    if clipped is not None:
        stats["clip_ratio"] = ((clipped.to(m.dtype) * m).sum() / kept).detach()
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference's log-probs")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if kl_bias_correction:  # its value is kl's on-policy (ratio 1), its gradient the ratio's too
            kl = kl * ratio
        per_token = per_token + beta * kl
        stats["kl"] = ((kl * m).sum() / kept).detach()
    summed = (per_token * m).sum(-1)  # (B,): each completion's tokens
    if loss_type in ("grpo", "sapo"):
        loss = (summed / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type in ("dapo", "cispo", "vespo", "bnpo"):
        loss = summed.sum() / kept
    elif loss_type == "dr_grpo":
        loss = summed.sum() / (per_token.shape[0] * max_completion_length)
    else:  # luspo
        loss = summed.mean()
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef needs the tokens' entropy")
        counted = m if keep is None else m * keep.to(m.dtype)
        stats["policy_loss"] = loss.detach()
        loss = loss - entropy_coef * (entropy * counted).sum() / counted.sum().clamp(min=1.0)
    return loss, stats


class AdaptiveEntropy(Callback):
    """Skywork-OR1's adaptive entropy control (TRL's use_adaptive_entropy): the entropy bonus's coefficient
    rises by `delta` after each optimizer step whose counted completion tokens' mean entropy (over the
    step's micro-batches on every data-parallel rank) was at or below `target`, and falls by it otherwise,
    within `bounds`; a step applies it only where the previous step's entropy was at or below the target
    (the first applies none). The coefficient and the last entropy are checkpointed."""

    def __init__(self, coef: float, target: float, delta: float, bounds: tuple[float, float]) -> None:
        """Start at `coef` (TRL's entropy_coef), toward `target` nats by steps of `delta` in `bounds`."""
        self.coef, self.target, self.delta, self.bounds = coef, target, delta, bounds
        self.last = math.inf  # no step measured yet: the first applies no bonus (TRL's)
        self.window = [0.0, 0.0]  # this step's entropy sum and token count
        self.device: torch.device | None = None  # the collectives' device, in the loop of several ranks

    def applied(self) -> float:
        """The coefficient this step's micro-batches apply: 0 unless the last step's entropy was at or
        below the target."""
        return self.coef if self.last <= self.target else 0.0

    def observe(self, entropy: torch.Tensor, counted: torch.Tensor) -> None:
        """Add a micro-batch's `entropy` (B, T) on its `counted` tokens to this step's window."""
        c = counted.to(entropy.dtype)
        self.window[0] += float((entropy.detach() * c).sum())
        self.window[1] += float(c.sum())

    def update(self, device: torch.device | None) -> None:
        """End a step: its entropy over every rank (`device`: the collectives'; None, this process's)
        moves the coefficient for the next one."""
        total, count = self.window if device is None else all_reduce_sum(self.window, device)
        entropy = total / max(count, 1.0)
        low, high = self.bounds
        step = self.delta if entropy <= self.target else -self.delta
        self.coef, self.last, self.window = min(max(self.coef + step, low), high), entropy, [0.0, 0.0]

    def on_fit_start(self, trainer: Trainer) -> None:
        """Reduce over the data-parallel ranks from here on; a probe's micro-batches are forgotten."""
        self.device = trainer.plan.device if trainer.dist.distributed else None
        self.window = [0.0, 0.0]

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Every optimizer step (every rank): move the coefficient."""
        self.update(self.device)

    def state_dict(self) -> dict[str, Any]:
        """The coefficient and the last step's entropy (None before the first)."""
        return {"coef": self.coef, "last": None if math.isinf(self.last) else self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s."""
        self.coef = float(state["coef"])
        self.last = math.inf if state["last"] is None else float(state["last"])


def vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    shape: tuple[tuple[float, float], tuple[float, float]] = VESPO_DEFAULTS,
) -> torch.Tensor:
    """(B, 1) VESPO's gamma weight `phi(w) = exp(lambda) w^k exp(-lambda w)` (1 at w = 1) of each
    completion's importance weight w, the exp of its tokens' summed `log_ratio` (B, T) over `mask`;
    (k, lambda) the first pair of `shape` where the completion's advantage (`advantages`, (B, 1)) is >= 0,
    else the second; in log space with TRL's bounds, 0 where it is not finite, detached."""
    with torch.no_grad():
        per_token = log_ratio.clamp(-_VESPO_TOKEN_BOUND, _VESPO_TOKEN_BOUND)
        log_w = (per_token * mask).sum(-1, keepdim=True).clamp(_VESPO_LOW, _VESPO_TOKEN_BOUND)
        up = advantages >= 0
        (k_up, lam_up), (k_down, lam_down) = shape
        k = torch.where(up, log_w.new_tensor(k_up), log_w.new_tensor(k_down))
        lam = torch.where(up, log_w.new_tensor(lam_up), log_w.new_tensor(lam_down)).clamp(min=1e-4)
        # w < 1 is damped by w^k, w > 1 by exp(-lambda (w - 1)): a smooth clip of stale completions
        return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def high_entropy_mask(
    entropy: torch.Tensor, mask: torch.Tensor, quantile: float, device: torch.device | None
) -> torch.Tensor:
    """(B, T) bool: the tokens of `mask` whose `entropy` is at least the (1 - `quantile`) quantile of every
    masked token's, over every data-parallel rank's when `device` is given (the collectives' device; None:
    this process's alone): "Beyond the 80/20 rule"'s high-entropy forking tokens, TRL's
    top_entropy_quantile."""
    values = entropy[mask].float()
    pooled = values if device is None else all_gather_cat(values, device)
    if pooled.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(pooled, 1.0 - quantile)
    return (entropy >= threshold) & mask.bool()


def token_logps(
    model: nn.Module,
    tokens: torch.Tensor,
    temperature: float,
    *,
    context: int | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each next token, entropy of the distribution it was drawn from: detached unless
    `entropy_grad`), each (B, L - 1), of `tokens` (B, L), right-padded rows from position 0, with logits
    over `temperature` as the sampler drew them (TRL's `_get_per_token_logps_and_entropies`). With the
    model's `context` given, a compiled model sees the rows padded to a length bucket
    (`core.compile.bucket_for_compiled`)."""
    x = tokens[:, :-1]
    if context is not None:
        x = kc.bucket_for_compiled(model, x, context)
    logits = model(x)[:, : tokens.shape[1] - 1].float() / temperature
    logp = logits.log_softmax(dim=-1)
    picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


def check_loss(loss_type: str, epsilon_high: float, level: str) -> None:
    """One-line ConfigError for a loss a run cannot train with; a warning, as TRL's, for one that departs
    from its paper's setting."""
    if loss_type == "cispo" and not epsilon_high:
        # with the default (epsilon, 0.2) every on-policy weight (1) would be cut to 0.2
        raise ConfigError(
            "task.loss_type=cispo caps the importance weight at task.epsilon_high, which is 0: set it "
            "(ScaleRL uses 5.0)",
            key="task.epsilon_high",
            value=str(epsilon_high),
        )
    if level == "sequence" and loss_type in ("dapo", "bnpo", "dr_grpo", "cispo"):
        warn(
            f"task.importance_sampling_level=sequence with task.loss_type={loss_type} sums token terms, so "
            "each completion weighs as its length: GSPO's objective is task.loss_type=grpo"
        )
    if loss_type == "luspo" and level != "sequence":
        warn(
            "task.loss_type=luspo is a sequence-level loss: its paper sets "
            "task.importance_sampling_level=sequence"
        )
    if loss_type == "vespo" and level != "token":
        warn(
            "task.loss_type=vespo weighs each completion by its own sequence-level importance weight: "
            "set task.importance_sampling_level=token (the default)"
        )
