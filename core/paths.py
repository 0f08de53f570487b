"""Where torchkiln keeps what it can rebuild: corpora, tokenizers, compile caches, device measurements."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Root of torchkiln's caches: $TORCHKILN_CACHE, else ~/.cache/torchkiln."""
    env = os.environ.get("TORCHKILN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "torchkiln"
