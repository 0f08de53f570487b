"""The one training loop every torchkiln task runs through.

`fit()` reads top to bottom: `_setup()` builds the run in a fixed order (device plan -> mesh -> model ->
data -> model transforms -> optimizer -> callbacks -> resume), then `_train_epoch()` runs accumulate -> clip
-> step until `max_steps`/`max_epochs`, with evaluation and atomic checkpoints at step or epoch boundaries.
The parts it builds are handed on by argument: the data comes from `core.loop.train_data`, the model's
policies from `core.loop.model_policies`, and the `Checkpointer` gets its `CheckpointParts` and returns the
resumed `TrainState`, which the trainer keeps.

Model transforms are one stage, `core.distributed.parallelize`, the same in one process and in many (where
the mesh is `MeshShape()` and tensor/data parallel do nothing): tensor parallel -> activation checkpointing
-> compile (`core.compile.apply`, when `compile_cfg` asks for it) -> the caller's `model_hook` -> FSDP/DDP
(torchtitan's order: sharding wraps what compile produced). Compile and the hook get a `probe` that runs one
training step on a real batch without consuming RNG, so a resumed run stays bit-exact. Every number the loop
derives from the mesh (data-parallel rank, ranks repeating one loss, the checkpoint's layout, clipping) is
`MeshShape`'s.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from core import compile as kc
from core.attention import cpu_bf16
from core.checkpoint.layout import read_meta
from core.data import bad_samples as badsamples
from core.data.loaders import on_device
from core.data.workers import report_failures
from core.device import DevicePlan, resolve
from core.distributed import MeshShape, build_mesh, dist_env
from core.distributed import group as dgroup
from core.distributed.dry_run import DryRunReport, dry_run, in_one_process
from core.distributed.parallelize import gradient_sync, optimizer_impl
from core.logging.messages import say, warn
from core.logging.processor import MetricsProcessor
from core.logging.progress import ProgressBar
from core.logging.sinks import Logger, MetricsLogger
from core.loop import ema as kema
from core.loop import evaluation, model_policies, train_data
from core.loop.accumulation import group_weights
from core.loop.callbacks import (
    Callback,
    Checkpoints,
    EarlyStopConfig,
    EarlyStopping,
    benchmark_evals,
    call_all,
    close_all,
    monitor_direction,
    named,
)
from core.loop.checkpointer import (
    Checkpointer,
    CheckpointParts,
    TrainState,
    find_best,
    resume_point,
)
from core.loop.config import TrainerConfig, check_config
from core.loop.debug import OverfitCheck, Profiler, anomaly_detection, anomaly_error
from core.loop.model_policies import ModelHook
from core.loop.nonfinite import NonfiniteSteps
from core.loop.preemption import StopSignals
from core.loop.task import Task
from core.nn.lora import reset_adapters
from core.optim import OptimConfig, build_optimizer, build_scheduler
from core.rng import seed_everything


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
        self.early_stop = early_stop or EarlyStopConfig()
        check_config(cfg, optim, self.early_stop)
        self.monitor = cfg.monitor or task.primary_metric
        self.monitor_max = monitor_direction(
            self.monitor, cfg.monitor_mode, headline=task.primary_metric, headline_max=task.maximize
        )
        self.task, self.cfg, self.optim_cfg, self.run_dir = task, cfg, optim, Path(run_dir)
        self.device_spec, self.precision, self.seed, self.resume = device, precision, seed, resume
        self.mps_fallback, self.compile_cfg, self.model_hook = mps_fallback, compile_cfg, model_hook
        self.user_callbacks, self.hparams = list(callbacks), hparams
        self.dist = dist_env()  # this process's place in a torchrun launch (rank 0 of 1 without one)
        self._say, self._warn = (say, warn) if self.dist.is_main else (_quiet, _quiet)  # only rank 0 talks
        self.state, self.shape, self.compiled, self.resumed = TrainState(), MeshShape(), False, False
        #: the run's parts, each owning its concern: the logging window, stops, non-finite steps
        self.metrics = MetricsProcessor(task)
        self.stop_signals, self.nonfinite = StopSignals(), NonfiniteSteps(cfg)
        # built by fit()'s _setup, in its order: plan -> mesh -> model -> data -> transforms -> optimizer
        self.plan: DevicePlan | None = None
        self.model: nn.Module | None = None
        self._mesh: Any = None  # the DeviceMesh of several ranks (None in one process)
        self.ema: kema.EMA | None = None  # trainer.ema_decay's or the task's own EMA; None: no EMA
        self.train_ds = self.train_sampler = self.val_loader = None
        self.opt = self.sched = self.scaler = None  # the optimizer, its schedule, AMP's gradient scaler
        self.callbacks: list[Callback] = []
        self.checkpointer: Checkpointer | None = None  # checkpoints and final weights, handed the parts built
        self.total_steps = self._epoch_batches = 0  # (the batches in the epoch being trained)
        self._bad_mark = 0  # the bad-sample count when this run started building its data
        self._group_finite = True  # the accumulation group being stepped had only finite losses
        self._evaluated_at = -1  # one evaluation per step at most

    # ---- the run, top to bottom -----------------------------------------------------------------------
    @report_failures()  # a dead DataLoader worker: one line naming its sample, wherever torch raises it
    def fit(self) -> dict[str, float]:
        """Train to `max_epochs`/`max_steps`; return the final metrics (last evaluation and best)."""
        self.callbacks = []
        try:
            self._setup()
            st, cfg = self.state, self.cfg
            self.model.train()
            t_start = time.perf_counter()
            self._hook("on_fit_start")
            if cfg.eval_on_start and st.step == 0:
                self._evaluate_on_start()
            with self.stop_signals.installed(), anomaly_detection(cfg.detect_anomaly):
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
            self.checkpointer.finish()
            wall = time.perf_counter() - t_start
            out = {**st.last_eval, "step": float(st.step), "epoch": float(st.epoch), "train/wall_s": wall}
            self.nonfinite.check_end(self.model, out, self.monitor, self.optim_cfg.lr, self.run_dir)
            self._hook("on_fit_end", out)
        finally:
            callbacks, self.callbacks = self.callbacks, []
            close_all(callbacks)
        return out

    def request_stop(self, reason: str) -> None:
        """End the run after the current step, with its checkpoint (a callback's early stop); `reason` is
        printed and recorded, so a resumed run stops too."""
        if not self.state.stopped:
            self.state.stopped = reason
            self._say(reason)

    def best_checkpoint(self) -> Path | None:
        """The complete checkpoint of this run with the best `monitor` value (None: none recorded one)."""
        return find_best(self.run_dir, self.monitor_max)

    def _hook(self, name: str, *args: Any) -> None:
        call_all(self.callbacks, name, self, *args)

    def _setup(self) -> None:
        """Plan -> mesh -> model -> data -> model transforms -> optimizer -> callbacks -> resume. The
        transforms (`core.distributed.parallelize`, one stage for one process and for many) come before the
        optimizer, which holds the parameters sharding made; the resumed weights and moments load into
        those in place (a compiled model keeps its graphs), each callback's state into the callback."""
        seed_everything(self.seed)
        self._bad_mark = badsamples.mark()  # the data this run builds skips bad samples from here on
        self._setup_plan()
        mesh = self._mesh = self._setup_mesh()
        deferred = self._loads_after_sharding()
        if deferred:
            with torch.device("meta"):
                model = self.task.build_model()
        else:
            model = self.plan.place(self.task.build_model)
        self._setup_data()
        self._measure(model, built_whole=not deferred)
        self.model = self._parallelize(model, mesh)
        if deferred:
            self._load_after_sharding()
        impl = optimizer_impl(self.shape, self.plan.optimizer_impl, self.optim_cfg.name)
        self.opt = build_optimizer(self.model, self.optim_cfg, impl)
        self.sched = build_scheduler(self.opt, self.optim_cfg, self.total_steps)
        self.scaler = self.plan.make_grad_scaler()
        self._setup_callbacks()
        self.checkpointer = self._build_checkpointer()
        loaded = self.checkpointer.load()  # into the parts; the position a resumed run continues at
        self.resumed = loaded is not None
        if loaded is not None:
            self.state = loaded

    def _measure(self, model: nn.Module, built_whole: bool) -> None:
        """What the run decides on its model before the transforms: a resumed checkpoint's attention paths
        adopted (before anything times them), then, for a model `built_whole` (not on the meta device),
        precision=auto's pick; the device's peak FLOPs and the model's own for the throughput metrics."""
        resumed = resume_point(self.resume, self.run_dir)
        meta = read_meta(resumed) if resumed is not None else None
        if meta is not None:
            cpu_bf16.adopt(meta.get("attention"))
        if built_whole:
            self.plan = model_policies.choose_precision(
                self.plan,
                self.precision,
                model,
                self.task,
                batch=lambda k: self._first_batch_share(1, k),
                dist=self.dist,
                resumed=resumed,
                meta=meta,
                say=self._say,
            )
        self.metrics.measure_peak(self.plan.device, self.plan.autocast_dtype or torch.float32)
        if built_whole:
            self._count_model_flops(model)

    def _build_checkpointer(self) -> Checkpointer:
        """The run's checkpoints, handed the parts they hold and whom they tell once `_setup` built them."""
        parts = CheckpointParts(
            model=self.model,
            optimizer=self.opt,
            scheduler=self.sched,
            scaler=self.scaler,
            callbacks=named(self.callbacks),
            ema=self.ema,
            dist=self.dist,
            layout=self.shape.layout(),
            task=type(self.task).__name__,
            precision=self.plan.precision,
            compiled=self.compiled,
            compile_cfg=self.compile_cfg,
            say=self._say,
            warn=self._warn,
            on_saved=lambda path: self._hook("on_checkpoint", path),
        )
        return Checkpointer(
            parts,
            self.cfg,
            run_dir=self.run_dir,
            resume=self.resume,
            monitor=self.monitor,
            monitor_max=self.monitor_max,
        )

    def _save(self, next_batch: int | None = None) -> None:
        """Checkpoint the run where its state stands (`Checkpointer.save`)."""
        evaluated = self._evaluated_at == self.state.step
        self.checkpointer.save(self.state, evaluated=evaluated, next_batch=next_batch)

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
        shape = model_policies.mesh_shape(self.cfg, world_size)
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
            lora=cfg.lora,
        )

    def _loads_after_sharding(self) -> bool:
        """Whether this run builds its model on the meta device and loads it shard by shard: several ranks
        that shard the parameters (FSDP or TP) and a task that can (`Task.loads_after_sharding`). A model
        hook's probe steps before the load, so with one the model is built whole."""
        sharded = self.shape.dp_shard > 1 or self.shape.ep > 1 or self.shape.tp > 1
        return (
            self.dist.distributed and sharded and self.model_hook is None and self.task.loads_after_sharding()
        )

    def _load_after_sharding(self) -> None:
        """The sharded model's storage on the device, each rank's shards of the weights read in, the
        adapters (trainer.lora) initialised; then the model FLOPs counted on it."""
        model = self.model
        self.task.load_after_sharding(model, self.plan.device)
        reset_adapters(model)  # built on meta: their init wrote nothing
        ways = self.shape.world_size // self.shape.dp_replicate
        self._say(f"model: built on the meta device, {ways}-way sharded, each rank read its own shards")
        # compiled code would compile under the flop counter: count the same ops eagerly
        with kc.run_eagerly():
            self._count_model_flops(model)
        flops = self.metrics.model_flops
        if self.shape.tp > 1:
            # a TP rank computes its heads' and columns' share: the model's FLOPs are the TP group's sum.
            # Every rank takes part, counted or not (a rank skipping the collective would hang the others)
            mine = [0.0, 1.0] if flops is None else [flops.per_unit, 0.0]
            total = torch.tensor(mine, dtype=torch.float64, device=self.plan.device)
            torch.distributed.all_reduce(total, group=self._mesh["tp"].get_group())
            per_unit, missing = total.tolist()
            if flops is not None:
                self.metrics.model_flops = None if missing else dataclasses.replace(flops, per_unit=per_unit)

    def _setup_mesh(self) -> Any:
        """The mesh `trainer.parallel` asks for (`self.shape`), or None in one process."""
        if not self.dist.distributed:
            return None
        self.shape = model_policies.mesh_shape(self.cfg, self.dist.world_size)
        self._say(
            f"parallel: {self.dist.world_size} processes, mesh "
            + " x ".join(f"{n}={getattr(self.shape, n)}" for n in self.shape.names()),
        )
        return build_mesh(self.shape, self.plan.device.type)

    def _parallelize(self, model: nn.Module, mesh: Any) -> nn.Module:
        """The model-transform stage (`core.loop.model_policies.transform`) with this run's compile and hook,
        whose `probe` runs one training step on a real batch of this rank."""
        compile_model = model_policies.compile_step(
            self.compile_cfg,
            self.plan,
            parallel=self.cfg.parallel,
            distributed=self.dist.distributed,
            resumed=resume_point(self.resume, self.run_dir),
            total_steps=self.total_steps,
            say=self._say,
        )
        probe_batch: list[Any] = []  # loaded on the first probe: a run without one reads no batch here

        def probe(m: nn.Module) -> None:
            self.compiled = kc.is_compiled(m)  # the shape hints apply to a compiled model's batches
            if not probe_batch:
                probe_batch.append(next(iter(self._loader(self.state.epoch))))
            with self.plan.autocast():
                out = self.task.step(m, self._on_device(m, probe_batch[0]))
            out.loss.backward()

        model, self.compiled = model_policies.transform(
            model,
            self.shape,
            mesh,
            self.cfg,
            compile_model=compile_model,
            hook=self.model_hook,
            probe=probe,
            sampler=self.train_sampler,
            device=self.plan.device,
            distributed=self.dist.distributed,
        )
        return model

    def _setup_plan(self) -> None:
        self.plan = dgroup.start_with_plan(self.device_spec, self.precision, self.mps_fallback, self.dist)
        self._say(f"device plan: {self.plan.summary()}")
        for w in self.plan.warnings:
            self._warn(w)

    def _first_batch_share(self, ranks: int, index: int = 0) -> Any:
        """One rank's share among `ranks` of epoch 0's batch `index` (`core.loop.train_data.batch_share`)."""
        return train_data.batch_share(self.task, self.train_ds, self.train_sampler, ranks, index)

    def _count_model_flops(self, model: nn.Module) -> None:
        """The metrics' model FLOPs, from one forward + backward of one rank's share of the first batch."""
        task = self.task

        def step(batch: Any) -> None:
            with self.plan.autocast():
                out = task.step(model, on_device(task, model, batch, self.plan))
            out.loss.backward()

        self.metrics.count_model_flops(model, lambda: self._first_batch_share(self.dist.world_size), step)

    def _setup_data(self) -> None:
        """The task's data, batch order and run length (`core.loop.train_data.build`)."""
        built = train_data.build(self.task, self.cfg, self.plan, self.seed, self.run_dir)
        self.train_ds, self.train_sampler, self.val_loader, self.total_steps = built

    def _setup_callbacks(self) -> None:
        """The loop's own callbacks (checkpoint policy, early stopping, debug aids; on rank 0 alone, which
        reports rows already reduced across ranks: the progress bar and metrics sinks), then the caller's;
        a resumed checkpoint gives each its state back (`Checkpointer.load`)."""
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
        task_own = self.task.callbacks() + benchmark_evals(self.task, cfg, self.dist.world_size)
        self.ema = kema.for_run(task_own, cfg, self.monitor)  # the task's own, or trainer.ema_decay's
        self.callbacks = task_own + own

    # ---- one epoch ------------------------------------------------------------------------------------
    def _train_epoch(self) -> int:
        """Train from the state's (epoch, batch) to the epoch's end or `total_steps`; the last batch index."""
        cfg, st = self.cfg, self.state
        self.train_sampler.set_epoch(st.epoch, st.batch_in_epoch)
        n = self._epoch_batches = len(self.train_sampler.batches(st.epoch))
        self.metrics.reset()
        i = st.batch_in_epoch - 1
        group: list[Any] = []
        for i, batch in enumerate(self._loader(st.epoch), st.batch_in_epoch):
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
            if cfg.eval_every and st.step % cfg.eval_every == 0 and not done:
                self._evaluate_and_log()
            if not done and i + 1 < n and self._wants_checkpoint(epoch_end=False):
                self._save(next_batch=i + 1)  # (the epoch's end writes its own)
            if self.stop_signals.requested(self.dist, self.plan.device) and not done:
                self._stop(next_batch=i + 1)
            if done or st.stopped:
                break
        return i

    def _accumulate(self, batches: list[Any], epoch: int, first: int) -> None:
        """Forward and backward each micro-batch of one accumulation group (batches `first`... of `epoch`),
        its mean loss weighted by its share of the group's loss units on all data-parallel ranks
        (`core.loop.accumulation`), so the summed gradient is that of one batch of the group's examples; the
        gradients are reduced across ranks on the last micro-batch only."""
        model = self.model
        with self.plan.autocast():  # (what it runs, a sampler, runs as the steps would)
            self.task.prepare_group(model, batches)
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
                    self.metrics.add(out, batch, loss, n_units)
                else:  # no backward: a NaN/inf gradient would poison the whole accumulated group
                    self._group_finite = False

    def _backward(self, loss: torch.Tensor, where: tuple[int, int]) -> None:
        """Backward of the scaled loss; under `trainer.detect_anomaly`, the op it names as the source of a
        NaN/inf becomes one line with the step and batch (exit 3), not a traceback."""
        try:
            self.scaler.scale(loss).backward()
        except RuntimeError as e:
            error = anomaly_error(e, self.state.step + 1, where) if self.cfg.detect_anomaly else None
            if error is None:
                raise
            raise error from None

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
            self.nonfinite.finite()
        else:
            self.nonfinite.skipped(st.step + 1, batches, self.train_sampler, self.run_dir)
        self.opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # a skipped first step makes torch warn that the scheduler stepped before the optimizer: intended
            warnings.simplefilter("ignore", UserWarning)
            self.sched.step()
        st.step += 1
        if st.step % cfg.log_every and st.step != self.total_steps:
            self._hook("on_step_end", {})
            return
        row = {"train/lr": self.sched.get_last_lr()[0]}
        row.update(self.metrics.row(self.shape, self.plan.device, self.dist))
        if grad_norm is not None:
            row["train/grad_norm"] = grad_norm
        if self.nonfinite.total:
            row["train/nonfinite_steps"] = float(self.nonfinite.total)
        bad = badsamples.count_since(self._bad_mark)
        if bad:  # skipped under data.on_bad_sample=skip, while building the data and while loading it
            row["data/bad_samples"] = float(bad)
        if self.compiled:
            row.update(kc.compile_metrics())
        self._hook("on_step_end", row)
        self.metrics.reset()

    def _stop(self, next_batch: int) -> None:
        """Checkpoint where the run stands and stop, for a stop signal (a preempting scheduler)."""
        self._save(next_batch=next_batch)
        self.checkpointer.finish()
        path = self.checkpointer.written(self.state.step) or "none (the save failed)"
        raise self.stop_signals.stopped(self.state.step, path)

    # ---- evaluation and checkpoints -------------------------------------------------------------------
    def evaluate(self, model: nn.Module, loader: DataLoader) -> dict[str, float]:
        """The task's metrics over `loader` (`core.loop.evaluation.evaluate`: what `recipes.eval` runs on a
        finished run), keys prefixed with `val/`."""
        return evaluation.evaluate(self.task, model, loader, self.plan, prepare=self._on_device)

    def _evaluate_and_log(self) -> None:
        """Evaluate (once per step), track the best `monitor` value, tell the callbacks."""
        st = self.state
        if self._evaluated_at == st.step:
            return
        self._evaluated_at = st.step
        metrics = self.evaluate(self.model, self.val_loader)
        self._hook("on_evaluate", metrics)  # e.g. the EMA model's val/ema_*, which the monitor may name
        evaluation.track_best(st, metrics, self.monitor, self.monitor_max)
        self._hook("on_eval_end", metrics)

    def _evaluate_on_start(self) -> None:
        """trainer.eval_on_start: the model as built and loaded, evaluated and logged at step 0 (the
        loggers alone see it: it is no candidate for the best checkpoint, nor an early stop's evaluation)."""
        metrics = self.evaluate(self.model, self.val_loader)
        for cb in self.callbacks:
            if isinstance(cb, Logger):
                cb.log(0, metrics, epoch=0)

    def _wants_checkpoint(self, epoch_end: bool) -> bool:
        return any(cb.wants_checkpoint(self, epoch_end) for cb in self.callbacks)

    # ---- data plumbing --------------------------------------------------------------------------------
    def _loader(self, epoch: int) -> DataLoader:
        """The training loader of `epoch` (`core.loop.train_data.train_loader`) for this rank's share;
        tensor-parallel peers share an index, since they hold parts of one model replica and must see the
        same samples (dp outer, tp inner)."""
        share = self.shape.dp_rank(self.dist.rank), self.shape.dp_size
        return train_data.train_loader(
            self.task,
            self.train_ds,
            self.train_sampler,
            self.plan,
            seed=self.seed,
            epoch=epoch,
            share=share,
            workers=self.cfg.num_workers,
        )

    def _on_device(self, model: nn.Module, batch: Any) -> Any:
        """Move a batch to the device, run the task's device-side preprocessing, then, for a compiled model,
        its shape hints (bucket padding, static and dynamic dims)."""
        batch = on_device(self.task, model, batch, self.plan)
        if self.compiled:
            batch = kc.apply_shape_hints(
                batch, self.task.shape_hints, self.train_sampler, training=model.training
            )
        return batch


def _quiet(message: str) -> None:
    """`say` for ranks other than 0."""
