"""Can the Triton kernels run these tensors here? Answered without importing triton."""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 256)
# Looked up once at import: under torch.compile(fullgraph=True) a find_spec call inside attention() is a
# graph break dynamo refuses (seen on CUDA: docs/testing.md § GPU checks), and the answer cannot change.
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


class Problem(NamedTuple):
    """What the kernels cannot do: the feature (`key`), its value here and what they support (`valid`), and
    the short phrase naming it (`why`)."""

    key: str
    value: str
    valid: tuple[str, ...]
    why: str


def triton_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Problem | None:
    """What the kernels cannot do for these tensors, or None if they can."""
    if not TRITON_INSTALLED:
        return Problem("triton", "not installed", ("installed",), "anything here: triton is not installed")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if q.device.type != "cuda" and not (interpreting and q.device.type == "cpu"):
        why = f"device={q.device.type} (needs CUDA, or CPU under TRITON_INTERPRET=1)"
        return Problem("device", q.device.type, ("cuda", "cpu with TRITON_INTERPRET=1"), why)
    if q.dtype not in TRITON_DTYPES or not q.dtype == k.dtype == v.dtype:
        dtypes = f"{q.dtype}/{k.dtype}/{v.dtype}"
        why = f"dtype={dtypes} (needs one of fp16, bf16, fp32 for all of q, k, v)"
        return Problem("dtype", dtypes, tuple(str(d) for d in TRITON_DTYPES), why)
    if v.shape[-1] != q.shape[-1]:
        why = f"v head_dim={v.shape[-1]} != q head_dim={q.shape[-1]}"
        return Problem("v.head_dim", str(v.shape[-1]), (str(q.shape[-1]),), why)
    if not HEAD_DIMS[0] <= q.shape[-1] <= HEAD_DIMS[1]:
        why = f"head_dim={q.shape[-1]} (supports {HEAD_DIMS[0]}..{HEAD_DIMS[1]})"
        return Problem("head_dim", str(q.shape[-1]), (f"{HEAD_DIMS[0]}..{HEAD_DIMS[1]}",), why)
    return None
