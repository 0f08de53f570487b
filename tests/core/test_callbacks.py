"""core.loop.callbacks and the loop's own callbacks: hook order, best/top-k retention, early stopping (resumed
exactly), debug aids (limits, overfit check, anomaly detection, profiler)."""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core import checkpoint
from core.errors import ConfigError, Preempted, TrainingError
from core.loop.callbacks import Callback, EarlyStopConfig
from core.loop.task import StepOutput
from core.loop.trainer import Trainer
from core.optim import OptimConfig
from tests.core.toy_task import ToyTask
from tests.helpers import fault, read_metrics, toy_trainer

#: 6 epochs of the toy task, every step logged, AdamW lr 3e-2 after 2 warm-up steps; a call's keywords win
_trainer = functools.partial(
    toy_trainer, max_epochs=6, log_every=1, optim=OptimConfig(lr=3e-2, warmup_steps=2)
)


class Recorder(Callback):
    """Writes down each hook as it is called."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        self.calls.append(("fit_start", trainer.state.step))

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.calls.append(("step", trainer.state.step))

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.calls.append(("eval", trainer.state.step))

    def on_epoch_end(self, trainer: Trainer) -> None:
        self.calls.append(("epoch_end", trainer.state.step))

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        self.calls.append(("checkpoint", int(path.name.split("_")[1])))

    def on_fit_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.calls.append(("fit_end", trainer.state.step))

    def close(self) -> None:
        self.calls.append(("close", -1))


def test_hooks_run_in_the_documented_order(tmp_path: Path) -> None:
    rec = Recorder()
    _trainer(
        tmp_path, callbacks=[rec], max_epochs=2, keep_best=0, export="last"
    ).fit()  # 40 samples / 8: 5 steps an epoch
    names = [c[0] for c in rec.calls]
    assert names[0] == "fit_start" and names[-2:] == ["fit_end", "close"]
    assert [c for c in rec.calls if c[0] == "step"] == [("step", s) for s in range(1, 11)]
    # at each epoch's end: evaluation, then on_epoch_end, then the checkpoint
    i = rec.calls.index(("eval", 5))
    assert rec.calls[i - 1] == ("step", 5) and rec.calls[i + 1 : i + 3] == [
        ("epoch_end", 5),
        ("checkpoint", 5),
    ]
    assert rec.calls.count(("eval", 10)) == 1 and rec.calls.count(("checkpoint", 10)) == 1


def _meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())


def test_prune_keeps_the_newest_and_the_best(tmp_path: Path) -> None:
    values = {1: 0.5, 2: 0.9, 3: None, 4: 0.7, 5: 0.6, 6: 0.95, 7: 0.4}
    for step, v in values.items():
        meta = {"monitor": {"key": "val/accuracy", "value": v}}
        checkpoint.save(tmp_path, step, model={"w": torch.zeros(1)}, train={}, meta=meta, keep_last=0)
    kept = checkpoint.prune(tmp_path, keep_last=2, keep_best=2, maximize=True)
    assert [p.name for p in kept] == ["step_00000002", "step_00000006", "step_00000007"]
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == [p.name for p in kept]
    # lower is better: the best two are 0.4 (step 7, also the newest) and 0.5 (step 1)
    assert checkpoint.best_checkpoints(kept, maximize=False)[0].name == "step_00000007"


def test_the_best_checkpoint_is_kept_and_holds_the_best_evaluation(tmp_path: Path) -> None:
    t = _trainer(tmp_path, keep_last=1, keep_best=1, eval_every=2, monitor="val/loss")
    out = t.fit()
    best = t.best_checkpoint()
    found = checkpoint.complete_checkpoints(tmp_path / "checkpoints")
    assert best in found and len(found) <= 2 and found[-1].name == "step_00000030"
    evals = {r["step"]: r["val/loss"] for r in read_metrics(tmp_path) if "val/loss" in r}
    best_step = min(evals, key=lambda s: (evals[s], s))
    assert best.name == f"step_{best_step:08d}" and _meta(best)["monitor"]["value"] == evals[best_step]
    assert out["best/val/loss"] == evals[best_step] == t.state.best


def test_an_unknown_monitor_is_one_config_error_naming_the_metrics(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, monitor="val/bogus", monitor_mode="max").fit()
    assert fault(e.value) == ("trainer.monitor", "val/bogus", ("val/accuracy", "val/loss"))
    with pytest.raises(ConfigError) as e:  # direction not readable from the name
        _trainer(tmp_path, monitor="val/bogus")
    assert fault(e.value) == ("trainer.monitor_mode", "auto", ("max", "min"))
    with pytest.raises(ConfigError) as e:  # the best could be pruned before the export
        _trainer(tmp_path, keep_best=0, export="best")
    assert fault(e.value) == ("trainer.keep_best", "0", (">= 1",))


class StopAt(Callback):
    """Sends the run a real SIGTERM, as a scheduler would, after `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if trainer.state.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_early_stopping_stops_and_a_resumed_run_stops_at_the_same_step(tmp_path: Path) -> None:
    # min_delta larger than any change: the first evaluation is the best, two more end the run
    early = EarlyStopConfig(patience=2, min_delta=10.0)
    kw = {"max_epochs": 50, "eval_every": 3, "monitor": "val/loss", "keep_last": 0}
    straight = _trainer(tmp_path / "a", early_stop=early, **kw)
    out = straight.fit()
    # evaluations at steps 3, 5 (an epoch's end) and 6: the last two did not improve
    assert out["step"] == 6 and straight.state.stopped.startswith("early stop")
    # the same run stopped after step 4 (between evaluations) and resumed continues the count exactly
    with pytest.raises(Preempted):
        _trainer(tmp_path / "b", early_stop=early, callbacks=[StopAt(4)], **kw).fit()
    resumed = _trainer(tmp_path / "b", early_stop=early, resume="auto", **kw)
    assert resumed.fit()["step"] == 6
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    # a finished, early-stopped run resumed again does not train on
    again = _trainer(tmp_path / "a", early_stop=early, resume="auto", **kw)
    assert again.fit()["step"] == 6


def test_limits_cut_each_epoch_and_overfit_repeats_one_batch(tmp_path: Path) -> None:
    t = _trainer(tmp_path / "limit", max_epochs=2, limit_train_batches=2, limit_val_batches=1)
    assert t.fit()["step"] == 4
    t = _trainer(tmp_path / "fit", overfit_batches=1, overfit_steps=60, log_every=5)
    assert t.fit()["step"] == 60  # passes: the loss on one fixed batch falls well below half
    one = t.train_sampler.batches(0)
    assert len(one) == 60 and all(b == one[0] for b in one) and t.train_sampler.batches(3) == one


def test_overfit_check_fails_a_model_that_cannot_fit_one_batch(tmp_path: Path) -> None:
    t = _trainer(
        tmp_path, overfit_batches=1, overfit_steps=30, log_every=5, optim=OptimConfig(lr=1e-9), seed=0
    )  # lr 1e-9: cannot move
    with pytest.raises(TrainingError) as e:
        t.fit()
    assert fault(e.value) == ("trainer.overfit_batches", "1", ())


class NanGradTask(ToyTask):
    """A finite loss whose gradient is NaN: sqrt at 0 has an infinite derivative, times a zero."""

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits, y) + 0.0 * torch.sqrt(logits.sum() - logits.sum().detach())
        return StepOutput(loss, len(y), {})


def test_anomaly_detection_names_the_op_behind_a_nan_gradient(tmp_path: Path) -> None:
    with pytest.raises(TrainingError) as e:
        _trainer(tmp_path / "a", task=NanGradTask(), detect_anomaly=True).fit()
    assert fault(e.value) == ("trainer.detect_anomaly", "SqrtBackward0", ())
    # without it the step is skipped as non-finite (grad norm NaN), and the run ends at the policy's limit,
    # naming the samples of the step it stopped at
    with pytest.raises(TrainingError) as e:
        _trainer(tmp_path / "b", task=NanGradTask(), max_nonfinite=2).fit()
    assert fault(e.value)[0] == "samples" and fault(e.value)[1]


def test_the_profiler_writes_a_trace_and_a_top_ops_table(tmp_path: Path) -> None:
    assert _trainer(tmp_path, max_epochs=2, profile_steps=3).fit()["step"] == 5  # then it stops
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::addmm") or n.startswith("aten::linear") for n in names)
    table = (tmp_path / "profile" / "top_ops.txt").read_text()
    assert "aten::" in table


class _Benchmarked(ToyTask):
    """The toy task with a benchmark of its own: the model's first weight, at evaluations."""

    def benchmarks(self, names: Any, limit: float) -> Any:
        def run(model: nn.Module, plan: Any) -> dict[str, float]:
            assert not model.training  # scored in eval mode, put back after
            return {f"eval/{n}/weight": float(next(model.parameters()).flatten()[0]) for n in names}

        return run


def test_trainer_evals_add_the_task_s_benchmark_metrics_beside_val(tmp_path: Path) -> None:
    # every second evaluation (trainer.evals_every=4 with eval_every=2); the rows keep val/* beside them
    toy_trainer(tmp_path, task=_Benchmarked(), evals=["b"], evals_every=4, eval_every=2, max_epochs=1).fit()
    rows = [r for r in read_metrics(tmp_path) if "val/loss" in r]
    assert [r["step"] for r in rows if "eval/b/weight" in r] == [
        r["step"] for r in rows if r["step"] % 4 == 0
    ]
    assert any(r["step"] % 4 for r in rows)  # evaluations between carry no benchmark
    with pytest.raises(ConfigError) as e:  # a task without benchmarks: refused before training
        toy_trainer(tmp_path / "plain", evals=["b"]).fit()
    assert fault(e.value)[:2] == ("trainer.evals", "b")
