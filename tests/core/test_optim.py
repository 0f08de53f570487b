"""core.optim: decay groups, each optimizer's type and hyperparameters, and every schedule against torch's own
schedulers chained as torchvision's classification reference chains them."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as S

from core.errors import ConfigError
from core.optim import OptimConfig, build_optimizer, build_scheduler, warmup_steps
from tests.helpers import fault, fit_toy


def test_no_weight_decay_on_biases_and_norms() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), impl="foreach")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


def _lrs(opt: torch.optim.Optimizer, sched: S.LRScheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_to_min_ratio() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    opt = build_optimizer(nn.Linear(2, 2), cfg)
    lrs = _lrs(opt, build_scheduler(opt, cfg, total_steps=14), 14)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for s in range(4, 14):  # reference: 0.1 + 0.9 * (1 + cos(pi * progress)) / 2
        assert lrs[s] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 10)), abs=1e-12)


def _reference(opt: torch.optim.Optimizer, cfg: OptimConfig, total: int) -> S.LRScheduler:
    """torch's schedulers as torchvision's references/classification/train.py chains them (our defaults
    where it has none: the (step+1)/warmup ramp is LinearLR from 1/warmup, reaching 1 a step before the
    main one)."""
    warmup = warmup_steps(cfg, total)
    after = total - warmup
    if cfg.schedule == "cosine":
        main: S.LRScheduler = S.CosineAnnealingLR(opt, T_max=after, eta_min=cfg.min_lr_ratio * cfg.lr)
    elif cfg.schedule == "step":
        main = S.StepLR(opt, step_size=cfg.step_every or after // 3, gamma=cfg.gamma or 0.1)
    elif cfg.schedule == "exponential":
        main = S.ExponentialLR(opt, gamma=cfg.gamma or cfg.min_lr_ratio ** (1 / after))
    else:
        main = S.ConstantLR(opt, factor=1.0, total_iters=0)
    if cfg.warmup_method == "constant":
        warm: S.LRScheduler = S.ConstantLR(opt, factor=cfg.warmup_decay, total_iters=warmup)
    elif cfg.warmup_decay is None:
        warm = S.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup - 1)
    else:
        warm = S.LinearLR(opt, start_factor=cfg.warmup_decay, total_iters=warmup)
    return S.SequentialLR(opt, [warm, main], milestones=[warmup])


WARMUPS = {
    "linear": {},
    "linear_decay": {"warmup_decay": 0.01},
    "constant": {"warmup_method": "constant", "warmup_decay": 0.1},
}
SCHEDULE_KEYS = {
    "cosine": {"min_lr_ratio": 0.05},
    "constant": {},
    "step": {"step_every": 7, "gamma": 0.5},
    "step_default": {"schedule": "step"},  # a third of the steps after warmup, gamma 0.1
    "exponential": {"gamma": 0.9},
    "exponential_default": {"schedule": "exponential", "min_lr_ratio": 0.01},  # reaches it at the end
}


@pytest.mark.filterwarnings("ignore:The epoch parameter:UserWarning")  # SequentialLR steps its next one at 0
@pytest.mark.parametrize("warmup", sorted(WARMUPS))
@pytest.mark.parametrize("schedule", sorted(SCHEDULE_KEYS))
def test_each_schedule_matches_torchs_chained_schedulers(warmup: str, schedule: str) -> None:
    total = 40
    cfg = OptimConfig(
        lr=0.5,
        warmup_steps=5,
        **{"schedule": schedule.split("_")[0], **WARMUPS[warmup], **SCHEDULE_KEYS[schedule]},
    )
    ours = build_optimizer(nn.Linear(2, 2), cfg)
    got = _lrs(ours, build_scheduler(ours, cfg, total), total)
    ref = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=cfg.lr)
    want = _lrs(ref, _reference(ref, cfg, total), total)
    # torch's main schedulers multiply recursively (floating error grows with the step); ours is closed form
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    if schedule == "exponential_default":
        assert got[-1] == pytest.approx(0.01 * 0.5 * 0.01 ** (-1 / 35), rel=1e-12)  # one step before the end


@pytest.mark.parametrize(
    ("name", "cls", "expected"),
    [
        ("adamw", torch.optim.AdamW, {"betas": (0.9, 0.95), "eps": 1e-8}),
        ("sgd", torch.optim.SGD, {"momentum": 0.9, "nesterov": False, "dampening": 0}),
        ("rmsprop", torch.optim.RMSprop, {"alpha": 0.9, "eps": 1e-8, "momentum": 0.9, "centered": False}),
    ],
)
def test_each_optimizer_has_its_type_and_hyperparameters(name: str, cls: type, expected: dict) -> None:
    opt = build_optimizer(nn.Linear(3, 3), OptimConfig(name=name, lr=0.1, weight_decay=1e-4))
    assert type(opt) is cls
    for group, decay in zip(opt.param_groups, (1e-4, 0.0), strict=True):
        assert group["lr"] == 0.1 and group["weight_decay"] == decay
        assert {k: group[k] for k in expected} == expected


@pytest.mark.parametrize(
    ("name", "impl", "fused", "foreach"),
    [
        ("adamw", "fused", True, None),
        ("sgd", "fused", True, None),
        ("sgd", "foreach", None, True),
        ("rmsprop", "fused", None, None),  # no fused RMSprop: torch's own choice
        ("rmsprop", "foreach", None, True),
        ("sgd", "default", None, None),
    ],
)
def test_the_device_plans_implementation_where_the_optimizer_has_it(
    name: str, impl: str, fused: bool | None, foreach: bool | None
) -> None:
    opt = build_optimizer(nn.Linear(3, 3), OptimConfig(name=name), impl=impl)
    assert (opt.defaults.get("fused"), opt.defaults.get("foreach")) == (fused, foreach)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_and_nesterov_against_the_closed_form(nesterov: bool) -> None:
    # two steps with gradients g1, g2 from p0 (reference: torch.optim.SGD's documented update, dampening 0):
    # b1 = g1, b2 = m b1 + g2; the update is b (plain) or g + m b (Nesterov)
    w = nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    model = nn.Module()
    model.w = w
    lr, m = 0.1, 0.9
    opt = build_optimizer(
        model, OptimConfig(name="sgd", lr=lr, momentum=m, nesterov=nesterov, weight_decay=0)
    )
    g1, g2 = torch.full_like(w, 1.0), torch.full_like(w, 2.0)
    expected = torch.zeros_like(w)
    b = None
    for g in (g1, g2):
        w.grad = g.clone()
        opt.step()
        b = g if b is None else m * b + g
        expected -= lr * ((g + m * b) if nesterov else b)
    assert torch.allclose(w.detach(), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (OptimConfig(lr=0), ("optim.lr", "0", ("> 0",))),
        (
            OptimConfig(schedule="linear"),
            ("optim.schedule", "linear", ("cosine", "constant", "step", "exponential")),
        ),
        (OptimConfig(name="adam"), ("optim.name", "adam", ("adamw", "sgd", "rmsprop"))),
        (OptimConfig(name="sgd", nesterov=True, momentum=0.0), ("optim.momentum", "0.0", ("> 0",))),
        (OptimConfig(warmup_method="constant"), ("optim.warmup_decay", "None", ("> 0 and <= 1",))),
        (OptimConfig(gamma=0.0), ("optim.gamma", "0.0", ("> 0 and <= 1",))),
    ],
)
def test_bad_values_name_the_key(cfg: OptimConfig, expected: tuple) -> None:
    with pytest.raises(ConfigError) as e:
        build_optimizer(nn.Linear(2, 2), cfg)
    assert fault(e.value) == expected
    with pytest.raises(ConfigError) as e:
        build_scheduler(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1), cfg, 10)
    assert fault(e.value) == expected


@pytest.mark.parametrize(
    "optim",
    [
        OptimConfig(name="sgd", lr=0.05, nesterov=True, warmup_steps=2, schedule="step", step_every=4),
        OptimConfig(
            name="rmsprop",
            lr=1e-3,
            eps=0.0316,
            warmup_steps=3,
            warmup_method="constant",
            warmup_decay=0.1,
            schedule="exponential",
            gamma=0.9,
        ),
    ],
    ids=["sgd", "rmsprop"],
)
def test_resume_mid_epoch_is_bit_exact(tmp_path: Path, optim: OptimConfig) -> None:
    # the pattern of tests/core/test_trainer.py: 5 steps an epoch, a run interrupted after step 8 resumes
    # from that checkpoint alone (momentum buffers, squared averages and the schedule's step restored)
    straight = fit_toy(tmp_path / "a", optim=optim)
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    ckpt = "step_00000008"
    shutil.copytree(tmp_path / "a" / "checkpoints" / ckpt, tmp_path / "b" / "checkpoints" / ckpt)
    resumed = fit_toy(tmp_path / "b", optim=optim, resume="auto")
    assert type(resumed.opt) is type(straight.opt)
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    for a, b in zip(straight.opt.state.values(), resumed.opt.state.values(), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight.opt.param_groups[0]["lr"] == resumed.opt.param_groups[0]["lr"]
