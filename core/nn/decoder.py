"""A Transformer decoder (Vaswani et al., 2017) for sequence-to-sequence models: causal self-attention over
the tokens so far, cross-attention over an encoder's output, a feed-forward layer, each behind a pre-norm
residual; and the cache incremental decoding runs on, where the encoder's keys and values are projected once
per source sequence and each new token costs one token's projections.

Attention always goes through `core.attention.attention` (dense (B, H, L, D)); padding is masked from lengths:
the encoder's (`memory_lengths`) in cross-attention, the targets' (`token_lengths`) in self-attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from core.attention import attention
from core.errors import ConfigError
from core.nn.transformer import KVCache, LayerCache, cached_attention


def length_mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """Bool (B, size), True on each row's first `lengths[b]` positions (the real, unpadded ones)."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


def sinusoidal_positions(start: int, length: int, dim: int, device: torch.device) -> torch.Tensor:
    """(length, dim) sine/cosine encodings of positions start..start+length (computed: no longest length)."""
    pos = torch.arange(start, start + length, device=device, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10_000.0) / dim))
    table = torch.zeros(length, dim, device=device)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv[: dim // 2])
    return table


def _heads(x: torch.Tensor, n: int, h: int) -> tuple[torch.Tensor, ...]:
    """(B, L, n*H*D) projection output -> n tensors (B, H, L, D); rows are (n, H, D)."""
    b, length, width = x.shape
    return x.view(b, length, n, h, width // (n * h)).permute(2, 0, 3, 1, 4).unbind(0)


class CrossAttention(nn.Module):
    """Multi-head attention of queries over an encoder's output (`memory`), its padding masked."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, backend: str = "auto") -> None:
        """`d_model` wide with `n_head` heads, queries and memory both `d_model` wide."""
        super().__init__()
        self.n_head, self.dropout, self.backend = n_head, dropout, backend
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, T, D) of `memory` (B, T, C): what a decoding cache keeps per utterance."""
        k, v = _heads(self.kv(memory), 2, self.n_head)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        memory_mask: torch.Tensor | None = None,
        group: int = 1,
    ) -> torch.Tensor:
        """Queries `x` (B*group, L, C) over `kv` (B, H, T, D, from `memory_kv`); `memory_mask` (B, T) is True
        on real frames. Each `group` consecutive rows share one memory (a beam's hypotheses of one source):
        their queries join one attention call over it, so its keys/values are never copied per row."""
        b, n, c = x.shape
        (q,) = _heads(self.q(x), 1, self.n_head)  # (B*group, H, L, D)
        if group > 1:
            q = q.unflatten(0, (b // group, group)).transpose(1, 2).flatten(2, 3)  # (B, H, group*L, D)
        p = self.dropout if self.training else 0.0
        y = attention(q, *kv, key_padding_mask=memory_mask, dropout_p=p, backend=self.backend)
        if group > 1:
            y = y.unflatten(2, (group, n)).transpose(1, 2).flatten(0, 1)  # (B*group, H, L, D)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; with a `LayerCache`, over the cached positions and the new ones."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, backend: str = "auto") -> None:
        """`d_model` wide with `n_head` heads."""
        super().__init__()
        self.n_head, self.dropout, self.backend = n_head, dropout, backend
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """`x` (B, L, C) -> (B, L, C); `key_padding_mask` (B, L) True on real tokens (not with `cache`)."""
        b, n, c = x.shape
        p = self.dropout if self.training else 0.0
        q, k, v = _heads(self.qkv(x), 3, self.n_head)
        if cache is not None:
            y = cached_attention(*(t.transpose(1, 2) for t in (q, k, v)), cache, p, self.backend)
            return self.proj(y.reshape(b, n, c))
        y = attention(
            q, k, v, causal=True, key_padding_mask=key_padding_mask, dropout_p=p, backend=self.backend
        )
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class DecoderBlock(nn.Module):
    """x + self_attn(ln(x)), x + cross_attn(ln(x), memory), x + mlp(ln(x)): the pre-norm decoder layer."""

    def __init__(
        self, d_model: int, n_head: int, mlp_ratio: float = 4.0, dropout: float = 0.0, backend: str = "auto"
    ) -> None:
        """One layer `d_model` wide, `n_head` heads, an MLP `mlp_ratio` times as wide."""
        super().__init__()
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(d_model) for _ in range(3))
        self.self_attn = CausalSelfAttention(d_model, n_head, dropout, backend)
        self.cross_attn = CrossAttention(d_model, n_head, dropout, backend)
        hidden = int(d_model * mlp_ratio)
        self.fc, self.fc_out = nn.Linear(d_model, hidden), nn.Linear(hidden, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        memory_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        group: int = 1,
    ) -> torch.Tensor:
        """(B*group, L, C) -> (B*group, L, C), attending to the memory's keys/values `kv` (B, H, T, D)."""
        x = x + self.drop(self.self_attn(self.ln1(x), key_padding_mask, cache))
        x = x + self.drop(self.cross_attn(self.ln2(x), kv, memory_mask, group))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln3(x)))))


class DecoderCache:
    """What incremental decoding keeps: per layer the memory's keys/values (projected once, in `start`) and
    the self-attention keys/values of the tokens decoded so far (a `KVCache`)."""

    def __init__(
        self,
        memory_kv: list[tuple[torch.Tensor, torch.Tensor]],
        memory_mask: torch.Tensor | None,
        tokens: KVCache,
        group: int,
    ) -> None:
        """Built by `TransformerDecoder.start`; `group` rows share one source sequence, whose memory keys and
        values (B, H, T, D) and mask (B, T) are held once."""
        self.memory_kv, self.memory_mask, self.tokens, self.group = memory_kv, memory_mask, tokens, group

    @property
    def length(self) -> int:
        """Tokens decoded so far (the next token's position)."""
        return self.tokens.length

    def reorder(self, index: torch.Tensor) -> None:
        """Row i takes row `index[i]`'s decoded tokens (a beam search keeping its best hypotheses). Rows stay
        within their source's group, so the memory's keys/values, shared by the group, are never copied."""
        rows = torch.arange(index.numel(), device=index.device)
        if not bool((index // self.group == rows // self.group).all()):
            raise ValueError(f"reorder moves a row out of its group of {self.group} (its source sequence)")
        n = self.tokens.length  # positions past it are unread: not worth copying
        for store in (self.tokens.keys, self.tokens.values):
            store[:, :, :, :n] = store[:, :, :, :n].index_select(1, index)


class TransformerDecoder(nn.Module):
    """Token ids (B, L) and an encoder's output (B, T, C) -> next-token logits (B, L, V): embeddings scaled
    by sqrt(C) plus sinusoidal positions, `n_layer` `DecoderBlock`s, a final LayerNorm and a projection."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_head: int,
        n_layer: int,
        *,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        backend: str = "auto",
        max_positions: int = 0,
        scale_embeddings: bool = True,
        tied: bool = False,
    ) -> None:
        """`backend` is `core.attention`'s (auto picks per device); the memory must be `d_model` wide.
        `max_positions` > 0 learns that many position embeddings in place of the sinusoids (Whisper's and
        GPT-2's layout; longer sequences are refused), `scale_embeddings=False` adds the token embeddings
        unscaled, and `tied` projects onto the token embeddings' transpose (no separate `out` layer)."""
        super().__init__()
        if d_model % n_head or (d_model // n_head) % 2:
            raise ConfigError(
                f"decoder width {d_model} must split into {n_head} even-sized heads",
                key="d_model",
                value=str(d_model),
            )
        self.vocab_size, self.d_model, self.n_head = vocab_size, d_model, n_head
        self.scale = math.sqrt(d_model) if scale_embeddings else 1.0
        self.embed = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Parameter(torch.zeros(max_positions, d_model)) if max_positions > 0 else None
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, n_head, mlp_ratio, dropout, backend) for _ in range(n_layer)
        )
        self.norm = nn.LayerNorm(d_model)
        self.out = None if tied else nn.Linear(d_model, vocab_size)

    def _embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        x = self.embed(tokens) * self.scale if self.scale != 1.0 else self.embed(tokens)
        end = start + tokens.shape[1]
        if self.positions is None:
            pos = sinusoidal_positions(start, tokens.shape[1], self.d_model, tokens.device)
        elif end > self.positions.shape[0]:
            raise ValueError(f"{end} token positions, but the decoder has {self.positions.shape[0]}")
        else:
            pos = self.positions[start:end]
        return self.drop(x + pos.to(x.dtype))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits (..., V) of final hidden states `x` (..., C): the final norm, then the output
        layer (or, tied, the token embeddings' transpose)."""
        x = self.norm(x)
        return self.out(x) if self.out is not None else F.linear(x, self.embed.weight)

    def forward(
        self,
        tokens: torch.Tensor,
        memory: torch.Tensor,
        memory_lengths: torch.Tensor | None = None,
        token_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits (B, L, V): position i sees tokens 0..i and the memory's real frames.
        `token_lengths` masks padded tokens as keys (with right padding causality already hides them from
        the real positions, so only padded positions' own outputs change)."""
        memory_mask = None if memory_lengths is None else length_mask(memory_lengths, memory.shape[1])
        token_mask = None if token_lengths is None else length_mask(token_lengths, tokens.shape[1])
        x = self._embed(tokens, 0)
        for block in self.blocks:
            x = block(x, block.cross_attn.memory_kv(memory), memory_mask, token_mask)
        return self.logits(x)

    def start(
        self,
        memory: torch.Tensor,
        memory_lengths: torch.Tensor | None = None,
        *,
        max_len: int,
        group: int = 1,
    ) -> DecoderCache:
        """An empty cache for decoding up to `max_len` tokens, `group` rows per source (the beam), the
        memory's keys/values projected here, once per source sequence (and held once)."""
        b = memory.shape[0]
        kv = [block.cross_attn.memory_kv(memory) for block in self.blocks]
        mask = None if memory_lengths is None else length_mask(memory_lengths, memory.shape[1])
        head_dim = self.d_model // self.n_head
        # the projections' dtype (under autocast, not the memory's): cached keys then match new queries
        dtype = kv[0][0].dtype if kv else memory.dtype
        rows = b * group
        cache = KVCache(
            len(self.blocks), rows, self.n_head, max_len, head_dim, dtype=dtype, device=memory.device
        )
        return DecoderCache(kv, mask, cache, group)

    def step(self, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """Logits (N, L, V) of `tokens` (N, L), the ones after those `cache` holds; the cache takes them."""
        x = self._embed(tokens, cache.length)
        for i, block in enumerate(self.blocks):
            x = block(
                x, cache.memory_kv[i], cache.memory_mask, cache=cache.tokens.layer(i), group=cache.group
            )
        cache.tokens.length += tokens.shape[1]
        return self.logits(x)
