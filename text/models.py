"""Text classification's models, as vision/models.py holds image classification's: a transformer encoder
with bidirectional blocks, key padding, pooling and a linear head. The language models have files of their
own (text.gpt, text.llama)."""

from __future__ import annotations

from typing import Annotated

import torch
from torch import nn

from core.bounds import Bounds
from core.errors import unknown_choice
from core.nn.transformer import Block, init_weights
from core.registry import MODELS

POOLINGS = ("mean", "cls")


@MODELS.register("text_encoder")
class TextClassifier(nn.Module):
    """A transformer encoder: embeddings, `n_layer` non-causal blocks that ignore padding keys, masked
    pooling, linear head."""

    def __init__(
        self,
        *,
        vocab_size: int,
        num_classes: int,
        max_len: int,
        n_layer: Annotated[int, Bounds(ge=1)] = 2,
        n_head: Annotated[int, Bounds(ge=1)] = 4,
        d_model: Annotated[int, Bounds(ge=1)] = 128,
        dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.1,
        pooling: Annotated[str, Bounds(choices=POOLINGS)] = "mean",
    ) -> None:
        """A classifier over `vocab_size` tokens into `num_classes`, for inputs up to `max_len` tokens.

        n_layer: transformer blocks
        n_head: attention heads per block (must divide d_model)
        d_model: width of the embeddings and the blocks
        dropout: dropout probability on the embeddings and in the blocks
        pooling: mean (of the real tokens' outputs) or cls (the output at a prepended class token)
        """
        super().__init__()
        if pooling not in POOLINGS:
            raise unknown_choice("model.pooling", pooling, POOLINGS)
        self.pooling = pooling
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len + 1, d_model)  # +1: the cls slot
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, bias=True) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)
        init_weights(self, max(n_layer, 1))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Class logits (B, C) for `tokens` (B, L) whose real positions are True in `mask` (B, L)."""
        x = self.tok_emb(tokens)
        if self.pooling == "cls":
            x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1)
            mask = torch.cat([mask.new_ones(len(x), 1), mask], dim=1)
        x = self.drop(x + self.pos_emb(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks:
            x = block(x, key_padding_mask=mask)
        x = self.ln_f(x)
        if self.pooling == "cls":
            return self.head(x[:, 0])
        m = mask.unsqueeze(-1).to(x.dtype)
        return self.head((x * m).sum(1) / m.sum(1).clamp_min(1.0))
