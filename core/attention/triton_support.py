"""Can the Triton kernels run these tensors here? Answered without importing triton."""

from __future__ import annotations

import importlib.util
import os

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 256)


def triton_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """A short phrase naming what the kernels cannot do for these tensors, or None if they can."""
    if importlib.util.find_spec("triton") is None:
        return "anything here: triton is not installed"
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if q.device.type != "cuda" and not (interpreting and q.device.type == "cpu"):
        return f"device={q.device.type} (needs CUDA, or CPU under TRITON_INTERPRET=1)"
    if q.dtype not in TRITON_DTYPES or not q.dtype == k.dtype == v.dtype:
        return f"dtype={q.dtype}/{k.dtype}/{v.dtype} (needs one of fp16, bf16, fp32 for all of q, k, v)"
    if v.shape[-1] != q.shape[-1]:
        return f"v head_dim={v.shape[-1]} != q head_dim={q.shape[-1]}"
    if not HEAD_DIMS[0] <= q.shape[-1] <= HEAD_DIMS[1]:
        return f"head_dim={q.shape[-1]} (supports {HEAD_DIMS[0]}..{HEAD_DIMS[1]})"
    return None
