"""An exponential moving average (EMA) of a model's weights, as torchvision's classification reference keeps
one (`--model-ema`): a `Callback` that updates it after optimizer steps, evaluates it beside the model and
keeps it in checkpoints.

The average is `torch.optim.swa_utils.AveragedModel` with `use_buffers=True` (batch-norm statistics are
averaged too, so the EMA model evaluates as it is) and `get_ema_multi_avg_fn` (one foreach lerp per update).
Nothing here is specific to images; it lives beside the task that uses it until another domain needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from core.callbacks import Callback
from core.compile import unwrap
from core.errors import ConfigError

if TYPE_CHECKING:
    from core.trainer import Trainer


class EMA(Callback):
    """EMA of the weights and buffers, updated every `every` optimizer steps; over the first `warmup` steps
    it copies the weights instead of averaging them. Each evaluation also scores it, as `val/ema_<metric>`.
    """

    def __init__(self, decay: float, *, every: int = 1, warmup: int = 0) -> None:
        """`decay` is per optimizer step: an update every `every` steps decays by 1 - every x (1 - decay),
        the reference's adjustment (its `adjust`, with the batch-size and epoch factors left out)."""
        self.every, self.warmup = every, warmup
        self.update_decay = 1.0 - min(1.0, (1.0 - decay) * every)
        self.model: AveragedModel | None = None
        self._resumed: dict[str, Any] | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        """Start the average from the model's weights (a resumed run: from the checkpoint's average)."""
        source = _plain(trainer)
        device = next(source.parameters()).device
        # a fresh build, not a deep copy: a model compiled in place carries compiled callables bound to the
        # original module, which a copy would keep calling; the build must not draw from the run's RNG
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            shadow = trainer.task.build_model().to(device)
        shadow.load_state_dict(source.state_dict())
        self.model = AveragedModel(
            shadow, multi_avg_fn=get_ema_multi_avg_fn(self.update_decay), use_buffers=True
        ).eval()
        if self._resumed is not None:
            self.model.load_state_dict(self._resumed)
            self._resumed = None

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Average in the weights every `every` steps; during warm-up, keep copying them."""
        step = trainer.state.step
        if self.model is None or step % self.every:
            return
        self.model.update_parameters(_plain(trainer))
        if step <= self.warmup:
            self.model.n_averaged.zero_()  # the next update copies again (the reference's lr warm-up reset)

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Score the average on the validation set through the task's own evaluation, as val/ema_*."""
        if self.model is None or trainer.state.step < self.every:
            return  # nothing averaged yet: the copy is the initial weights
        scores = trainer.evaluate(self.model.module, trainer.val_loader)
        metrics.update({f"val/ema_{k.removeprefix('val/')}": v for k, v in scores.items()})

    def state_dict(self) -> dict[str, Any]:
        """The averaged weights, buffers and update count (tensors only)."""
        if self.model is None:
            return {}
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's average until the model exists (`on_fit_start`)."""
        self._resumed = dict(state) or None


def _plain(trainer: Trainer) -> nn.Module:
    """The trained module itself: behind a compile wrapper or DDP; sharded models are refused."""
    model = unwrap(trainer.model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    if trainer.shape.dp_shard > 1 or trainer.shape.tp > 1:
        raise ConfigError(
            "task.ema_decay: an EMA of sharded weights (trainer.parallel=fsdp/tp) is not supported; "
            "set task.ema_decay=0 or train with trainer.parallel=ddp"
        )
    return model
