"""The run's checkpoints as one part of the loop: `save()` (every boundary, the preemption stop, the run's
end), `load()` (resume, from a checkpoint written by one process or several, at any world size or layout)
and `export_weights()` (the run's final weights: the best checkpoint's, the last step's, or the EMA's).

The loop decides *when* (the `Checkpoints` callback's policy, stop signals); this part decides *what* a
checkpoint holds and writes it: weights (sharded by torch.distributed.checkpoint under several processes),
optimizer, scheduler, scaler, every RNG, the loop position and each callback's state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core import checkpoint
from core import compile as kc
from core.attention import cpu_bf16
from core.distributed import group as dgroup
from core.errors import CheckpointWriteError
from core.loop import ema as kema
from core.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from core.loop.trainer import Trainer


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


class Checkpointer:
    """Saves and loads one trainer's run (`run_dir/checkpoints/step_*`), and writes its final weights."""

    def __init__(self, trainer: Trainer) -> None:
        """Serve `trainer`; its model, optimizer, scheduler and scaler exist once its `_setup` built them."""
        self.trainer = trainer
        self.folder = trainer.run_dir / "checkpoints"
        #: the step whose checkpoint exists (one per step at most: an improvement's and an epoch end's)
        self.saved_at = -1
        #: a background write (trainer.ckpt_async) the next save or the run's end waits for
        self.pending: Any = None
        #: each callback's state as the resumed checkpoint kept it, by `Trainer._named_callbacks` name
        self.callback_states: dict[str, Any] = {}

    def resume_path(self) -> Path | None:
        """The checkpoint `resume=` names (None: a fresh run); found before anything is built."""
        t = self.trainer
        return checkpoint.resolve(t.resume, t.run_dir) if t.resume else None

    def resumed_steps(self) -> int:
        """The step the checkpoint to resume from was written at (0: a fresh run), from its folder's name."""
        path = self.resume_path()
        done = re.search(r"\d+$", path.name) if path is not None else None
        return int(done[0]) if done else 0

    def load(self) -> Path | None:
        """Load the checkpoint `resume=` names into the model, optimizer, scheduler, scaler, RNG and state;
        every rank loads its part. A killed writer's leftovers are removed first (by rank 0)."""
        t = self.trainer
        if t.dist.is_main:  # named by the pids of rank 0's host
            checkpoint.remove_stale_temporaries(self.folder)
        dgroup.barrier()
        path = self.resume_path()
        if path is None:
            return None
        # several ranks load their shards into the sharded model; one process into the plain module under
        # compile's wrapper, in place, so the compiled graphs keep their parameters
        model = t.model if t.dist.distributed else kc.unwrap(t.model)
        st, meta = checkpoint.load_into(
            path, model=model, optimizer=t.opt, trainable_only=t.cfg.lora.rank > 0
        )
        t.sched.load_state_dict(st["scheduler"])
        t.scaler.load_state_dict(st["scaler"])
        set_rng_state(st["rng"])
        t.state = TrainState.from_checkpoint(st, meta)
        self.callback_states = st.get("callbacks", {})
        where = f"step {st['step']}, epoch {st['epoch']}, batch {st['batch_in_epoch']}"
        t._say(f"resumed from {path} ({where})")
        return path

    def save(self, next_batch: int | None = None) -> None:
        """Checkpoint the run at its state's step; mid-epoch when `next_batch` (the batch a resumed run
        starts at) is given, else at the state's position. A failed write follows trainer.ckpt_on_error."""
        self.finish()
        t, st = self.trainer, self.trainer.state
        if self.saved_at == st.step:  # this step's checkpoint exists (e.g. written for an improvement)
            return
        train_state = self._train_state(st.batch_in_epoch if next_batch is None else next_batch)
        meta = self._meta()
        try:
            if t.dist.distributed:
                del train_state["optimizer"]  # sharded with the model's, by torch.distributed.checkpoint
                meta["parallel"] = t.shape.layout()
                path = checkpoint.save_sharded(
                    self.folder,
                    st.step,
                    model=t.model,
                    optimizer=t.opt,
                    train=train_state,
                    meta=meta,
                    keep_last=0,  # the policy (core.loop.callbacks.Checkpoints) prunes once it is complete
                    async_save=t.cfg.ckpt_async,
                    trainable_only=t.cfg.lora.rank > 0,  # the frozen base comes from model.weights again
                )
                if not isinstance(path, Path):  # written in the background; the next save waits for it
                    self.saved_at, self.pending = st.step, path
                    return
            else:
                model = kc.unwrap(t.model).state_dict()
                if t.cfg.lora.rank > 0:  # the frozen base comes from model.weights again on resume
                    model = checkpoint.trainable_state(kc.unwrap(t.model), model)
                path = checkpoint.save(
                    self.folder, st.step, model=model, train=train_state, meta=meta, keep_last=0
                )
        except CheckpointWriteError as err:
            self._failed(err)
            return
        self.saved_at = st.step
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

    def newest(self) -> Path | None:
        """The newest complete checkpoint of the run (None: none was written)."""
        return checkpoint.resolve("auto", self.trainer.run_dir)

    def best(self) -> Path | None:
        """The complete checkpoint with the best `monitor` value (None: none recorded one)."""
        found = checkpoint.best_checkpoints(
            checkpoint.complete_checkpoints(self.folder), self.trainer.monitor_max
        )
        return found[0] if found else None

    def export_weights(self, path: Path) -> Path | None:
        """Write the run's final weights to `path` (safetensors): the best checkpoint's
        (`trainer.export=best`, by `trainer.monitor`) or the last step's (`last`, or no checkpoint recorded a
        monitored value); the EMA's for `export=ema`, and a best checkpoint's EMA under a `val/ema_*`
        monitor. Returns the checkpoint exported, None for the last step's. Several processes: every rank
        calls this (the shards are gathered), rank 0 writes."""
        t = self.trainer
        best = self.best() if t.cfg.export == "best" else None
        if t.cfg.export == "ema" or (best is not None and t.monitor.startswith(kema.METRIC_PREFIX)):
            state = kema.averaged_state(t, best)  # several processes: a collective
            if t.dist.is_main:
                checkpoint.write_safetensors(state, path)
            return best
        if best is not None and t.dist.distributed and t.cfg.lora.rank > 0:
            # its shards hold the adapters alone; the frozen base is the live model's (it never trains)
            state = checkpoint.full_model_state(t.model)  # a collective: every rank gives its shards
            if t.dist.is_main:
                checkpoint.write_safetensors({**state, **checkpoint.load(best)[0]}, path)
            return best
        if best is not None:
            if t.dist.is_main:  # the checkpoint on disk (one file, or the shards read whole)
                weights = checkpoint.load(best)[0]
                if t.dist.distributed:
                    checkpoint.write_safetensors(weights, path)
                else:  # through the model, so tied weights are found and stored once
                    model = kc.unwrap(t.model)
                    checkpoint.load_model_state(model, weights, best)
                    checkpoint.save_model_weights(model, path)
            return best
        if not t.dist.distributed:
            checkpoint.save_model_weights(kc.unwrap(t.model), path)
            return None
        state = checkpoint.full_model_state(t.model)  # a collective: every rank gives its shards
        if t.dist.is_main:
            checkpoint.write_safetensors(state, path)
        return None

    def _train_state(self, next_batch: int) -> dict[str, Any]:
        """What resuming needs besides the weights: optimizer, scheduler, scaler, RNG, position, callbacks."""
        t, st = self.trainer, self.trainer.state
        return {
            "optimizer": t.opt.state_dict(),
            "scheduler": t.sched.state_dict(),
            "scaler": t.scaler.state_dict(),
            "rng": rng_state(),
            "step": st.step,
            "epoch": st.epoch,
            "batch_in_epoch": next_batch,
            "callbacks": {name: cb.state_dict() for name, cb in t._named_callbacks()},
        }

    def _meta(self) -> dict[str, Any]:
        """The checkpoint's meta.json: its metrics, the best so far and what picks the best checkpoints."""
        t, st = self.trainer, self.trainer.state
        evaluated = t._evaluated_at == st.step
        return {
            "epoch": st.epoch,
            "metrics": st.last_eval,
            "best": st.best,
            "best_step": st.best_step,
            "stopped": st.stopped,
            # what picks the best checkpoints: this step's value of the monitored metric, if it was evaluated
            "monitor": {"key": t.monitor, "value": st.last_eval.get(t.monitor) if evaluated else None},
            "task": type(t.task).__name__,
            # a resumed run with precision=auto keeps it rather than measuring its model again
            "precision": t.plan.precision,
            # and core.attention's timed choices (short bf16 path or SDPA), rather than timing them again
            "attention": cpu_bf16.decisions(),
        }

    def _failed(self, err: CheckpointWriteError) -> None:
        """trainer.ckpt_on_error: stop the run with the one-line error, or warn and train on."""
        if self.trainer.cfg.ckpt_on_error == "stop":
            raise err
        self.trainer._warn(f"{err}; training on (trainer.ckpt_on_error=warn)")

    def _complete(self, path: Path) -> None:
        """A checkpoint is complete: its compile artifacts beside it, then the callbacks (pruning)."""
        t = self.trainer
        if t.compiled and t.dist.is_main:  # a resumed run starts warm (ranks compile the same graphs)
            kc.save_artifacts(path / "compile_artifacts.bin", t.compile_cfg)
        t._hook("on_checkpoint", path)
