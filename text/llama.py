"""The Llama-style decoder (Llama 3.x, Qwen2.5, Qwen3): token embedding, `n_layer` pre-norm blocks of
grouped-query attention with rotary positions and a SwiGLU MLP, a final RMSNorm and a (tied or untied)
head. Each block:

    h = x + o_proj(attention(rope(q_norm(q_proj(n))), rope(k_norm(k_proj(n))), v_proj(n))),  n = attn_norm(x)
    y = h + mlp(mlp_norm(h))

`q_norm`/`k_norm` (RMSNorm over each head's features) are Qwen3's; q/k/v biases are Qwen2's. Every size is
a field of `DecoderConfig`, which the model keeps as `model.config`: the presets (`text.pretrained`), the
Hugging Face key table (`text.checkpoints.hf`) and the tensor-parallel plan read it there. The model is a
plain module with random weights; `text.pretrained` builds it to a Hugging Face folder's sizes and loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from torch import nn

from core.attention import attention
from core.bounds import Bounds
from core.errors import ConfigError
from core.nn.layers import Llama3Scaling, RMSNorm, apply_rope, rope_angles, rope_frequencies
from core.nn.transformer import (
    KVCache,
    LayerCache,
    Packing,
    cache_dtype,
    cached_attention,
    pack_documents,
    packed_attention,
)
from text.moe import check_moe, feed_forward


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """The sizes of a Llama-style decoder over `vocab_size` tokens generating within `context` positions
    (both from the task); the other fields are the config's `model.*` keys.

    n_layer: transformer blocks
    n_head: query heads per block
    n_kv_head: key/value heads per block, shared by n_head / n_kv_head query heads each (grouped-query)
    d_model: width of the embeddings and the residual stream
    head_dim: features per head (0: d_model / n_head; Qwen3 sets its own)
    hidden: gated units of the SwiGLU MLP
    rope_theta: base of the rotary frequencies
    rope_factor: Llama 3 frequency scaling's factor (0: no scaling)
    rope_low_freq_factor: Llama 3 scaling: below this many turns over the original context, slowed
    rope_high_freq_factor: Llama 3 scaling: above this many turns over the original context, kept
    rope_original_context: Llama 3 scaling: the context the frequencies were first trained on
    norm_eps: epsilon of every RMSNorm
    qk_norm: RMSNorm over each head's queries and keys before the rotation (Qwen3)
    qkv_bias: biases on the q/k/v projections (Qwen2)
    out_bias: bias on the attention's output projection
    tie_embeddings: the head reads the token embedding's matrix
    n_experts: experts per mixture-of-experts block (0: every block's MLP is dense; text.moe)
    experts_per_token: experts each token is routed to
    expert_hidden: gated units of each expert (0: hidden)
    norm_topk_prob: the chosen experts' router probabilities renormalised to sum to 1
    moe_every: every this-many-th block (counting from 1) has experts, the others a dense MLP
    dense_layers: blocks (from 0) with a dense MLP whatever moe_every says
    router_aux_loss_coef: weight of the router's load-balancing loss added to the training loss
    """

    vocab_size: int
    context: int
    n_layer: Annotated[int, Bounds(ge=1)] = 4
    n_head: Annotated[int, Bounds(ge=1)] = 8
    n_kv_head: Annotated[int, Bounds(ge=1)] = 4
    d_model: Annotated[int, Bounds(ge=1)] = 256
    head_dim: Annotated[int, Bounds(ge=0)] = 0
    hidden: Annotated[int, Bounds(ge=1)] = 768
    rope_theta: Annotated[float, Bounds(gt=0)] = 10_000.0
    # kept as given (rope_factor=0 ignores the other three), so an export restates nothing
    rope_factor: Annotated[float, Bounds(ge=0)] = 0.0
    rope_low_freq_factor: Annotated[float, Bounds(gt=0)] = 1.0
    rope_high_freq_factor: Annotated[float, Bounds(gt=0)] = 4.0
    rope_original_context: Annotated[int, Bounds(ge=1)] = 8192
    norm_eps: Annotated[float, Bounds(gt=0)] = 1e-5
    qk_norm: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    tie_embeddings: bool = True
    n_experts: Annotated[int, Bounds(ge=0)] = 0
    experts_per_token: Annotated[int, Bounds(ge=1)] = 2
    expert_hidden: Annotated[int, Bounds(ge=0)] = 0
    norm_topk_prob: bool = False
    moe_every: Annotated[int, Bounds(ge=1)] = 1
    dense_layers: tuple[int, ...] = ()
    router_aux_loss_coef: Annotated[float, Bounds(ge=0)] = 0.001

    def __post_init__(self) -> None:
        """One-line ConfigError for sizes no decoder has; `head_dim` 0 becomes d_model / n_head."""
        d_model, n_head, n_kv_head = self.d_model, self.n_head, self.n_kv_head
        if not self.head_dim and d_model % n_head:
            raise ConfigError(
                f"model.d_model={d_model} must be a multiple of model.n_head={n_head} (or set a head_dim)",
                key="model.n_head",
                value=str(n_head),
                valid=tuple(str(d) for d in range(1, d_model + 1) if d_model % d == 0),
            )
        # frozen: the one place the derived width is filled in, so every reader sees features per head
        object.__setattr__(self, "head_dim", self.head_dim or d_model // n_head)
        if self.head_dim % 2:
            raise ConfigError(
                f"model.head_dim={self.head_dim} must be even: rotary embeddings turn pairs of features",
                key="model.head_dim",
                value=str(self.head_dim),
                valid=("an even number",),
            )
        if n_head % n_kv_head:
            raise ConfigError(
                f"model.n_head={n_head} must be a multiple of model.n_kv_head={n_kv_head}",
                key="model.n_kv_head",
                value=str(n_kv_head),
                valid=tuple(str(d) for d in range(1, n_head + 1) if n_head % d == 0),
            )
        check_moe(self)

    def rope_scaling(self) -> Llama3Scaling | None:
        """Llama 3's frequency scaling of these options, or None (rope_factor 0)."""
        if not self.rope_factor:
            return None
        return Llama3Scaling(
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_context,
        )


class LlamaBlock(nn.Module):
    """Pre-norm grouped-query attention with rotary positions, then a SwiGLU MLP, each added to `x`."""

    def __init__(self, config: DecoderConfig, layer: int = 0) -> None:
        """Block `layer` of `config`'s width: n_head query heads sharing n_kv_head key/value heads of
        head_dim features, an MLP of `hidden` gated units (or the experts `text.moe` gives it)."""
        super().__init__()
        c = config
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        # separate q/k/v projections (not one fused matmul): q has more heads than k and v, and tensor
        # parallel then shards each by whole heads with no row permutation
        self.q_proj = nn.Linear(c.d_model, c.n_head * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.d_model, c.n_kv_head * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.d_model, c.n_kv_head * c.head_dim, bias=c.qkv_bias)
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.o_proj = nn.Linear(c.n_head * c.head_dim, c.d_model, bias=c.out_bias)
        self.mlp_norm = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = feed_forward(c, layer)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        *,
        packing: Packing | None = None,
        cache: LayerCache | None = None,
        direct: bool = False,
    ) -> torch.Tensor:
        """The block on `x` (B, L, C), causal; `rope` is the cos/sin (B or 1, L, 1, D/2) of each token's
        position; `packing` keeps attention inside documents; `cache` holds the earlier positions; `direct`
        calls the layers' `forward`s, skipping `Module.__call__` (for layers known to run nothing else)."""
        layers = (self.attn_norm, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.mlp_norm, self.mlp)
        attn_norm, q_proj, k_proj, v_proj, o_proj, mlp_norm, mlp = (
            (m.forward for m in layers) if direct else layers
        )
        b, n, _ = x.shape
        h = attn_norm(x)
        # heads counted from the outputs: under tensor parallel a rank holds only its share of them
        q = q_proj(h).view(b, n, -1, self.head_dim)
        k = k_proj(h).view(b, n, -1, self.head_dim)
        v = v_proj(h).view(b, n, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope).to(v.dtype), apply_rope(k, *rope).to(v.dtype)
        if packing is not None:
            y = packed_attention(q, k, v, packing, 0.0)
        elif cache is not None:
            y = cached_attention(q, k, v, cache)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            y = attention(q, k, v, causal=True).transpose(1, 2)
        x = x + o_proj(y.reshape(b, n, -1))
        return x + mlp(mlp_norm(x))


class Llama(nn.Module):
    """A Llama/Qwen-style decoder of `config`'s sizes; `text.generation` samples from it (KV-cached)."""

    def __init__(self, config: DecoderConfig) -> None:
        """A decoder of `config`'s sizes (kept as `self.config`, the model's one record of them)."""
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self._init_weights(config.n_layer)

    @property
    def context(self) -> int:
        """Positions the model generates within (the task's context)."""
        return self.config.context

    def _init_weights(self, n_layer: int) -> None:
        """N(0, 0.02) matrices, zero biases, the residual outputs scaled by 1/sqrt(2 n_layer) (GPT-2's)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual = name.endswith(("o_proj.weight", "mlp.down.weight", "experts.down"))
                nn.init.normal_(p, std=0.02 / (2 * n_layer) ** 0.5 if residual else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits (B, L, V) for `tokens` (B, L); with `doc_ids` (B, L) no token attends across documents and
        positions restart at each document; with `cache` the tokens follow the cached ones and are cached;
        `logits_to_keep` > 0: the last that many positions' alone (B, logits_to_keep, V), as Hugging Face's
        keyword (1: all a generator reads after a prefill; a preference loss's completions)."""
        if cache is not None and doc_ids is not None:
            raise ValueError("a KV cache decodes one document per row; doc_ids are for training rows")
        packing = None if doc_ids is None else pack_documents(doc_ids)
        return self._logits(tokens, packing, cache, logits_to_keep=logits_to_keep)

    def decode(self, tokens: torch.Tensor, cache: KVCache, *, direct: bool = False) -> torch.Tensor:
        """`forward` for one token per row after the cached ones (the generation loop's call); `direct`
        calls every layer's `forward`, skipping `Module.__call__` (for a model known to run nothing else
        on a call: `text.generation` checks)."""
        if not direct:
            return self(tokens, cache=cache)
        return self._logits(tokens, None, cache, direct=True)

    def _logits(
        self,
        tokens: torch.Tensor,
        packing: Packing | None,
        cache: KVCache | None,
        *,
        direct: bool = False,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """The forward pass (`forward`'s), its layers called directly when `direct`."""
        if packing is not None:
            pos = packing.positions
        elif cache is not None:
            pos = cache.positions(tokens.shape[1])  # after the cached tokens, less the row's left padding
        else:
            pos = torch.arange(tokens.shape[1], device=tokens.device)[None]
        c = self.config
        freqs = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling(), device=tokens.device)
        cos, sin = rope_angles(freqs, pos)
        rope = cos[:, :, None], sin[:, :, None]  # one angle per (row, position), shared by every head
        parts = (self.tok_emb, self.norm, self.head, *self.blocks)
        emb, norm, head, *blocks = (m.forward if direct else m for m in parts)
        x = emb(tokens)
        for i, block in enumerate(blocks):
            x = block(
                x, rope, packing=packing, cache=None if cache is None else cache.layer(i), direct=direct
            )
        if cache is not None:
            cache.length += tokens.shape[1]
        # the head is the widest matmul: positions whose logits are not read would cost as much each
        return head(norm(x[:, -logits_to_keep:] if logits_to_keep else x))

    def new_cache(self, batch: int = 1) -> KVCache:
        """An empty KV cache for `batch` rows of up to `context` positions: key/value heads only, in the
        dtype they come out in (`core.nn.transformer.cache_dtype`)."""
        w, c = self.tok_emb.weight, self.config
        shape = (len(self.blocks), batch, c.n_kv_head, c.context, c.head_dim)
        return KVCache(*shape, dtype=cache_dtype(w), device=w.device)

    def external_name(self, module: str) -> str:
        """`module`'s name in Hugging Face's layout, which LoRA targets and adapter folders use."""
        from text.checkpoints.hf import hf_module_name  # (hf.py reads folders; the model needs only names)

        return hf_module_name(module)
