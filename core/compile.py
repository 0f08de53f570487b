"""torch.compile applied from outside: per-block (regional) or whole-model, measured, cached, never fatal.

`apply(model, cfg, probe=...)` compiles a plain `nn.Module` in place (so state_dict keys never gain
`_orig_mod.`), falls back to eager with a one-line warning when the compiler fails, and under the default
`policy=auto` keeps compile only when timed training steps show it is faster. `compile_metrics()` gives the
counters the training loop logs (recompiles, graph breaks, compile seconds).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from core.checkpoint import ORIG_MOD, clean_key
from core.errors import ConfigError
from core.paths import cache_root

if TYPE_CHECKING:
    from core.task import ShapeHints

log = logging.getLogger("torchkiln.compile")

POLICIES = ("auto", "off", "full", "regional")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DYNAMIC = {"auto": None, "true": True, "false": False}
ON_ERROR = ("eager", "raise")


@dataclass
class CompileConfig:
    """The `compile` config section; these defaults are the single source of truth."""

    #: auto = compile (see auto_candidates), keep it only if timed steps beat eager; off; full = whole model;
    #: regional = each repeated block (ModuleList children sharing a class, or `model.compile_blocks`)
    policy: str = "auto"
    #: torch.compile mode (Inductor only)
    mode: str = "default"
    #: "auto" lets dynamo make a dim dynamic after it changes once; "true"/"false" force it
    dynamic: str = "auto"
    #: what a compiler error does: fall back to eager with a warning, or raise
    on_error: str = "eager"
    #: Inductor/FX cache directory; None = $TORCHKILN_CACHE/compile or ~/.cache/torchkiln/compile
    cache_dir: str | None = None
    #: bound on recompiles (each costs compile time; many mean unmarked dynamic dims or data-dependent code)
    max_recompiles: int = 8
    #: bound on seconds spent in recompiles, or 4x the first compile's seconds if more: the <= 3 recompiles
    #: bucketed lengths cost (one graph per bucket) plus an eval-mode one, each as long as the first, are
    #: expected; recompiles of an unbucketed or dynamic-shape graph can each take minutes
    max_recompile_seconds: float = 120.0
    #: what passing either bound does: "eager" runs the model eager from then on (a recompiling model spends
    #: more time compiling than compiled code saves); "warn" logs once and keeps compiling
    on_recompile_limit: str = "eager"
    #: fail on graph breaks instead of splitting the graph (torchtitan compiles blocks this way)
    fullgraph: bool = False
    #: timed probe steps per side (compiled, eager) under policy=auto, after one warm-up each
    auto_steps: int = 3
    #: policy=auto keeps compile only if eager_ms / compiled_ms >= this (margin against timing noise)
    auto_min_speedup: float = 1.02
    #: what policy=auto compiles and times against eager, fastest kept (each costs a cold compile); empty =
    #: per device (`default_auto_candidates`): whole model on CPU, per block elsewhere
    auto_candidates: list[str] = field(default_factory=list)
    #: policy=auto stays eager when the planned run's eager time is below this: a cold CPU compile, and the
    #: toolchain probe the first time on a machine, cost tens of seconds (BENCHMARKS.md § Compile), which a
    #: short run can never earn back
    auto_min_run_seconds: float = 300.0

    def validate(self) -> CompileConfig:
        """Raise ConfigError naming the first bad key; return self."""
        for key, value, valid in (
            ("policy", self.policy, POLICIES),
            ("mode", self.mode, MODES),
            ("dynamic", str(self.dynamic).lower(), tuple(DYNAMIC)),
            ("on_error", self.on_error, ON_ERROR),
            ("on_recompile_limit", self.on_recompile_limit, ("eager", "warn")),
        ):
            if value not in valid:
                raise ConfigError(f"compile.{key}={value} is unknown; valid: {', '.join(valid)}")
        if self.max_recompiles < 0:
            raise ConfigError(f"compile.max_recompiles={self.max_recompiles} must be >= 0")
        if self.max_recompile_seconds < 0:
            raise ConfigError(f"compile.max_recompile_seconds={self.max_recompile_seconds:g} must be >= 0")
        for name in self.auto_candidates:
            if name not in ("full", "regional"):
                raise ConfigError(f"compile.auto_candidates has {name}; valid: full, regional")
        if self.auto_steps < 1:
            raise ConfigError(f"compile.auto_steps={self.auto_steps} must be >= 1")
        return self


@dataclass
class CompileReport:
    """What `apply` decided and why; attached to the model as `model.compile_report`."""

    policy: str
    compiled: str = "none"  # none | full | regional
    reason: str = ""
    blocks: int = 0
    compile_seconds: float = float("nan")
    eager_step_ms: float = float("nan")
    compiled_step_ms: float = float("nan")


# ----------------------------------------------------------------------------------------------- metrics


@dataclass
class _Counters:
    """Process-wide compile events since the last `reset_metrics()`; dynamo's own counters are global too."""

    compiles: int = 0
    recompiles: int = 0
    seconds: float = 0.0
    graph_breaks_at_reset: int = 0
    cache_at_reset: dict[str, int] = field(default_factory=dict)
    max_recompiles: int = CompileConfig.max_recompiles
    recompile_seconds: float = 0.0
    first_seconds: float = 0.0  # in compiles that were not recompiles
    max_recompile_seconds: float = CompileConfig.max_recompile_seconds
    on_limit: str = CompileConfig.on_recompile_limit
    warned: bool = False
    started: dict[str, float] = field(default_factory=dict)
    installed: bool = False
    unavailable: str = ""


_counters = _Counters()


def _graph_breaks_total() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def _cache_totals() -> dict[str, int]:
    """Hits and misses of Inductor's FX-graph cache plus AOTAutograd's cache: hits mean a warm start."""
    from torch._dynamo.utils import counters

    return {
        "hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
        "misses": counters["inductor"]["fxgraph_cache_miss"]
        + counters["aot_autograd"]["autograd_cache_miss"],
    }


# the clock compile durations are read from (tests replace it to make the seconds bound deterministic)
_compile_clock: Callable[[], float] = time.perf_counter


def _on_start(args: Any) -> None:
    _counters.started[f"{args.callback_trigger}:{args.compile_id}"] = _compile_clock()


def _is_recompile(compile_id: object) -> bool:
    # compile ids read "frame/attempt" ("!ca/frame/attempt" under compiled autograd); attempt > 0 means
    # this code object was compiled before and its guards failed on new inputs: a recompile
    parts = str(compile_id).split("/")
    return len(parts) >= 2 and parts[-1].isdigit() and int(parts[-1]) > 0


#: recompile seconds allowed per second of first compile (see CompileConfig.max_recompile_seconds)
RECOMPILE_SECONDS_PER_FIRST = 4


def _recompile_seconds_bound() -> float:
    return max(_counters.max_recompile_seconds, RECOMPILE_SECONDS_PER_FIRST * _counters.first_seconds)


def _over_recompile_bounds() -> bool:
    return (
        _counters.recompiles > _counters.max_recompiles
        or _counters.recompile_seconds > _recompile_seconds_bound()
    )


def _on_end(args: Any) -> None:
    begun = _counters.started.pop(f"{args.callback_trigger}:{args.compile_id}", None)
    recompile = _is_recompile(args.compile_id)
    if begun is not None:
        took = _compile_clock() - begun
        _counters.seconds += took
        if recompile:  # its lazily compiled backward included
            _counters.recompile_seconds += took
        else:
            _counters.first_seconds += took
    if args.callback_trigger.name != "DYNAMO":
        return  # lazy backward / autotuning / cudagraph recording belong to a compile already counted
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache and cache not in _headers_kept:  # the first compile has built (or found) the header by now
        _headers_kept.add(cache)
        sync_precompiled_headers(Path(cache))
    _counters.compiles += 1
    if recompile:
        _counters.recompiles += 1
        # with on_limit=eager the model's next call reverts to eager and says so; warn here otherwise
        if _over_recompile_bounds() and _counters.on_limit == "warn" and not _counters.warned:
            _counters.warned = True
            log.warning(
                "torch.compile recompiled %d times in %.1f s (bounds: compile.max_recompiles=%d, %.1f s); "
                "mark varying dims with core.compile.mark_dynamic_batch and bucket lengths "
                "(core.data.LengthBucketBatchSampler), or see TORCH_LOGS=recompiles",
                _counters.recompiles,
                _counters.recompile_seconds,
                _counters.max_recompiles,
                _recompile_seconds_bound(),
            )


def _install_counters() -> None:
    """Register the compile callbacks, again if `torch._dynamo.reset()` (which clears them) ran since."""
    if _counters.unavailable:
        return
    try:
        from torch._dynamo.callback import CallbackArgs, callback_handler  # noqa: F401
    except ImportError:
        _counters.unavailable = f"torch {torch.__version__} has no compile callbacks; recompiles not counted"
        log.info(_counters.unavailable)
        return
    if _on_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_start)
        callback_handler.register_end_callback(_on_end)
    _counters.installed = True


def reset_metrics(
    max_recompiles: int | None = None, on_limit: str | None = None, max_recompile_seconds: float | None = None
) -> None:
    """Zero the counters behind `compile_metrics()` (apply() does this); set the recompile bounds, action."""
    _install_counters()
    _counters.compiles = _counters.recompiles = 0
    _counters.seconds = _counters.recompile_seconds = _counters.first_seconds = 0.0
    _counters.warned = False
    _counters.graph_breaks_at_reset = _graph_breaks_total()
    _counters.cache_at_reset = _cache_totals()
    if max_recompiles is not None:
        _counters.max_recompiles = max_recompiles
    if on_limit is not None:
        _counters.on_limit = on_limit
    if max_recompile_seconds is not None:
        _counters.max_recompile_seconds = max_recompile_seconds


def compile_metrics() -> dict[str, float]:
    """Compile counters since the last apply()/reset_metrics(), keyed for the metrics logger."""
    _install_counters()
    out = {"compile/graph_breaks": float(_graph_breaks_total() - _counters.graph_breaks_at_reset)}
    for key, total in _cache_totals().items():
        out[f"compile/cache_{key}"] = float(total - _counters.cache_at_reset.get(key, 0))
    if _counters.installed:
        out["compile/compiles"] = float(_counters.compiles)
        out["compile/recompiles"] = float(_counters.recompiles)
        out["compile/seconds"] = _counters.seconds
    return out


# ----------------------------------------------------------------------------------------------- cache


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


def _inductor_header_dir() -> Path | None:
    """Where Inductor keeps its precompiled kernel header (a temp dir), or None where torch has none."""
    try:
        from torch._inductor import codecache
    except ImportError:  # pragma: no cover - every torch with Inductor has the module
        return None
    where = getattr(codecache, "_HEADER_DIR", None)  # read only: Inductor keeps building there
    return Path(where) if isinstance(where, str) else None


def sync_precompiled_headers(path: Path) -> int:
    """Mirror Inductor's precompiled kernel headers between its temp dir and cache dir `path`; files added.

    The header (~160 MB, seconds of g++; BENCHMARKS.md § Compile) lives in the temp dir, so it is rebuilt
    after every reboot or container start, and Inductor builds it before it looks for existing kernels:
    even a fully warm cache dir paid for it. A copy under `path/precompiled_headers` survives with the
    cache dir and is put back when the temp dir lacks it. Hard links where both share a filesystem (no
    disk, no time), else a copy; each file is taken under Inductor's own lock for that header, so a header
    that g++ is still writing is never copied."""
    theirs = _inductor_header_dir()
    ours = path / "precompiled_headers"
    if theirs is None or theirs == ours:
        return 0
    from torch.utils._filelock import FileLock

    added = 0
    for src_dir, dst_dir in ((ours, theirs), (theirs, ours)):
        for gch in sorted(src_dir.glob("*.h.gch")) if src_dir.is_dir() else ():
            header = gch.with_suffix("")  # <hash>.h beside <hash>.h.gch
            if (dst_dir / gch.name).exists() or not header.is_file():
                continue
            (theirs / "locks").mkdir(parents=True, exist_ok=True)
            try:
                with FileLock(str(theirs / "locks" / f"{header.stem}.lock"), timeout=600):
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
    the C++ kernels Inductor built on CPU (`core.compile_artifacts`), which torch's artifacts leave out."""
    from core import compile_artifacts

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
    return compile_artifacts.write(Path(path), blob, _inductor_cache_root(cfg))


def load_artifacts(path: str | os.PathLike[str], cfg: CompileConfig | None = None) -> bool:
    """Preload artifacts saved by `save_artifacts` into `cache_dir(cfg)`; call before the first compile."""
    from core import compile_artifacts

    path = Path(path)
    if not path.is_file():
        return False
    root = configure_cache(cfg)  # artifacts land in whatever cache dir is current, so point it at ours first
    try:
        blob, kernels = compile_artifacts.read(path, root)
    except Exception as exc:  # a damaged file only costs a cold start, never the run
        log.warning("ignoring compile artifacts %s (%s: %s)", path, type(exc).__name__, _first_line(exc))
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
        log.warning("ignoring compile artifacts %s (%s: %s)", path, type(exc).__name__, _first_line(exc))
        return kernels > 0
    return True


def is_compiled(model: nn.Module) -> bool:
    """Whether `apply` left `model` (or its blocks) compiled: its compile_report names full or regional."""
    report = getattr(model, "compile_report", None)
    return report is not None and report.compiled != "none"


# ----------------------------------------------------------------------------------------------- state dicts


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module behind any `torch.compile(...)` wrappers (in-place compiled modules are their own)."""
    while hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
        model = model._orig_mod
    return model


def _strip_prefixed_keys(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and ORIG_MOD in k[len(prefix) :]]:
        state_dict[prefix + clean_key(key[len(prefix) :])] = state_dict.pop(key)


def accept_prefixed_keys(model: nn.Module) -> nn.Module:
    """Make `model.load_state_dict` accept keys saved through `torch.compile` wrappers (`_orig_mod.`)."""
    if not getattr(model, "_torchkiln_accepts_prefixed", False):
        # the root's pre-hook sees (and may rename keys in) the one dict every submodule then loads from
        model._register_load_state_dict_pre_hook(_strip_prefixed_keys, with_module=True)
        model._torchkiln_accepts_prefixed = True
    return model


# ----------------------------------------------------------------------------------------------- blocks


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """Repeated blocks to compile one by one: `model.compile_blocks` if declared, else the outermost
    ModuleList/Sequential children that share a class with a sibling and are not leaf layers."""
    declared = getattr(model, "compile_blocks", None)
    if declared is not None:
        if callable(declared) and not isinstance(declared, nn.Module):
            declared = declared()
        blocks = [model.get_submodule(b) if isinstance(b, str) else b for b in declared]
        for b in blocks:
            if not isinstance(b, nn.Module):
                raise ConfigError(
                    f"{type(model).__name__}.compile_blocks holds {type(b).__name__}, not modules"
                )
        return blocks
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            classes = [type(c) for c in children]
            repeated = [c for c in children if classes.count(type(c)) > 1 and any(True for _ in c.children())]
            if repeated:
                found.extend(repeated)
                children = [c for c in children if all(c is not r for r in repeated)]
        for child in children:
            visit(child)

    visit(model)
    return found


# ----------------------------------------------------------------------------------------------- applying


class _Fallback:
    """Stands in for a module's compiled call: on a compiler error, runs eager and reverts the whole model."""

    def __init__(self, compiled: Callable[..., Any], module: nn.Module, state: _ModelState) -> None:
        self.compiled, self.module, self.state = compiled, module, state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _install_counters()
        if _counters.on_limit == "eager" and _over_recompile_bounds():
            self.state.revert(
                f"{_counters.recompiles} recompiles in {_counters.recompile_seconds:.1f} s (bounds: "
                f"compile.max_recompiles={_counters.max_recompiles}, "
                f"{_recompile_seconds_bound():.1f} s from compile.max_recompile_seconds="
                f"{_counters.max_recompile_seconds:g} or {RECOMPILE_SECONDS_PER_FIRST}x the first compile)",
                failed=False,
            )
            return self.module._call_impl(*args, **kwargs)
        if self.state.propagate_marks and _marked_sizes:
            _mark_matching_dims((args, kwargs))
        try:
            return self.compiled(*args, **kwargs)
        except Exception as exc:
            if self.state.on_error == "raise":
                raise
            # an error eager reproduces is the user's, not the compiler's: let eager raise it
            out = self.module._call_impl(*args, **kwargs)
            self.state.revert(_describe(exc))
            return out


@dataclass
class _ModelState:
    """The modules compiled in place for one model, so one failure reverts them all."""

    targets: list[nn.Module]
    on_error: str
    report: CompileReport
    #: regional blocks see activations, not the marked batch: carry the batch's dynamic sizes over to them
    propagate_marks: bool = False

    def revert(self, why: str = "", *, failed: bool = True) -> None:
        for module in self.targets:
            module._compiled_call_impl = None
        if why and failed:
            self.report.compiled = "none"
            self.report.reason = f"compile failed ({why}); running eager"
            log.warning("torch.compile failed (%s); running eager (compile.on_error=eager)", why)
        elif why:
            self.report.compiled = "none"
            self.report.reason = f"{why}: running eager from here (compile.on_recompile_limit=eager)"
            log.warning(
                "torch.compile: %s; running eager from here (compile.on_recompile_limit=eager; mark varying "
                "dims with core.compile.mark_dynamic_batch, bucket lengths, or see TORCH_LOGS=recompiles)",
                why,
            )

    def restore(self, compiled: list[Callable[..., Any] | None]) -> None:
        for module, impl in zip(self.targets, compiled, strict=True):
            module._compiled_call_impl = impl


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def _describe(exc: BaseException) -> str:
    """One line naming the error and its root cause (dynamo wraps backend errors in BackendCompilerFailed)."""
    out = f"{type(exc).__name__}: {_first_line(exc)}"
    cause = getattr(exc, "inner_exception", None) or exc.__cause__
    if isinstance(cause, BaseException) and cause is not exc:
        out += f" <- {type(cause).__name__}: {_first_line(cause)}"
    return out


def _compile_kwargs(cfg: CompileConfig, backend: str | Callable[..., Any] | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dynamic": DYNAMIC[str(cfg.dynamic).lower()], "fullgraph": cfg.fullgraph}
    if backend is not None:
        kwargs["backend"] = backend
    if (backend is None or backend == "inductor") and cfg.mode != "default":
        kwargs["mode"] = cfg.mode
    return kwargs


def _allow_per_instance_graphs(n_blocks: int) -> None:
    """Before torch 2.5 dynamo compiled one graph per module instance, so N blocks sharing a forward
    needed N cache entries; raise the limit there so late blocks do not silently run eager."""
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 5):
        return  # parameters are graph inputs (inline_inbuilt_nn_modules): one graph serves every block
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name, 8) < 2 * n_blocks + 8:
        log.info("torch %s compiles each block separately; raising dynamo %s", torch.__version__, name)
        setattr(cfg, name, 2 * n_blocks + 8)


def _sync(model: nn.Module) -> None:
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cuda":
        torch.cuda.synchronize(p.device)
    elif p is not None and p.device.type == "mps":
        torch.mps.synchronize()


def _time_ms(model: nn.Module, probe: Callable[[nn.Module], None], steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        _sync(model)
        t0 = time.perf_counter()
        probe(model)
        _sync(model)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


class _Preserved:
    """Restores RNG streams and buffers (e.g. BatchNorm statistics) that probe steps advance."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> _Preserved:
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        return self

    def __exit__(self, *exc: object) -> None:
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            for n, b in self.model.named_buffers():
                if n in self.buffers:
                    b.copy_(self.buffers[n])


def decide(eager_ms: float, compiled_ms: float, min_speedup: float) -> tuple[bool, str]:
    """Whether policy=auto keeps compile given median step times, and the reason in words."""
    speedup = eager_ms / compiled_ms if compiled_ms > 0 else float("inf")
    keep = speedup >= min_speedup
    verdict = "keeping compile" if keep else f"keeping eager (needs >= {min_speedup:.2f}x)"
    return (
        keep,
        f"compiled {compiled_ms:.1f} ms/step vs eager {eager_ms:.1f} ms/step ({speedup:.2f}x): {verdict}",
    )


def default_auto_candidates(device_type: str) -> list[str]:
    """What policy=auto tries when compile.auto_candidates is empty: the whole model on CPU, blocks elsewhere.

    On CPU the whole-model graph stepped as fast or faster than per-block graphs for every stand-in model
    benchmarked, and within noise of them for the recipes' own models (BENCHMARKS.md § Compile), and most
    of a cold compile is a fixed toolchain cost that both pay; on GPUs
    per-block compile is the usual choice (torchtitan), where the cold cost grows with the blocks traced.
    """
    return ["full"] if device_type == "cpu" else ["regional"]


def _candidates(model: nn.Module, cfg: CompileConfig) -> list[tuple[str, list[nn.Module]]]:
    """(kind, modules to compile) for each distinct way `cfg` asks to try; regional without blocks is full."""
    if cfg.policy != "auto":
        names = [cfg.policy]
    elif cfg.auto_candidates:
        names = list(cfg.auto_candidates)
    else:
        param = next(model.parameters(), None)
        names = default_auto_candidates(param.device.type if param is not None else "cpu")
    out: list[tuple[str, list[nn.Module]]] = []
    for name in names:
        blocks = find_blocks(model) if name == "regional" else []
        if name == "regional" and not blocks:
            log.info("no repeated blocks found in %s; compiling it whole", type(model).__name__)
        kind, targets = ("regional", blocks) if blocks else ("full", [model])
        if all(kind != k for k, _ in out):
            out.append((kind, targets))
    return out


def _compile_in_place(targets: list[nn.Module], kwargs: dict[str, Any], state: _ModelState) -> bool:
    """Compile each target in place behind a `_Fallback`; False (reverted, warned) if wrapping failed."""
    try:
        for module in targets:
            module.compile(**kwargs)
            module._compiled_call_impl = _Fallback(module._compiled_call_impl, module, state)
    except Exception as exc:
        if state.on_error == "raise":
            raise
        state.revert(_describe(exc))
        return False
    return True


def _first_step(model: nn.Module, probe: Callable[[nn.Module], None], state: _ModelState) -> float:
    """Run the probe once (this compiles); on a compiler error fall back per on_error. Returns seconds."""
    t0 = time.perf_counter()
    try:
        probe(model)
    except Exception as exc:
        if state.on_error == "raise" or state.report.compiled == "none":
            raise  # the forward already fell back, so eager itself failed: the model's own error
        # a backward compiled lazily fails inside loss.backward(), beyond _Fallback's reach
        state.revert()
        probe(model)  # eager; an error here is the model's own and propagates
        state.revert(_describe(exc))
    return time.perf_counter() - t0


def apply(
    model: nn.Module,
    cfg: CompileConfig | None = None,
    *,
    probe: Callable[[nn.Module], None] | None = None,
    backend: str | Callable[..., Any] | None = "inductor",
    planned_steps: int | None = None,
) -> nn.Module:
    """Compile `model` in place per `cfg` and return it; `probe(model)` runs one training forward+backward.

    The probe's first call triggers compilation, so compiler errors surface here (and fall back to eager
    under on_error=eager); policy=auto also times it. Probe steps leave RNG and buffers as they found them
    but accumulate gradients: zero them afterwards. The decision is in `model.compile_report`.
    """
    cfg = (cfg or CompileConfig()).validate()
    accept_prefixed_keys(model)
    reset_metrics(cfg.max_recompiles, cfg.on_recompile_limit, cfg.max_recompile_seconds)
    report = CompileReport(policy=cfg.policy)
    model.compile_report = report
    if cfg.policy == "off":
        report.reason = "compile.policy=off"
        return model
    if not hasattr(nn.Module, "compile"):
        report.reason = f"torch {torch.__version__} lacks nn.Module.compile; running eager"
        log.warning(report.reason)
        return model
    if backend is None or backend == "inductor":
        configure_cache(cfg)
    kwargs = _compile_kwargs(cfg, backend)

    candidates = _candidates(model, cfg)
    if cfg.policy != "auto" or probe is None:
        kind, targets = candidates[0]  # auto without a probe cannot measure: its first candidate
        state = _start(kind, targets, report, cfg.on_error)
        if not _compile_in_place(targets, kwargs, state):
            return model
        if probe is None:
            report.reason = f"compile.policy={cfg.policy}: {kind} compile, not timed (no probe)"
        else:
            with _Preserved(model):
                report.compile_seconds = _first_step(model, probe, state)
            if report.compiled == "none":
                return model  # reverted to eager and warned
            report.reason = (
                f"compile.policy={cfg.policy}: first step (compile) {report.compile_seconds:.1f} s"
            )
        log.info(report.reason)
        return model

    if planned_steps is not None:
        with _Preserved(model):
            _time_ms(model, probe, 1)  # warm-up
            step_ms = statistics.median(_time_ms(model, probe, 1) + _time_ms(model, probe, 1))
        eager_total = step_ms * planned_steps / 1000
        if eager_total < cfg.auto_min_run_seconds:
            report.eager_step_ms = step_ms
            report.reason = (
                f"compile.policy=auto: eager, the run is too short to repay a compile ({planned_steps} "
                f"steps x {step_ms:.1f} ms = {eager_total:.0f} s < "
                f"compile.auto_min_run_seconds={cfg.auto_min_run_seconds:g})"
            )
            log.info(report.reason)
            return model

    # auto: per candidate, compile (first probe step), then alternate eager and compiled steps so drift in
    # machine load hits both sides alike; keep the fastest candidate if it beats eager by the margin
    eager_ms: list[float] = []
    tried: list[tuple[float, str, list[nn.Module], list[Any], float]] = []
    with _Preserved(model):
        for kind, targets in candidates:
            state = _start(kind, targets, report, cfg.on_error)
            if not _compile_in_place(targets, kwargs, state):
                continue
            seconds = _first_step(model, probe, state)
            if report.compiled == "none":
                continue  # this candidate failed to compile; reverted and warned
            impls = [m._compiled_call_impl for m in targets]
            _time_ms(model, probe, 1)  # compiled warm-up (allocator, autotuned kernels)
            state.revert()
            _time_ms(model, probe, 1)  # eager warm-up
            ours: list[float] = []
            for _ in range(cfg.auto_steps):
                eager_ms += _time_ms(model, probe, 1)
                state.restore(impls)
                ours += _time_ms(model, probe, 1)
                state.revert()
            tried.append((statistics.median(ours), kind, targets, impls, seconds))
    if not tried:
        return model  # every candidate fell back to eager, with a warning each
    report.eager_step_ms = statistics.median(eager_ms)
    report.compiled_step_ms, kind, targets, impls, report.compile_seconds = min(tried, key=lambda t: t[0])
    keep, why = decide(report.eager_step_ms, report.compiled_step_ms, cfg.auto_min_speedup)
    if keep:
        _ModelState(targets, cfg.on_error, report).restore(impls)
        report.compiled, report.blocks = kind, len(targets) if kind == "regional" else 0
    else:
        report.compiled = "none"
    others = ", ".join(f"{k} {ms:.1f} ms" for ms, k, *_ in tried if k != kind)
    report.reason = (
        f"compile.policy=auto: best {kind} {why}"
        + (f"; also tried {others}" if others else "")
        + f"; its first step (compile) {report.compile_seconds:.1f} s"
    )
    log.info(report.reason)
    return model


def _start(kind: str, targets: list[nn.Module], report: CompileReport, on_error: str) -> _ModelState:
    """Record that `kind` is being compiled and return the state that reverts it as a whole."""
    report.compiled, report.blocks = kind, len(targets) if kind == "regional" else 0
    if kind == "regional":
        _allow_per_instance_graphs(len(targets))
    return _ModelState(targets, on_error, report, propagate_marks=kind == "regional")


def revert(model: nn.Module) -> nn.Module:
    """Undo in-place compilation of `model` and all its submodules (e.g. before export or debugging)."""
    for module in model.modules():
        module._compiled_call_impl = None
    return model


# ----------------------------------------------------------------------------------------------- dynamic dims


def _tensors(batch: Any, key: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield key, batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _tensors(v, str(k))
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v, key)
    elif hasattr(batch, "__dataclass_fields__"):
        for k in batch.__dataclass_fields__:
            yield from _tensors(getattr(batch, k), k)


def apply_shape_hints(batch: Any, hints: ShapeHints, sampler: object, *, training: bool) -> Any:
    """A compiled model's batch shaped per the task's `hints`: bucketed dims padded up to `sampler`'s
    boundaries (a `LengthBucketBatchSampler`; other samplers have none), static dims marked, and in
    evaluation the dims whose last batches are short marked dynamic. Returns the (new) batch."""
    if not isinstance(batch, dict):
        return batch
    pad = getattr(sampler, "pad_to_bucket", None)
    if pad is not None and hints.bucket_pad:
        batch = {k: pad(v, hints.bucket_pad[k]) if k in hints.bucket_pad else v for k, v in batch.items()}
    if not training and hints.eval_dynamic:
        mark_dynamic_batch(batch, hints.eval_dynamic)
    for key, dims in hints.static.items():
        for d in dims:
            if key in batch:
                torch._dynamo.mark_static(batch[key], d)
    return batch


def mark_dynamic_batch(batch: Any, dims: Sequence[int] | Mapping[str, Sequence[int]] = (0,)) -> Any:
    """Mark the varying dims (batch, time) of every tensor in `batch` dynamic so dynamo compiles them
    symbolically from the first call instead of recompiling per shape; returns `batch`.

    `dims` applies to every tensor that has them, or maps a dict/dataclass key to its dims. Call it after
    the batch is on its device (`.to()` makes new tensors without the marks). The marks are hints, not
    constraints: a model that branches on a size still works, it just recompiles (and that is counted).
    """
    mark = _mark_fn()
    _marked_sizes.clear()
    for key, tensor in _tensors(batch):
        wanted: Iterable[int] = dims.get(key, ()) if isinstance(dims, Mapping) else dims
        for d in wanted:
            if -tensor.dim() <= d < tensor.dim():
                mark(tensor, d % tensor.dim())
                if tensor.shape[d] >= 2:  # dynamo specialises sizes 0 and 1 whatever the marks say
                    _marked_sizes.add(int(tensor.shape[d]))
    return batch


#: sizes of the dims the latest `mark_dynamic_batch` marked; regionally compiled blocks mark the dims of
#: their inputs that have these sizes, because activations (e.g. the embedding output) do not inherit marks
#: and dynamo would otherwise compile each block statically first and recompile (twice, for view and
#: non-view inputs) on every newly varying dim
_marked_sizes: set[int] = set()


def _mark_fn() -> Callable[[torch.Tensor, int], None]:
    # a weak mark: a model that specialises the dim still runs (and recompiles, which is counted)
    return getattr(torch._dynamo, "maybe_mark_dynamic", torch._dynamo.mark_dynamic)


def _mark_matching_dims(inputs: Any) -> None:
    mark = _mark_fn()
    for _key, tensor in _tensors(inputs):
        for d, size in enumerate(tensor.shape):
            if size in _marked_sizes:
                mark(tensor, d)


def copy_uncompiled(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with no compiled state (compiled callables do not deep-copy)."""
    saved = {m: m._compiled_call_impl for m in model.modules()}
    try:
        revert(model)
        return copy.deepcopy(model)
    finally:
        for m, impl in saved.items():
            m._compiled_call_impl = impl
