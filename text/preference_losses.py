"""The pair losses of preference tuning (`+task=dpo`), TRL's `DPOTrainer` loss types (and CPO's SimPO) with
their semantics: each a per-pair loss of the chosen and rejected completions' summed log-probabilities
under the policy and the reference, checked against TRL's own trainer code in tests.

Most are of the chosen log-ratio to the reference minus the rejected one's; `task.f_divergence_type`
replaces each log-ratio by the derivative of another f-divergence first (f-DPO, Wang et al. 2023), for the
losses whose reparameterisation allows it (`F_DIVERGENCE_LOSSES`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from core.errors import ConfigError

#: task.loss: each a pair loss (`pair_losses`); sft adds the chosen completions' negative log-likelihood
LOSSES = (
    "sigmoid",
    "ipo",
    "simpo",
    "hinge",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "sft",
)
#: task.f_divergence_type: the f-divergence whose derivative replaces each log-ratio (reverse_kl: DPO's own)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
#: the losses an f-divergence other than reverse KL applies to (their log Z terms cancel in the difference)
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
#: the losses task.label_smoothing applies to (exo_pair needs it above 0)
SMOOTHED = ("sigmoid", "simpo", "exo_pair", "robust", "aot", "aot_unpaired")


def check_losses(
    losses: list[str],
    weights: list[float],
    label_smoothing: float,
    divergence: str,
    *,
    ld_alpha: float | None = None,
    use_weighting: bool = False,
    sync_ref_model: bool = False,
    precompute_reference: bool = False,
) -> None:
    """One-line ConfigError, naming the key, for a combination of +task=dpo's loss settings TRL refuses too
    (and simpo, CPO's there, with the options of TRL's DPOTrainer)."""
    if weights and len(weights) != len(losses):
        raise ConfigError(
            f"task.loss_weights has {len(weights)} values for {len(losses)} losses (task.loss)",
            key="task.loss_weights",
            value=str(list(weights)),
        )
    if "simpo" in losses and len(losses) > 1:
        raise ConfigError(
            f"task.loss={losses}: simpo is reference-free (CPO's) and combines with no other loss but "
            "task.sft_weight",
            key="task.loss",
            value=",".join(losses),
        )
    if label_smoothing and not set(losses) & set(SMOOTHED):
        raise ConfigError(
            f"task.label_smoothing applies to task.loss in {', '.join(SMOOTHED)}, not {','.join(losses)}; "
            "leave it at 0",
            key="task.label_smoothing",
            value=str(label_smoothing),
            valid=("0",),
        )
    if "exo_pair" in losses and not label_smoothing:
        raise ConfigError(
            "task.loss=exo_pair needs task.label_smoothing > 0 (its epsilon; the EXO paper uses 1e-3)",
            key="task.label_smoothing",
            value="0",
        )
    if divergence != "reverse_kl" and not set(losses) <= set(F_DIVERGENCE_LOSSES):
        raise ConfigError(
            f"task.f_divergence_type={divergence} applies to task.loss in {', '.join(F_DIVERGENCE_LOSSES)} "
            "only: use reverse_kl with the others",
            key="task.f_divergence_type",
            value=divergence,
        )
    for key, value in (("task.ld_alpha", ld_alpha), ("task.use_weighting", use_weighting)):
        if value is not None and value is not False and "simpo" in losses:
            message = f"{key} applies to TRL's DPO losses; simpo is CPO's: leave it unset"
            raise ConfigError(message, key=key, value=str(value))
    if use_weighting and {"aot", "aot_unpaired"} & set(losses):
        # (TRL refuses it too) the aot losses sort pairs: a pair's weight would land on another's loss
        raise ConfigError(
            "task.use_weighting does not combine with the aot losses, which sort the pairs",
            key="task.use_weighting",
            value="true",
        )
    if sync_ref_model and (precompute_reference or "simpo" in losses):
        # (TRL refuses the first too) precomputed log-probs are of the reference before any sync
        why = "task.precompute_reference=true computes once" if precompute_reference else "simpo has none"
        message = f"task.sync_ref_model=true moves the reference, which {why}"
        raise ConfigError(message, key="task.sync_ref_model", value="true")


def f_scores(log_ratio: torch.Tensor, divergence: str, alpha: float = 0.5) -> torch.Tensor:
    """f'(t) at t = exp(`log_ratio`) for the f-divergence `divergence` (reverse_kl: the log-ratio itself;
    forward_kl: 1 - 1/t; js_divergence: log 2t / (t + 1); alpha_divergence: (t^(alpha - 1) - 1) / (alpha
    - 1), the exponent capped at 80 as TRL's)."""
    if divergence == "reverse_kl":
        return log_ratio
    if divergence == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    if divergence != "alpha_divergence":
        raise ValueError(f"unknown f-divergence {divergence!r}")
    if abs(alpha - 1.0) < 1e-6:  # its limit is the reverse KL
        return log_ratio
    # capped where exp would overflow float32 (TRL's bound)
    t = torch.clamp((alpha - 1.0) * log_ratio, max=80.0)
    return (torch.exp(t) - 1.0) / (alpha - 1.0)


def pair_losses(
    kind: str,
    policy: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor],
    tokens: tuple[torch.Tensor, torch.Tensor],
    *,
    beta: float,
    simpo_gamma: float = 0.0,
    label_smoothing: float = 0.0,
    divergence: str = "reverse_kl",
    alpha: float = 0.5,
    discopop_tau: float = 0.05,
) -> torch.Tensor:
    """Per-pair losses (B,) of loss `kind` from the summed completion log-probabilities `policy` and
    `reference` (chosen, rejected; each (B,)) and the completions' token counts `tokens`; the log-ratios
    through `f_scores` (`divergence`, `alpha`) where the loss takes scores. aot and aot_unpaired sort over
    the batch (each rank's micro-batch, as TRL's per device)."""
    eps = label_smoothing
    if kind == "simpo":  # reference-free, on mean log-probabilities
        chosen, rejected = (lp / n.clamp(min=1) for lp, n in zip(policy, tokens, strict=True))
        margin = beta * (chosen - rejected) - simpo_gamma
        return -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
    chosen, rejected = (p - r for p, r in zip(policy, reference, strict=True))
    c_score, r_score = f_scores(chosen, divergence, alpha), f_scores(rejected, divergence, alpha)
    z = beta * (c_score - r_score)
    if kind == "sigmoid":  # with eps: conservative DPO
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if kind in ("ipo", "sigmoid_norm"):  # each score averaged over its completion's tokens
        mean = (c_score / tokens[0].clamp(min=1)) - (r_score / tokens[1].clamp(min=1))
        return (mean - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * mean)
    if kind == "hinge":
        return torch.relu(1 - z)
    if kind == "exo_pair":  # KL(softmax over the pair's rewards || (1 - eps, eps))
        return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
            F.logsigmoid(-z) - math.log(eps)
        )
    if kind == "robust":  # unbiased under a share eps of flipped labels
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if kind == "discopop":  # a logistic and an exponential loss blended by the margin
        mix = torch.sigmoid(z / discopop_tau)
        return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
    up, down = beta * chosen, beta * rejected
    if kind == "nca_pair":
        return -F.logsigmoid(up) - 0.5 * F.logsigmoid(-up) - 0.5 * F.logsigmoid(-down)
    if kind == "bco_pair":
        return -F.logsigmoid(up) - F.logsigmoid(-down)
    if kind == "sppo_hard":  # the hard-probability SPPO: winner's log-ratio to 1/(2 beta), loser's to -it
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    if kind == "apo_zero":  # the chosen above the model's own outputs: up with it, down with the rejected
        return 1 - torch.sigmoid(up) + torch.sigmoid(down)
    if kind == "apo_down":  # the chosen below them: both down, the rejected more
        return torch.sigmoid(up) + 1 - torch.sigmoid(up - down)
    if kind in ("aot", "aot_unpaired"):  # the sorted distributions of the margins, matched
        # aot: the policy's chosen-rejected margins against the reference's; unpaired: the log-ratios
        margins = (policy[0] - policy[1], reference[0] - reference[1])
        mine, theirs = margins if kind == "aot" else (chosen, rejected)
        delta = torch.sort(mine, dim=0).values - torch.sort(theirs, dim=0).values
        return -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    raise ValueError(f"unknown pair loss {kind!r}")
