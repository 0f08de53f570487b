"""The one training loop every torchkiln task runs through.

`fit()` reads top to bottom: `_setup()` builds the run in a fixed order (device plan -> model -> data ->
mesh -> model transforms -> optimizer -> resume), then `_train_epoch()` runs accumulate -> clip -> step until
`max_steps`/`max_epochs`, with evaluation and atomic checkpoints at step or epoch boundaries.

Model transforms are one stage, `core.distributed.parallelize`, the same in one process and in many (where
the mesh is `MeshShape()` and tensor/data parallel do nothing): tensor parallel -> activation checkpointing
-> compile (`core.compile.apply`, when `compile_cfg` asks for it) -> the caller's `model_hook` -> FSDP/DDP
(torchtitan's order: sharding wraps what compile produced). Compile and the hook get a `probe` that runs one
training step on a real batch without consuming RNG, so a resumed run stays bit-exact. Every number the loop
derives from the mesh (data-parallel rank, ranks repeating one loss, the checkpoint's layout, clipping) is
`MeshShape`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from core import checkpoint
from core import compile as kc
from core.bounds import Bounds, check_values
from core.data import bad_samples as badsamples
from core.data.loaders import on_device, task_loader
from core.data.samplers import LimitedBatchSampler, ResumableBatchSampler
from core.data.workers import report_failures
from core.device import DevicePlan, resolve
from core.distributed import PARALLEL_STYLES, MeshShape, build_mesh, dist_env, training_mesh
from core.distributed import group as dgroup
from core.distributed.activation_checkpoint import MODES as CHECKPOINT_MODES
from core.distributed.activation_checkpoint import check_mode
from core.distributed.dry_run import DryRunReport, dry_run, in_one_process
from core.distributed.parallelize import gradient_sync, optimizer_impl, parallelize
from core.errors import CheckpointWriteError, ConfigError, Preempted, TrainingError
from core.files import write_failure
from core.logging import throughput
from core.logging.messages import say, warn
from core.logging.progress import ProgressBar
from core.logging.sinks import Logger, MetricsLogger
from core.loop import ema as kema
from core.loop import evaluation
from core.loop.accumulation import group_weights
from core.loop.callbacks import (
    Callback,
    Checkpoints,
    EarlyStopConfig,
    EarlyStopping,
    improved,
    monitor_direction,
)
from core.loop.debug import OverfitCheck, Profiler, anomaly_detection
from core.loop.task import Task
from core.optim import OptimConfig, build_optimizer, build_scheduler
from core.rng import derive_seed, rng_state, seed_everything, set_rng_state


@dataclass
class TrainerConfig:
    """Loop settings; steps count optimizer steps (after gradient accumulation)."""

    #: passes over the training data at most (the run also stops at max_steps)
    max_epochs: Annotated[int, Bounds(ge=1)] = 20
    #: -1: no limit beyond max_epochs
    max_steps: Annotated[int, Bounds(ge=1, also=(-1,))] = -1
    #: examples per batch over all data-parallel ranks (each takes an equal share)
    batch_size: Annotated[int, Bounds(ge=1)] = 64
    #: 0: twice batch_size (evaluation keeps no activations for backward)
    eval_batch_size: Annotated[int, Bounds(ge=0)] = 0
    #: batches whose gradients are summed into one optimizer step, each loss weighted by its share of the
    #: group's loss units on all ranks (core.loop.accumulation); gradients are reduced across ranks once a
    # group
    grad_accum: Annotated[int, Bounds(ge=1)] = 1
    #: largest global gradient norm, clipped to before each step; 0: no clipping
    grad_clip: Annotated[float, Bounds(ge=0)] = 1.0
    #: 0: evaluate at each epoch's end only
    eval_every: Annotated[int, Bounds(ge=0)] = 0
    #: 0: checkpoint at each epoch's end only
    ckpt_every: Annotated[int, Bounds(ge=0)] = 0
    #: 0: keep every checkpoint
    keep_last: Annotated[int, Bounds(ge=0)] = 2
    #: also keep the best this many checkpoints by `monitor` (a checkpoint is written at each improvement)
    keep_best: Annotated[int, Bounds(ge=0)] = 1
    #: the metric that picks the best checkpoint and early stopping watches; empty: the task's headline
    monitor: str = ""
    #: whether a larger `monitor` is better; auto: the task's direction for its headline, else by name
    monitor_mode: Annotated[str, Bounds(choices=("auto", "max", "min"))] = "auto"
    #: the weights a recipe exports at the end: the best checkpoint's (by `monitor`; with a val/ema_*
    #: monitor, that checkpoint's EMA), the last step's, or the last step's EMA (needs ema_decay)
    export: Annotated[str, Bounds(choices=("best", "last", "ema"))] = "best"
    #: an exponential moving average of the weights and buffers (core.loop.ema), decay per optimizer step,
    #: evaluated beside the model as val/ema_* (0: off; e.g. 0.999); any task and parallel style
    ema_decay: Annotated[float, Bounds(ge=0, lt=1)] = 0.0
    #: optimizer steps between EMA updates; each update decays by 1 - ema_every x (1 - ema_decay)
    ema_every: Annotated[int, Bounds(ge=1)] = 1
    #: optimizer steps over which the EMA copies the weights before it starts averaging
    ema_warmup: Annotated[int, Bounds(ge=0)] = 0
    #: steps between training-loss lines (metrics.jsonl, the console, TensorBoard)
    log_every: Annotated[int, Bounds(ge=1)] = 20
    #: DataLoader worker processes; -1: the device plan's count (or the task's own)
    num_workers: Annotated[int, Bounds(ge=-1)] = -1
    #: a bar over the run's steps when stderr is a terminal (a log file gets the plain step lines only)
    progress: bool = True
    #: debug: train on only the first N batches of each epoch (0: all)
    limit_train_batches: Annotated[int, Bounds(ge=0)] = 0
    #: debug: evaluate on only the first N validation batches (0: all)
    limit_val_batches: Annotated[int, Bounds(ge=0)] = 0
    #: debug: train on the same first N batches for `overfit_steps` steps (in place of max_steps and
    #: max_epochs); the run fails unless the training loss falls below half its start (0: off)
    overfit_batches: Annotated[int, Bounds(ge=0)] = 0
    #: debug: the length of an overfit run, in optimizer steps
    overfit_steps: Annotated[int, Bounds(ge=1)] = 100
    #: debug: torch.autograd anomaly detection (names the op that made a NaN; several times slower)
    detect_anomaly: bool = False
    #: debug: profile this many steps (after 2 of warm-up) into RUN_DIR/profile, then stop (0: off)
    profile_steps: Annotated[int, Bounds(ge=0)] = 0
    #: a step whose loss (or clipped gradient norm) is not finite: "skip" it (no update, counted as
    #: train/nonfinite_steps) until `max_nonfinite` in a row, then stop; "abort" stops at the first
    nonfinite: Annotated[str, Bounds(choices=("skip", "abort"))] = "skip"
    #: non-finite steps in a row that nonfinite=skip tolerates before it stops the run (exit 3)
    max_nonfinite: Annotated[int, Bounds(ge=1)] = 10
    #: a checkpoint that cannot be written (full disk): "stop" the run (exit 74), or "warn" and train on
    ckpt_on_error: Annotated[str, Bounds(choices=("stop", "warn"))] = "stop"
    #: several processes (torchrun): auto = ddp when launched with more than one, else none; ddp; fsdp
    #: (FSDP2); tp (tensor parallel); fsdp_tp (a 2-D mesh, `tp` wide); custom (the three sizes below)
    parallel: Annotated[str, Bounds(choices=PARALLEL_STYLES)] = "auto"
    #: tensor-parallel width for fsdp_tp and custom (ranks sharing one model replica's layers)
    tp: Annotated[int, Bounds(ge=1)] = 2
    #: custom only: FSDP shard group size (-1: what the world size leaves)
    dp_shard: Annotated[int, Bounds(ge=1, also=(-1,))] = -1
    #: custom only: DDP replica group size (-1: what the world size leaves)
    dp_replicate: Annotated[int, Bounds(ge=1, also=(-1,))] = 1
    #: activation checkpointing of the model's repeated blocks: none; full (backward runs each checkpointed
    #: block's forward again, keeping only its input); selective (keeps the matmul and attention outputs,
    #: recomputes the cheap ops; torch >= 2.4)
    activation_checkpointing: Annotated[str, Bounds(choices=CHECKPOINT_MODES)] = "none"
    #: checkpoint every N-th block (blocks N, 2N, ...; 1: all): less recompute for less memory saved
    activation_checkpointing_every: Annotated[int, Bounds(ge=1)] = 1
    #: several processes: write checkpoints in the background (torch.distributed.checkpoint.async_save) once
    #: the tensors are staged in memory; training goes on, the next save (or the run's end) waits for it
    ckpt_async: bool = False
    #: lay the model out over dist.world_size ranks of torch's fake process group in this one process, run
    #: one micro-batch forward and backward as rank 0, report its bytes and collectives, and train nothing
    #: (`Trainer.dry_run`)
    dry_run: bool = False


#: what a scheduler sends before it preempts a job (SLURM: SIGTERM, or SIGUSR1/2 by sbatch --signal=USR2@N)
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, n))
#: the caller's hook, e.g. `lambda m, probe: core.compile.apply(m, cfg, probe=probe)`
ModelHook = Callable[[nn.Module, Callable[[nn.Module], None]], nn.Module]


@dataclass
class TrainState:
    """Where the run is: the loop position and best metric a checkpoint stores besides the weights."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best: float | None = None
    last_eval: dict[str, float] = field(default_factory=dict)
    #: the step whose evaluation was the best (-1: none yet)
    best_step: int = -1
    #: why the run stopped before its end (early stopping), or empty; a resumed stopped run does not train
    stopped: str = ""

    @classmethod
    def from_checkpoint(cls, train: dict[str, Any], meta: dict[str, Any]) -> TrainState:
        """The state a checkpoint recorded (its loop position in `train`, its metrics in `meta`)."""
        return cls(
            train["step"],
            train["epoch"],
            train["batch_in_epoch"],
            meta.get("best"),
            meta.get("metrics", {}),
            meta.get("best_step", -1),
            meta.get("stopped", ""),
        )


class Trainer:
    """Drives a `Task`: build, (resume), train with accumulation/clipping/AMP, evaluate, checkpoint."""

    def __init__(
        self,
        task: Task,
        cfg: TrainerConfig,
        optim: OptimConfig,
        *,
        run_dir: Path | str,
        device: str = "auto",
        precision: str = "auto",
        seed: int = 0,
        resume: str | None = None,
        mps_fallback: bool = False,
        compile_cfg: kc.CompileConfig | None = None,
        model_hook: ModelHook | None = None,
        callbacks: Sequence[Callback] = (),
        early_stop: EarlyStopConfig | None = None,
        hparams: dict[str, Any] | None = None,
    ) -> None:
        """Configure a run writing into `run_dir`; nothing is built until `fit()`. `callbacks` (loggers
        among them, e.g. `core.logging.sinks.TensorBoardLogger()`) run after the loop's own; `hparams` (flat
        `section.key` names) go to each logger once."""
        check_values("trainer", dataclasses.asdict(cfg), TrainerConfig)
        check_values("optim", dataclasses.asdict(optim), OptimConfig)
        if cfg.export == "best" and cfg.keep_best == 0 and cfg.keep_last > 0:
            # the best checkpoint could be pruned before the end, and the export would silently be another
            raise ConfigError(
                "trainer.export=best needs trainer.keep_best >= 1 (or trainer.keep_last=0: keep all); "
                "or set trainer.export=last",
                key="trainer.keep_best",
                value=str(cfg.keep_best),
                valid=(">= 1",),
            )
        check_mode(cfg.activation_checkpointing, cfg.activation_checkpointing_every)  # this torch can run it
        self.early_stop = early_stop or EarlyStopConfig()
        check_values("early_stop", dataclasses.asdict(self.early_stop), EarlyStopConfig)
        self.monitor = cfg.monitor or task.primary_metric
        self.monitor_max = monitor_direction(
            self.monitor, cfg.monitor_mode, headline=task.primary_metric, headline_max=task.maximize
        )
        self.user_callbacks, self.hparams = list(callbacks), hparams
        self.task, self.cfg, self.optim_cfg = task, cfg, optim
        self.run_dir = Path(run_dir)
        self.device_spec, self.precision, self.seed, self.resume = device, precision, seed, resume
        self.mps_fallback = mps_fallback
        self.compile_cfg, self.model_hook = compile_cfg, model_hook
        self.model: nn.Module | None = None
        #: the run's EMA of the weights (trainer.ema_decay, or a task's own), once set up; None: no EMA
        self.ema: kema.EMA | None = None
        self.plan: DevicePlan | None = None
        self.state = TrainState()
        self.compiled = False
        self._nonfinite_run = self._nonfinite_total = 0  # non-finite steps in a row, and in all
        self.resumed = False
        self._evaluated_at = self._saved_at = -1  # one evaluation and one checkpoint per step at most
        self._next_batch: int | None = None  # the batch a checkpoint written now would resume at
        self._stop_signal: int | None = None  # set by a STOP_SIGNALS handler, acted on after the step
        self._outer_handlers: dict[int, Any] = {}  # the handlers ours replaced, chained after the stop
        self.dist = dist_env()  # this process's place in a torchrun launch (rank 0 of 1 without one)
        self._pending_save: Any = None  # a background checkpoint write (trainer.ckpt_async)
        self.shape = MeshShape()
        self._say, self._warn = (say, warn) if self.dist.is_main else (_quiet, _quiet)  # only rank 0 talks

    # ---- the run, top to bottom -----------------------------------------------------------------------
    @report_failures()  # a dead DataLoader worker: one line naming its sample, wherever torch raises it
    def fit(self) -> dict[str, float]:
        """Train to `max_epochs`/`max_steps`; return the final metrics (last evaluation and best)."""
        self.callbacks: list[Callback] = []
        try:
            self._setup()
            st, cfg = self.state, self.cfg
            self.model.train()
            t_start = time.perf_counter()
            self._hook("on_fit_start")
            with self._stop_on_signals(), anomaly_detection(cfg.detect_anomaly):
                while not st.stopped and st.step < self.total_steps and st.epoch < cfg.max_epochs:
                    last = self._train_epoch()
                    st.epoch, st.batch_in_epoch = st.epoch + 1, 0
                    mid_epoch = last + 1 < self._epoch_batches
                    if mid_epoch:  # stopped by max_steps or early stopping: a resumed run continues there
                        st.epoch, st.batch_in_epoch = st.epoch - 1, last + 1
                    self._evaluate_and_log()
                    if not mid_epoch:
                        self._hook("on_epoch_end")
                    self._save()
            self._finish_pending_save()
            wall = time.perf_counter() - t_start
            out = {**st.last_eval, "step": float(st.step), "epoch": float(st.epoch), "train/wall_s": wall}
            self._hook("on_fit_end", out)
        finally:
            self._close_callbacks()
        return out

    def request_stop(self, reason: str) -> None:
        """End the run after the current step, with its checkpoint (a callback's early stop); `reason` is
        printed and recorded, so a resumed run stops too."""
        if not self.state.stopped:
            self.state.stopped = reason
            self._say(reason)

    def best_checkpoint(self) -> Path | None:
        """The complete checkpoint of this run with the best `monitor` value (None: none recorded one)."""
        found = checkpoint.best_checkpoints(
            checkpoint.complete_checkpoints(self.run_dir / "checkpoints"), self.monitor_max
        )
        return found[0] if found else None

    def _hook(self, name: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, name)(self, *args)

    def _close_callbacks(self) -> None:
        """Close every callback, however the run ends; the first failure is raised after all have closed."""
        first: BaseException | None = None
        for cb in self.callbacks:
            try:
                cb.close()
            except Exception as e:  # noqa: BLE001  (each sink gets its chance to close)
                first = first or e
        self.callbacks = []
        if first is not None and sys.exc_info()[0] is None:
            raise first

    def _setup(self) -> None:
        """Plan -> model -> data -> mesh -> model transforms -> optimizer -> resume. The transforms
        (`core.distributed.parallelize`, one stage for one process and for many) come before the
        optimizer, which holds the parameters sharding made; the resumed weights and moments load into
        those in place (a compiled model keeps its graphs)."""
        seed_everything(self.seed)
        self._bad_mark = badsamples.mark()  # the data this run builds skips bad samples from here on
        self._setup_plan()
        self._setup_throughput()
        model = self._build_model()
        self._setup_data()
        self.model_flops = self._count_model_flops(model)
        mesh = self._setup_mesh()
        self.model = self._parallelize(model, mesh)
        impl = optimizer_impl(self.shape, self.plan.optimizer_impl, self.optim_cfg.name)
        self.opt = build_optimizer(self.model, self.optim_cfg, impl)
        self.sched = build_scheduler(self.opt, self.optim_cfg, self.total_steps)
        self.scaler = self.plan.make_grad_scaler()
        # several ranks load their shards into the sharded model; one process into the plain module under
        # compile's wrapper, in place, so the compiled graphs keep their parameters
        self._resume(self.model if self.dist.distributed else kc.unwrap(self.model))
        self._setup_callbacks()

    def dry_run(self, world_size: int) -> DryRunReport:
        """This run's layout (trainer.parallel and its sizes, activation checkpointing) over `world_size`
        fake ranks on this CPU: the task's model built on the meta device, one micro-batch of rank 0's share
        of the first batch stepped forward and backward; nothing trained or checkpointed. Compile and
        `model_hook` are not applied (a fake group moves no data, so their timings would mean nothing)."""
        cfg, task = self.cfg, self.task
        if self.dist.distributed:
            raise in_one_process()
        seed_everything(self.seed)
        # the fake group's mesh is a CPU one, so is the step, whatever device the real run would use
        self.plan = resolve("cpu", self.precision, mps_fallback=self.mps_fallback)
        self.plan.apply()
        shape = training_mesh(
            cfg.parallel,
            world_size,
            tp=cfg.tp,
            dp_shard=cfg.dp_shard,
            dp_replicate=cfg.dp_replicate,
            batch_size=cfg.batch_size,
        )
        self._setup_data()
        batch = self._first_batch_share(shape.dp_size)

        def step(model: nn.Module) -> torch.Tensor:
            with self.plan.autocast():
                return task.step(model, on_device(task, model, batch, self.plan)).loss

        return dry_run(
            task.build_model,
            shape,
            step=step,
            activation_checkpointing=cfg.activation_checkpointing,
            checkpoint_every=cfg.activation_checkpointing_every,
            param_dtype=None,
        )

    def _setup_mesh(self) -> Any:
        """The mesh `trainer.parallel` asks for (`self.shape`), or None in one process."""
        if not self.dist.distributed:
            return None
        cfg = self.cfg
        self.shape = training_mesh(
            cfg.parallel,
            self.dist.world_size,
            tp=cfg.tp,
            dp_shard=cfg.dp_shard,
            dp_replicate=cfg.dp_replicate,
            batch_size=cfg.batch_size,
        )
        self._say(
            f"parallel: {self.dist.world_size} processes, mesh "
            + " x ".join(f"{n}={getattr(self.shape, n)}" for n in self.shape.names()),
        )
        return build_mesh(self.shape, self.plan.device.type)

    def _parallelize(self, model: nn.Module, mesh: Any) -> nn.Module:
        """The model-transform stage (`core.distributed.parallelize`) with this run's compile and hook,
        whose `probe` runs one training step on a real batch of this rank without consuming RNG."""
        cfg, several = self.cfg, self.dist.distributed
        compile_model = self._compile_transform()
        probe_batch: list[Any] = []  # loaded on the first probe: a run without one reads no batch here

        def probe(m: nn.Module) -> None:
            self.compiled = kc.is_compiled(m)  # the shape hints apply to a compiled model's batches
            if not probe_batch:
                loader = self._loader(self.train_ds, self.train_sampler, self.state.epoch)
                probe_batch.append(next(iter(loader)))
            with self.plan.autocast():
                out = self.task.step(m, self._on_device(m, probe_batch[0]))
            out.loss.backward()

        def compile_step(m: nn.Module) -> nn.Module:
            m = compile_model(m, probe)
            self.compiled = kc.is_compiled(m)
            return m

        def hook_step(m: nn.Module) -> nn.Module:
            m = self.model_hook(m, probe)
            self.compiled = kc.is_compiled(m)
            return m

        # a compiled model gets one batch size (the probe's included), each short last batch topped up rather
        # than compiled for; several ranks always do, so each data-parallel rank gets an equal share
        probed = compile_model is not None or self.model_hook is not None
        if probed or several:
            self.train_sampler.set_fill_last(True)
        # probing must not consume RNG, or a resumed run would diverge from an uninterrupted one
        with torch.random.fork_rng(devices=[self.plan.device] if self.plan.device.type == "cuda" else []):
            model = parallelize(
                model,
                self.shape,
                mesh,
                activation_checkpointing=cfg.activation_checkpointing,
                checkpoint_every=cfg.activation_checkpointing_every,
                compile=None if compile_model is None else compile_step,
                hook=None if self.model_hook is None else hook_step,
                # the plan's precision stays autocast's, as in one process: an FSDP param_dtype of bf16 would
                # hand norms that autocast keeps in fp32 (batch norm) bf16 weights; gradients reduce in fp32
                param_dtype=None,
            )
        if probed or several:
            self.train_sampler.set_fill_last(self.compiled or several)
        model.zero_grad(set_to_none=True)  # the probe's gradients
        return model

    def _compile_transform(self) -> Callable[[nn.Module, Callable[[nn.Module], None]], nn.Module] | None:
        """`compile_cfg` as the stage's compile step `(model, probe) -> model`, or None for eager. A resumed
        run first loads its checkpoint's compile artifacts. Several ranks compile untimed: a timed choice
        (policy=auto) could differ between them."""
        ccfg = self.compile_cfg
        if ccfg is None or ccfg.policy == "off":
            return None
        ckpt_path = checkpoint.resolve(self.resume, self.run_dir) if self.resume else None
        if ckpt_path is not None:  # a resumed run starts from its checkpoint's compile artifacts
            kc.load_artifacts(ckpt_path / "compile_artifacts.bin", ccfg)
        backend = self.plan.compile_backend
        if backend is None:
            self._say(f"compile: eager ({self.plan.reasons.get('compile', 'no backend here')})")
            return None
        if self.dist.distributed and ccfg.policy == "auto":
            self._say(
                f"compile: eager under trainer.parallel={self.cfg.parallel} (policy=auto times compile "
                "against eager per process, and ranks could choose differently: set compile.policy=regional "
                "or full)",
            )
            return None
        # the steps left once resumed: the weights load after the stage, but a step dir's name says its step
        done = re.search(r"\d+$", ckpt_path.name) if ckpt_path is not None else None
        planned = self.total_steps - (int(done[0]) if done else 0)
        timed = not self.dist.distributed

        def compile_model(m: nn.Module, probe: Callable[[nn.Module], None]) -> nn.Module:
            # kc.apply tells its decision (the torchkiln.compile logger) itself
            return kc.apply(m, ccfg, probe=probe if timed else None, backend=backend, planned_steps=planned)

        return compile_model

    def _setup_plan(self) -> None:
        self.plan = resolve(self.device_spec, self.precision, mps_fallback=self.mps_fallback)
        if self.dist.distributed and self.plan.device.type == "cuda" and self.plan.device.index is None:
            # each rank pins the GPU of its local rank
            spec = f"cuda:{self.dist.local_rank}"
            self.plan = resolve(spec, self.precision, mps_fallback=self.mps_fallback)
        self.plan.apply()
        if self.dist.distributed:
            dgroup.start(self.plan.device.type, self.dist)
            if self.plan.device.type == "cpu":
                # ranks on one machine share its cores: the plan's count split among them, unless the
                # launcher set OMP_NUM_THREADS (our launcher does: cores / ranks)
                each = (
                    int(os.environ.get("OMP_NUM_THREADS", "0"))
                    or self.plan.num_threads // self.dist.local_world_size
                )
                torch.set_num_threads(max(1, each))
        self._say(f"device plan: {self.plan.summary()}")
        for w in self.plan.warnings:
            self._warn(w)

    def _setup_throughput(self) -> None:
        """The matmul peak MFU is measured against, in the compute dtype at the plan's threads, before the
        model takes memory (on CUDA its buffers would otherwise count as the run's peak)."""
        dtype = self.plan.autocast_dtype or torch.float32
        self.peak_flops = throughput.matmul_peak(self.plan.device, dtype)
        if self.plan.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.plan.device)

    def _first_batch_share(self, ranks: int) -> Any:
        """One rank's contiguous share of epoch 0's first training batch among `ranks`, collated."""
        task = self.task
        indices = self.train_sampler.batches(0)[0]
        indices = indices[: max(1, len(indices) // ranks)]
        collate = task.train_collate_fn() or task.collate_fn() or default_collate
        return collate([self.train_ds[i] for i in indices])

    def _count_model_flops(self, model: nn.Module) -> throughput.ModelFlops | None:
        """Training FLOPs per throughput unit of the built model, from one forward + backward of a slice of
        the first training batch as large as one rank's share (`core.logging.throughput.measure_model`)."""
        task = self.task

        def step(batch: Any) -> None:
            with self.plan.autocast():
                out = task.step(model, on_device(task, model, batch, self.plan))
            out.loss.backward()

        try:
            return throughput.measure_model(
                model,
                lambda: self._first_batch_share(self.dist.world_size),
                step,
                task.throughput_units,
                task.throughput_unit,
            )
        except Exception as e:  # noqa: BLE001
            # the rates are a report, not the run: a model the flop counter cannot follow trains anyway, and
            # a fault of the step itself surfaces in the first real step right after, as it would without this
            why = (str(e).splitlines() or [""])[0][:120]
            warn(f"model FLOPs not counted ({type(e).__name__}: {why}); no train/tflops or train/mfu")
            return None

    def _build_model(self) -> nn.Module:
        """The task's model on the plan's device; a model too large for memory is a ConfigError (exit 2),
        raised when its first tensor cannot be allocated, before any data is read."""
        try:
            return self.task.build_model().to(self.plan.device)
        except RuntimeError as e:  # torch.OutOfMemoryError (CUDA) and the CPU allocator's error are both
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            m = re.search(r"allocate (\d+) bytes|allocate ([\d.]+ [KMGT]iB)", str(e), re.IGNORECASE)
            asked = (f"{int(m[1]) / 2**30:.1f} GiB" if m[1] else m[2]) if m else "more than there is"
            raise ConfigError(
                f"the model does not fit in {self.plan.device.type} memory (one tensor asked for {asked}); "
                "lower the model's sizes (model.*) or the task's sequence length"
            ) from None

    def _setup_data(self) -> None:
        cfg, task = self.cfg, self.task
        self.train_ds, val_ds = task.build_datasets()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            task.save_artifacts(self.run_dir)
        except OSError as e:  # a full disk: one line naming the file, exit 74, as for any output
            where = Path(e.filename) if e.filename else self.run_dir
            raise write_failure(where, e, fix="nothing was trained yet") from None
        self.train_sampler = task.batch_sampler(self.train_ds, cfg.batch_size, train=True, seed=self.seed)
        if cfg.overfit_batches:  # one epoch: the same few batches over and over, `overfit_steps` steps
            repeat, n = cfg.overfit_steps * cfg.grad_accum, cfg.overfit_batches
            self.train_sampler = LimitedBatchSampler(self.train_sampler, n, repeat_to=repeat)
        elif cfg.limit_train_batches:
            self.train_sampler = LimitedBatchSampler(self.train_sampler, cfg.limit_train_batches)
        self.val_loader = evaluation.eval_loader(task, val_ds, cfg, self.plan, self.seed)
        steps_per_epoch = math.ceil(len(self.train_sampler.batches(0)) / cfg.grad_accum)
        if steps_per_epoch == 0:
            raise ConfigError("the training set is empty; check data= and its paths")
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else steps_per_epoch * cfg.max_epochs
        if cfg.overfit_batches:  # a debug run's own length: task configs set max_steps/max_epochs
            self.total_steps = cfg.overfit_steps

    def _resume(self, model: nn.Module) -> Path | None:
        """Load the checkpoint `resume` names (written by one process or several, at any world size or
        layout) into the model, optimizer, scheduler, scaler, RNG and state; every rank loads its part."""
        if self.dist.is_main:  # a killed writer's leftovers, named by the pids of rank 0's host
            checkpoint.remove_stale_temporaries(self.run_dir / "checkpoints")
        dgroup.barrier()
        ckpt_path = checkpoint.resolve(self.resume, self.run_dir) if self.resume else None
        if ckpt_path is None:
            return None
        self.resumed = True
        st, meta = checkpoint.load_into(ckpt_path, model=model, optimizer=self.opt)
        self.sched.load_state_dict(st["scheduler"])
        self.scaler.load_state_dict(st["scaler"])
        set_rng_state(st["rng"])
        self.state = TrainState.from_checkpoint(st, meta)
        self._callback_states = st.get("callbacks", {})
        where = f"step {st['step']}, epoch {st['epoch']}, batch {st['batch_in_epoch']}"
        self._say(f"resumed from {ckpt_path} ({where})")
        return ckpt_path

    def _setup_callbacks(self) -> None:
        """The loop's own callbacks (checkpoint policy, early stopping, debug aids; on rank 0 alone, which
        reports rows already reduced across ranks: the progress bar and metrics sinks), then the caller's;
        each gets back the state a resumed checkpoint kept for it."""
        cfg = self.cfg
        own: list[Callback] = [
            Checkpoints(ckpt_every=cfg.ckpt_every, keep_last=cfg.keep_last, keep_best=cfg.keep_best),
            EarlyStopping(self.early_stop),
        ]
        if cfg.overfit_batches:
            own.append(OverfitCheck())
        if cfg.profile_steps:  # on every rank, so all stop at one step; rank 0 writes the trace
            own.append(Profiler(self.run_dir / "profile", cfg.profile_steps, write=self.dist.is_main))
        if self.dist.is_main:
            own.insert(0, MetricsLogger())
            if cfg.progress:
                own.insert(0, ProgressBar())
        # loggers write on rank 0 alone; other callbacks run on every rank (their decisions, e.g. to stop,
        # rest on metrics every rank computes alike)
        own += [cb for cb in self.user_callbacks if self.dist.is_main or not isinstance(cb, Logger)]
        # the task's first: metrics they add to an evaluation (an EMA model's) reach the loggers' rows
        task_own = self.task.callbacks()
        self.ema = kema.find(task_own)
        if cfg.ema_decay > 0:
            if self.ema is not None:
                raise ConfigError(
                    f"trainer.ema_decay={cfg.ema_decay} and the task's own EMA (task.ema_decay) are both "
                    "set; set one of them"
                )
            self.ema = kema.EMA(cfg.ema_decay, every=cfg.ema_every, warmup=cfg.ema_warmup)
            task_own.insert(0, self.ema)
        if self.ema is None and (cfg.export == "ema" or self.monitor.startswith(kema.METRIC_PREFIX)):
            key = "trainer.export=ema" if cfg.export == "ema" else f"trainer.monitor={self.monitor}"
            raise ConfigError(
                f"{key} needs an EMA of the weights: set trainer.ema_decay (e.g. 0.999)",
                key=key.partition("=")[0],
                value=key.partition("=")[2] or None,
            )
        self.callbacks = task_own + own
        states = getattr(self, "_callback_states", {})
        for name, cb in self._named_callbacks():
            if name in states:
                cb.load_state_dict(states[name])

    def _named_callbacks(self) -> list[tuple[str, Callback]]:
        """Each callback with a stable name for its checkpointed state (class name, numbered if repeated)."""
        seen: dict[str, int] = {}
        out = []
        for cb in self.callbacks:
            base = type(cb).__name__
            seen[base] = seen.get(base, 0) + 1
            out.append((base if seen[base] == 1 else f"{base}.{seen[base]}", cb))
        return out

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """While training, STOP_SIGNALS ask the loop to checkpoint after the current step and stop."""
        if threading.current_thread() is not threading.main_thread():
            yield  # Python delivers signals to the main thread only: nothing to install here
            return

        def request_stop(signum: int, frame: object) -> None:
            self._stop_signal = signum

        previous = self._outer_handlers = {s: signal.signal(s, request_stop) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    # ---- one epoch ------------------------------------------------------------------------------------
    def _train_epoch(self) -> int:
        """Train from the state's (epoch, batch) to the epoch's end or `total_steps`; the last batch index."""
        cfg, st = self.cfg, self.state
        self.train_sampler.set_epoch(st.epoch, st.batch_in_epoch)
        n = self._epoch_batches = len(self.train_sampler.batches(st.epoch))
        self._reset_window()
        i = st.batch_in_epoch - 1
        group: list[Any] = []
        for i, batch in enumerate(
            self._loader(self.train_ds, self.train_sampler, st.epoch), st.batch_in_epoch
        ):
            group_start = (i // cfg.grad_accum) * cfg.grad_accum
            group.append(batch)
            # the whole group is loaded before its first forward: its loss units are counted up front
            if i + 1 < min(group_start + cfg.grad_accum, n):
                continue
            first = i + 1 - len(group)
            self._accumulate(group, st.epoch, first)
            group = []
            self._optimizer_step((st.epoch, first, i + 1))
            done = st.step >= self.total_steps
            self._next_batch = i + 1
            if cfg.eval_every and st.step % cfg.eval_every == 0 and not done:
                self._evaluate_and_log()
            if not done and i + 1 < n and self._wants_checkpoint(epoch_end=False):
                self._save(next_batch=i + 1)  # (the epoch's end writes its own)
            if self._stop_requested() and not done:
                self._stop(next_batch=i + 1)
            if done or st.stopped:
                break
        self._next_batch = None
        return i

    def _accumulate(self, batches: list[Any], epoch: int, first: int) -> None:
        """Forward and backward each micro-batch of one accumulation group (batches `first`... of `epoch`),
        its mean loss weighted by its share of the group's loss units on all data-parallel ranks
        (`core.loop.accumulation`), so the summed gradient is that of one batch of the group's examples; the
        gradients are reduced across ranks on the last micro-batch only."""
        model = self.model
        units = [self.task.loss_units(b) for b in batches]
        weights = group_weights(units, self.plan.device, dp_size=self.shape.dp_size, tp=self.shape.replicas)
        self._group_finite = True
        for k, (batch, n_units, weight) in enumerate(zip(batches, units, weights, strict=True)):
            with gradient_sync(model, k == len(batches) - 1):
                with self.plan.autocast():
                    out = self.task.step(model, self._on_device(model, batch))
                loss = float(out.loss.detach())
                finite = math.isfinite(loss)
                if self.dist.distributed:  # every rank runs backward (its collectives) or none does
                    finite = not dgroup.any_rank(not finite, self.plan.device)
                if finite:
                    self._backward(out.loss * weight, (epoch, first + k))
                    self._seen += out.count
                    self._throughput_units += self.task.throughput_units(batch)
                    self._units += n_units
                    self._loss_sum += loss * n_units
                    for key, value in out.metrics.items():  # tensors stay on the device until logged
                        total = self._metric_sums.setdefault(key, [0.0, 0])
                        total[0] = (
                            total[0] + (value.detach() if torch.is_tensor(value) else value) * out.count
                        )
                        total[1] += out.count
                else:  # no backward: a NaN/inf gradient would poison the whole accumulated group
                    self._group_finite = False

    def _backward(self, loss: torch.Tensor, where: tuple[int, int]) -> None:
        """Backward of the scaled loss; under `trainer.detect_anomaly`, the op it names as the source of a
        NaN/inf becomes one line with the step and batch (exit 3), not a traceback."""
        try:
            self.scaler.scale(loss).backward()
        except RuntimeError as e:
            if not self.cfg.detect_anomaly or "nan" not in str(e).lower():
                raise
            first = str(e).strip().splitlines()[0]
            op = re.search(r"Function '(\w+)'", first)  # autograd's "Function 'SqrtBackward0' returned nan"
            raise TrainingError(
                f"trainer.detect_anomaly: {first} (step {self.state.step + 1}, epoch {where[0]}, batch "
                f"{where[1]}); the op named produced it: check its inputs, or lower optim.lr",
                key="trainer.detect_anomaly",
                value=op.group(1) if op else first,
            ) from None

    def _optimizer_step(self, batches: tuple[int, int, int]) -> None:
        """Clip, step, schedule and log at an accumulation boundary; `batches` = (epoch, first, end) of the
        group, named if its loss was not finite."""
        cfg, st = self.cfg, self.state
        grad_norm = None
        if cfg.grad_clip > 0 and self._group_finite:
            self.scaler.unscale_(self.opt)
            grad_norm = self.shape.clip_grad_norm(self.model.parameters(), cfg.grad_clip)
            # a GradScaler (fp16) skips inf/NaN gradients itself and lowers its scale; only fp32/bf16 here
            self._group_finite = math.isfinite(grad_norm) or self.scaler.is_enabled()
        if self._group_finite:
            self.scaler.step(self.opt)
            self.scaler.update()
            self._nonfinite_run = 0
        else:
            self._nonfinite(batches)
        self.opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # a skipped first step makes torch warn that the scheduler stepped before the optimizer: intended
            warnings.simplefilter("ignore", UserWarning)
            self.sched.step()
        st.step += 1
        if st.step % cfg.log_every and st.step != self.total_steps:
            self._hook("on_step_end", {})
            return
        seen, units, loss_sum, amount = self._seen, self._units, self._loss_sum, self._throughput_units
        keys = sorted(self._metric_sums)  # the task's own step metrics, weighted by each batch's examples
        metric_sums = [float(self._metric_sums[k][0]) for k in keys] + [self._metric_sums[k][1] for k in keys]
        if self.dist.distributed:  # the window over all data-parallel ranks (a replica's ranks repeat it)
            window = dgroup.all_reduce_sum([seen, units, loss_sum, amount, *metric_sums], self.plan.device)
            seen, units, loss_sum, amount, *metric_sums = (x / self.shape.replicas for x in window)
        seconds = time.perf_counter() - self._t0
        row = {"train/lr": self.sched.get_last_lr()[0], "train/samples_per_s": seen / max(seconds, 1e-9)}
        row.update(
            throughput.row(
                self.model_flops, amount, seconds, devices=self.dist.world_size, peak=self.peak_flops
            )
        )
        row["train/peak_mem_mib"] = throughput.peak_memory_bytes(self.plan.device) / 2**20
        if units:  # a window of skipped (non-finite) steps has no loss to report
            # the mean over the window's loss units (tokens for a language model), as the gradient weighs them
            row["train/loss"] = loss_sum / units
        for k, total, count in zip(keys, metric_sums[: len(keys)], metric_sums[len(keys) :], strict=True):
            if count:
                row[f"train/{k}"] = total / count
        if grad_norm is not None:
            row["train/grad_norm"] = grad_norm
        if self._nonfinite_total:
            row["train/nonfinite_steps"] = float(self._nonfinite_total)
        bad = badsamples.count_since(self._bad_mark)
        if bad:  # skipped under data.on_bad_sample=skip, while building the data and while loading it
            row["data/bad_samples"] = float(bad)
        if self.compiled:
            row.update(kc.compile_metrics())
        self._hook("on_step_end", row)
        self._reset_window()

    def _stop_requested(self) -> bool:
        """A stop signal reached this process, or (several processes) any rank: all stop at one step."""
        if self.dist.distributed:
            return dgroup.any_rank(self._stop_signal is not None, self.plan.device)
        return self._stop_signal is not None

    def _stop(self, next_batch: int) -> None:
        """Checkpoint where the run stands and stop, for a stop signal (a preempting scheduler)."""
        self._save(next_batch=next_batch)
        self._finish_pending_save()
        name = (
            signal.Signals(self._stop_signal).name if self._stop_signal else "a stop signal on another rank"
        )
        path = self.run_dir / "checkpoints" / f"step_{self.state.step:08d}"
        if not (path / "meta.json").is_file():  # trainer.ckpt_on_error=warn and the save failed
            path = checkpoint.resolve("auto", self.run_dir) or "none (the save failed)"
        outer = self._outer_handlers.get(self._stop_signal)
        if callable(outer):  # the handler ours replaced (e.g. a job scheduler's requeue) runs after the save
            outer(self._stop_signal, None)
        raise Preempted(
            f"{name} after step {self.state.step}: checkpoint {path}; resume=auto continues there"
        )

    def _nonfinite(self, batches: tuple[int, int, int]) -> None:
        """Count a skipped step; past the policy's limit, stop with the step, its samples and a checkpoint."""
        self._nonfinite_run += 1
        self._nonfinite_total += 1
        cfg, st = self.cfg, self.state
        if cfg.nonfinite == "skip" and self._nonfinite_run < cfg.max_nonfinite:
            return
        epoch, first, end = batches
        samples = [j for b in self.train_sampler.batches(epoch)[first:end] for j in b]
        shown = ", ".join(map(str, samples[:8])) + (", ..." if len(samples) > 8 else "")
        good = checkpoint.newest_with_finite_weights(self.run_dir / "checkpoints")
        raise TrainingError(
            f"non-finite loss or gradients at step {st.step + 1} (epoch {epoch}, batches {first}-{end - 1}, "
            f"samples {shown}), {self._nonfinite_run} step(s) in a row (trainer.nonfinite={cfg.nonfinite}, "
            f"trainer.max_nonfinite={cfg.max_nonfinite}); newest checkpoint with finite weights: "
            f"{good or 'none'}; lower optim.lr, set trainer.grad_clip, or check these samples",
            key="samples",
            value=shown,
        )

    def _reset_window(self) -> None:
        """Start a logging window: examples seen, loss units seen and their loss sum, the task's step
        metrics (`StepOutput.metrics`, logged as train/NAME: means weighted by examples), its start time."""
        self._seen, self._units, self._loss_sum, self._t0 = 0, 0, 0.0, time.perf_counter()
        self._throughput_units = 0.0
        self._metric_sums: dict[str, list[Any]] = {}  # step metric -> [sum of value x examples, examples]

    # ---- evaluation and checkpoints -------------------------------------------------------------------
    def evaluate(self, model: nn.Module, loader: DataLoader) -> dict[str, float]:
        """The task's metrics over `loader` (`core.loop.evaluation.evaluate`: what `recipes.eval` runs on a
        finished run), keys prefixed with `val/`."""
        return evaluation.evaluate(self.task, model, loader, self.plan, prepare=self._on_device)

    def _evaluate_and_log(self) -> None:
        """Evaluate (once per step), track the best `monitor` value, tell the callbacks."""
        st, key = self.state, self.monitor
        if self._evaluated_at == st.step:
            return
        self._evaluated_at = st.step
        metrics = self.evaluate(self.model, self.val_loader)
        self._hook("on_evaluate", metrics)  # e.g. the EMA model's val/ema_*, which the monitor may name
        if key not in metrics:
            raise ConfigError(
                f"trainer.monitor={key} is not among this task's metrics ({', '.join(sorted(metrics))}); "
                "set trainer.monitor to one of them",
                key="trainer.monitor",
                value=key,
                valid=sorted(metrics),
            )
        if improved(metrics[key], st.best, self.monitor_max):
            st.best, st.best_step = metrics[key], st.step
        if st.best is not None:
            metrics[f"best/{key}"] = st.best
        st.last_eval = metrics
        self._hook("on_eval_end", metrics)

    def _wants_checkpoint(self, epoch_end: bool) -> bool:
        return any(cb.wants_checkpoint(self, epoch_end) for cb in self.callbacks)

    def _checkpoint_failed(self, err: CheckpointWriteError) -> None:
        """trainer.ckpt_on_error: stop the run with the one-line error, or warn and train on."""
        if self.cfg.ckpt_on_error == "stop":
            raise err
        self._warn(f"{err}; training on (trainer.ckpt_on_error=warn)")

    def _finish_pending_save(self) -> None:
        """Wait for a background checkpoint write (trainer.ckpt_async), failing as a blocking one would."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            try:
                path = pending.result()
            except CheckpointWriteError as err:
                self._checkpoint_failed(err)
            else:
                self._saved(path)

    def _save(self, next_batch: int | None = None) -> None:
        """Checkpoint the state; mid-epoch when `next_batch` is given, else at the state's position."""
        self._finish_pending_save()
        st = self.state
        if self._saved_at == st.step:  # this step's checkpoint exists (e.g. written for an improvement)
            return
        next_epoch, next_batch = st.epoch, st.batch_in_epoch if next_batch is None else next_batch
        train_state = {
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(),
            "step": st.step,
            "epoch": next_epoch,
            "batch_in_epoch": next_batch,
            "callbacks": {name: cb.state_dict() for name, cb in self._named_callbacks()},
        }
        evaluated = self._evaluated_at == st.step
        meta = {
            "epoch": next_epoch,
            "metrics": st.last_eval,
            "best": st.best,
            "best_step": st.best_step,
            "stopped": st.stopped,
            # what picks the best checkpoints: this step's value of the monitored metric, if it was evaluated
            "monitor": {"key": self.monitor, "value": st.last_eval.get(self.monitor) if evaluated else None},
            "task": type(self.task).__name__,
        }
        try:
            if self.dist.distributed:
                del train_state["optimizer"]  # sharded with the model's, by torch.distributed.checkpoint
                meta["parallel"] = self.shape.layout()
                path = checkpoint.save_sharded(
                    self.run_dir / "checkpoints",
                    st.step,
                    model=self.model,
                    optimizer=self.opt,
                    train=train_state,
                    meta=meta,
                    # the policy (core.loop.callbacks.Checkpoints) prunes once the save is complete
                    keep_last=0,
                    async_save=self.cfg.ckpt_async,
                )
                if not isinstance(path, Path):  # written in the background; the next save waits for it
                    self._saved_at, self._pending_save = st.step, path
                    return
            else:
                path = checkpoint.save(
                    self.run_dir / "checkpoints",
                    st.step,
                    model=kc.unwrap(self.model).state_dict(),
                    train=train_state,
                    meta=meta,
                    keep_last=0,
                )
        except CheckpointWriteError as err:
            self._checkpoint_failed(err)
            return
        self._saved_at = st.step
        self._saved(path)

    def _saved(self, path: Path) -> None:
        """A checkpoint is complete: its compile artifacts beside it, then the callbacks (pruning)."""
        if self.compiled and self.dist.is_main:  # a resumed run starts warm (ranks compile the same graphs)
            kc.save_artifacts(path / "compile_artifacts.bin", self.compile_cfg)
        self._hook("on_checkpoint", path)

    # ---- data plumbing --------------------------------------------------------------------------------
    def _loader(self, ds: Dataset, sampler: ResumableBatchSampler, epoch: int) -> DataLoader:
        """The training loader of `epoch`: each sample's augmentation seeded, this rank's share of a batch."""
        return task_loader(
            self.task,
            _SeededSamples(ds),
            _SeededBatches(sampler, self.seed, epoch, self._dp_share()),
            self.plan,
            workers=self.cfg.num_workers,
            seed=self.seed,
            epoch=epoch,
            split="train",
            described=ds,
            # the task's training collate (MixUp/CutMix draws), seeded from the batch's samples
            collate_fn=_SeededCollate(self.task.train_collate_fn()),
        )

    def _dp_share(self) -> tuple[int, int]:
        """(this rank's index, count) among the data-parallel ranks; tensor-parallel peers share an index,
        since they hold parts of one model replica and must see the same samples (dp outer, tp inner)."""
        return self.shape.dp_rank(self.dist.rank), self.shape.dp_size

    def _on_device(self, model: nn.Module, batch: Any) -> Any:
        """Move a batch to the device, run the task's device-side preprocessing, then, for a compiled model,
        its shape hints (bucket padding, static and dynamic dims)."""
        batch = on_device(self.task, model, batch, self.plan)
        if self.compiled:
            batch = kc.apply_shape_hints(
                batch, self.task.shape_hints, self.train_sampler, training=model.training
            )
        return batch


class _SeededSamples(Dataset):
    """Runs each sample's random transforms under a seed fixed by (run seed, epoch, index)."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, Any]:
        """(the sample's seed, the sample); `_SeededCollate` takes the seeds off again."""
        idx, seed = key
        # only the CPU generator: augmentation runs on CPU, and CUDA RNG (dropout) must stay untouched
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            return seed, self.ds[idx]


class _SeededCollate:
    """Runs a training collate (MixUp draws its mixing there) under a seed fixed by its batch's first sample
    seed, so a batch's draws depend on (run seed, epoch, its samples) alone: not on which worker collates it
    nor on where a resumed run's loader started."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None) -> None:
        self.collate = collate or default_collate

    def __call__(self, items: list[tuple[int, Any]]) -> Any:
        seeds, samples = zip(*items, strict=True)
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(derive_seed(seeds[0], "collate"))
            return self.collate(list(samples))


class _SeededBatches:
    """Pairs each index from a resumable batch sampler with its per-sample seed; with several data-parallel
    ranks, each takes its contiguous share of every global batch, so the global batches (and a sample's
    seed) are those of a one-process run."""

    def __init__(
        self, sampler: ResumableBatchSampler, seed: int, epoch: int, share: tuple[int, int] = (0, 1)
    ) -> None:
        self.sampler, self.seed, self.epoch, (self.rank, self.ranks) = sampler, seed, epoch, share

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.sampler:
            # a sample's seed is (run seed, epoch, index); a second copy of an index in the same batch
            # (repeated augmentation) adds its copy number, so copies are augmented apart
            copies: dict[int, int] = {}
            seeded = []
            for i in batch:
                k = copies[i] = copies.get(i, -1) + 1
                seeded.append((i, derive_seed(self.seed, "sample", self.epoch, i, *((k,) if k else ()))))
            if self.ranks > 1 and len(seeded) % self.ranks:
                # a batch that does not split evenly (a length bucket's token budget) is topped up from its
                # own start, seeds included: each rank gets an equal share and no sample is dropped
                need = -len(seeded) % self.ranks
                seeded = seeded + (seeded * need)[:need]
            k = len(seeded) // self.ranks
            yield seeded[self.rank * k : (self.rank + 1) * k] if self.ranks > 1 else seeded

    def __len__(self) -> int:
        return len(self.sampler)


def _quiet(message: str) -> None:
    """`say` for ranks other than 0."""
