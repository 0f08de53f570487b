"""TR-DPO's reference updates (Gorbatovski et al. 2024; TRL's `sync_ref_model`) for the tasks that keep a
frozen reference model (`+task=grpo`'s KL, `+task=dpo`): every `ref_model_sync_steps` optimizer steps the
reference becomes alpha x the policy + (1 - alpha) x itself, on every rank alike (their replicas are equal).
Once synced the reference is no longer what the task builds it from, so its weights are checkpointed and a
resumed run's reference is restored from them (TRL's checkpoints hold the policy alone)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from core import compile as kc
from core.checkpoint.weights import clean_key
from core.errors import ConfigError
from core.loop.callbacks import Callback
from core.nn.lora import lora_modules

if TYPE_CHECKING:
    from core.loop.trainer import Trainer


class ReferenceSync(Callback):
    """Mixes the policy into the task's frozen reference every `every` steps (module docstring)."""

    def __init__(self, reference: Callable[[nn.Module], nn.Module], alpha: float, every: int) -> None:
        """Sync the reference `reference(policy)` gives (the task's frozen copy, built on first use) every
        `every` steps with the policy's share `alpha`."""
        self.reference, self.alpha, self.every = reference, alpha, every
        self.current: nn.Module | None = None  # the reference last synced or restored
        self.pending: dict[str, torch.Tensor] | None = None  # a resumed run's synced weights, not yet loaded

    def restore(self, reference: nn.Module) -> nn.Module:
        """`reference`, with a resumed run's synced weights loaded into it where they are still pending (the
        task calls this at each use: it may have built its reference before the checkpoint was read)."""
        if self.pending is not None:
            reference.load_state_dict(self.pending)
            self.pending, self.current = None, reference
        return reference

    def on_fit_start(self, trainer: Trainer) -> None:
        """LoRA's reference is the base under the adapters, which no sync may move (TRL refuses it too); a
        sharded policy's parameters are not whole on any rank."""
        if lora_modules(trainer.model):
            raise ConfigError(
                "task.sync_ref_model=true needs a full fine-tune: under LoRA the reference is the base "
                "weights the adapters sit on; set trainer.lora.rank=0 or task.sync_ref_model=false",
                key="trainer.lora.rank",
                value=str(trainer.cfg.lora.rank),
            )
        trainer.shape.require_whole(str(trainer.cfg.parallel), "task.sync_ref_model=true")

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Every `every` steps: mix the policy into the reference."""
        if trainer.state.step % self.every == 0:
            self.sync(trainer.model)

    def sync(self, model: nn.Module) -> None:
        """reference = alpha x `model` + (1 - alpha) x reference, parameter by parameter (by name, through
        DDP's and compile's wrappers)."""
        from torch.nn.parallel import DistributedDataParallel

        inner = kc.unwrap(model.module if isinstance(model, DistributedDataParallel) else model)
        policy = {clean_key(n): p for n, p in inner.named_parameters()}
        reference = self.reference(model)
        with torch.no_grad():
            for name, ref in reference.named_parameters():
                ref.mul_(1.0 - self.alpha).add_(policy[name].detach(), alpha=self.alpha)
        self.current = reference

    def state_dict(self) -> dict[str, Any]:
        """The synced reference's weights (on the CPU); nothing before the first sync (the task builds the
        reference as it was then)."""
        if self.current is None:
            return {} if self.pending is None else {"reference": self.pending}
        return {"reference": {k: v.detach().cpu().clone() for k, v in self.current.state_dict().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A synced reference's weights, loaded into the reference when the task builds it (`restore`)."""
        if "reference" in state:
            self.pending, self.current = state["reference"], None
