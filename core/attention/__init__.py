"""Attention for every torchkiln model: one API over Triton flash kernels, blockwise SDPA, a short bf16 CPU
path (taken where it times faster than SDPA) and naive math.

Dense (B, H, L, D) or packed (T, H, D) + cu_seqlens; causal, sliding window, ALiBi, GQA, key padding and
dropout in any mix. Triton is imported only when its kernels first run.
"""

from core.attention.dispatch import BACKENDS, attention, backend_order

__all__ = ["BACKENDS", "attention", "backend_order"]
