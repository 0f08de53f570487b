"""Tensor-parallel plans for the vision models, registered with `core.distributed` when `vision` is imported.

The ViT's transformer blocks are sharded (`core.distributed.block_tp`); the patch embedding, positions, final
LayerNorm and head are small and stay whole on every rank. The CNNs have no plan (use data parallel).
"""

from __future__ import annotations

from typing import Any

from core.distributed.block_tp import parallelize_blocks
from core.distributed.tensor_parallel import register_tp_plan
from vision.models import ViT


@register_tp_plan(ViT)
def parallelize_vit(model: ViT, tp_mesh: Any) -> ViT:
    """Shard the ViT's blocks across `tp_mesh`; patch embedding, positions, norm and head stay whole."""
    width = "model.dim x model.mlp_ratio"
    parallelize_blocks(model.blocks, tp_mesh, heads_key="model.heads", width_key=width)
    return model
