"""Decoder-only GPT-2-layout language model with tied input/output embeddings and a KV cache (sampled from by
`text.generation`)."""

from __future__ import annotations

from typing import Annotated

import torch
from torch import nn

from core.bounds import Bounds
from core.errors import ConfigError
from core.nn.transformer import Block, KVCache, cache_dtype, init_weights, pack_documents
from core.registry import MODELS


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

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits (B, L, V) for `tokens` (B, L); with `doc_ids` (B, L) no token attends across documents;
        with `cache` the tokens follow the `cache.length` cached ones, attend to them, and are cached too;
        `logits_to_keep` > 0: the last that many positions' alone (B, logits_to_keep, V), as in
        `text.llama.Llama.forward`.

        Positions restart at 0 at each document start within a row, so a document's logits depend on its
        own tokens only, wherever it sits in the packed row.
        """
        if cache is not None and doc_ids is not None:
            raise ValueError("a KV cache decodes one document per row; doc_ids are for training rows")
        if cache is not None and tokens.shape[1] == 1 and not self.training:
            return self.decode(tokens, cache)
        packing = None if doc_ids is None else pack_documents(doc_ids)
        if packing is not None:
            pos = packing.positions
        elif cache is not None:
            pos = cache.positions(tokens.shape[1])  # after the cached tokens, less the row's left padding
        else:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for i, block in enumerate(self.blocks):
            x = block(x, causal=True, packing=packing, cache=None if cache is None else cache.layer(i))
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.head(self.ln_f(x[:, -logits_to_keep:] if logits_to_keep else x))

    def decode(self, tokens: torch.Tensor, cache: KVCache, *, direct: bool = False) -> torch.Tensor:
        """`forward` for one token per row (B, 1) after the cached ones, in eval mode, through `Block.decode`;
        `direct` skips `Module.__call__` on every layer (for a model known to run nothing else on a call)."""
        pos = cache.length
        if pos >= cache.keys.shape[3]:
            raise ConfigError(  # a ValueError too, as before
                f"the KV cache holds {cache.keys.shape[3]} positions; {pos + 1} asked",
                key="kv_cache",
                value=str(pos + 1),
                valid=(f"<= {cache.keys.shape[3]}",),
            )
        emb, pos_emb, ln_f, head = self.tok_emb, self.pos_emb, self.ln_f, self.head
        if direct:
            emb, ln_f, head = emb.forward, ln_f.forward, head.forward
        at = pos_emb.weight[pos] if cache.pads is None else pos_emb.weight[pos - cache.pads][:, None]
        x = emb(tokens) + at
        for i, block in enumerate(self.blocks):
            x = block.decode(x, cache.keys[i], cache.values[i], pos, keep=cache.keep, direct=direct)
        cache.length += 1
        return head(ln_f(x))

    def new_cache(self, batch: int = 1) -> KVCache:
        """An empty KV cache for `batch` rows of up to `context` positions, in the model's place and the dtype
        its keys come out in (`core.nn.transformer.cache_dtype`)."""
        block, w = self.blocks[0], self.tok_emb.weight
        shape = (len(self.blocks), batch, block.n_head, self.context, block.head_dim)
        return KVCache(*shape, dtype=cache_dtype(w), device=w.device)
