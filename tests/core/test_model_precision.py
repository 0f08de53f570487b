"""core.device.model_precision: precision=auto on a CPU follows the model's own timed step (bf16 only past
the margin), caches it by the model's and batch's shapes, never caches a measurement taken under real
background load, and a resumed run keeps the precision its checkpoint trained in."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from core.device import model_precision as mp
from core.device import resolve
from core.device.probe import MARGIN


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh torchkiln cache for this test."""
    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def timing(fp32: float, bf16: float, others: float | None = 0.0) -> mp.ModelTiming:
    return mp.ModelTiming(fp32, bf16, others, "2026-12-04T00:00:00+00:00")


def test_bf16_is_chosen_only_past_the_margin_and_load_decides_nothing() -> None:
    plan = dataclasses.replace(resolve("cpu", "fp32"), reasons={"precision": "machine: fp32"})
    assert mp.decide(plan, timing(10.0, 10.0 / (MARGIN + 0.01))).precision == "bf16"
    assert mp.decide(plan, timing(10.0, 10.0 / (MARGIN - 0.01))).precision == "fp32"
    bf16_plan = mp.precision_of(plan, "bf16", "machine: bf16")
    assert mp.decide(bf16_plan, timing(10.0, 20.0)).precision == "fp32"  # the model overrides the machine
    loaded = mp.decide(bf16_plan, timing(10.0, 20.0, others=1.5))
    assert loaded.precision == "bf16" and "under load" in loaded.reasons["precision"]


def _model_and_step() -> tuple[nn.Module, object, list[tuple[bool, int]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 8))
    x, calls = torch.randn(32, 64), []

    def step(bf16: bool, i: int) -> None:
        calls.append((bf16, i))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(x[: 32 - i]).float().pow(2).mean().backward()

    return model, step, calls


def test_a_measurement_is_cached_by_shape_and_leaves_the_model_as_it_found_it(cache: Path) -> None:
    model, step, calls = _model_and_step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    first = mp.timing("key", model, step)
    assert first.fp32_ms > 0 and first.bf16_ms > 0 and not first.cached
    # both precisions warm up on batch 0, then a pair on each further batch, the pair's order alternating
    pairs = [[(i % 2 == 0, i), (i % 2 == 1, i)] for i in range(1, mp.STEPS + 1)]
    assert calls == [(False, 0), (True, 0), *(c for pair in pairs for c in pair)]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # BatchNorm stats kept
    assert all(p.grad is None for p in model.parameters()) and torch.equal(rng, torch.random.get_rng_state())
    if first.under_load:  # a busy host (the suite's other worker): measured, used, not kept
        assert not mp.cache_path("key").exists()
        return
    again = mp.timing("key", model, step)
    assert again.cached and (again.fp32_ms, again.bf16_ms) == (first.fp32_ms, first.bf16_ms)
    assert len(calls) == 2 * (mp.STEPS + 1)  # read, not measured again
    other = nn.Sequential(nn.Linear(64, 64))
    plan = resolve("cpu", "auto")
    assert mp.model_key(plan, model, [[32, 64]]) != mp.model_key(plan, other, [[32, 64]])
    assert mp.model_key(plan, model, [[32, 64]]) != mp.model_key(plan, model, [[16, 64]])


def test_a_measurement_under_real_background_load_is_not_cached(cache: Path) -> None:
    from bench.load import background

    model, step, _ = _model_and_step()  # a few ms of steps: the load is read over LOAD_WINDOW_S all the same
    with background("spin", 2):
        time.sleep(0.5)  # the spinning processes are up before the measurement starts
        result = mp.timing("loaded", model, step)
    assert result.under_load, result
    assert not mp.cache_path("loaded").exists()


def test_the_trainer_follows_the_cached_timing_and_a_resume_keeps_its_precision(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.checkpoint.layout import read_meta
    from tests.helpers import toy_trainer

    def run(name: str, **kw: object) -> object:
        t = toy_trainer(tmp_path / name, precision="auto", max_epochs=1, ckpt_every=2, keep_last=10, **kw)
        t.fit()
        return t

    # the first run's measurement is fixed (bf16 5x faster, on an idle host), so the wiring is tested on any
    # host; the real measurement, and load, are the tests above
    monkeypatch.setattr(mp, "measure", lambda model, step: timing(10.0, 2.0))
    first = run("a")
    files = list((cache / "device").glob("model-precision-*.json"))
    assert first.plan.precision == "bf16" and len(files) == 1
    for fp32, want in ((10.0, "bf16"), (1.0, "fp32")):  # steer the cached timing both ways
        saved = dataclasses.asdict(timing(fp32, 2.0))
        del saved["cached"]
        files[0].write_text(json.dumps(saved))
        t = run(f"run-{want}")
        assert t.plan.precision == want, t.plan.reasons["precision"]
        ckpt = sorted((tmp_path / f"run-{want}" / "checkpoints").iterdir())[0]
        assert read_meta(ckpt)["precision"] == want
    # the cache now says fp32; a run resumed from the bf16 run's checkpoint keeps bf16
    ckpts = sorted((tmp_path / "run-bf16" / "checkpoints").iterdir())
    shutil.copytree(ckpts[0], tmp_path / "resumed" / "checkpoints" / ckpts[0].name)
    t = run("resumed", resume="auto")
    assert t.plan.precision == "bf16"


def test_the_trainer_times_each_pair_on_a_new_batch_of_the_first_epoch(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's batches are the epoch's first STEPS + 1, in the sampler's order: batch 0 for the
    warm-ups, a batch new to both precisions for each timed pair (as a run whose lengths vary sees them)."""
    from tests.core.toy_task import ToyTask
    from tests.helpers import toy_trainer

    given: list[list[object]] = []
    real = mp.timed_step

    def recording(task: object, model: nn.Module, batches: list[object], device: torch.device) -> object:
        given.append(batches)
        return real(task, model, batches, device)

    monkeypatch.setattr(mp, "timed_step", recording)
    t = toy_trainer(tmp_path / "run", task=ToyTask(jitter=0.0), precision="auto", max_epochs=1)
    t.fit()
    (batches,) = given
    order = t.train_sampler.batches(0)[: mp.STEPS + 1]
    assert len(batches) == mp.STEPS + 1 == len({tuple(ix) for ix in order})
    for (x, _y), indices in zip(batches, order, strict=True):
        assert torch.equal(x, t.train_ds.x[indices])
