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
from core.errors import ConfigError
from text.gpt import GPT
from text.llama import Llama
from text.models import TextClassifier


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


@register_tp_plan(Llama)
def parallelize_llama(model: Llama, tp_mesh: Any) -> Llama:
    """Shard each block's attention by key/value head groups and its SwiGLU by hidden units (Megatron's
    split: q, k, v, gate, up column-wise; o and down row-wise); embeddings, norms and head stay whole."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp, c = tp_mesh.size(), model.config
    # a rank holds whole key/value heads and the query heads that share them, so grouped attention runs
    # locally
    for key, size in (("model.n_kv_head", c.n_kv_head), ("model.hidden", c.hidden)):
        if size % tp:
            raise ConfigError(
                f"{key}={size} is not divisible by the tensor-parallel size tp={tp}; set trainer.tp to a "
                "divisor of it",
                key=key,
                value=str(size),
                valid=(f"a multiple of trainer.tp={tp}",),
            )
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"q_proj": col, "k_proj": col, "v_proj": col, "o_proj": row, "mlp.gate": col, "mlp.up": col}
    plan["mlp.down"] = row
    if c.qk_norm:
        # The QK-norms' gains are whole on every rank but see only this rank's heads: as plain tensors each
        # rank's gradient would hold its heads' share alone. As replicated DTensors over an input sharded on
        # the head dim (2 of (B, L, H, D)), autograd sums the shares across ranks.
        norm = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan |= {"q_norm": norm, "k_norm": norm}
    for b in model.blocks:
        parallelize_module(b, tp_mesh, plan)
    return model
