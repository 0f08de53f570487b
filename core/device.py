"""Device dispatch: one `DevicePlan` holds every device decision and the reason for it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from core.errors import ConfigError


@dataclass(frozen=True)
class DevicePlan:
    """Every device decision the rest of torchkiln reads, with a reason for each."""

    device: torch.device
    autocast_dtype: torch.dtype | None
    grad_scaler: bool
    pin_memory: bool
    num_workers: int
    optimizer_impl: str
    reasons: dict[str, str] = field(default_factory=dict)

    def apply(self) -> None:
        """Apply process-wide runtime settings (matmul precision, threads) once at start-up."""


def _available() -> list[str]:
    out = ["cpu"]
    if torch.cuda.is_available():
        out += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        out.append("mps")
    return out


def resolve(spec: str = "auto", precision: str = "auto") -> DevicePlan:
    """Pick the device (CUDA, then MPS, then CPU unless `spec` names one) and its precision policy."""
    avail = _available()
    if spec == "auto":
        spec = "cuda" if "cuda" in avail else "mps" if "mps" in avail else "cpu"
    elif spec not in avail:
        raise ConfigError(f"device={spec} is not available here; available: {', '.join(avail)}")
    dev = torch.device(spec)
    if precision not in ("auto", "fp32", "bf16", "fp16"):
        raise ConfigError(f"precision={precision} is unknown; valid: auto, fp32, bf16, fp16")
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if precision == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return DevicePlan(
        device=dev,
        autocast_dtype=dtype,
        grad_scaler=dtype is torch.float16,
        pin_memory=dev.type == "cuda",
        num_workers=min(4, max(0, (os.cpu_count() or 1) - 1)),
        optimizer_impl="fused" if dev.type == "cuda" else "foreach",
    )
