"""core.optim: decay groups and the warmup + cosine schedule against its closed form."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from core.errors import ConfigError
from core.optim import OptimConfig, build_optimizer, build_scheduler


def test_no_weight_decay_on_biases_and_norms() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), impl="foreach")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


def test_warmup_then_cosine_to_min_ratio() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    opt = build_optimizer(nn.Linear(2, 2), cfg)
    sched = build_scheduler(opt, cfg, total_steps=14)
    lrs = []
    for _ in range(14):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for s in range(4, 14):  # reference: 0.1 + 0.9 * (1 + cos(pi * progress)) / 2
        assert lrs[s] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 10)), abs=1e-12)


def test_bad_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match="optim.lr=0"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(lr=0))
    with pytest.raises(ConfigError, match="optim.schedule=step is unknown"):
        build_scheduler(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1), OptimConfig(schedule="step"), 10)
