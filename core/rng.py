"""Seeding and capture/restore of every RNG a training run touches (for bit-exact resume)."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

try:  # numpy is optional for core
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without numpy
    np = None  # type: ignore[assignment]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derive_seed(seed: int, *parts: object) -> int:
    """A seed for one use of the run seed (e.g. "order", epoch): the same in every process and on every
    machine (never Python's salted hash()), independent across uses, in [0, 2**63)."""
    text = repr((seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def rng_state() -> dict[str, Any]:
    """Capture all RNG states as tensors/lists, loadable with `torch.load(weights_only=True)`."""
    state: dict[str, Any] = {"python": _to_lists(random.getstate()), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    if torch.cuda.is_initialized():  # only a run that touched CUDA has CUDA RNG state worth saving
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by `rng_state`."""
    random.setstate(_to_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, tuple) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x
