"""The run's checkpoints as one part of the loop: `save()` (every boundary, the preemption stop, the run's
end), `load()` (resume, from a checkpoint written by one process or several, at any world size or layout)
and `export_weights()` (the run's final weights: the best checkpoint's, the last step's, or the EMA's).

The loop decides *when* (the `Checkpoints` callback's policy, stop signals); this part decides *what* a
checkpoint holds and writes it: weights (sharded by torch.distributed.checkpoint under several processes),
optimizer, scheduler, scaler, every RNG, the loop position and each callback's state. It is handed those
parts (`CheckpointParts`) and the run's position (`TrainState`) by argument, as torchtitan's
CheckpointManager is, and `load()` returns the position it resumed at; it holds no trainer. The data order
needs no part of its own: the loop position (epoch, batch) and the run's seed give it again
(`core.data.seeded`, per-sample seeds).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from core import checkpoint
from core import compile as kc
from core.attention import cpu_bf16
from core.checkpoint.layout import step_dir
from core.distributed import DistEnv
from core.distributed import group as dgroup
from core.errors import CheckpointWriteError
from core.loop import ema as kema
from core.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from core.loop.callbacks import Callback
    from core.loop.config import TrainerConfig


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


@dataclass(frozen=True)
class CheckpointParts:
    """What a checkpoint holds and whom it tells, handed to the `Checkpointer` once the run built them."""

    #: the model as trained (compiled, sharded); one process saves the plain module under compile's wrapper
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    #: every callback by its `core.loop.callbacks.named` name: each one's `state_dict()` is saved
    callbacks: Sequence[tuple[str, Callback]]
    #: the run's EMA of the weights (None: none), which `export_weights` may write
    ema: kema.EMA | None
    dist: DistEnv
    #: the mesh's `MeshShape.layout()`, which a checkpoint of several processes records
    layout: dict[str, int]
    #: meta.json's `task` (the task's class name) and `precision` (what a resumed precision=auto keeps)
    task: str
    precision: str
    #: whether the model is compiled: its compile artifacts (under `compile_cfg`) go beside each checkpoint
    compiled: bool
    compile_cfg: kc.CompileConfig | None
    #: how it reports: a line (rank 0 alone), a warning, and a complete checkpoint (`on_checkpoint`)
    say: Callable[[str], None]
    warn: Callable[[str], None]
    on_saved: Callable[[Path], None]


def resume_point(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint `resume=` names in `run_dir` (None: a fresh run); found before anything is built."""
    return checkpoint.resolve(resume, run_dir) if resume else None


def resumed_steps(path: Path | None) -> int:
    """The step checkpoint `path` was written at (0: a fresh run), from its folder's name."""
    done = re.search(r"\d+$", path.name) if path is not None else None
    return int(done[0]) if done else 0


def find_best(run_dir: Path, maximize: bool) -> Path | None:
    """The complete checkpoint of `run_dir` with the best `monitor` value (None: none recorded one)."""
    found = checkpoint.best_checkpoints(checkpoint.complete_checkpoints(run_dir / "checkpoints"), maximize)
    return found[0] if found else None


class Checkpointer:
    """Saves and loads one run's checkpoints (`run_dir/checkpoints/step_*`), and writes its final weights."""

    def __init__(
        self,
        parts: CheckpointParts,
        cfg: TrainerConfig,
        *,
        run_dir: Path,
        resume: str | None,
        monitor: str,
        monitor_max: bool,
    ) -> None:
        """Serve `parts` under the settings of `cfg` (ckpt_async, ckpt_on_error, export, lora); `resume` is
        resume=, and `monitor` (larger is better when `monitor_max`) picks the best checkpoint."""
        self.parts, self.cfg, self.run_dir, self.resume = parts, cfg, run_dir, resume
        self.monitor, self.monitor_max = monitor, monitor_max
        self.folder = run_dir / "checkpoints"
        #: the adapters alone are saved under trainer.lora: the frozen base comes from model.weights again
        self.trainable_only = cfg.lora.rank > 0
        #: the step whose checkpoint exists (one per step at most: an improvement's and an epoch end's)
        self.saved_at = -1
        #: a background write (trainer.ckpt_async) the next save or the run's end waits for
        self.pending: Any = None

    def load(self) -> TrainState | None:
        """Load the checkpoint `resume=` names into the model, optimizer, scheduler, scaler, RNG and each
        callback, and return the run's position in it (None: a fresh run). Every rank loads its part; a
        killed writer's leftovers are removed first (by rank 0)."""
        p = self.parts
        if p.dist.is_main:  # named by the pids of rank 0's host
            checkpoint.remove_stale_temporaries(self.folder)
        dgroup.barrier()
        path = resume_point(self.resume, self.run_dir)
        if path is None:
            return None
        # several ranks load their shards into the sharded model; one process into the plain module under
        # compile's wrapper, in place, so the compiled graphs keep their parameters
        model = p.model if p.dist.distributed else kc.unwrap(p.model)
        st, meta = checkpoint.load_into(
            path, model=model, optimizer=p.optimizer, trainable_only=self.trainable_only
        )
        p.scheduler.load_state_dict(st["scheduler"])
        p.scaler.load_state_dict(st["scaler"])
        set_rng_state(st["rng"])
        states = st.get("callbacks", {})
        for name, cb in p.callbacks:
            if name in states:
                cb.load_state_dict(states[name])
        p.say(f"resumed from {path} (step {st['step']}, epoch {st['epoch']}, batch {st['batch_in_epoch']})")
        return TrainState.from_checkpoint(st, meta)

    def save(self, state: TrainState, *, evaluated: bool, next_batch: int | None = None) -> None:
        """Checkpoint the run at `state`'s step; mid-epoch when `next_batch` (the batch a resumed run starts
        at) is given, else at the state's position. `evaluated`: this step was evaluated, so its monitored
        value is recorded. A failed write follows trainer.ckpt_on_error."""
        self.finish()
        p = self.parts
        if self.saved_at == state.step:  # this step's checkpoint exists (e.g. written for an improvement)
            return
        train_state = self._train_state(state, state.batch_in_epoch if next_batch is None else next_batch)
        meta = self._meta(state, evaluated)
        try:
            if p.dist.distributed:
                del train_state["optimizer"]  # sharded with the model's, by torch.distributed.checkpoint
                meta["parallel"] = p.layout
                path = checkpoint.save_sharded(
                    self.folder,
                    state.step,
                    model=p.model,
                    optimizer=p.optimizer,
                    train=train_state,
                    meta=meta,
                    keep_last=0,  # the policy (core.loop.callbacks.Checkpoints) prunes once it is complete
                    async_save=self.cfg.ckpt_async,
                    trainable_only=self.trainable_only,
                )
                if not isinstance(path, Path):  # written in the background; the next save waits for it
                    self.saved_at, self.pending = state.step, path
                    return
            else:
                model = kc.unwrap(p.model).state_dict()
                if self.trainable_only:
                    model = checkpoint.trainable_state(kc.unwrap(p.model), model)
                path = checkpoint.save(
                    self.folder, state.step, model=model, train=train_state, meta=meta, keep_last=0
                )
        except CheckpointWriteError as err:
            self._failed(err)
            return
        self.saved_at = state.step
        self._complete(path)

    def finish(self) -> None:
        """Wait for a background checkpoint write (trainer.ckpt_async), failing as a blocking one would."""
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                path = pending.result()
            except CheckpointWriteError as err:
                self._failed(err)
            else:
                self._complete(path)

    def written(self, step: int) -> Path | None:
        """The complete checkpoint of `step`, else (trainer.ckpt_on_error=warn, and its save failed) the
        newest (None: none was written)."""
        path = step_dir(self.folder, step)
        return path if (path / "meta.json").is_file() else self.newest()

    def newest(self) -> Path | None:
        """The newest complete checkpoint of the run (None: none was written)."""
        return checkpoint.resolve("auto", self.run_dir)

    def best(self) -> Path | None:
        """The complete checkpoint with the best `monitor` value (None: none recorded one)."""
        return find_best(self.run_dir, self.monitor_max)

    def export_weights(self, path: Path) -> Path | None:
        """Write the run's final weights to `path` (safetensors): the best checkpoint's
        (`trainer.export=best`, by `trainer.monitor`) or the last step's (`last`, or no checkpoint recorded a
        monitored value); the EMA's for `export=ema`, and a best checkpoint's EMA under a `val/ema_*`
        monitor. Returns the checkpoint exported, None for the last step's. Several processes: every rank
        calls this (the shards are gathered), rank 0 writes."""
        p, export = self.parts, self.cfg.export
        best = self.best() if export == "best" else None
        if export == "ema" or (best is not None and self.monitor.startswith(kema.METRIC_PREFIX)):
            state = kema.averaged_state(p.ema, p.model, p.dist, best)  # several processes: a collective
            if p.dist.is_main:
                checkpoint.write_safetensors(state, path)
            return best
        if best is not None and p.dist.distributed and self.trainable_only:
            # its shards hold the adapters alone; the frozen base is the live model's (it never trains)
            state = checkpoint.full_model_state(p.model)  # a collective: every rank gives its shards
            if p.dist.is_main:
                checkpoint.write_safetensors({**state, **checkpoint.load(best)[0]}, path)
            return best
        if best is not None:
            if p.dist.is_main:  # the checkpoint on disk (one file, or the shards read whole)
                weights = checkpoint.load(best)[0]
                if p.dist.distributed:
                    checkpoint.write_safetensors(weights, path)
                else:  # through the model, so tied weights are found and stored once
                    model = kc.unwrap(p.model)
                    checkpoint.load_model_state(model, weights, best)
                    checkpoint.save_model_weights(model, path)
            return best
        if not p.dist.distributed:
            checkpoint.save_model_weights(kc.unwrap(p.model), path)
            return None
        state = checkpoint.full_model_state(p.model)  # a collective: every rank gives its shards
        if p.dist.is_main:
            checkpoint.write_safetensors(state, path)
        return None

    def _train_state(self, state: TrainState, next_batch: int) -> dict[str, Any]:
        """What resuming needs besides the weights: optimizer, scheduler, scaler, RNG, position, callbacks."""
        p = self.parts
        return {
            "optimizer": p.optimizer.state_dict(),
            "scheduler": p.scheduler.state_dict(),
            "scaler": p.scaler.state_dict(),
            "rng": rng_state(),
            "step": state.step,
            "epoch": state.epoch,
            "batch_in_epoch": next_batch,
            "callbacks": {name: cb.state_dict() for name, cb in p.callbacks},
        }

    def _meta(self, state: TrainState, evaluated: bool) -> dict[str, Any]:
        """The checkpoint's meta.json: its metrics, the best so far and what picks the best checkpoints."""
        return {
            "epoch": state.epoch,
            "metrics": state.last_eval,
            "best": state.best,
            "best_step": state.best_step,
            "stopped": state.stopped,
            # what picks the best checkpoints: this step's value of the monitored metric, if it was evaluated
            "monitor": {
                "key": self.monitor,
                "value": state.last_eval.get(self.monitor) if evaluated else None,
            },
            "task": self.parts.task,
            # a resumed run with precision=auto keeps it rather than measuring its model again
            "precision": self.parts.precision,
            # and core.attention's timed choices (short bf16 path or SDPA), rather than timing them again
            "attention": cpu_bf16.decisions(),
        }

    def _failed(self, err: CheckpointWriteError) -> None:
        """trainer.ckpt_on_error: stop the run with the one-line error, or warn and train on."""
        if self.cfg.ckpt_on_error == "stop":
            raise err
        self.parts.warn(f"{err}; training on (trainer.ckpt_on_error=warn)")

    def _complete(self, path: Path) -> None:
        """A checkpoint is complete: its compile artifacts beside it, then the callbacks (pruning)."""
        p = self.parts
        if p.compiled and p.dist.is_main:  # a resumed run starts warm (ranks compile the same graphs)
            kc.save_artifacts(path / "compile_artifacts.bin", p.compile_cfg)
        p.on_saved(path)
