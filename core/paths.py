"""Where torchkiln keeps what it can rebuild: corpora, tokenizers, compile caches, device measurements."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename, so a reader never sees half of it;
    on failure (e.g. a full disk) the temporary file is removed and the error raised."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def cache_root() -> Path:
    """Root of torchkiln's caches: $TORCHKILN_CACHE, else ~/.cache/torchkiln."""
    env = os.environ.get("TORCHKILN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "torchkiln"
