"""RL with verifiable rewards (`+task=grpo`, text/grpo.py and text/policy_gradient.py): the advantages and the
loss of each aggregation equal TRL 1.16.0's `GRPOTrainer` code, called on a minimally built trainer
(float64, 1e-6; the test-only `hf` extra); equal rewards give zero advantages; prompt and padding tokens
carry no loss; the sampling policy's log-probs are the training forward's (fp32, 1e-5); completions are kept
for `task.iterations` updates; the recipe trains, writes its completions, and resumes bit-exact from a
checkpoint taken between two updates on one generation."""

from __future__ import annotations

import ast
import collections
import copy
import dataclasses
import json
import math
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from core.data.bad_samples import BadSamplePolicy
from core.errors import ConfigError, DataError
from core.loop.accumulation import group_weights
from tests.helpers import counted_compiles, dist_env_vars, read_metrics, run_here, train
from text import rewards as rw
from text.generation import Rollout
from text.grpo import GroupRelativePolicyOptimization
from text.policy_gradient import (
    LEVELS,
    LOSS_TYPES,
    TOKEN_MEAN_LOSSES,
    VESPO_DEFAULTS,
    AdaptiveEntropy,
    batch_reward_stats,
    group_advantages,
    high_entropy_mask,
    policy_loss,
    token_logps,
    vespo_weights,
)
from text.prompts import collate_prompts
from text.prompts import prompts as prompts_data
from text.rollouts import DrawnRollout, PendingRollouts, RepeatedBatches, ScoredRollout, pack_rollout

CODE_REWARD = "tests.text.test_grpo:completion_code"
TINY_MODEL = {"name": "llama", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "hidden": 64}


class _Accelerator:
    """What TRL's loss code asks of accelerate in one process."""

    num_processes, process_index, device = 1, 0, torch.device("cpu")
    sync_gradients = True  # one micro-batch a step

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def pad_across_processes(self, x: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        return x

    gather_for_metrics = gather


def _trl_trainer(**attrs: Any) -> Any:
    """A `GRPOTrainer` built with `object.__new__` and only the attributes its loss code reads."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl (the `hf` extra) is not installed")
    t = object.__new__(grpo.GRPOTrainer)
    t.__dict__.update(
        accelerator=_Accelerator(),
        model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False),
        _metrics={"train": collections.defaultdict(list)},
        **attrs,
    )
    return t


def _trl_loss(
    logps: torch.Tensor,
    inputs: dict[str, Any],
    delta: float | None = None,
    entropies: torch.Tensor | None = None,
    bias_correction: bool = False,
    vespo: tuple[tuple[float, float], tuple[float, float]] = ((2.0, 3.0), (3.0, 2.0)),
    **attrs: Any,
) -> torch.Tensor:
    """TRL's `_compute_loss` on `inputs`, the policy's per-token log-probs given as `logps` (and their
    distributions' entropies as `entropies`, else 0)."""
    t = _trl_loss_trainer(delta, bias_correction, vespo, **attrs)
    return _trl_compute(t, logps, inputs, entropies)


def _trl_compute(
    t: Any, logps: torch.Tensor, inputs: dict[str, Any], entropies: torch.Tensor | None = None
) -> torch.Tensor:
    """`t`'s `_compute_loss` with `logps` (and `entropies`, else 0) as the policy's."""
    entropies = torch.zeros_like(logps) if entropies is None else entropies
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    return t._compute_loss(None, inputs)


def _trl_loss_trainer(
    delta: float | None = None,
    bias_correction: bool = False,
    vespo: tuple[tuple[float, float], tuple[float, float]] = ((2.0, 3.0), (3.0, 2.0)),
    fields: dict[str, Any] | None = None,
    **attrs: Any,
) -> Any:
    """A `GRPOTrainer` whose `_compute_loss` runs: `fields` adds to its config's, `attrs` to its own."""
    (k_pos, lambda_pos), (k_neg, lambda_neg) = vespo
    args = types.SimpleNamespace(
        delta=delta,
        use_bias_correction_kl=bias_correction,
        steps_per_generation=1,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=k_pos,
        vespo_lambda_pos=lambda_pos,
        vespo_k_neg=k_neg,
        vespo_lambda_neg=lambda_neg,
        **(fields or {}),
    )
    return _trl_trainer(
        use_vllm=False,
        aux_loss_enabled=False,
        args=args,
        **{
            "current_gradient_accumulation_steps": 1,
            "importance_sampling_level": "token",
            "off_policy_mask_threshold": None,
            "top_entropy_quantile": 1.0,
            "_entropy_bonus_enabled": False,
            **attrs,
        },
    )


def _loss_inputs(seed: int = 0) -> tuple[torch.Tensor, dict[str, Any]]:
    """Policy log-probs (6, 5) and TRL's loss inputs around them: the sampler's and the reference's
    log-probs apart from them, a ragged completion mask, advantages of both signs (float64)."""
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 5
    base = torch.randn(b, t, dtype=torch.float64, generator=g) * 0.3 - 1
    old = base + 0.3 * torch.randn(b, t, dtype=torch.float64, generator=g)
    ref = base + 0.2 * torch.randn(b, t, dtype=torch.float64, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    adv = torch.randn(b, dtype=torch.float64, generator=g).abs() * torch.tensor([1.0, -1.0] * (b // 2))
    inputs = {
        "prompt_ids": torch.zeros(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return base, inputs


def _both_losses(
    base: torch.Tensor, inputs: dict[str, Any], **options: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(ours's gradient on `base`, TRL's, ours's statistics) for the same loss settings. With `entropy`
    (B, T) given, both sides see it as the tokens' entropy, for `quantile` (the top entropy quantile) and
    `entropy_coef` (the bonus, whose gradient on the entropy is compared too, 1e-9, and returned as
    statistics' `entropy_grad`); `kl_bias_correction`, `off_policy_threshold` and `vespo` as
    `policy_loss`'s."""
    high = options.get("epsilon_high", 0.28)
    theirs_in, ours_in = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    entropy, quantile, coef = (
        options.get("entropy"),
        options.get("quantile", 1.0),
        options.get("entropy_coef", 0.0),
    )
    theirs_ent = ours_ent = keep = None
    if entropy is not None:
        theirs_ent, ours_ent = entropy.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
        if quantile < 1:
            keep = high_entropy_mask(entropy, inputs["completion_mask"].bool(), quantile, None)
    vespo = options.get("vespo", VESPO_DEFAULTS)
    theirs = _trl_loss(
        theirs_in,
        inputs,
        delta=options.get("delta"),
        entropies=theirs_ent,
        bias_correction=options.get("kl_bias_correction", False),
        vespo=vespo,
        off_policy_mask_threshold=options.get("off_policy_threshold"),
        loss_type=options["loss_type"],
        beta=options.get("beta", 0.0),
        epsilon_low=0.2,
        epsilon_high=high,
        max_completion_length=base.shape[1],
        importance_sampling_level=options.get("level", "token"),
        top_entropy_quantile=quantile,
        _entropy_bonus_enabled=bool(coef),
        entropy_coef=coef,
        use_adaptive_entropy=False,
    )
    ours, stats = policy_loss(
        ours_in,
        inputs["old_per_token_logps"],
        inputs["advantages"],
        inputs["completion_mask"],
        loss_type=options["loss_type"],
        epsilon=0.2,
        epsilon_high=high,
        beta=options.get("beta", 0.0),
        ref_logps=inputs["ref_per_token_logps"],
        max_completion_length=base.shape[1],
        level=options.get("level", "token"),
        delta=options.get("delta"),
        keep=keep,
        entropy=ours_ent,
        entropy_coef=coef,
        vespo=vespo,
        kl_bias_correction=options.get("kl_bias_correction", False),
        off_policy_threshold=options.get("off_policy_threshold"),
    )
    theirs.backward()
    ours.backward()
    assert abs(theirs.item() - ours.item()) <= 1e-6
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=0, atol=1e-6)
    assert ours_in.grad is not None
    if coef:
        assert ours_ent is not None and theirs_ent is not None
        torch.testing.assert_close(ours_ent.grad, theirs_ent.grad, rtol=0, atol=1e-9)
        stats["entropy_grad"] = ours_ent.grad
    return ours_in.grad, theirs_in.grad, stats


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_loss_and_its_gradient_equal_trls_for_each_aggregation(
    loss_type: str, level: str, beta: float
) -> None:
    # cispo's epsilon_high is the importance weight's cap (TRL alike), not a clip range's side
    high = 1.2 if loss_type == "cispo" else 0.28
    base, inputs = _loss_inputs()
    grad, _, stats = _both_losses(
        base, inputs, loss_type=loss_type, level=level, beta=beta, epsilon_high=high
    )
    mask = inputs["completion_mask"]
    assert grad[mask == 0].abs().max() == 0  # masked (prompt, padding) tokens carry no loss
    assert grad.abs().max() > 0
    if loss_type not in ("sapo", "vespo"):  # their weights are smooth: nothing is clipped
        # the clip range is exercised on both sides of the ratios (token level: sequences average theirs)
        assert 0 < float(stats["clip_ratio"]) < 1 or level == "sequence"
    assert ("kl" in stats) == bool(beta)


def test_on_policy_the_ratio_variants_give_the_plain_surrogates_gradient() -> None:
    # one update a generation (task.iterations=1): every ratio is 1 with its gradient, so cispo's capped
    # weight, vespo's gamma weight (phi(1) = 1), sapo's gate and GSPO's sequence ratio give the clipped
    # surrogate's gradient, aggregation alike
    base, inputs = _loss_inputs(1)
    grads = {}
    for name, loss_type, level in (
        ("dapo", "dapo", "token"),
        ("cispo", "cispo", "token"),
        ("vespo", "vespo", "token"),
        ("sapo", "sapo", "token"),
        ("grpo", "grpo", "token"),
        ("gspo", "grpo", "sequence"),
    ):
        x = base.clone().requires_grad_(True)
        options = {
            "loss_type": loss_type,
            "level": level,
            "epsilon_high": 5.0 if loss_type == "cispo" else None,
        }
        policy_loss(x, x.detach(), inputs["advantages"], inputs["completion_mask"], **options)[0].backward()
        grads[name] = x.grad
    # sapo's mean is per sequence (grpo's): its tokens weigh as grpo's
    for a, b in (("dapo", "cispo"), ("dapo", "vespo"), ("grpo", "sapo"), ("grpo", "gspo")):
        torch.testing.assert_close(grads[a], grads[b], rtol=0, atol=1e-12)
    assert not torch.allclose(grads["dapo"], grads["grpo"])  # the aggregations differ


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_top_entropy_quantile_trains_the_high_entropy_tokens_as_trls(loss_type: str) -> None:
    base, inputs = _loss_inputs()
    mask = inputs["completion_mask"]
    entropy = torch.rand(base.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3
    keep = high_entropy_mask(entropy, mask.bool(), 0.2, None)
    # a fifth of the completion tokens (to one token), the highest-entropy ones, none outside the mask
    n = int(mask.sum())
    assert abs(int(keep.sum()) - 0.2 * n) <= 1 and not keep[mask == 0].any()
    assert entropy[keep].min() > entropy[mask.bool() & ~keep].max()
    settings = {"loss_type": loss_type, "beta": 0.04, "epsilon_high": 0.2}
    grad, _, _ = _both_losses(base, inputs, entropy=entropy, quantile=0.2, **settings)
    # the tokens left out keep only the KL's gradient
    plain = _both_losses(base, inputs, **settings)[0]
    assert not torch.allclose(grad[mask.bool() & ~keep], plain[mask.bool() & ~keep])


@pytest.mark.parametrize("quantile", [1.0, 0.5])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_entropy_bonus_and_its_gradients_equal_trls(loss_type: str, quantile: float) -> None:
    base, inputs = _loss_inputs(3)
    entropy = torch.rand(base.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 3
    high = 5.0 if loss_type == "cispo" else 0.28
    options = {"loss_type": loss_type, "epsilon_high": high, "entropy": entropy, "quantile": quantile}
    _, _, stats = _both_losses(base, inputs, entropy_coef=0.05, **options)
    # the bonus raises the entropy of every counted token alike, and of no other
    mask = inputs["completion_mask"].bool()
    counted = mask & high_entropy_mask(entropy, mask, quantile, None) if quantile < 1 else mask
    grad = stats["entropy_grad"]
    assert (grad[counted] < 0).all() and grad[~counted].eq(0).all()
    # policy_loss is the loss before the bonus: the same settings' loss without it
    keep = None if quantile == 1 else counted
    old, adv = inputs["old_per_token_logps"], inputs["advantages"]
    plain, plain_stats = policy_loss(
        base,
        old,
        adv,
        mask,
        loss_type=loss_type,
        epsilon_high=high,
        max_completion_length=base.shape[1],
        keep=keep,
    )
    assert stats["policy_loss"].item() == pytest.approx(plain.item(), rel=0, abs=1e-12)
    assert "policy_loss" not in plain_stats


def test_adaptive_entropy_control_moves_and_applies_the_coefficient_as_trls_over_accumulated_steps() -> None:
    # 6 optimizer steps of 2 micro-batches (grpo: the loop weighs two of equal prompts 1/2 each, TRL divides
    # each by its accumulation steps), the entropy scaled below and above the 1-nat target; TRL's controller
    # sees the micro-batches' window at the step boundary (sync_gradients), ours at the step's end
    target, delta, bounds = 1.0, 0.02, (0.0, 0.03)
    fields = {"entropy_target": target, "entropy_coef_delta": delta}
    fields.update(entropy_coef_min=bounds[0], entropy_coef_max=bounds[1])
    trl = _trl_loss_trainer(
        fields=fields,
        loss_type="grpo",
        beta=0.0,
        epsilon_low=0.2,
        epsilon_high=0.28,
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
        use_adaptive_entropy=True,
        _entropy_bonus_enabled=True,
        _last_world_entropy=math.inf,
        _entropy_window_stats=None,
        current_gradient_accumulation_steps=2,
    )
    trl.accelerator = _Accelerator()
    ours = AdaptiveEntropy(0.01, target, delta, bounds)
    applied, coefs = [], []
    for step, scale in enumerate([0.3, 0.3, 3.0, 0.3, 3.0, 3.0]):
        applied.append(ours.applied())
        for k in range(2):
            base, inputs = _loss_inputs(10 * step + k)
            g = torch.Generator().manual_seed(10 * step + k)
            entropy = torch.rand(base.shape, dtype=torch.float64, generator=g) * scale
            trl.accelerator.sync_gradients = k == 1
            theirs = _trl_compute(trl, base, inputs, entropy)
            mask = inputs["completion_mask"].bool()
            keep = high_entropy_mask(entropy, mask, 0.5, None)
            mine, _ = policy_loss(
                base,
                inputs["old_per_token_logps"],
                inputs["advantages"],
                mask,
                loss_type="grpo",
                epsilon_high=0.28,
                keep=keep,
                entropy=entropy,
                entropy_coef=ours.applied(),
            )
            assert theirs.item() == pytest.approx(mine.item() / 2, rel=0, abs=1e-12)
            ours.observe(entropy, mask & keep)
        ours.update(None)
        assert ours.coef == pytest.approx(trl.entropy_coef, abs=1e-15)
        assert ours.last == pytest.approx(trl._last_world_entropy, abs=1e-12)
        coefs.append(ours.coef)
    # no bonus before a step was measured; it rises while the entropy is low, within its bound, applies
    # only after a low step, and falls after high ones
    assert applied == [0.0, 0.01 + delta, 0.03, 0.0, 0.03, 0.0]
    assert coefs == pytest.approx([0.03, 0.03, 0.01, 0.03, 0.01, 0.0])
    restored = AdaptiveEntropy(0.5, target, delta, bounds)
    restored.load_state_dict(ours.state_dict())
    assert (restored.coef, restored.last) == (ours.coef, ours.last)
    fresh = AdaptiveEntropy(0.5, target, delta, bounds)
    fresh.load_state_dict(fresh.state_dict())  # before any step: no entropy measured yet
    assert fresh.applied() == 0.0


def _join_gloo(rank: int, world: int, store: str) -> None:
    """This spawned process as rank `rank` of a gloo group of `world`, meeting in the folder `store`."""
    import os

    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=rank, world_size=world)


def _rank_entropy_mask(
    rank: int, world: int, store: str, parts: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    _join_gloo(rank, world, store)
    entropy, mask = parts[rank]
    torch.save(high_entropy_mask(entropy, mask, 0.3, torch.device("cpu")), Path(store, f"keep{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # two spawned gloo processes (~6 s on 2 loaded cores)
def test_the_entropy_quantile_over_two_real_ranks_is_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rank r holds a micro-batch of its own width and completion tokens; the quantile is of both ranks'
    g = torch.Generator().manual_seed(4)
    parts = [
        (torch.rand(n, w, generator=g), torch.rand(n, w, generator=g) > 0.4) for n, w in ((3, 7), (5, 4))
    ]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_rank_entropy_mask, args=(2, str(tmp_path), parts), nprocs=2, join=True)
    pooled = torch.cat([e[m] for e, m in parts])
    threshold = torch.quantile(pooled, 0.7)
    kept = 0
    for rank, (entropy, mask) in enumerate(parts):
        keep = torch.load(tmp_path / f"keep{rank}.pt", weights_only=True)
        assert torch.equal(keep, (entropy >= threshold) & mask)
        kept += int(keep.sum())
    assert 0 < kept < len(pooled)  # each rank's own quantile would keep other tokens
    alone = [high_entropy_mask(e, m, 0.3, None) for e, m in parts]
    assert any(
        not torch.equal(a, torch.load(tmp_path / f"keep{r}.pt", weights_only=True))
        for r, a in enumerate(alone)
    )


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_sided_clipping_caps_the_ratio_of_negative_advantages_as_trls(loss_type: str) -> None:
    base, inputs = _loss_inputs()
    capped, _, _ = _both_losses(base, inputs, loss_type=loss_type, delta=1.3)
    plain, _, _ = _both_losses(base, inputs, loss_type=loss_type)
    # delta (1.3, above 1 + epsilon_high) caps the unclipped term: a ratio above it with A < 0 is held
    # there, so those tokens carry no gradient where plain clipping lets the ratio through; the rest alike
    ratio = torch.exp(base - inputs["old_per_token_logps"])
    held = (ratio > 1.3) & (inputs["advantages"][:, None] < 0) & (inputs["completion_mask"] == 1)
    assert held.any()
    assert capped[held].abs().max() == 0 and plain[held].abs().min() > 0
    torch.testing.assert_close(capped[~held], plain[~held], rtol=0, atol=1e-12)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_bias_corrected_kl_equals_trls_and_moves_only_the_gradient_on_policy(
    loss_type: str, level: str
) -> None:
    high = 1.2 if loss_type == "cispo" else 0.28
    base, inputs = _loss_inputs(4)
    options = {"loss_type": loss_type, "level": level, "beta": 0.04, "epsilon_high": high}
    corrected, _, stats = _both_losses(base, inputs, kl_bias_correction=True, **options)
    plain, _, plain_stats = _both_losses(base, inputs, **options)
    assert not torch.allclose(corrected, plain)  # off-policy (old != policy) both value and gradient move
    # on-policy the ratio is 1 with its gradient: the KL's value stays, its gradient gains kl x grad log p
    x, y = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    on = {**options, "ref_logps": inputs["ref_per_token_logps"], "max_completion_length": base.shape[1]}
    adv, mask = inputs["advantages"], inputs["completion_mask"]
    with_ratio, s1 = policy_loss(x, x.detach(), adv, mask, kl_bias_correction=True, **on)
    without, s2 = policy_loss(y, y.detach(), adv, mask, **on)
    assert with_ratio.item() == pytest.approx(without.item(), abs=1e-12)
    assert s1["kl"].item() == pytest.approx(s2["kl"].item(), abs=1e-12)
    with_ratio.backward()
    without.backward()
    assert x.grad is not None and y.grad is not None and not torch.allclose(x.grad, y.grad)
    assert "kl" in stats and "kl" in plain_stats


@pytest.mark.parametrize("threshold", [0.05, 0.2])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "vespo"])
def test_off_policy_masking_drops_stale_negative_completions_as_trls(
    loss_type: str, threshold: float
) -> None:
    high = 1.2 if loss_type == "cispo" else 0.28
    base, inputs = _loss_inputs(6)
    # the sampler's log-probs above the policy's by 0.1 a token on rows 0, 1, 3 (advantages +, -, -),
    # below on row 5 (-): at threshold 0.05 rows 1 and 3 are stale and negative, at 0.2 none is
    drift = torch.tensor([0.1, 0.1, 0.0, 0.1, 0.0, -0.1], dtype=torch.float64)
    noise = 0.01 * torch.randn(base.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    inputs["old_per_token_logps"] = base + drift[:, None] + noise
    options = {"loss_type": loss_type, "epsilon_high": high}
    grad, _, stats = _both_losses(base, inputs, off_policy_threshold=threshold, **options)
    plain = _both_losses(base, inputs, **options)[0]
    dropped = torch.tensor([False, True, False, True, False, False]) & (threshold < 0.1)
    assert stats["off_policy_masked"].item() == pytest.approx(dropped.double().mean().item())
    # a dropped completion carries no policy gradient (beta 0: none at all); every other is untouched
    assert grad[dropped].abs().sum() == 0 and plain[dropped].abs().sum() > 0 or not dropped.any()
    torch.testing.assert_close(grad[~dropped], plain[~dropped], rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [((2.0, 3.0), (3.0, 2.0)), ((1.0, 0.5), (4.0, 6.0))])
def test_vespos_gamma_weights_equal_trls_including_extreme_ratios(shape: Any) -> None:
    grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl (the `hf` extra) is not installed")
    g = torch.Generator().manual_seed(7)
    log_ratio = torch.randn(8, 5, dtype=torch.float64, generator=g) * 0.3
    log_ratio[0, 0], log_ratio[1, 1], log_ratio[2, :] = 30.0, -40.0, 0.0  # past the bounds; on-policy
    mask = (torch.rand(8, 5, generator=g) > 0.2).double()
    mask[2] = 1.0
    adv = torch.randn(8, 1, dtype=torch.float64, generator=g)
    ours = vespo_weights(adv, log_ratio, mask, shape)
    (k_pos, lambda_pos), (k_neg, lambda_neg) = shape
    theirs = grpo.GRPOTrainer.get_gamma_weights(
        adv, log_ratio, mask, None, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    assert ours[2].item() == pytest.approx(1.0)  # w = 1: phi(1) = 1, the on-policy gradient unchanged
    assert ours[0].item() < 1e-6  # a completion far off the sampler's is all but dropped
    base, inputs = _loss_inputs(8)
    _both_losses(base, inputs, loss_type="vespo", vespo=shape, beta=0.04)


NAN = math.nan
#: each reward of each completion, groups of 4: plain; and with rewards that returned None (NaN) for some,
#: a group with three scorable completions and one that applies to none, a group with one scorable, and a
#: group whose scorable completions score alike
REWARDS = {
    "plain": ([[1, 0.5], [0, 0], [1, 1], [0, 0.5], [1, 0], [1, 0], [1, 0], [1, 0]], [False, True]),
    "none_returned": (
        [[1, NAN], [0, NAN], [NAN, 1], [0, 0.5]]
        + [[NAN, NAN], [1, 0], [0, 0], [1, NAN]]
        + [[NAN, NAN], [NAN, NAN], [NAN, NAN], [1, 0]]
        + [[1, 0], [NAN, NAN], [1, NAN], [1, 0]],
        [False, False, True, True],
    ),
}


def _trl_scored(per_func: torch.Tensor, weights: list[float], g: int, scale: str, aggregation: str) -> Any:
    """TRL's GRPOTrainer with generation stubbed and `per_func` as every reward's values, after its
    `_generate_and_score_completions` (its output's advantages, its logged metrics)."""
    n = len(per_func)
    t = _trl_trainer(
        environment_factories=None,
        tools=None,
        environments=None,
        _tokenizer=types.SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        args=types.SimpleNamespace(
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            per_device_train_batch_size=n,
            gradient_checkpointing_kwargs=None,
        ),
        num_iterations=1,
        use_vllm=False,
        beta=0.0,
        num_generations=g,
        multi_objective_aggregation=aggregation,
        scale_rewards=scale,
        reward_weights=torch.tensor(weights, dtype=torch.float64),
        reward_func_names=["a", "b"],
        reward_funcs=[None, None],
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": collections.defaultdict(list),
            "advantages": [],
            "extra": collections.defaultdict(list),
        },
        _pending_extra_logs={},
        _pending_metrics={},
        log_multimodal=False,
    )
    t._generate = lambda prompts: ([[1, 2]] * n, [[3]] * n, None, ["x"] * n, None, None, None, None)
    t._calculate_rewards = lambda *args: per_func
    t.advantages = t._generate_and_score_completions([{"prompt": "p"}] * n)["advantages"]
    return t


@pytest.mark.parametrize("rewards", REWARDS)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantages_equal_trls(scale: str, rewards: str) -> None:
    g, weights = 4, [1.0, 0.5]
    per_func = torch.tensor(REWARDS[rewards][0], dtype=torch.float64)
    t = _trl_scored(per_func, weights, g, scale, "sum_then_normalize")
    theirs = t.advantages
    total = rw.weighted_total(per_func, torch.tensor(weights, dtype=torch.float64))
    batch_std = batch_reward_stats([total], None)[1] if scale == "batch" else None
    ours, flat = group_advantages(total, g, scale=scale, batch_std=batch_std)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert flat.tolist() == REWARDS[rewards][1]
    assert ours[torch.isnan(total)].eq(0).all()  # a completion no reward applies to: advantage 0
    if rewards == "plain":
        # under batch scaling TRL logs whether the batch's std is 0; ours stays the share of flat groups
        assert t._metrics["train"]["frac_reward_zero_std"] == [0.0 if scale == "batch" else 0.5]
    # (TRL logs a group with one scorable completion as having a std: NaN, not 0; ours has no signal)


def test_normalize_then_sum_trains_on_trls_advantages_and_its_statistics_split_over_micro_batches() -> None:
    torch.manual_seed(0)
    names = ["tests.text.test_grpo:code_where_even", CODE_REWARD]  # the first returns None for some
    task = _task(rewards=names, reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum")
    model = task.build_model()
    drawn = task.draw(model, task.build_datasets()[0].rows[:4])
    assert torch.isnan(drawn.scores).any() and not torch.isnan(drawn.scores[:, 1]).any()
    roll = task.scored_rollout(model, drawn, None)
    theirs = _trl_scored(drawn.scores, [1.0, 0.5], task.group_size, "group", "normalize_then_sum").advantages
    torch.testing.assert_close(roll.advantages.double(), theirs, rtol=0, atol=1e-6)
    # the generation batch's statistics from two micro-batches (whole groups) are the whole batch's
    values = task.advantage_input(drawn)
    half = len(values) // 2
    parts = [
        task.advantage_input(dataclasses.replace(drawn, scores=drawn.scores[i : i + half])) for i in (0, half)
    ]
    assert batch_reward_stats(parts, None) == pytest.approx(batch_reward_stats([values], None), rel=1e-12)


def test_equal_rewards_in_a_group_give_zero_advantages() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.2], dtype=torch.float64)
    for scale in ("group", "none", "mean"):
        adv, flat = group_advantages(rewards, 3, scale=scale)
        assert adv[:6].eq(0).all() and flat.tolist() == [True, True, False]
        assert adv[6:].abs().min() > 0
    adv, flat = group_advantages(torch.zeros(4, dtype=torch.float64), 4, scale="mean")
    assert adv.eq(0).all() and flat.tolist() == [True]  # no success: no update, not a division by 0


def test_mean_scaling_gives_maxrls_advantages_whose_expected_gradient_is_the_log_likelihoods() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    adv, _ = group_advantages(rewards, 4, scale="mean")
    # (r - mean) / mean: one success in 4 gets 3, two get 1 each; the failures -1
    assert adv.tolist() == [3.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
    # The exact expectation, over every outcome of a group of n, of the mean of A_i d/dtheta log pi(y_i)
    # for a Bernoulli policy p = sigmoid(theta) (score 1 - p for a success, -p for a failure):
    # (1 - p) - (1 - p)^n, the log-likelihood's d log p / d theta = 1 - p but for the groups without a
    # success; std scaling's is sqrt(p (1 - p))-weighted instead, far from it as p falls.
    n = 4
    for p in (0.05, 0.3, 0.8):
        expected = {"mean": 0.0, "group": 0.0}
        for k in range(1 << n):
            r = torch.tensor([(k >> i) & 1 for i in range(n)], dtype=torch.float64)
            chance = p ** float(r.sum()) * (1 - p) ** float(n - r.sum())
            score = r * (1 - p) - (1 - r) * p  # float64 as r
            for scale in expected:
                a, _ = group_advantages(r, n, scale=scale)
                expected[scale] += chance * float((a * score).mean())
        assert expected["mean"] == pytest.approx((1 - p) - (1 - p) ** n, abs=1e-12)
        assert abs(expected["group"] - expected["mean"]) > 0.01


def test_prompt_and_padding_tokens_carry_no_loss() -> None:
    tokens, mask = pack_rollout([[1, 2, 3], [4, 5]], [[6, 7], [8]], pad_id=0)
    assert tokens.tolist() == [[1, 2, 3, 6, 7], [4, 5, 8, 0, 0]]
    # position i predicts token i + 1: the completion's tokens are the targets kept
    assert mask.tolist() == [[False, False, True, True], [False, True, False, False]]
    torch.manual_seed(0)
    task = _task()
    model = task.build_model().eval()
    a = token_logps(model, tokens, 1.0)[0]
    tokens[1, 3:] = 9  # other padding: no kept position sees it (causal, right-padded)
    b = token_logps(model, tokens, 1.0)[0]
    assert torch.equal(a[mask], b[mask])


def test_a_batch_of_prompts_exports_as_the_token_ids_of_its_shortest_prompt() -> None:
    task = _task()
    _, val = task.build_datasets()
    rows = [val[i] for i in range(len(val))]
    rows[1] = dataclasses.replace(rows[1], ids=rows[1].ids[:-2])  # prompts of two lengths
    model = task.build_model().eval()
    inputs = task.export_inputs(model, collate_prompts(rows))
    shortest = min(len(r.ids) for r in rows)
    assert inputs.args[0].tolist() == [r.ids[:shortest] for r in rows]
    assert inputs.length == shortest and inputs.names == ("tokens",)
    assert task.export_inputs(model, collate_prompts(rows), length=3).args[0].shape == (len(rows), 3)


def _task(**options: Any) -> GroupRelativePolicyOptimization:
    settings = {"group_size": 3, "max_new_tokens": 6, "context": 96, "rewards": ["length", CODE_REWARD]}
    return GroupRelativePolicyOptimization(
        model=dict(TINY_MODEL), data={"name": "prompts", "count": 40}, **{**settings, **options}
    )


@pytest.mark.parametrize("sampling", [{"top_p": 0.9}, {"min_p": 0.05, "repetition_penalty": 1.3}])
def test_the_sampling_log_probs_equal_the_training_forwards(sampling: dict[str, float]) -> None:
    # the filters and the penalty choose the tokens; the log-probs are of the logits over temperature (TRL's)
    torch.manual_seed(0)
    task = _task(**sampling)
    model = task.build_model()
    rows = task.build_datasets()[0].rows[:3]  # prompts of several lengths, left-padded in one batch
    sampled = task.sample(model, rows, torch.Generator().manual_seed(1))
    prompts = [r.ids for r in rows for _ in range(task.group_size)]
    tokens, mask = pack_rollout(prompts, sampled.ids, task.tokenizer.pad_id)
    trained = token_logps(model.train(), tokens, task.temperature)[0]
    for i, logprobs in enumerate(sampled.logprobs):
        torch.testing.assert_close(trained[i][mask[i]], logprobs, rtol=0, atol=1e-5)


def test_a_compiled_policy_compiles_once_a_length_bucket_and_gives_the_eager_log_probs() -> None:
    # each step's completions give the rows a new length: a compiled policy sees them padded to a length
    # bucket, that dim static, so four lengths in three buckets make three graphs (without the buckets the
    # first length compiles static and one dynamic graph takes the rest: two), each the eager forward's
    torch.manual_seed(0)
    task = _task()
    eager = task.build_model().train()
    model = copy.deepcopy(eager)
    per_length = []
    with counted_compiles(model) as compiles:
        for n in (41, 46, 61, 81):  # forward widths 40 and 45 (bucket 48), 60 (64), 80 (96: the context)
            tokens = torch.randint(1, 200, (4, n))
            # eager first: it fills the attention dispatch's caches, which the compiled graph guards on
            want, want_entropy = token_logps(eager, tokens, 0.7, context=task.context)
            got, entropy = token_logps(model, tokens, 0.7, context=task.context)
            assert got.shape == (4, n - 1)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
            per_length.append(len(compiles))
    first = per_length[0]
    assert first > 0 and per_length == [first, first, 2 * first, 3 * first]


def test_top_k_1_samples_the_greedy_completion_in_every_place_of_a_group() -> None:
    torch.manual_seed(0)
    task = _task(top_k=1, max_new_tokens=8)
    model = task.build_model()
    rows = task.build_datasets()[0].rows[:2]
    drawn = task.sample(model, rows, torch.Generator().manual_seed(0))
    greedy = task.sample(model, rows, torch.Generator(), group_size=1, temperature=0.0)
    g = task.group_size
    assert [drawn.ids[i * g : (i + 1) * g] for i in range(2)] == [[ids] * g for ids in greedy.ids]
    # without it the same generator's draws differ from the greedy ones
    free = _task(max_new_tokens=8).sample(model, rows, torch.Generator().manual_seed(0))
    assert free.ids != drawn.ids


def test_a_generation_is_trained_on_iterations_times_then_sampled_again() -> None:
    made: list[int] = []

    def make() -> ScoredRollout:
        made.append(1)
        return ScoredRollout(torch.zeros(1), torch.zeros(1), torch.zeros(1), None, None, {})

    r = PendingRollouts()
    for _ in range(6):
        r.take((3, 5), 3, make)
    assert len(made) == 2 and not r.pending
    from core.data.samplers import ShuffledBatchSampler

    inner = ShuffledBatchSampler(6, 2, shuffle=True, seed=0)
    repeated = RepeatedBatches(inner, 3).batches(1)
    assert repeated == [b for b in inner.batches(1) for _ in range(3)]


def test_a_step_trains_on_its_completions_and_logs_the_reward_statistics() -> None:
    torch.manual_seed(0)
    task = _task(iterations=2)
    model = task.build_model()
    ds = task.build_datasets()[0]
    batch = task.collate_fn()([ds[0], ds[1]])
    first = task.step(model, batch)
    first.loss.backward()
    assert set(task.rollouts.pending) == {(0, 1)}  # kept for the second update
    assert first.metrics[f"rewards/{CODE_REWARD}/std"] > 0
    for key in (
        "frac_reward_zero_std",
        "completion_length",
        "truncated",
        "clip_ratio",
        "entropy",
        f"rewards/{CODE_REWARD}/std",
    ):
        assert key in first.metrics
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())
    second = task.step(model, batch)
    assert not task.rollouts.pending and task.rollouts.generations == 1
    # unchanged weights: the second update's ratios are 1, so its loss is the first's
    assert second.loss.item() == pytest.approx(first.loss.item(), abs=1e-6)


@pytest.mark.parametrize("coef", [0.0, 0.1])
def test_the_entropy_bonus_raises_the_policys_entropy_where_no_group_has_signal(coef: float) -> None:
    torch.manual_seed(0)
    task = _task(rewards=["tests.text.test_grpo:constant_reward"], entropy_coef=coef, iterations=2)
    model = task.build_model()
    batch = task.collate_fn()(task.build_datasets()[0].rows[:2])
    out = task.step(model, batch)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not coef:  # every advantage 0: nothing to learn without the bonus
        assert all(g.abs().max() == 0 for g in grads)
        return
    entropy = float(out.metrics["entropy"])
    assert out.loss.item() == pytest.approx(-coef * entropy, rel=1e-5)
    with torch.no_grad():
        for p in model.parameters():
            p -= 1.0 * p.grad
    roll = task.rollouts.pending[tuple(r.index for r in batch["rows"])]  # kept for the second update
    after = token_logps(model, roll.tokens, task.temperature)[1]
    assert float((after * roll.mask).sum() / roll.mask.sum()) > entropy


def test_vespo_and_off_policy_masking_train_through_the_task_and_log_their_statistics() -> None:
    torch.manual_seed(0)
    task = _task(iterations=2, loss_type="vespo", off_policy_mask_threshold=1e-3)
    model = task.build_model()
    ds = task.build_datasets()[0]
    batch = task.collate_fn()([ds[0], ds[1]])
    first = task.step(model, batch)
    # the first update is on-policy (the sampler's log-probs are the forward's to ~1e-6): phi(1) = 1,
    # no completion has drifted past the threshold
    assert first.metrics["vespo/phi_seq_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first.metrics["off_policy_masked"] == 0
    first.loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    second = task.step(model, batch)  # the same completions under the updated policy
    assert second.metrics["vespo/phi_seq_mean"] != pytest.approx(1.0, abs=1e-6)
    assert 0 < second.metrics["off_policy_masked"] < 1


def test_the_adaptive_entropy_coefficient_is_applied_after_a_low_entropy_step_and_logged() -> None:
    torch.manual_seed(0)
    task = _task(use_adaptive_entropy=True, entropy_target=100.0, entropy_coef_delta=0.1)
    assert task.entropy_control in task.callbacks()  # stepped and checkpointed by the loop
    model = task.build_model()
    ds = task.build_datasets()[0]
    batch = task.collate_fn()([ds[0], ds[1]])
    task.rollouts.training = True  # as in the loop (a probe's steps do not move the coefficient)
    first = task.step(model, batch)
    assert first.metrics["entropy_coef"] == 0
    assert float(first.loss.detach()) == float(first.metrics["policy_loss"])
    assert task.entropy_control is not None
    task.entropy_control.update(None)  # the step's end: the tiny model's ~5 nats are below the target
    assert task.entropy_control.coef == pytest.approx(0.1)
    assert task.entropy_control.last == pytest.approx(float(first.metrics["entropy"]), rel=1e-6)
    second = task.step(model, batch)  # a new generation, the bonus applied
    entropy = float(second.metrics["entropy"])
    expected = float(second.metrics["policy_loss"]) - 0.1 * entropy
    assert float(second.loss.detach()) == pytest.approx(expected, rel=1e-6)


def _task_on_weights(folder: Path, **options: Any) -> GroupRelativePolicyOptimization:
    """`_task`'s settings on the model `folder` holds (model.weights)."""
    settings = {"group_size": 3, "max_new_tokens": 6, "context": 96, "rewards": ["length", CODE_REWARD]}
    return GroupRelativePolicyOptimization(
        model={**TINY_MODEL, "weights": str(folder)},
        data={"name": "prompts", "count": 40},
        **{**settings, **options},
    )


def test_syncing_the_reference_mixes_the_policy_in_as_trls_callback_and_checkpoints_it(
    tmp_path: Path,
) -> None:
    from text.checkpoints.hf import write_folder

    callbacks = pytest.importorskip("trl.trainer.callbacks", reason="trl (the `hf` extra) is not installed")
    torch.manual_seed(0)
    start = _task().build_model()
    write_folder(start, tmp_path / "start")
    options = {"beta": 0.1, "sync_ref_model": True, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 2}
    task = _task_on_weights(tmp_path / "start", **options)
    sync = task.reference_sync
    assert sync is not None and sync in task.callbacks()
    policy = task.build_model()
    with torch.no_grad():  # as training would have moved it
        for p in policy.parameters():
            p.add_(0.1 * torch.randn_like(p))

    def weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in m.named_parameters()}

    first = weights(start)
    assert weights(task.reference(policy)).keys() == first.keys()
    trainer = types.SimpleNamespace(model=policy, state=types.SimpleNamespace(step=1))
    sync.on_step_end(trainer, {})  # not a sync step: the reference is model.weights', nothing to save
    assert all(torch.equal(v, first[k]) for k, v in weights(task.reference(policy)).items())
    assert sync.state_dict() == {}
    trainer.state.step = 2
    sync.on_step_end(trainer, {})
    theirs = copy.deepcopy(start)
    callbacks.SyncRefModelCallback._sync_target_model(policy, theirs, 0.6)
    synced = weights(task.reference(policy))
    assert all(torch.equal(v, synced[k]) for k, v in weights(theirs).items())
    assert not any(torch.equal(v, first[k]) for k, v in synced.items())
    # through compile's wrapper the policy's parameters are found by name alike
    sync.sync(torch.compile(policy))
    callbacks.SyncRefModelCallback._sync_target_model(policy, theirs, 0.6)
    synced = weights(task.reference(policy))
    assert all(torch.equal(v, synced[k]) for k, v in weights(theirs).items())
    # a resumed run's reference is the synced one, not model.weights'
    again = _task_on_weights(tmp_path / "start", **options)
    assert again.reference_sync is not None
    again.reference_sync.load_state_dict(sync.state_dict())
    assert all(torch.equal(v, synced[k]) for k, v in weights(again.reference(policy)).items())


def test_syncing_the_reference_needs_a_kl_and_a_full_fine_tune(tmp_path: Path) -> None:
    from core.nn.lora import LoRAConfig, apply_lora
    from text.checkpoints.hf import write_folder

    with pytest.raises(ConfigError) as e:
        _task(sync_ref_model=True)
    assert (e.value.key, e.value.value) == ("task.sync_ref_model", "true")
    torch.manual_seed(0)
    write_folder(_task().build_model(), tmp_path / "start")
    task = _task_on_weights(tmp_path / "start", beta=0.1, sync_ref_model=True)
    model = task.build_model()
    apply_lora(model, LoRAConfig(rank=2))
    trainer = types.SimpleNamespace(model=model, cfg=types.SimpleNamespace(lora=LoRAConfig(rank=2)))
    assert task.reference_sync is not None
    with pytest.raises(ConfigError) as e:
        task.reference_sync.on_fit_start(trainer)  # type: ignore[arg-type]
    assert (e.value.key, e.value.value) == ("trainer.lora.rank", "2")


def test_settings_a_run_cannot_use_are_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        _task(max_new_tokens=96)
    assert e.value.key == "task.max_new_tokens"
    with pytest.raises(ConfigError) as e:
        _task(rewards=["exact_match", "length"], reward_weights=[1.0])
    assert e.value.key == "task.reward_weights"
    with pytest.raises(ConfigError) as e:
        _task(beta=0.1)
    assert e.value.key == "task.beta"
    for rewards, weights in ((["length", CODE_REWARD], []), ([CODE_REWARD], [-1.0])):
        with pytest.raises(ConfigError) as e:  # rewards that can be negative under the mean's division
            _task(scale_rewards="mean", rewards=rewards, reward_weights=weights)
        assert (e.value.key, e.value.value) == ("task.scale_rewards", "mean")
    with pytest.raises(ConfigError) as e:  # cispo's cap on the importance weight would be epsilon's 0.2
        _task(loss_type="cispo")
    assert (e.value.key, e.value.value) == ("task.epsilon_high", "0.0")
    with pytest.raises(ConfigError) as e:
        _task(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1)
    assert (e.value.key, e.value.value) == ("task.entropy_coef_min", "0.5")


@pytest.mark.parametrize("masked", [False, True])
def test_masking_truncated_completions_takes_their_tokens_out_of_the_loss(masked: bool) -> None:
    torch.manual_seed(0)
    task = _task(mask_truncated_completions=masked, max_new_tokens=4)
    model = task.build_model()
    rows = task.build_datasets()[0].rows[:1]
    tok = task.tokenizer
    end = tok.encode(task.template.end_of_turn())
    # one completion ends at the end of turn, one is cut at max_new_tokens, one ends at the document end
    ids = [tok.encode("a") + end, tok.encode("abcd"), tok.encode("ab") + [tok.eos_id]]
    sampled = Rollout(ids, [torch.zeros(len(c)) for c in ids], [False, False, True])
    total = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    scores = torch.zeros(3, len(task.rewards), dtype=torch.float64)
    drawn = DrawnRollout(sampled, ["a", "abcd", "ab"], scores, total, list(rows))
    roll = task.scored_rollout(model, drawn, None)
    assert roll.mask.sum(-1).tolist() == [len(ids[0]), 0 if masked else 4, len(ids[2])]
    # the statistics are of every completion sampled, the cut one too
    assert roll.metrics["truncated"] == pytest.approx(1 / 3)
    assert roll.metrics["completion_length"] == pytest.approx(sum(map(len, ids)) / 3)
    # dapo's loss units are the tokens left in the loss
    task.rollouts.pending[(rows[0].index,)] = roll
    assert task.loss_units({"rows": rows}) == int(roll.mask.sum())


def code_where_even(prompts: list[Any], completions: list[str], **fields: Any) -> list[float | None]:
    """A multi-task user reward: `completion_code` where its value's tenths are even, else None."""
    return [v if round(v * 10) % 2 == 0 else None for v in completion_code(prompts, completions)]


def test_completions_a_reward_skips_leave_its_statistics_and_none_applying_train_with_advantage_0() -> None:
    torch.manual_seed(0)
    task = _task(rewards=["tests.text.test_grpo:code_where_even", "tests.text.test_grpo:code_where_even"])
    task.reward_weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    model = task.build_model()
    rows = task.build_datasets()[0].rows[:4]
    drawn = task.draw(model, rows)
    codes = torch.tensor(completion_code([], drawn.texts), dtype=torch.float64)
    applies = (codes * 10).round().remainder(2).eq(0)
    assert applies.any() and not applies.all()  # the random model's completions fall both ways
    # no reward applies to the odd ones: no total, so no part in their group's mean or std
    assert torch.isnan(drawn.total).eq(~applies).all()
    assert torch.equal(drawn.total[applies], 3 * codes[applies])
    roll = task.scored_rollout(model, drawn, None)
    advantages, flat = group_advantages(drawn.total, task.group_size)
    assert torch.equal(roll.advantages, advantages) and advantages[~applies].eq(0).all()
    kept = 3 * codes[applies]
    assert roll.metrics["reward"] == pytest.approx(float(kept.mean()))
    name = "tests.text.test_grpo:code_where_even"
    assert roll.metrics[f"rewards/{name}/mean"] == pytest.approx(float(codes[applies].mean()))
    assert roll.metrics["frac_reward_zero_std"] == float(flat.double().mean())
    # the written sample has null where no reward applied (JSON has no NaN)
    sample = json.loads(json.dumps(task.rollouts.samples[-1], allow_nan=False))
    assert [r is None for r in sample["rewards"]] == (~applies[: task.group_size]).tolist()


@pytest.mark.parametrize("field", ["prompts", "completions", "completion_ids", "trainer_state"])
def test_a_prompt_row_with_a_field_named_as_a_rewards_keyword_is_a_bad_row(
    tmp_path: Path, field: str
) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Reverse abc", "answer": "cba"}, {"prompt": "Reverse abd", field: [1]}]
    rows += [{"prompt": f"Reverse {w}", "answer": w[::-1]} for w in ("xyz", "uvw")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        prompts_data(train=str(path))
    assert e.value.key == "data.max_bad_fraction" and f"{path}:2 (a field named '{field}'" in str(e.value)
    # skipped by the bad-sample policy, the good row trains
    kept = prompts_data(train=str(path), policy=BadSamplePolicy(max_bad_fraction=0.5))
    assert [r["prompt"] for r in kept.train + kept.val] == ["Reverse abc", "Reverse xyz", "Reverse uvw"]


def nothing_applies(prompts: list[Any], completions: list[str], **fields: Any) -> list[None]:
    """A reward that applies to no completion."""
    return [None] * len(completions)


def test_an_evaluation_no_reward_applies_to_is_one_error_naming_the_rewards() -> None:
    task = _task(rewards=["tests.text.test_grpo:nothing_applies"])
    model = task.build_model()
    batch = task.collate_fn()(task.build_datasets()[1].rows[:2])
    with pytest.raises(DataError) as e:
        task.evaluate(model, [batch])
    assert (e.value.key, e.value.value) == ("task.rewards", "tests.text.test_grpo:nothing_applies")
    # one reward that applies beside it is enough: the other is left out of the metrics
    both = _task(rewards=["tests.text.test_grpo:nothing_applies", CODE_REWARD])
    got = both.evaluate(model, [batch])
    assert set(got) == {"reward", f"rewards/{CODE_REWARD}"}


def negative_code(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
    """A user reward below 0: `completion_code` less 1."""
    return [v - 1.0 for v in completion_code(prompts, completions)]


def test_mean_scaling_stops_at_a_negative_reward_naming_the_key_and_the_prompt() -> None:
    torch.manual_seed(0)
    task = _task(scale_rewards="mean", rewards=["tests.text.test_grpo:negative_code"])
    model = task.build_model()
    rows = task.build_datasets()[0].rows[:2]
    with pytest.raises(DataError) as e:
        task.draw(model, rows)
    assert (e.value.key, e.value.value) == ("task.scale_rewards", "mean")
    assert f"prompt {rows[0].index} has" in str(e.value)  # the first with a negative reward
    # a reward that is never below 0 draws on the same prompts without an error
    ok = _task(scale_rewards="mean", rewards=[CODE_REWARD]).draw(model, rows)
    assert bool((ok.total >= 0).all())


def test_guidance_trains_a_failed_groups_last_completion_on_the_prompts_answer() -> None:
    torch.manual_seed(0)
    task = _task(rewards=["exact_match"], guidance=True, iterations=2, max_new_tokens=16)
    model = task.build_model()
    rows = task.build_datasets()[0].rows[:3]
    drawn = task.draw(model, rows)
    g, tok = task.group_size, task.tokenizer
    assert drawn.sampled_scores is not None and drawn.sampled_scores.eq(0).all()  # a random model: no answer
    assert drawn.guided == 3
    end = tok.encode(task.template.end_of_turn())
    for i, row in enumerate(rows):
        assert drawn.sampled.ids[i * g + g - 1] == tok.encode(row.fields["answer"]) + end
        assert drawn.texts[i * g + g - 1] == row.fields["answer"]
        assert not drawn.sampled.stopped[i * g + g - 1]  # it ends at the end of turn, not at eos
    assert drawn.total.tolist() == [0.0, 0.0, 1.0] * 3
    roll = task.scored_rollout(model, drawn, None)
    assert (roll.advantages.view(3, g)[:, -1] > 0).all() and (roll.advantages.view(3, g)[:, :-1] < 0).all()
    assert roll.metrics["reward"] == 0.0 and roll.metrics["guided"] == 1.0  # the policy's own reward
    # the answer's log-probs are the policy's, as a sampled completion's: the first update's ratio is 1
    trained = token_logps(model.train(), roll.tokens, task.temperature)[0]
    assert roll.old_logps is not None
    torch.testing.assert_close(trained[roll.mask], roll.old_logps[roll.mask], rtol=0, atol=1e-5)


def constant_reward(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
    """A user reward that scores every completion alike."""
    return [0.5] * len(completions)


def test_guidance_leaves_a_group_alone_where_a_sample_scores_as_well_as_the_answer() -> None:
    torch.manual_seed(0)
    model = _task().build_model()
    drawn = {}
    for guidance in (False, True):
        task = _task(rewards=["tests.text.test_grpo:constant_reward"], guidance=guidance, max_new_tokens=16)
        drawn[guidance] = task.draw(model, task.build_datasets()[0].rows[:3])
    assert drawn[True].guided == 0
    assert drawn[True].sampled.ids == drawn[False].sampled.ids
    assert torch.equal(drawn[True].total, drawn[False].total)


def test_guidance_on_a_prompt_without_the_answer_field_is_one_line_naming_it() -> None:
    torch.manual_seed(0)
    task = _task(rewards=[CODE_REWARD], guidance=True, answer_field="solution", max_new_tokens=16)
    rows = task.build_datasets()[0].rows[:2]
    with pytest.raises(DataError) as e:
        task.draw(task.build_model(), rows)
    assert (e.value.key, e.value.value) == ("task.answer_field", "solution")
    assert f"prompt {rows[0].index} " in str(e.value)


def test_a_text_prompt_is_continued_as_it_is_and_a_message_list_through_the_chat_template(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    path = tmp_path / "prompts.jsonl"
    asked = [{"role": "user", "content": "Reverse abc"}]
    rows = [{"prompt": "Question: 2+2? Answer:", "answer": "4"}, {"prompt": asked, "answer": "cba"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    task = _task(rewards=["exact_match"], guidance=True, max_new_tokens=16)
    task.data_cfg = {"name": "prompts", "train": str(path), "val_fraction": 0.5}
    text_row, chat_row = task.build_datasets()[0].rows[:2]
    tok = task.tokenizer
    # TRL's standard form (and +task=dpo's text pairs): the text after the document start, no template
    assert text_row.ids == [tok.doc_start_id, *tok.encode("Question: 2+2? Answer:")]
    rendered = task.template.render(asked, add_generation_prompt=True)
    assert tok.decode(chat_row.ids[1:]) == rendered and chat_row.ids[0] == tok.doc_start_id
    # a text prompt's answer ends as a document does, a conversation's as its turn
    assert task.answer_ids(text_row, "answer", "test") == [*tok.encode("4"), tok.eos_id]
    end = tok.encode(task.template.end_of_turn())
    assert task.answer_ids(chat_row, "answer", "test") == [*tok.encode("cba"), *end]
    # guidance trains each failed group on its answer, read back as the reward reads a completion
    drawn = task.draw(task.build_model(), [text_row, chat_row])
    g = task.group_size
    assert drawn.guided == 2 and [drawn.texts[g - 1], drawn.texts[2 * g - 1]] == ["4", "cba"]


def half_flat(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
    """A user reward with no signal for prompts whose answer starts before "d" (0.5 each), else
    `completion_code`'s."""
    if str(fields["answer"][0]) < "d":  # a field: one value a completion, as TRL passes them
        return [0.5] * len(completions)
    return completion_code(prompts, completions)


def test_dynamic_sampling_gives_flat_groups_places_to_new_prompts_groups_with_signal() -> None:
    torch.manual_seed(0)
    model = _task().build_model()
    drawn, tasks = {}, {}
    for rounds in (0, 4):
        task = tasks[rounds] = _task(rewards=["tests.text.test_grpo:half_flat"], dynamic_sampling=rounds)
        rows = task.build_datasets()[0].rows[:6]
        drawn[rounds] = task.draw(model, rows)
    g, flat_rows = 3, [i for i, r in enumerate(rows) if str(r.fields["answer"]) < "d"]
    assert 0 < len(flat_rows) < 6
    plain, dyn = drawn[0], drawn[4]
    assert dyn.refilled == len(flat_rows)
    for i, row in enumerate(dyn.rows):
        group = dyn.total[i * g : (i + 1) * g]
        assert bool((group != group[0]).any())  # every place now holds a group with signal
        if i in flat_rows:  # a new prompt's, its completions scored as theirs
            assert str(row.fields["answer"]) >= "d" and row is not rows[i]
            group_texts = dyn.texts[i * g : (i + 1) * g]
            assert dyn.total[i * g : (i + 1) * g].tolist() == completion_code([], group_texts)
        else:  # the first draw's group, as without dynamic sampling
            assert row is rows[i]
            assert dyn.sampled.ids[i * g : (i + 1) * g] == plain.sampled.ids[i * g : (i + 1) * g]
    assert dyn.sampled_scores is not None and torch.equal(dyn.sampled_scores, plain.scores)
    assert tasks[4].rollouts.generations > 1
    # the replaced groups' log-probs are the policy's on their new prompts: the first ratio is 1
    roll = tasks[4].scored_rollout(model, dyn, None)
    assert roll.metrics["refilled"] == len(flat_rows) / 6 and roll.metrics["frac_reward_zero_std"] == 0
    assert roll.metrics["reward"] == pytest.approx(float(plain.total.mean()))  # the first draw's
    trained = token_logps(model.train(), roll.tokens, 1.0)[0]
    old = torch.cat([lp for lp in dyn.sampled.logprobs])
    torch.testing.assert_close(trained[roll.mask], old, rtol=0, atol=1e-5)
    # drawn again from the same generation count (a resumed run), the same prompts and completions
    again = _task(rewards=["tests.text.test_grpo:half_flat"], dynamic_sampling=4)
    again.build_datasets()
    redo = again.draw(model, rows)
    assert [r.index for r in redo.rows] == [r.index for r in dyn.rows]
    assert redo.sampled.ids == dyn.sampled.ids


def test_dynamic_sampling_stops_after_its_draws_where_no_prompt_has_signal() -> None:
    torch.manual_seed(0)
    task = _task(rewards=["tests.text.test_grpo:constant_reward"], dynamic_sampling=2)
    rows = task.build_datasets()[0].rows[:2]
    drawn = task.draw(task.build_model(), rows)
    assert drawn.refilled == 0 and task.rollouts.generations == 3  # the first draw and two more
    assert [r.index for r in drawn.rows or []] == [r.index for r in rows]
    assert drawn.total.eq(0.5).all()


def completion_code(prompts: list[Any], completions: list[Any], **fields: Any) -> list[float]:
    """A user reward (`CODE_REWARD`) that tells a random model's completions apart: their characters' code
    points summed, mod 10, over 10 (a conversational prompt's completions are messages)."""
    return [sum(map(ord, rw.completion_text(c))) % 10 / 10 for c in completions]


#: (global_step, max_steps) of each trainer_state `loop_position` was given, in this process
LOOP_POSITIONS: list[tuple[int, int]] = []


def loop_position(
    prompts: list[Any], completions: list[Any], trainer_state: Any, **kwargs: Any
) -> list[None]:
    """A reward that applies to no completion (None), recording where the loop says it is."""
    LOOP_POSITIONS.append((trainer_state.global_step, trainer_state.max_steps))
    return [None] * len(completions)


TINY_RUN = [
    "+task=grpo",
    "trainer=smoke",
    "trainer.max_steps=3",
    "trainer.ckpt_every=1",
    "trainer.keep_last=0",
    "trainer.batch_size=2",
    "logger=none",
    "precision=fp32",
    "compile.policy=off",
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.hidden=64",
    "data.count=40",
    "task.context=96",
    "task.group_size=3",
    "task.max_new_tokens=5",
    "task.eval_questions=2",
    "task.iterations=2",
    "task.rewards=[exact_match,tests.text.test_grpo:completion_code,tests.text.test_grpo:loop_position]",
    "task.reward_weights=[1.0,0.5,1.0]",
    # the adaptive entropy coefficient (checkpointed): the tiny model's ~5 nats are below the target, so it
    # rises by 0.05 a step and applies from the second
    "task.use_adaptive_entropy=true",
    "task.entropy_target=100",
    "task.entropy_coef_delta=0.05",
    "task.guidance=true",  # deterministic: resume stays bit-exact with it
    "optim.lr=1e-3",
]


@pytest.mark.slow  # two short recipe runs (~40 s on 2 loaded cores)
def test_the_recipe_trains_writes_completions_and_resumes_bit_exact_between_updates(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    LOOP_POSITIONS.clear()
    whole = train(tmp_path / "whole", TINY_RUN)
    rows = [r for r in read_metrics(whole) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["train/frac_reward_zero_std"] <= 1 for r in rows)
    assert "train/rewards/tests.text.test_grpo:completion_code/mean" in rows[0]
    # a reward that applies to nothing logs nothing (not 0), and sees the loop's position: generations
    # sampled after 0 and 2 optimizer steps (task.iterations=2) of 3
    assert not any("loop_position" in k for r in rows for k in r)
    assert {(0, 3), (2, 3)} <= set(LOOP_POSITIONS) and {m for _, m in LOOP_POSITIONS} <= {0, 3}
    assert all(0 <= r["train/guided"] <= 1 for r in rows)
    assert [r["train/entropy_coef"] for r in rows] == pytest.approx([0.0, 0.05, 0.1])
    samples = [json.loads(line) for line in (whole / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 3]  # a generation every task.iterations=2 steps
    assert len(samples[0]["completions"]) == 3
    # step 1's checkpoint lies between the two updates on generation 1: its completions are in it
    resumed = tmp_path / "resumed"
    ckpt = whole / "checkpoints" / "step_00000001"
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    train(resumed, [*TINY_RUN, "resume=auto"])
    a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    first = torch.load(ckpt / "model.pt", weights_only=True)
    assert any(not torch.equal(a[k], first[k]) for k in a)  # it trained
    # the run exports as a Hugging Face folder, checked by the export against the eager model
    r = run_here("recipes.export", f"ckpt={whole}", "format=hf")
    assert r.returncode == 0, r.stderr
    entry = json.loads((whole / "export" / "export.json").read_text())["hf"]
    assert (whole / "export" / "hf" / "model.safetensors").is_file()
    assert entry["task"] == "grpo" and all(c["max_abs_error"] <= 1e-5 for c in entry["checked"])


@pytest.mark.slow  # two short recipe runs (~40 s on 2 loaded cores)
def test_a_run_syncing_its_reference_resumes_bit_exact_with_the_synced_reference(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from text.checkpoints.hf import write_folder

    torch.manual_seed(0)
    sizes = {"n_layer": 1, "d_model": 32, "n_head": 4, "n_kv_head": 2, "hidden": 64}
    start = GroupRelativePolicyOptimization(
        model={"name": "llama", **sizes}, data={"name": "prompts", "count": 40}, context=96
    ).build_model()
    write_folder(start, tmp_path / "start")
    # a sync after every step: step 1's checkpoint (between the two updates on generation 1) holds the
    # reference synced once, which generation 2's KL (steps 3) is computed against
    args = [*TINY_RUN, f"model.weights={tmp_path / 'start'}", "task.beta=0.1", "task.sync_ref_model=true"]
    args += ["task.ref_model_sync_steps=1"]
    whole = train(tmp_path / "whole", args)
    assert all("train/kl" in r for r in read_metrics(whole) if "train/loss" in r)
    ckpt = whole / "checkpoints" / "step_00000001"
    state = torch.load(ckpt / "train.pt", weights_only=True)["callbacks"]["ReferenceSync"]
    policy = torch.load(ckpt / "model.pt", weights_only=True)
    # the folder's weights with 0.6 of the policy's after step 1 mixed in
    for k, v in start.state_dict().items():
        torch.testing.assert_close(state["reference"][k], 0.4 * v + 0.6 * policy[k], rtol=0, atol=1e-6)
    resumed = tmp_path / "resumed"
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    train(resumed, [*args, "resume=auto"])
    a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_unknown_reward_is_one_line_listing_the_built_in_ones(tmp_path: Path) -> None:
    r = run_here("recipes.train", "+task=grpo", "task.rewards=[exact]", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert "exact_match" in last and "number" in last and "exact" in last


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo"])
def test_prompts_sharded_over_two_ranks_give_one_process_advantages_and_gradient(loss_type: str) -> None:
    # 4 prompts x 3 completions of unequal lengths; rank r holds prompts 2r, 2r+1 with their whole groups
    g, group = torch.Generator().manual_seed(3), 3
    rewards = torch.rand(12, dtype=torch.float64, generator=g)
    logps = torch.randn(12, 7, dtype=torch.float64, generator=g) - 1
    old = logps + 0.2 * torch.randn(12, 7, dtype=torch.float64, generator=g)
    mask = torch.rand(12, 7, generator=g) > 0.4
    whole_in = logps.clone().requires_grad_(True)
    adv, _ = group_advantages(rewards, group)
    options = {"loss_type": loss_type, "max_completion_length": 7, "epsilon_high": 1.2}
    policy_loss(whole_in, old, adv, mask, **options)[0].backward()
    ranks_in = logps.clone().requires_grad_(True)
    shares = [slice(6 * r, 6 * r + 6) for r in range(2)]
    # each rank's loss units (loss_units): its completion tokens for dapo and cispo, its 2 prompts otherwise
    units = [int(mask[rows].sum()) if loss_type in TOKEN_MEAN_LOSSES else 2 for rows in shares]
    for rows, n in zip(shares, units, strict=True):
        adv_r, _ = group_advantages(rewards[rows], group)
        torch.testing.assert_close(adv_r, adv[rows], rtol=0, atol=0)
        loss, _ = policy_loss(ranks_in[rows], old[rows], adv_r, mask[rows], **options)
        # the loop's weight (its share of the units on both ranks x 2 ranks), then DDP's mean over them
        (loss * (n / sum(units) * 2) / 2).backward()
    torch.testing.assert_close(ranks_in.grad, whole_in.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "bnpo"])
def test_accumulated_micro_batches_give_the_whole_batchs_gradient(loss_type: str) -> None:
    # trainer.grad_accum=2 on one rank: micro-batches of 1 and 3 prompts (x 2 completions), each loss a
    # mean over its own units, weighted by its share of the group's (core.loop.accumulation): completion
    # tokens for dapo and cispo, prompts for the others (GroupRelativePolicyOptimization.loss_units).
    # bnpo is left out: its normaliser is each micro-batch's own tokens by definition (TRL's too)
    g = torch.Generator().manual_seed(5)
    logps = torch.randn(8, 6, dtype=torch.float64, generator=g) - 1
    old = logps + 0.2 * torch.randn(8, 6, dtype=torch.float64, generator=g)
    adv = torch.randn(8, dtype=torch.float64, generator=g)
    mask = torch.rand(8, 6, generator=g) > 0.4
    options = {"loss_type": loss_type, "max_completion_length": 6, "epsilon_high": 1.2}
    whole_in, parts_in = logps.clone().requires_grad_(True), logps.clone().requires_grad_(True)
    policy_loss(whole_in, old, adv, mask, **options)[0].backward()
    parts = ((slice(0, 2), 1), (slice(2, 8), 3))
    units = [int(mask[rows].sum()) if loss_type in TOKEN_MEAN_LOSSES else prompts for rows, prompts in parts]
    assert int(mask[:2].sum()) * 3 != int(mask[2:].sum())  # unequal tokens a prompt: prompt weights differ
    for (rows, _), weight in zip(parts, group_weights(units, torch.device("cpu")), strict=True):
        loss, _ = policy_loss(parts_in[rows], old[rows], adv[rows], mask[rows], **options)
        (loss * weight).backward()
    torch.testing.assert_close(parts_in.grad, whole_in.grad, rtol=0, atol=1e-12)


def test_dapo_samples_the_whole_accumulation_group_first_and_counts_its_completion_tokens() -> None:
    torch.manual_seed(0)
    task = _task()
    model = task.build_model()
    rows = task.build_datasets()[0].rows
    batches = [collate_prompts(rows[:1]), collate_prompts(rows[1:4])]
    task.prepare_group(model, batches)
    assert task.rollouts.generations == 2
    pending = [task.rollouts.pending[tuple(r.index for r in b["rows"])] for b in batches]
    assert [task.loss_units(b) for b in batches] == [int(p.mask.sum()) for p in pending]
    steps = [task.step(model, b) for b in batches]
    assert task.rollouts.generations == 2 and not task.rollouts.pending  # the steps sampled nothing more
    # each step's loss is a mean over its own completion tokens
    for out, roll in zip(steps, pending, strict=True):
        logps = token_logps(model, roll.tokens, task.temperature)[0]
        want, _ = policy_loss(logps, logps.detach(), roll.advantages, roll.mask)
        torch.testing.assert_close(out.loss, want, rtol=0, atol=1e-6)
    other = _task(loss_type="grpo")
    other.prepare_group(model, batches)  # the other aggregations sample in their steps: prompts are units
    assert other.rollouts.generations == 0 and other.loss_units(batches[1]) == 3


def test_batch_scaling_divides_by_the_std_of_the_whole_accumulation_groups_rewards() -> None:
    torch.manual_seed(0)
    task = _task(scale_rewards="batch", loss_type="grpo")
    model = task.build_model()
    rows = task.build_datasets()[0].rows
    batches = [collate_prompts(rows[:2]), collate_prompts(rows[2:5])]
    task.prepare_group(model, batches)  # every aggregation samples the group first under batch scaling
    assert task.rollouts.generations == 2
    pending = [task.rollouts.pending[tuple(r.index for r in b["rows"])] for b in batches]
    # the same draws again: rewards from the generators the two generations used
    again = _task(scale_rewards="batch", loss_type="grpo")
    totals = [again.draw(model, b["rows"]).total for b in batches]
    std = torch.cat(totals).std().item()
    assert std > 0 and all(t.std().item() != pytest.approx(std) for t in totals)
    for roll, total in zip(pending, totals, strict=True):
        groups = total.view(-1, task.group_size)
        want = ((groups - groups.mean(1, keepdim=True)) / (std + 1e-4)).flatten()
        torch.testing.assert_close(roll.advantages, want, rtol=0, atol=1e-12)
    # task.iterations=2 gives a batch twice: the second group samples nothing and keeps its advantages
    twice = _task(scale_rewards="batch", iterations=2)
    twice.prepare_group(model, batches[:1])
    roll = twice.rollouts.pending[tuple(r.index for r in batches[0]["rows"])]
    twice.step(model, batches[0])
    twice.prepare_group(model, batches[:1])
    assert twice.rollouts.generations == 1 and twice.step(model, batches[0]) is not None
    assert not twice.rollouts.pending and roll.uses == 2


def test_normalize_then_sum_normalises_over_the_whole_accumulation_groups_statistics() -> None:
    torch.manual_seed(0)
    options = {"rewards": ["length", CODE_REWARD], "multi_objective_aggregation": "normalize_then_sum"}
    task = _task(loss_type="grpo", length_limit=2, **options)
    model = task.build_model()
    rows = task.build_datasets()[0].rows
    batches = [collate_prompts(rows[:2]), collate_prompts(rows[2:5])]
    task.prepare_group(model, batches)  # sampled first, as batch scaling is, for the group's statistics
    assert task.rollouts.generations == 2
    again = _task(loss_type="grpo", length_limit=2, **options)
    values = [again.advantage_input(again.draw(model, b["rows"])) for b in batches]
    every = torch.cat(values)
    assert every.std() > 0
    for b, v in zip(batches, values, strict=True):
        roll = task.rollouts.pending[tuple(r.index for r in b["rows"])]
        want = (v - every.mean()) / (every.std() + 1e-4)
        torch.testing.assert_close(roll.advantages, want, rtol=0, atol=1e-12)


def _rank_batch_std(rank: int, world: int, store: str, totals: list[list[torch.Tensor]]) -> None:
    _join_gloo(rank, world, store)
    stats = batch_reward_stats(totals[rank], torch.device("cpu"))
    Path(store, f"stats{rank}").write_text(repr(stats))
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # two spawned gloo processes (~6 s on 2 loaded cores)
def test_the_batch_statistics_over_two_real_ranks_are_one_process_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rank r holds two micro-batches' rewards (unequal sizes); gloo, one thread each
    g = torch.Generator().manual_seed(7)
    totals = [
        [torch.rand(n, dtype=torch.float64, generator=g) * 3 + 10 for n in sizes]
        for sizes in ((4, 8), (6, 2))
    ]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_rank_batch_std, args=(2, str(tmp_path), totals), nprocs=2, join=True)
    every = torch.cat([t for rank in totals for t in rank])
    for rank in range(2):
        mean, std = ast.literal_eval((tmp_path / f"stats{rank}").read_text())
        assert abs(mean - every.mean().item()) <= 1e-12 and abs(std - every.std().item()) <= 1e-12


def test_generations_without_reward_variance_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import text.grpo as grpo

    said: list[str] = []
    monkeypatch.setattr(grpo, "warn", said.append)
    task = _task()
    for _ in range(grpo.NO_SIGNAL_WARN_AFTER - 1):
        task._watch_signal(True)
    task._watch_signal(False)  # a generation with signal starts the count again
    for _ in range(3 * grpo.NO_SIGNAL_WARN_AFTER):
        task._watch_signal(True)
    assert len(said) == 1


@pytest.mark.slow  # sets up a run before its first step fails (~15 s on 2 loaded cores)
def test_a_reward_that_raises_stops_the_run_with_exit_2_naming_it_and_the_prompt(tmp_path: Path) -> None:
    spec = "tests.text.test_rewards:raising"
    args = [a for a in TINY_RUN if not a.startswith(("task.rewards", "task.reward_weights"))]
    r = run_here("recipes.train", *args, f"task.rewards=[{spec}]", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert spec in last and "prompt" in last
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("embedded", ["reverse", "add"])
def test_the_embedded_prompts_and_their_sft_conversations_hold_out_the_same_items(embedded: str) -> None:
    from text.prompts import prompts, toy_chat

    asked, answered = prompts(embedded=embedded, count=512), toy_chat(embedded=embedded, count=512)
    for rows, convs in ((asked.train, answered.train), (asked.val, answered.val)):
        # one user message each, asked as the SFT conversations ask it (a chat model's task)
        assert [r["prompt"] for r in rows] == [c[:1] for c in convs]
        assert [r["answer"] for r in rows] == [c[1]["content"] for c in convs]
    assert asked.val and len(asked.train) + len(asked.val) == {"reverse": 512, "add": 100}[embedded]
    if embedded == "reverse":
        assert all(r["answer"] == r["prompt"][0]["content"].split()[1][::-1] for r in asked.train)


def _ddp_run(run: Path, *extra: str) -> None:
    """TINY_RUN under torchrun, 2 DDP ranks (gloo), into `run`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = [a for a in TINY_RUN if not a.startswith("trainer.batch_size=")]
    cmd += ["-m", "recipes.train", *args, "trainer.parallel=ddp", "trainer.batch_size=4", *extra]
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={run}"], env=dist_env_vars(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow  # two 2-rank torchrun launches (~60 s on 2 loaded cores)
def test_two_ddp_ranks_resume_bit_exact_between_updates_on_one_generation(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _ddp_run(whole)  # dapo: every rank's step all-reduces the batch's completion tokens
    ckpt = whole / "checkpoints" / "step_00000001"
    controls = []
    for rank in (0, 1):  # each rank's pending completions are in its own training state
        state = torch.load(ckpt / f"train_rank{rank}.pt", weights_only=True)
        assert len(state["callbacks"]["RolloutState"]["pending"]) == 1
        controls.append(state["callbacks"]["AdaptiveEntropy"])
    # the entropy that moved the coefficient is both ranks' tokens' (their completions differ): one value
    assert controls[0]["coef"] == pytest.approx(0.05) and controls[0]["last"] > 0
    assert controls[0] == controls[1]
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    _ddp_run(resumed, "resume=auto")
    a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
