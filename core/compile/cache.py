"""Where compiled code lives between runs: the cache dir, Inductor's precompiled header mirror, and the
artifacts file a checkpoint carries so a resumed run starts warm."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from core.compile import artifacts, torch_internals
from core.compile.config import CompileConfig
from core.compile.report import first_line
from core.files import cache_root

log = logging.getLogger("torchkiln.compile")


def cache_dir(cfg: CompileConfig | None = None) -> Path:
    """Compile cache dir: cfg.cache_dir, else $TORCHKILN_CACHE/compile, else ~/.cache/torchkiln/compile."""
    if cfg is not None and cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return cache_root() / "compile"


def configure_cache(cfg: CompileConfig | None = None) -> Path:
    """Point Inductor's (and so Triton's and the FX/AOTAutograd) on-disk caches at `cache_dir(cfg)`."""
    path = cache_dir(cfg)
    path.mkdir(parents=True, exist_ok=True)
    # Inductor reads this variable on every cache lookup, so setting it before the first compile suffices
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    sync_precompiled_headers(path)  # a reboot emptied the temp dir: put the cache dir's header back
    return path


#: cache dirs that already have a copy of the header this process's first compile into them used
_headers_kept: set[str] = set()


def keep_precompiled_headers() -> None:
    """After a compile into the current cache dir, mirror the header it used there (once per dir)."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache and cache not in _headers_kept:
        _headers_kept.add(cache)
        sync_precompiled_headers(Path(cache))


def sync_precompiled_headers(path: Path) -> int:
    """Mirror Inductor's precompiled kernel headers between its temp dir and cache dir `path`; files added.

    The header (~160 MB, seconds of g++; BENCHMARKS.md § Compile) lives in the temp dir, so it is rebuilt
    after every reboot or container start, and Inductor builds it before it looks for existing kernels:
    even a fully warm cache dir paid for it. A copy under `path/precompiled_headers` survives with the
    cache dir and is put back when the temp dir lacks it. Hard links where both share a filesystem (no
    disk, no time), else a copy; each file is taken under Inductor's own lock for that header, so a header
    that g++ is still writing is never copied."""
    theirs = torch_internals.inductor_header_dir()
    ours = path / "precompiled_headers"
    if theirs is None or theirs == ours:
        return 0
    added = 0
    for src_dir, dst_dir in ((ours, theirs), (theirs, ours)):
        for gch in sorted(src_dir.glob("*.h.gch")) if src_dir.is_dir() else ():
            header = gch.with_suffix("")  # <hash>.h beside <hash>.h.gch
            if (dst_dir / gch.name).exists() or not header.is_file():
                continue
            (theirs / "locks").mkdir(parents=True, exist_ok=True)
            try:
                with torch_internals.file_lock(str(theirs / "locks" / f"{header.stem}.lock"), timeout=600):
                    for src in (header, gch):  # the .h first: Inductor checks for the .gch
                        added += _link_or_copy(src, dst_dir / src.name)
            except OSError as exc:  # a full disk or a read-only dir costs a header rebuild, never the run
                log.warning("precompiled header not copied to %s (%s: %s)", dst_dir, type(exc).__name__, exc)
    return added


def _link_or_copy(src: Path, dst: Path) -> int:
    if dst.exists():
        return 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except FileExistsError:
        return 0  # another process put it there
    except OSError:  # another filesystem: copy, atomically, since a half-written header would be read
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
        shutil.copyfile(src, tmp)
        tmp.replace(dst)
    return 1


def _inductor_cache_root(cfg: CompileConfig | None) -> Path:
    # apply(model, cfg) compiled into cache_dir(cfg); without a cfg, where Inductor is pointed now
    if cfg is None and os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return cache_dir(cfg)


def save_artifacts(path: str | os.PathLike[str], cfg: CompileConfig | None = None) -> bool:
    """Write this process's compile artifacts to `path` (beside a checkpoint); False if there are none.

    Torch's cache artifacts (FX graphs, AOTAutograd, Triton kernels) where the torch version has them, plus
    the C++ kernels Inductor built on CPU (`core.compile.artifacts`), which torch's artifacts leave out."""
    blob = None
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if save is None:
        log.info(
            "torch %s lacks torch.compiler.save_cache_artifacts; saving only the C++ kernels",
            torch.__version__,
        )
    else:
        result = save()
        blob = result[0] if result is not None else None
    return artifacts.write(Path(path), blob, _inductor_cache_root(cfg))


def load_artifacts(path: str | os.PathLike[str], cfg: CompileConfig | None = None) -> bool:
    """Preload artifacts saved by `save_artifacts` into `cache_dir(cfg)`; call before the first compile."""
    path = Path(path)
    if not path.is_file():
        return False
    root = configure_cache(cfg)  # artifacts land in whatever cache dir is current, so point it at ours first
    try:
        blob, kernels = artifacts.read(path, root, trust=cfg is not None and cfg.trust_artifacts)
    except Exception as exc:  # a damaged file only costs a cold start, never the run
        log.warning("ignoring compile artifacts %s (%s: %s)", path, type(exc).__name__, first_line(exc))
        return False
    if kernels:
        log.info("compile artifacts %s: %d C++ kernels restored into %s", path, kernels, root)
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if blob is None:
        return kernels > 0
    if load is None:
        log.info("torch %s lacks torch.compiler.load_cache_artifacts; graphs start cold", torch.__version__)
        return kernels > 0
    try:
        load(blob)
    except Exception as exc:  # a stale or foreign artifact only costs a cold start, never the run
        log.warning("ignoring compile artifacts %s (%s: %s)", path, type(exc).__name__, first_line(exc))
        return kernels > 0
    return True
