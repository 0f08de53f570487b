"""The pre-norm transformer block the text and vision models share, GPT-2 initialisation, packing of
documents into fixed-length rows, and the key/value cache causal stacks decode with.

Attention always goes through `core.attention.attention`. Packed rows (several documents in one row) attend
within each document only: the rows are flattened into core's packed layout `(total_tokens, H, D)` with
`cu_seqlens`, so no token ever sees another document and no padding is computed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from core.attention import attention
from core.compile import torch_internals
from core.errors import ConfigError


class Packing(NamedTuple):
    """Where documents start inside a batch of packed rows."""

    cu_seqlens: torch.Tensor  # int32 (N+1,): starts of the N segments in the flattened batch, then its size
    max_seqlen: int
    positions: torch.Tensor  # (B, L): position of each token within its segment, restarting at 0


@torch_internals.eager_only  # data-dependent (segment starts, their count): eager between compiled pieces
def pack_documents(doc_ids: torch.Tensor) -> Packing | None:
    """Segments of equal consecutive `doc_ids` (B, L) per row; None when every row is one segment."""
    b, n = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    if not bool(starts[:, 1:].any()):
        return None  # plain causal attention over whole rows is the same computation, and faster
    first = starts.flatten().nonzero().squeeze(1)
    cu = torch.cat([first, first.new_tensor([b * n])]).to(torch.int32)
    col = torch.arange(n, device=doc_ids.device).expand(b, n)
    seg_start = torch.where(starts, col, torch.zeros_like(col)).cummax(dim=1).values
    return Packing(cu, int(cu.diff().max()), col - seg_start)


class LayerCache(NamedTuple):
    """One block's share of a `KVCache`: where its keys and values go, and how many positions are filled."""

    keys: torch.Tensor  # (B, H, T_max, D), a view of the cache's storage: writes land in the cache
    values: torch.Tensor
    start: int  # positions already cached; the block's new tokens take positions start, start+1, ...
    keep: torch.Tensor | None = None  # (B, T_max) bool, False at a row's left padding; None: no padding


class KVCache:
    """Keys and values of the positions a causal stack has already seen, preallocated per block as
    (B, H, T_max, D) and written in place, so decoding one token costs one token's projections.

    Rows of different lengths decode together left-padded (`pad_left`): a row's padding is never attended
    to and its positions count from its first real token, so each row computes what it computes alone. A
    cache with no padding carries no mask (the attention of rows of one length is unchanged)."""

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        """Room for `max_len` positions of `batch` rows in each of `n_layer` blocks; empty."""
        shape = (n_layer, batch, n_head, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # positions filled, the same in every block
        self.pads: torch.Tensor | None = None  # (B,) left-padding positions per row; None: none
        self.keep: torch.Tensor | None = None  # (B, T_max) bool, False at the padding

    def pad_left(self, pads: torch.Tensor) -> None:
        """Make the first `pads[i]` (B,) positions of row `i` padding: never attended to, and not counted
        in the row's positions (its first real token is position 0). No padding at all keeps no mask."""
        if not bool(pads.any()):
            self.pads = self.keep = None
            return
        self.pads = pads.to(device=self.keys.device, dtype=torch.long)
        slots = torch.arange(self.keys.shape[3], device=self.keys.device)
        self.keep = slots[None] >= self.pads[:, None]

    def positions(self, n: int) -> torch.Tensor:
        """Positions (1 or B, n) of the next `n` tokens of each row: after the cached ones, less the row's
        padding (the padding itself takes position 0)."""
        pos = torch.arange(self.length, self.length + n, device=self.keys.device)[None]
        return pos if self.pads is None else (pos - self.pads[:, None]).clamp_min(0)

    def layer(self, i: int) -> LayerCache:
        """Block `i`'s slice, for new tokens that start after the cached ones."""
        return LayerCache(self.keys[i], self.values[i], self.length, self.keep)

    def reset(self) -> None:
        """Forget every position and the padding (the storage is reused, not cleared: positions past
        `length` are unread)."""
        self.length = 0
        self.pads = self.keep = None


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on `device`'s type, or None where it is off."""
    kind = device.type
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    if kind == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def cache_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a KV cache for a model with `weight` holds: autocast's where it is on for the weight's
    device (the keys and values come out of the projections in it: an fp32 cache would be cast back at
    every step), else the weight's."""
    return autocast_dtype(weight.device) or weight.dtype


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)) (GPT-2 layout)."""

    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool, mlp_ratio: float = 4.0) -> None:
        """A block of width `d_model` with `n_head` heads and an MLP `mlp_ratio` times as wide."""
        super().__init__()
        if d_model % n_head:
            raise ConfigError(f"model.d_model={d_model} must be a multiple of model.n_head={n_head}")
        self.n_head, self.head_dim, self.dropout = n_head, d_model // n_head, dropout
        self.ln1 = nn.LayerNorm(d_model, bias=bias)
        # One fused projection whose output rows are head-major, (n_head, 3, head_dim): a contiguous row
        # shard (tensor parallel's column-wise split) holds whole heads with their q, k and v, so each rank
        # keeps one matmul and attends with its own heads. Separate q/k/v Linears would shard as simply but
        # cost three matmuls; the new name marks the layout, so a checkpoint's old `qkv` ((3, n_head,
        # head_dim) rows) is recognised by its key and permuted on load (`_upgrade_fused_qkv`).
        self.qkv_by_head = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.ln2 = nn.LayerNorm(d_model, bias=bias)
        hidden = int(d_model * mlp_ratio)
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)
        torch_internals.add_load_state_dict_pre_hook(self, _upgrade_fused_qkv)

    def forward(
        self,
        x: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        packing: Packing | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """Apply the block to `x` (B, L, C); `packing` (causal only) keeps attention inside documents;
        `cache` (causal only) holds the earlier positions' keys and values: `x` is the tokens after them."""
        b, n, _ = x.shape
        qkv = self.qkv_by_head(self.ln1(x))
        # heads counted from the output, not self.n_head: under tensor parallel this rank's projection holds
        # only its share of the heads (and a DTensor weight's .shape is the global one)
        h = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, n, h, 3, self.head_dim).unbind(3)
        p = self.dropout if self.training else 0.0
        if packing is not None:
            y = packed_attention(q, k, v, packing, p).view(b, n, h * self.head_dim)
        elif cache is not None:
            y = cached_attention(q, k, v, cache, p).reshape(b, n, h * self.head_dim)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            y = attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, dropout_p=p)
            y = y.transpose(1, 2).reshape(b, n, h * self.head_dim)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))

    def decode(
        self,
        x: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        pos: int,
        *,
        keep: torch.Tensor | None = None,
        direct: bool = False,
    ) -> torch.Tensor:
        """The block on one new token per row, `x` (B, 1, C) at position `pos`, in eval mode: its key and
        value are written into `keys`/`values` (B, H, T_max, D, this block's cache) at `pos`, and it attends
        to positions 0..pos, except where `keep` (B, T_max) is False (left padding). The same result as
        `forward(x, cache=...)`, with fewer ops; `direct` calls the layers' `forward`s, skipping
        `Module.__call__` (for layers known to run nothing else on a call).

        A decoding step's matmuls are single rows, so per-call overhead is much of its time (BENCHMARKS.md
        § Generation): this path reads q, k and v straight out of the projection as (B, H, 1, D) views
        instead of transposing, and calls SDPA directly: one query has no causal mask (at most the padding's,
        which its own key keeps from being empty), so the attention dispatcher (there to pick a kernel for
        masks, packing and long rows) has no choice to make.
        """
        layers = (self.ln1, self.qkv_by_head, self.proj, self.ln2, self.fc, self.fc_out)
        ln1, qkv_by_head, proj, ln2, fc, fc_out = (m.forward for m in layers) if direct else layers
        b = x.shape[0]
        qkv = qkv_by_head(ln1(x))
        h = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, h, 3, 1, self.head_dim).unbind(2)  # rows are head-major: (H, 3, D)
        keys.select(2, pos).copy_(k.squeeze(2))
        values.select(2, pos).copy_(v.squeeze(2))
        mask = None if keep is None else keep[:, None, None, : pos + 1]
        y = F.scaled_dot_product_attention(q, keys[:, :, : pos + 1], values[:, :, : pos + 1], attn_mask=mask)
        x = x + proj(y.reshape(b, 1, h * self.head_dim))
        return x + fc_out(F.gelu(fc(ln2(x))))


def _upgrade_fused_qkv(block: Block, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Rename a checkpoint's `qkv` (rows (3, n_head, head_dim)) to `qkv_by_head` with head-major rows."""
    for kind in ("weight", "bias"):
        old = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if old is None:
            continue
        if old.shape[0] == 3 * block.n_head * block.head_dim:  # else strict loading reports the size mismatch
            rest = old.shape[1:]
            old = old.reshape(3, block.n_head, block.head_dim, *rest).transpose(0, 1).reshape(old.shape)
        state_dict[f"{prefix}qkv_by_head.{kind}"] = old


# the CPU path loops over segments: traced, each new segment count would recompile
@torch_internals.eager_only
def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, dropout_p: float
) -> torch.Tensor:
    """Causal attention within each packed segment of (B, L, H, D) q/k/v (k/v may have fewer heads, shared
    by groups of q's); (B*L, H, D) out."""
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    return attention(
        q,
        k,
        v,
        causal=True,
        cu_seqlens=packing.cu_seqlens,
        max_seqlen=packing.max_seqlen,
        dropout_p=dropout_p,
    )


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of (B, L, H, D) q/k/v at positions start..start+L over the cache and themselves,
    never to a row's left padding (`cache.keep`); the new keys and values are written into the cache.
    (B, L, H, D) out (zeros for a query of the padding, which sees no key)."""
    start, end = cache.start, cache.start + q.shape[1]
    if end > cache.keys.shape[2]:
        raise ConfigError(  # a ValueError too, as before
            f"the KV cache holds {cache.keys.shape[2]} positions; {end} asked",
            key="kv_cache",
            value=str(end),
            valid=(f"<= {cache.keys.shape[2]}",),
        )
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    cache.keys[:, :, start:end] = k
    cache.values[:, :, start:end] = v
    k, v = cache.keys[:, :, :end], cache.values[:, :, :end]
    kpm = None if cache.keep is None else cache.keep[:, :end]
    # `causal` aligns query i with key i (top-left), right only when the queries start at position 0. One new
    # query is the newest position and sees every key. Otherwise query i (position start+i) sees keys
    # j <= start+i: in the top-left frame that is a window reaching `start` keys to the right.
    if start == 0:
        y = attention(q, k, v, causal=True, key_padding_mask=kpm, dropout_p=dropout_p, backend=backend)
    elif q.shape[2] == 1:
        y = attention(q, k, v, key_padding_mask=kpm, dropout_p=dropout_p, backend=backend)
    else:
        y = attention(
            q, k, v, window=(end, start), key_padding_mask=kpm, dropout_p=dropout_p, backend=backend
        )
    return y.transpose(1, 2)


def init_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer)."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / (2 * n_layer) ** 0.5 if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
