"""Tensor-parallel plans for the text models, registered with `core.distributed` when `text` is imported.

Only the transformer blocks are sharded (`core.distributed.block_tp`). Embeddings, the final LayerNorm and
the head stay whole on every rank: at these sizes (vocabularies of thousands, widths under a thousand) that
is the simplest correct choice, and the logits come out whole for any loss. Sharding the vocabulary
(torchtitan's vocab-parallel embedding with loss parallel) is the next step for large vocabularies.
"""

from __future__ import annotations

from typing import Any

from core.distributed.block_tp import parallelize_blocks
from core.distributed.tensor_parallel import register_tp_plan
from text.classifier import TextClassifier
from text.gpt import GPT


@register_tp_plan(GPT)
def parallelize_gpt(model: GPT, tp_mesh: Any) -> GPT:
    """Shard the GPT's blocks across `tp_mesh`; embeddings, tied head and final LayerNorm stay whole."""
    parallelize_blocks(model.blocks, tp_mesh, heads_key="model.n_head", width_key="model.d_model")
    return model


@register_tp_plan(TextClassifier)
def parallelize_text_classifier(model: TextClassifier, tp_mesh: Any) -> TextClassifier:
    """Shard the encoder's blocks across `tp_mesh`; embeddings, pooling and the class head stay whole."""
    parallelize_blocks(model.blocks, tp_mesh, heads_key="model.n_head", width_key="model.d_model")
    return model
