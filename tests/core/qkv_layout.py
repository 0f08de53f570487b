"""Checkpoints as written before the fused q/k/v projection became head-major (`qkv`, rows (3, H, D))."""

from __future__ import annotations

import re

import torch

_NEW = re.compile(r"(^|\.)qkv_by_head\.")


def old_qkv_layout(state: dict[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """`state` with every `qkv_by_head` (rows (H, 3, D)) turned back into the old `qkv` (rows (3, H, D))."""
    out = {}
    for key, value in state.items():
        if _NEW.search(key):
            rows = value.shape[0]
            value = value.reshape(n_head, 3, rows // (3 * n_head), *value.shape[1:]).transpose(0, 1)
            value, key = value.reshape(rows, *value.shape[3:]).clone(), _NEW.sub(r"\1qkv.", key)
        out[key] = value
    return out
