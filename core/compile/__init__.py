"""torch.compile applied from outside: per-block (regional) or whole-model, measured, cached, never fatal.

`apply(model, cfg, probe=...)` compiles a plain `nn.Module` in place (so state_dict keys never gain
`_orig_mod.`), falls back to eager with a one-line warning when the compiler fails, and under the default
`policy=auto` keeps compile only when timed training steps show it is faster. `compile_metrics()` gives the
counters the training loop logs (recompiles, graph breaks, compile seconds).

One concern per module: `config` (CompileConfig), `report` (CompileReport, one-line errors), `apply` (in-place
compile, fallback, auto timing, what runs compiled), `blocks` (what regional compiles), `shapes` (dynamic
marks, length buckets, a task's shape hints), `state_dict` (compiled <-> eager keys), `metrics` (compile
counters and recompile bounds), `cache` (cache dir, precompiled header, artifacts beside checkpoints),
`artifacts` (that file's format) and `torch_internals` (every private torch API used, nowhere else).
"""

from core.compile.apply import (
    apply,
    bucket_for_compiled,
    compiled_modules,
    copy_uncompiled,
    decide,
    default_auto_candidates,
    is_compiled,
    revert,
    run_eagerly,
)
from core.compile.blocks import find_blocks
from core.compile.cache import (
    cache_dir,
    configure_cache,
    load_artifacts,
    save_artifacts,
    sync_precompiled_headers,
)
from core.compile.config import DYNAMIC, MODES, ON_ERROR, POLICIES, CompileConfig
from core.compile.metrics import compile_metrics, reset_metrics
from core.compile.report import CompileReport
from core.compile.shapes import apply_shape_hints, length_bucket, mark_dynamic_batch
from core.compile.state_dict import accept_prefixed_keys, unwrap

__all__ = [
    "DYNAMIC",
    "MODES",
    "ON_ERROR",
    "POLICIES",
    "CompileConfig",
    "CompileReport",
    "accept_prefixed_keys",
    "apply",
    "apply_shape_hints",
    "bucket_for_compiled",
    "cache_dir",
    "compile_metrics",
    "compiled_modules",
    "configure_cache",
    "copy_uncompiled",
    "decide",
    "default_auto_candidates",
    "find_blocks",
    "is_compiled",
    "length_bucket",
    "load_artifacts",
    "mark_dynamic_batch",
    "reset_metrics",
    "revert",
    "run_eagerly",
    "save_artifacts",
    "sync_precompiled_headers",
    "unwrap",
]
