"""Activation checkpointing of a model's repeated blocks, the memory transform of the parallelize stage.

`full` keeps only each checkpointed block's input for backward and runs its forward again there;
`selective` is torch's selective activation checkpointing: the outputs of the matmuls and attention kernels
(the expensive ops) are kept, the cheap ones (norms, GELU, dropout, reshapes) are recomputed. Both use torch's
non-reentrant `torch.utils.checkpoint` (RNG restored, so dropout masks repeat), on the blocks
`core.compile.blocks.find_blocks` names, every `every`-th of them (torchtitan's `ac_freq`: blocks every,
2 * every, ...). A block keeps its class, names and parameters: its forward is wrapped, not the module, so
checkpoints, FSDP's per-block sharding and regional compile see the same module tree as without.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from core.compile.blocks import find_blocks
from core.errors import ConfigError, unknown_choice

#: trainer.activation_checkpointing values
MODES = ("none", "full", "selective")


def check_mode(mode: str, every: int = 1) -> None:
    """ConfigError unless `mode` is a known mode that this torch can run and `every` >= 1."""
    if mode not in MODES:
        raise unknown_choice("trainer.activation_checkpointing", mode, MODES)
    if every < 1:
        raise ConfigError(
            f"trainer.activation_checkpointing_every={every} must be >= 1 (1: every block, 2: every second)"
        )
    if mode == "selective" and not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        raise ConfigError(
            f"trainer.activation_checkpointing=selective needs torch >= 2.4 (this is {torch.__version__}); "
            "use trainer.activation_checkpointing=full"
        )


def checkpoint_blocks(model: nn.Module, mode: str, every: int = 1) -> list[nn.Module]:
    """Checkpoint every `every`-th block of `model` per `mode` (in place); returns the blocks wrapped."""
    check_mode(mode, every)
    if mode == "none":
        return []
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(
            f"trainer.activation_checkpointing={mode}: {type(model).__name__} has no repeated blocks to "
            "checkpoint (declare them as compile_blocks); set trainer.activation_checkpointing=none"
        )
    chosen = [b for i, b in enumerate(blocks) if (i + 1) % every == 0]
    for block in chosen:
        # an instance attribute shadows the class's forward; nn.Module.__call__ (FSDP's hooks, compile's
        # wrapper) still runs around it, so the recompute happens inside the block's own hooks
        block.forward = functools.partial(_checkpointed, block.forward, mode == "selective")
    return chosen


def _checkpointed(forward: Callable[..., Any], selective: bool, *args: Any, **kwargs: Any) -> Any:
    """`forward(*args, **kwargs)` under non-reentrant checkpointing (selective: torch's policy contexts)."""
    from torch.utils.checkpoint import checkpoint

    # full passes no context_fn at all: dynamo traces the default one, not an explicit no-op
    extra = {"context_fn": _selective_contexts} if selective else {}
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def _selective_contexts() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls)


@functools.cache
def _saved_ops() -> frozenset[Any]:
    """The ops whose outputs selective checkpointing keeps: matmuls and fused attention (the ones here)."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    # core.attention's Triton kernels, where they are registered (a GPU with triton)
    fused = getattr(getattr(torch.ops, "torchkiln", None), "flash_attention_fwd", None)
    if fused is not None and hasattr(fused, "default"):
        ops.add(fused.default)
    return frozenset(ops)


def _save_matmuls(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE
