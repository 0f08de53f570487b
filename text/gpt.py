"""Decoder-only transformer language model (GPT-2 layout) with tied input/output embeddings."""

from __future__ import annotations

from typing import Annotated

import torch
from torch import nn

from core.bounds import Bounds
from core.registry import MODELS
from core.transformer import Block, init_weights, pack_documents


@MODELS.register("gpt")
class GPT(nn.Module):
    """A GPT-2-style decoder: token + position embeddings, `n_layer` causal blocks, final LayerNorm, head
    tied to the embedding."""

    def __init__(
        self,
        *,
        vocab_size: int,
        context: int,
        n_layer: Annotated[int, Bounds(ge=1)] = 4,
        n_head: Annotated[int, Bounds(ge=1)] = 4,
        d_model: Annotated[int, Bounds(ge=1)] = 256,
        dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.0,
        bias: bool = False,
    ) -> None:
        """A GPT over `vocab_size` tokens and up to `context` positions (both from the tokenizer and task).

        n_layer: transformer blocks
        n_head: attention heads per block (must divide d_model)
        d_model: width of the embeddings and the blocks
        dropout: dropout probability on the embeddings and in the blocks
        bias: biases in the linear layers and LayerNorms
        """
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying: one matrix reads and writes tokens
        init_weights(self, n_layer)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, L, V) for `tokens` (B, L); with `doc_ids` (B, L) no token attends across documents.

        Positions restart at 0 at each document start within a row, so a document's logits depend on its
        own tokens only, wherever it sits in the packed row.
        """
        packing = None if doc_ids is None else pack_documents(doc_ids)
        pos = torch.arange(tokens.shape[1], device=tokens.device) if packing is None else packing.positions
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x, causal=True, packing=packing)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample up to `max_new_tokens` after `prompt` (1-D ids); stops early at `eos_id`; returns new ids.

        The same `generator` seed gives the same text on the same device: sampling draws from it alone.
        """
        ids = prompt.view(1, -1)
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.context :])[0, -1].float()
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = int(torch.multinomial(probs.cpu(), 1, generator=generator))
            if nxt == eos_id:
                break
            out.append(nxt)
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
        return prompt.new_tensor(out, dtype=torch.long)
