"""Averaged weights for any task: an exponential moving average (EMA) of the trained model, kept by a
`Callback` under any parallel style, and the average of a run's last N checkpoints.

The EMA holds one tensor per parameter and buffer of the trained module (batch-norm statistics are
averaged too, so the average evaluates as it is), updated with one foreach lerp after optimizer steps, as
torchvision's classification reference does (`--model-ema`, on `torch.optim.swa_utils.AveragedModel`).
It holds each tensor's *local* part: under FSDP or tensor parallel the parameters are DTensors and each
rank averages its own shard (the lerp is elementwise, so the shards are the one-process average cut the
same way), with no collective and 1/world of the memory. To evaluate or export the average it is swapped
into the model's own tensors and back, so the model's forward (sharded, compiled) serves the average too.

Its checkpointed state is those local tensors (this rank's training-state file under several processes): a
run resumed at the layout it was saved with continues bit-exact; another layout is refused in one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from core import checkpoint
from core.compile import unwrap
from core.distributed import DistEnv
from core.errors import CheckpointError, ConfigError
from core.loop.callbacks import Callback

if TYPE_CHECKING:
    from core.loop.config import TrainerConfig
    from core.loop.trainer import Trainer

#: the prefix of the metrics the EMA model scores (`val/ema_accuracy` beside `val/accuracy`)
METRIC_PREFIX = "val/ema_"


def ema_metric(key: str) -> str:
    """The EMA model's name for the metric `key` (`val/loss` -> `val/ema_loss`)."""
    return METRIC_PREFIX + key.removeprefix("val/")


class EMA(Callback):
    """EMA of the weights and buffers, updated every `every` optimizer steps; over the first `warmup` steps
    it copies the weights instead of averaging them. Each evaluation also scores it, as `val/ema_<metric>`.
    """

    def __init__(self, decay: float, *, every: int = 1, warmup: int = 0) -> None:
        """`decay` is per optimizer step: an update every `every` steps decays by 1 - every x (1 - decay),
        the reference's adjustment (its `adjust`, with the batch-size and epoch factors left out)."""
        self.every, self.warmup = every, warmup
        self.update_decay = 1.0 - min(1.0, (1.0 - decay) * every)
        self.names: list[str] = []
        self.shadow: list[torch.Tensor] = []
        #: updates since the last copy (0: the next update copies the weights)
        self.n_averaged = 0
        self._resumed: dict[str, Any] | None = None

    # ---- the callback ---------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer) -> None:
        """Start the average from the model's weights (a resumed run: from the checkpoint's average)."""
        names, tensors = _local_tensors(trainer.model)
        self.names, self.shadow = names, [t.detach().clone() for t in tensors]
        if self._resumed is not None:
            self.shadow, self.n_averaged = self._from_state(self._resumed, tensors)
            self._resumed = None

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Average in the weights every `every` steps; during warm-up, keep copying them."""
        step = trainer.state.step
        if not self.shadow or step % self.every:
            return
        _, tensors = _local_tensors(trainer.model)
        with torch.no_grad():
            if self.n_averaged == 0:
                torch._foreach_copy_(self.shadow, tensors)
            else:
                floats = [i for i, t in enumerate(self.shadow) if t.is_floating_point() or t.is_complex()]
                torch._foreach_lerp_(
                    [self.shadow[i] for i in floats], [tensors[i] for i in floats], 1.0 - self.update_decay
                )
                for i, t in enumerate(self.shadow):  # counters (num_batches_tracked) are not averaged
                    if i not in floats:
                        t.copy_(tensors[i])
        self.n_averaged += 1
        if step <= self.warmup:
            self.n_averaged = 0  # the next update copies again (the reference's lr warm-up reset)

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Score the average on the validation set through the task's own evaluation, as val/ema_*."""
        device = trainer.plan.device
        # a loader's iterator draws its base seed from the global RNG: with the average scored or not, the
        # run trains the same
        forked = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        with forked, self.swapped_in(trainer.model):
            scores = trainer.evaluate(trainer.model, trainer.val_loader)
        metrics.update({ema_metric(k): v for k, v in scores.items()})

    def state_dict(self) -> dict[str, Any]:
        """This rank's averaged tensors by parameter/buffer name, and the update count (tensors only)."""
        if not self.shadow:
            return {}
        out: dict[str, Any] = {n: t.detach().clone() for n, t in zip(self.names, self.shadow, strict=True)}
        out["n_averaged"] = torch.tensor(self.n_averaged, dtype=torch.long)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's average until the model exists (`on_fit_start`)."""
        self._resumed = dict(state) or None

    # ---- the average in the model ---------------------------------------------------------------------
    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module, state: dict[str, Any] | None = None) -> Iterator[None]:
        """Within the block, `model`'s own tensors hold the average (or that of `state`, a checkpoint's);
        the trained values are restored bit for bit afterwards."""
        _, tensors = _local_tensors(model)
        values = self.shadow if state is None else self._from_state(state, tensors)[0]
        with torch.no_grad():
            saved = [t.clone() for t in tensors]
            torch._foreach_copy_(tensors, values)
        try:
            yield
        finally:
            _reshard(model)  # FSDP's root may hold unsharded copies of the average after a forward
            with torch.no_grad():
                torch._foreach_copy_(tensors, saved)

    def _from_state(
        self, state: dict[str, Any], tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], int]:
        """(the averaged tensors, the update count) of a checkpointed state, checked against this rank's
        tensors; an AveragedModel's keys (`module.` prefixed, vision's EMA before it moved here) load too."""
        state = {k.removeprefix("module."): v for k, v in state.items()}
        count = int(state.pop("n_averaged", 0))
        missing = [n for n in self.names if n not in state]
        if missing:
            raise CheckpointError(
                f"the checkpoint's EMA has no {missing[0]!r}: it was written for another model; resume "
                "with the model= it was trained with, or set trainer.ema_decay=0",
                key="ema",
                value=missing[0],
                valid=sorted(state),
            )
        out = []
        for name, t in zip(self.names, tensors, strict=True):
            saved = state[name]
            if saved.shape != t.shape:
                raise CheckpointError(
                    f"the checkpoint's EMA of {name!r} is {tuple(saved.shape)}, this rank holds "
                    f"{tuple(t.shape)}: it was saved at another parallel layout; resume with the "
                    "trainer.parallel and process count it was written with (or set trainer.ema_decay=0)",
                    key=f"ema.{name}",
                    value=str(tuple(saved.shape)),
                    valid=(str(tuple(t.shape)),),
                )
            out.append(saved.to(device=t.device, dtype=t.dtype).clone())
        return out, count


def find(callbacks: list[Callback]) -> EMA | None:
    """The EMA among `callbacks`, if any."""
    return next((cb for cb in callbacks if isinstance(cb, EMA)), None)


def for_run(task_callbacks: list[Callback], cfg: TrainerConfig, monitor: str) -> EMA | None:
    """The run's EMA: the task's own, or one `trainer.ema_decay` asks for (put first among
    `task_callbacks`); a ConfigError when both are set, or when export=ema or a val/ema_* monitor has none."""
    ema = find(task_callbacks)
    if cfg.ema_decay > 0:
        if ema is not None:
            raise ConfigError(
                f"trainer.ema_decay={cfg.ema_decay} and the task's own EMA (task.ema_decay) are both "
                "set; set one of them"
            )
        ema = EMA(cfg.ema_decay, every=cfg.ema_every, warmup=cfg.ema_warmup)
        task_callbacks.insert(0, ema)
    if ema is None and (cfg.export == "ema" or monitor.startswith(METRIC_PREFIX)):
        key = "trainer.export=ema" if cfg.export == "ema" else f"trainer.monitor={monitor}"
        raise ConfigError(
            f"{key} needs an EMA of the weights: set trainer.ema_decay (e.g. 0.999)",
            key=key.partition("=")[0],
            value=key.partition("=")[2] or None,
        )
    return ema


def averaged_state(
    ema: EMA | None, model: nn.Module, dist: DistEnv, ckpt: Path | None = None
) -> dict[str, torch.Tensor]:
    """The whole `model`'s state with `ema`'s weights (or those checkpoint `ckpt` kept), as plain CPU
    tensors on rank 0 (others get {}); every rank calls this (several processes: a collective)."""
    if ema is None:
        raise ConfigError(
            "trainer.export=ema needs an EMA: set trainer.ema_decay (e.g. 0.999)",
            key="trainer.export",
            value="ema",
        )
    state = None
    if ckpt is not None:
        rank_file = ckpt / f"train_rank{dist.rank}.pt"
        train = torch.load(
            rank_file if rank_file.is_file() else ckpt / "train.pt", map_location="cpu", weights_only=True
        )
        state = train.get("callbacks", {}).get("EMA")
        if not state:
            raise CheckpointError(f"checkpoint {ckpt} kept no EMA; set trainer.export=last or best")
    with ema.swapped_in(model, state):
        if dist.distributed:
            whole = checkpoint.full_model_state(model)
        else:
            whole = checkpoint.clean_state_dict(unwrap(model).state_dict())
        # copies, taken while the average is swapped in: a DDP (or one-process) state dict on the CPU holds
        # the model's own tensors, which hold the trained weights again once the block ends
        return {k: v.detach().cpu().clone() for k, v in whole.items()}


def _local_tensors(model: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of the trained module's parameters and buffers, each a DTensor's local part: the
    tensors the optimizer updates in place (tied weights once)."""
    _reshard(model)
    module = unwrap(model)
    if isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    # non-persistent buffers (a causal mask, rotary tables) are not state: constant, and never saved
    transient = {
        f"{prefix}.{b}" if prefix else b
        for prefix, m in module.named_modules()
        for b in getattr(m, "_non_persistent_buffers_set", ())
    }
    names, tensors = [], []
    buffers = [(n, b) for n, b in module.named_buffers() if n not in transient]
    for name, t in [*module.named_parameters(), *buffers]:
        local = t.to_local() if hasattr(t, "to_local") else t
        names.append(checkpoint.clean_key(name))
        tensors.append(local.detach())
    return names, tensors


def _reshard(model: nn.Module) -> None:
    """FSDP2 keeps its root's parameters gathered after a forward without backward (an evaluation): shard
    them again, so the module holds its sharded DTensors, which the average updates and swaps."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 cannot have sharded the model
        return
    for m in unwrap(model).modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ---- averaging checkpoints ---------------------------------------------------------------------------------
def last_checkpoints(run_dir: Path, last: int) -> list[Path]:
    """The newest `last` complete checkpoints of `run_dir`, oldest first; too few: a one-line ConfigError."""
    found = checkpoint.complete_checkpoints(run_dir / "checkpoints")
    if not found:
        raise ConfigError(
            f"ckpt={run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}",
            key="ckpt",
            value=str(run_dir),
        )
    if last > len(found):
        raise ConfigError(
            f"last={last}: {run_dir} keeps {len(found)} checkpoint(s); give last={len(found)} or less "
            "(trainer.keep_last sets how many a run keeps)",
            key="last",
            value=str(last),
            valid=(f"<= {len(found)}",),
        )
    return found[-last:]


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The elementwise mean of the model weights of `paths` (in float64, cast back to each tensor's dtype;
    integer buffers such as counters are the newest's), read with weights_only loads only."""
    states = [checkpoint.load(p)[0] for p in paths]  # sharded checkpoints are gathered from their shards
    keys = list(states[-1])
    for p, s in zip(paths, states, strict=True):
        if sorted(s) != sorted(keys) or any(s[k].shape != states[-1][k].shape for k in keys):
            raise CheckpointError(
                f"checkpoint {p} holds other weights than {paths[-1]}; average checkpoints of one model"
            )
    out = {}
    for k in keys:
        newest = states[-1][k]
        if newest.is_floating_point():
            total = sum(s[k].double() for s in states)
            out[k] = (total / len(states)).to(newest.dtype)
        else:
            out[k] = newest.clone()
    return out
