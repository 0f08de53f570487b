"""Process-wide compile counters (compiles, recompiles, seconds, graph breaks, cache hits) for the loop's
logs, and the recompile bounds `apply`'s fallback enforces. dynamo's own counters are process-global too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from core.compile import torch_internals
from core.compile.cache import keep_precompiled_headers
from core.compile.config import CompileConfig

log = logging.getLogger("torchkiln.compile")


@dataclass
class _Counters:
    """Process-wide compile events since the last `reset_metrics()`; dynamo's own counters are global too."""

    compiles: int = 0
    #: recompiles per compiled frame ("frame" of dynamo's "frame/attempt" compile ids): the count bound is
    #: on the most recompiled one, as dynamo's own recompile_limit is per code object
    frame_recompiles: dict[str, int] = field(default_factory=dict)
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

    @property
    def recompiles(self) -> int:
        """Recompiles of every frame together."""
        return sum(self.frame_recompiles.values())


#: the counters since the last reset_metrics()
events = _Counters()


def _graph_breaks_total() -> int:
    return int(sum(torch_internals.dynamo_counters()["graph_break"].values()))


def _cache_totals() -> dict[str, int]:
    """Hits and misses of Inductor's FX-graph cache plus AOTAutograd's cache: hits mean a warm start."""
    counters = torch_internals.dynamo_counters()
    return {
        "hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
        "misses": counters["inductor"]["fxgraph_cache_miss"]
        + counters["aot_autograd"]["autograd_cache_miss"],
    }


# the clock compile durations are read from (tests replace it to make the seconds bound deterministic)
_compile_clock: Callable[[], float] = time.perf_counter


def _on_start(args: Any) -> None:
    events.started[f"{args.callback_trigger}:{args.compile_id}"] = _compile_clock()


def _frame(compile_id: object) -> str:
    """The frame part of a compile id ("!ca/3/1" -> "!ca/3")."""
    return str(compile_id).rsplit("/", 1)[0]


def _is_recompile(compile_id: object) -> bool:
    # compile ids read "frame/attempt" ("!ca/frame/attempt" under compiled autograd); attempt > 0 means
    # this code object was compiled before and its guards failed on new inputs: a recompile
    parts = str(compile_id).split("/")
    return len(parts) >= 2 and parts[-1].isdigit() and int(parts[-1]) > 0


#: recompile seconds allowed per second of first compile (see CompileConfig.max_recompile_seconds)
RECOMPILE_SECONDS_PER_FIRST = 4


def recompile_seconds_bound() -> float:
    """Seconds of recompiles allowed: the configured bound, or RECOMPILE_SECONDS_PER_FIRST x the first's."""
    return max(events.max_recompile_seconds, RECOMPILE_SECONDS_PER_FIRST * events.first_seconds)


def most_frame_recompiles() -> int:
    """The recompiles of the most recompiled frame since the last reset."""
    return max(events.frame_recompiles.values(), default=0)


def over_recompile_bounds() -> bool:
    """Whether recompiles passed either bound (one frame's count, or seconds) since the last reset: a model
    split by graph breaks into N frames recompiles each once for evaluation (no_grad), N in all, the one
    expected recompile, which the count bound must not take for a storm."""
    return (
        most_frame_recompiles() > events.max_recompiles
        or events.recompile_seconds > recompile_seconds_bound()
    )


def _on_end(args: Any) -> None:
    begun = events.started.pop(f"{args.callback_trigger}:{args.compile_id}", None)
    recompile = _is_recompile(args.compile_id)
    if begun is not None:
        took = _compile_clock() - begun
        events.seconds += took
        if recompile:  # its lazily compiled backward included
            events.recompile_seconds += took
        else:
            events.first_seconds += took
    if args.callback_trigger.name != "DYNAMO":
        return  # lazy backward / autotuning / cudagraph recording belong to a compile already counted
    keep_precompiled_headers()  # the first compile has built (or found) the header by now
    events.compiles += 1
    if recompile:
        frame = _frame(args.compile_id)
        events.frame_recompiles[frame] = events.frame_recompiles.get(frame, 0) + 1
        # with on_limit=eager the model's next call reverts to eager and says so; warn here otherwise
        if over_recompile_bounds() and events.on_limit == "warn" and not events.warned:
            events.warned = True
            log.warning(
                "torch.compile recompiled %d times in %.1f s (bounds: compile.max_recompiles=%d, %.1f s); "
                "mark varying dims with core.compile.mark_dynamic_batch and bucket lengths "
                "(core.data.samplers.LengthBucketBatchSampler), or see TORCH_LOGS=recompiles",
                events.recompiles,
                events.recompile_seconds,
                events.max_recompiles,
                recompile_seconds_bound(),
            )


def install_callbacks() -> None:
    """Register the compile callbacks, again if `torch._dynamo.reset()` (which clears them) ran since."""
    if events.unavailable:
        return
    callback_handler = torch_internals.compile_callbacks()
    if callback_handler is None:
        events.unavailable = f"torch {torch.__version__} has no compile callbacks; recompiles not counted"
        log.info(events.unavailable)
        return
    if _on_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_start)
        callback_handler.register_end_callback(_on_end)
    events.installed = True


def reset_metrics(
    max_recompiles: int | None = None, on_limit: str | None = None, max_recompile_seconds: float | None = None
) -> None:
    """Zero the counters behind `compile_metrics()` (apply() does this); set the recompile bounds, action."""
    install_callbacks()
    events.compiles = 0
    events.frame_recompiles = {}
    events.seconds = events.recompile_seconds = events.first_seconds = 0.0
    events.warned = False
    events.graph_breaks_at_reset = _graph_breaks_total()
    events.cache_at_reset = _cache_totals()
    if max_recompiles is not None:
        events.max_recompiles = max_recompiles
    if on_limit is not None:
        events.on_limit = on_limit
    if max_recompile_seconds is not None:
        events.max_recompile_seconds = max_recompile_seconds


def compile_metrics() -> dict[str, float]:
    """Compile counters since the last apply()/reset_metrics(), keyed for the metrics logger."""
    install_callbacks()
    out = {"compile/graph_breaks": float(_graph_breaks_total() - events.graph_breaks_at_reset)}
    for key, total in _cache_totals().items():
        out[f"compile/cache_{key}"] = float(total - events.cache_at_reset.get(key, 0))
    if events.installed:
        out["compile/compiles"] = float(events.compiles)
        out["compile/recompiles"] = float(events.recompiles)
        out["compile/seconds"] = events.seconds
    return out
