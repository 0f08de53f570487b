"""The training loop's logging window: what each micro-batch adds (examples, loss units, the task's step
metrics, throughput units) and the row logged every `trainer.log_every` steps, reduced over the
data-parallel ranks, with its rates, model FLOPs, MFU and peak memory (`core.logging.throughput`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from core.distributed import MeshShape
from core.distributed import group as dgroup
from core.distributed.env import DistEnv
from core.logging import throughput
from core.logging.messages import warn
from core.loop.task import StepOutput, Task


class MetricsProcessor:
    """Owns the window between two logged rows and the FLOP figures the rows' rates are measured against."""

    def __init__(self, task: Task) -> None:
        """A window for `task`'s units; the peak and the model's FLOPs are measured once the run's device
        plan and model exist (`measure_peak`, `count_model_flops`)."""
        self.task = task
        #: the matmul peak (FLOP/s) MFU is measured against; None until measured
        self.peak_flops: float | None = None
        #: the device and compute dtype the peak was measured on (measured again on them, if ever)
        self.peak_on: tuple[torch.device, torch.dtype] | None = None
        #: the built model's training FLOPs per throughput unit; None: not counted (no MFU then)
        self.model_flops: throughput.ModelFlops | None = None
        self.seen, self.units, self.loss_sum, self.amount = 0, 0, 0.0, 0.0
        #: the task's step metric -> [sum of value x examples, examples]
        self.metric_sums: dict[str, list[Any]] = {}
        self.t0 = time.perf_counter()

    def measure_peak(self, device: torch.device, dtype: torch.dtype) -> None:
        """The matmul peak in the compute dtype at the plan's threads, measured before the model takes memory
        (on CUDA its buffers would otherwise count as the run's peak memory)."""
        self.peak_flops = throughput.matmul_peak(device, dtype)
        self.peak_on = (device, dtype)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def count_model_flops(
        self, model: nn.Module, first_batch: Callable[[], Any], step: Callable[[Any], None]
    ) -> None:
        """Training FLOPs per throughput unit of the built model, from one forward + backward (`step`) of
        `first_batch()`, a slice of the first training batch as large as one rank's share
        (`core.logging.throughput.measure_model`)."""
        task = self.task
        try:
            self.model_flops = throughput.measure_model(
                model, first_batch, step, task.throughput_units, task.throughput_unit
            )
        except Exception as e:  # noqa: BLE001
            # the rates are a report, not the run: a model the flop counter cannot follow trains anyway, and
            # a fault of the step itself surfaces in the first real step right after, as it would without this
            why = (str(e).splitlines() or [""])[0][:120]
            warn(f"model FLOPs not counted ({type(e).__name__}: {why}); no train/tflops or train/mfu")
            self.model_flops = None

    def reset(self) -> None:
        """Start a window: examples seen, loss units seen and their loss sum, the task's step metrics
        (`StepOutput.metrics`, logged as train/NAME: means weighted by examples), its start time."""
        self.seen, self.units, self.loss_sum, self.amount = 0, 0, 0.0, 0.0
        self.metric_sums = {}
        self.t0 = time.perf_counter()

    def add(self, out: StepOutput, batch: Any, loss: float, units: int) -> None:
        """A micro-batch whose loss was finite (it ran backward); `loss` is its mean over `units` units."""
        self.seen += out.count
        self.amount += self.task.throughput_units(batch)
        self.units += units
        self.loss_sum += loss * units
        for key, value in out.metrics.items():  # tensors stay on the device until logged
            total = self.metric_sums.setdefault(key, [0.0, 0])
            if isinstance(value, float) and math.isnan(value):
                continue  # nothing measured in this batch (StepOutput.metrics): the key stays, uncounted
            total[0] = total[0] + (value.detach() if torch.is_tensor(value) else value) * out.count
            total[1] += out.count

    def _rates(self, amount: float, seconds: float, devices: int) -> dict[str, float]:
        """The throughput columns; a window that beat the peak has it measured again first (MFU <= 1)."""
        rates = throughput.row(self.model_flops, amount, seconds, devices=devices, peak=self.peak_flops)
        if rates.get("train/mfu", 0.0) <= 1 or self.peak_on is None or self.peak_flops is None:
            return rates
        achieved = rates["train/tflops"] * 1e12 / devices
        first, self.peak_flops = self.peak_flops, throughput.remeasure_peak(*self.peak_on, achieved)
        warn(
            f"the run did {achieved / 1e9:.1f} GFLOP/s a device, more than the matmul peak measured at "
            f"its start ({first / 1e9:.1f}): measured again, longer: {self.peak_flops / 1e9:.1f}"
        )
        rates = throughput.row(self.model_flops, amount, seconds, devices=devices, peak=self.peak_flops)
        rates["train/mfu"] = min(1.0, rates["train/mfu"])  # rounding only: the peak is >= the achieved rate
        return rates

    def row(self, shape: MeshShape, device: torch.device, dist: DistEnv) -> dict[str, float]:
        """The window's training row: rates, FLOPs, MFU, peak memory, the mean loss over its loss units and
        the task's step metrics; several processes reduce the window over every data-parallel rank first
        (a collective: every rank calls this), a replica's ranks counted once."""
        seen, units, loss_sum, amount = self.seen, self.units, self.loss_sum, self.amount
        keys = sorted(self.metric_sums)
        sums = [float(self.metric_sums[k][0]) for k in keys] + [self.metric_sums[k][1] for k in keys]
        if dist.distributed:
            window = dgroup.all_reduce_sum([seen, units, loss_sum, amount, *sums], device)
            seen, units, loss_sum, amount, *sums = (x / shape.replicas for x in window)
        seconds = time.perf_counter() - self.t0
        row = {"train/samples_per_s": seen / max(seconds, 1e-9)}
        rates = self._rates(amount, seconds, dist.world_size)
        row.update(rates)
        row["train/peak_mem_mib"] = throughput.peak_memory_bytes(device) / 2**20
        if units:  # a window of skipped (non-finite) steps has no loss to report
            # the mean over the window's loss units (tokens for a language model), as the gradient weighs them
            row["train/loss"] = loss_sum / units
        for k, total, count in zip(keys, sums[: len(keys)], sums[len(keys) :], strict=True):
            if count:
                row[f"train/{k}"] = total / count
        return row
