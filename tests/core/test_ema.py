"""core.loop.ema: the EMA callback on any task (bit-exact resume, val/ema_* metrics a monitor may name, the
training it leaves untouched) and the average of a run's checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from core import checkpoint
from core.errors import CheckpointError, ConfigError
from core.loop.ema import EMA, average_checkpoints, averaged_state, last_checkpoints
from core.loop.evaluation import evaluate
from tests.core.toy_task import ToyTask
from tests.helpers import fault, fit_toy, read_metrics

EMA_ON = {"ema_decay": 0.9, "ema_every": 2, "ema_warmup": 2}


def _ema_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return checkpoint.load(run_dir / "checkpoints" / f"step_{step:08d}")[1]["callbacks"]["EMA"]


@pytest.mark.parametrize("ckpt", [5, 8])  # an epoch's end (5 steps an epoch), mid-epoch
def test_a_run_with_ema_resumed_from_a_checkpoint_ends_bit_exact_in_weights_and_ema(
    tmp_path: Path, ckpt: int
) -> None:
    straight = fit_toy(tmp_path / "a", **EMA_ON)
    name = f"step_{ckpt:08d}"
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)  # the run was killed after `ckpt`
    shutil.copytree(tmp_path / "a" / "checkpoints" / name, tmp_path / "b" / "checkpoints" / name)
    resumed = fit_toy(tmp_path / "b", resume="auto", **EMA_ON)
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    want, got = _ema_state(tmp_path / "a", 15), _ema_state(tmp_path / "b", 15)
    assert want.keys() == got.keys() and int(want["n_averaged"]) == 6  # copies at 2, 4; 6, ..., 14 average
    assert all(torch.equal(want[k], got[k]) for k in want)
    weights = straight.model.state_dict()
    assert not torch.equal(want["0.weight"], weights["0.weight"])  # an average, not the last weights


def test_the_ema_leaves_training_as_it_was_and_scores_its_own_weights(tmp_path: Path) -> None:
    plain = fit_toy(tmp_path / "plain", max_epochs=2)
    t = fit_toy(tmp_path / "ema", max_epochs=2, **EMA_ON)
    # evaluating the average swaps it into the model and back: the trained weights are bit-exact the same
    for k, v in plain.model.state_dict().items():
        assert torch.equal(v, t.model.state_dict()[k]), k
    rows = read_metrics(tmp_path / "ema")
    last = [r for r in rows if "val/ema_accuracy" in r][-1]
    # the logged val/ema_* are the task's evaluation of a plain model holding the EMA's tensors
    model = ToyTask().build_model()
    state = {k: v for k, v in _ema_state(tmp_path / "ema", 10).items() if k != "n_averaged"}
    model.load_state_dict(state)
    scores = evaluate(t.task, model, t.val_loader, t.plan)
    assert last["val/ema_loss"] == scores["val/loss"] and last["val/ema_accuracy"] == scores["val/accuracy"]
    assert last["val/ema_loss"] != last["val/loss"]


def test_a_val_ema_monitor_picks_the_best_checkpoint_by_the_emas_metric(tmp_path: Path) -> None:
    t = fit_toy(tmp_path, max_epochs=3, eval_every=2, monitor="val/ema_loss", **EMA_ON)
    assert t.monitor_max is False  # a loss: smaller is better
    metas = [
        json.loads((p / "meta.json").read_text())
        for p in checkpoint.complete_checkpoints(tmp_path / "checkpoints")
    ]
    scored = [m for m in metas if m["monitor"]["value"] is not None]
    assert scored and all(m["monitor"]["key"] == "val/ema_loss" for m in scored)
    assert all(m["monitor"]["value"] == m["metrics"]["val/ema_loss"] for m in scored)
    best = min(m["monitor"]["value"] for m in scored)
    assert metas[-1]["best"] == best and t.best_checkpoint() is not None
    # trainer.export=best under this monitor: the best checkpoint's EMA, not its trained weights
    exported = averaged_state(t.ema, t.model, t.dist, t.best_checkpoint())
    kept = _ema_state(tmp_path, int(t.best_checkpoint().name.removeprefix("step_")))
    assert exported.keys() == {k for k in kept if k != "n_averaged"}
    assert all(torch.equal(exported[k], kept[k]) for k in exported)
    headline = fit_toy(tmp_path / "acc", max_epochs=1, monitor="val/ema_accuracy", **EMA_ON)
    assert headline.monitor_max is True  # the task's own direction for its headline metric


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        ({"export": "ema"}, "trainer.export=ema"),
        ({"monitor": "val/ema_accuracy"}, "trainer.monitor=val/ema_accuracy"),
    ],
)
def test_ema_settings_without_an_ema_are_one_line(tmp_path: Path, cfg: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        fit_toy(tmp_path, max_epochs=1, **cfg)
    assert fault(e.value)[:2] == tuple(key.split("=", 1))


def test_the_average_of_checkpoints_is_their_elementwise_mean(tmp_path: Path) -> None:
    fit_toy(tmp_path, max_epochs=2)
    paths = last_checkpoints(tmp_path, 3)
    assert [p.name for p in paths] == ["step_00000006", "step_00000008", "step_00000010"]
    avg = average_checkpoints(paths)
    states = [checkpoint.load(p)[0] for p in paths]
    for k, v in avg.items():  # the float64 mean, in float32: within one rounding of the fp32 mean
        want = (states[0][k].double() + states[1][k].double() + states[2][k].double()) / 3
        torch.testing.assert_close(v, want.float(), rtol=0, atol=1e-7)
        assert v.dtype == states[0][k].dtype
    with pytest.raises(ConfigError) as e:
        last_checkpoints(tmp_path, 99)
    assert fault(e.value) == ("last", "99", ("<= 6",))  # steps 2, 4, 5 (an epoch end), 6, 8, 10
    with pytest.raises(ConfigError) as e:
        last_checkpoints(tmp_path / "empty", 1)
    assert fault(e.value) == ("ckpt", str(tmp_path / "empty"), ())


def test_a_resumed_ema_of_another_shape_is_refused(tmp_path: Path) -> None:
    ema = EMA(0.9)
    model = torch.nn.Linear(2, 3)
    holder = type("T", (), {"model": model})()
    ema.load_state_dict({"weight": torch.zeros(1, 2), "bias": torch.zeros(3), "n_averaged": torch.tensor(1)})
    with pytest.raises(CheckpointError) as e:
        ema.on_fit_start(holder)
    assert fault(e.value) == ("ema.weight", "(1, 2)", ("(3, 2)",))
