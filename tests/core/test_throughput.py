"""core.logging.throughput: attention FLOPs by the model-FLOPs rule on every backend, a count that leaves the
run
untouched, and the rates, MFU and peak memory every logged row carries."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.attention import attention
from core.logging import throughput
from core.loop.trainer import Trainer
from core.optim import OptimConfig
from tests.core.toy_task import ToyTask
from tests.helpers import read_metrics, toy_trainer

B, H, L, D = 2, 3, 10, 8
#: 2 matmuls (q k^T, p v) of B*H*L*L*D multiply-adds each, 2 FLOPs a multiply-add; backward twice that
ATTENTION_FWD = 2 * 2 * B * H * L * L * D


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_attention_counts_two_matmuls_forward_and_four_backward_on_each_backend(backend: str) -> None:
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    assert throughput.count_flops(lambda: attention(q, k, v, causal=True, backend=backend)) == ATTENTION_FWD
    flops = throughput.count_flops(lambda: attention(q, k, v, causal=True, backend=backend).sum().backward())
    assert flops == 3 * ATTENTION_FWD


def test_packed_attention_counts_each_document_against_itself() -> None:
    q, v = torch.randn(10, H, D), torch.randn(10, H, D)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    assert throughput._packed_attention(q, v, cu) == 2 * H * 2 * D * (4 * 4 + 6 * 6)


class BatchNormTask(ToyTask):
    """The toy task with BatchNorm (running statistics a stray forward would move) and dropout."""

    def build_model(self) -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 3))


def test_measuring_leaves_gradients_buffers_and_every_generator_as_they_were() -> None:
    task = BatchNormTask()
    model = task.build_model()
    ds, _ = task.build_datasets()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    random.seed(5)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(5)
    random.seed(5)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        F.cross_entropy(model(x), y).backward()

    got = throughput.measure_model(
        model,
        lambda: torch.utils.data.default_collate([ds[i] for i in range(8)]),
        step,
        lambda b: 8.0,
        "samples",
    )
    # Linear(4, 16) and Linear(16, 3) over 8 examples: forward 2*8*(64+48), backward (input and weight
    # gradients of the second, weight gradient of the first: x needs no gradient) 2*8*(48+48+64)
    assert got == throughput.ModelFlops(
        per_unit=(2 * 8 * (64 + 48) + 2 * 8 * (48 + 48 + 64)) / 8, unit="samples"
    )
    assert (torch.rand(3).tolist(), random.random()) == (expected[0].tolist(), expected[1])
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_peak_is_measured_once_per_process_without_drawing_from_the_run_s_generator() -> None:
    before = torch.get_rng_state()
    peak = throughput.matmul_peak(torch.device("cpu"), torch.float32, n=96)
    assert torch.equal(torch.get_rng_state(), before)
    assert peak > 0 and throughput.matmul_peak(torch.device("cpu"), torch.float32, n=96) == peak


@pytest.mark.parametrize(("seconds", "sizes"), [(1.0, [256]), (0.001, [256, 512, 1024])])
def test_the_peak_s_matmul_grows_until_one_takes_long_enough(
    monkeypatch: pytest.MonkeyPatch, seconds: float, sizes: list[int]
) -> None:
    """A device that takes a second for the smallest matmul (an emulated CPU) is measured there; a fast one
    doubles the size up to the largest asked for, each size warmed up once and timed `reps` times."""
    timed: list[int] = []

    def fake_time(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
        timed.append(a.shape[0])
        return seconds

    monkeypatch.setattr(throughput, "_time_mm", fake_time)
    peak = throughput._measure_peak(torch.device("cpu"), torch.float32, 1024, reps=3)
    assert timed == [n for n in sizes for _ in range(1 + 3)]
    assert peak == 2 * sizes[-1] ** 3 / seconds


def test_the_peak_is_the_best_size_and_repetition_not_the_last() -> None:
    """As on an AMX Xeon's bf16 (docs/running.md § Throughput and MFU): the middle size runs fastest and
    each size's first timings are slow. The peak is the best rate of any size and repetition."""
    rates = {256: [1e9, 2e9, 3e9], 512: [2e9, 9e9, 4e9], 1024: [5e9, 6e9, 7e9]}  # FLOP/s: warm-up, reps
    calls = {n: iter(r) for n, r in rates.items()}

    def fake_time(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
        n = a.shape[0]
        return 2 * n**3 / next(calls[n])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(throughput, "_time_mm", fake_time)
        peak = throughput._measure_peak(torch.device("cpu"), torch.float32, 1024, reps=2)
    assert peak == pytest.approx(9e9)


def test_rates_and_mfu_of_a_window() -> None:
    flops = throughput.ModelFlops(per_unit=6e6, unit="tokens")
    row = throughput.row(flops, units=4000.0, seconds=2.0, devices=2, peak=1e11)
    assert row == {"train/tokens_per_s": 2000.0, "train/tflops": 0.012, "train/mfu": 0.06}
    assert throughput.row(None, units=4000.0, seconds=2.0, devices=1, peak=1e11) == {}


#: 2 epochs of 5 batches, every 2nd step logged, AdamW lr 1e-2 with no warm-up
RUN = {"max_epochs": 2, "log_every": 2, "optim": OptimConfig(lr=1e-2)}


def test_every_logged_row_has_rates_mfu_and_peak_memory_and_counting_changes_no_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = toy_trainer(tmp_path / "a", **RUN)
    counted.fit()
    # the toy MLP: Linear(4, 16) and Linear(16, 3), forward 2*(64+48) per example, backward 2*(48+48+64)
    assert counted.metrics.model_flops == throughput.ModelFlops(
        per_unit=2 * (64 + 48) + 2 * (48 + 48 + 64), unit="samples"
    )
    train = [r for r in read_metrics(tmp_path / "a") if "train/loss" in r]
    assert len(train) == 5  # 10 steps, every 2nd logged
    for r in train:
        assert r["train/samples_per_s"] > 0 and r["train/peak_mem_mib"] > 10
        assert r["train/tflops"] == pytest.approx(
            counted.metrics.model_flops.per_unit * r["train/samples_per_s"] / 1e12
        )
        assert r["train/mfu"] == pytest.approx(r["train/tflops"] * 1e12 / counted.metrics.peak_flops)
    monkeypatch.setattr(Trainer, "_count_model_flops", lambda self, model: None)
    plain = toy_trainer(tmp_path / "b", **RUN)
    plain.fit()
    for k, v in plain.model.state_dict().items():
        assert torch.equal(v, counted.model.state_dict()[k]), k
    assert "train/mfu" not in read_metrics(tmp_path / "b")[0]


def test_a_model_the_counter_cannot_follow_trains_without_mfu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(run: object) -> int:
        raise AttributeError("an op the flop counter cannot follow")

    monkeypatch.setattr(throughput, "count_flops", refuse)
    t = toy_trainer(tmp_path, **RUN)
    t.fit()
    assert t.metrics.model_flops is None and t.state.step == 10
    train = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    assert train and all("train/mfu" not in r and r["train/peak_mem_mib"] > 0 for r in train)


def test_a_window_faster_than_the_peak_has_it_measured_again_and_mfu_never_exceeds_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fake clock makes a window do 40 GFLOP/s against a first peak of 10: the peak is measured again
    (longer), and the row's MFU is achieved / remeasured peak, or 1 where the remeasure is still lower."""
    from core.distributed import MeshShape
    from core.distributed.env import DistEnv
    from core.logging import processor

    measured: list[tuple[int, int]] = []
    peaks = iter([10e9, 20e9, 80e9])  # the first measurement, then two measured again

    def fake_measure(device: torch.device, dtype: torch.dtype, n_max: int, reps: int) -> float:
        measured.append((n_max, reps))
        return next(peaks)

    monkeypatch.setattr(throughput, "_measure_peak", fake_measure)
    monkeypatch.setattr(throughput, "_PEAKS", {})
    clock = [100.0]
    monkeypatch.setattr(processor, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    metrics = processor.MetricsProcessor(SimpleNamespace(throughput_units=lambda batch: 4000.0))
    metrics.model_flops = throughput.ModelFlops(per_unit=1e7, unit="tokens")
    metrics.measure_peak(torch.device("cpu"), torch.float32)
    one = DistEnv()

    def window(seconds: float) -> dict[str, float]:
        metrics.reset()
        metrics.amount = 4000.0  # tokens, 1e7 FLOPs each: 4e10 FLOPs in the window
        clock[0] += seconds
        return metrics.row(MeshShape(), torch.device("cpu"), one)

    first = window(1.0)  # 40 GFLOP/s > 10: measured again (20, still below): the peak is what was achieved
    assert first["train/mfu"] == 1.0 and metrics.peak_flops == pytest.approx(40e9)
    assert measured[1][0] > measured[0][0] and measured[1][1] > measured[0][1]  # larger and longer
    assert window(2.0)["train/mfu"] == pytest.approx(0.5) and len(measured) == 2  # 20 of 40: no remeasure
    faster = window(0.25)  # 160 GFLOP/s: measured again, 80: still below, so 160 it is
    assert faster["train/mfu"] == 1.0 and metrics.peak_flops == pytest.approx(160e9)


def test_a_step_metric_that_is_nan_is_left_out_of_the_windows_mean_not_averaged_in() -> None:
    from core.distributed import MeshShape
    from core.distributed.env import DistEnv
    from core.logging.processor import MetricsProcessor
    from core.loop.task import StepOutput

    metrics = MetricsProcessor(SimpleNamespace(throughput_units=lambda batch: 1.0))
    metrics.reset()
    nan = float("nan")
    for count, value, never in ((2, 1.0, nan), (3, nan, nan), (1, 4.0, nan)):
        out = StepOutput(torch.tensor(0.0), count, {"reward": value, "skipped": never, "plain": 1.5})
        metrics.add(out, None, 0.0, count)
    row = metrics.row(MeshShape(), torch.device("cpu"), DistEnv())
    assert row["train/reward"] == pytest.approx((2 * 1.0 + 1 * 4.0) / 3)  # weighted by the batches measured
    assert row["train/plain"] == 1.5 and "train/skipped" not in row  # nothing measured: no column
    # the key is kept uncounted, so every rank reduces the same list of metrics
    assert metrics.metric_sums["skipped"] == [0.0, 0]
