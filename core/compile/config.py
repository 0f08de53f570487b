"""The `compile` config section (`CompileConfig`): every default in one place, validated up front."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated

from core.bounds import Bounds, check_values

POLICIES = ("auto", "off", "full", "regional")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DYNAMIC = {"auto": None, "true": True, "false": False}
ON_ERROR = ("eager", "raise")


@dataclass
class CompileConfig:
    """The `compile` config section; these defaults are the single source of truth."""

    #: auto = compile (see auto_candidates), keep it only if timed steps beat eager; off; full = whole model;
    #: regional = each repeated block (ModuleList children sharing a class, or `model.compile_blocks`)
    policy: Annotated[str, Bounds(choices=POLICIES)] = "auto"
    #: torch.compile mode (Inductor only)
    mode: Annotated[str, Bounds(choices=MODES)] = "default"
    #: "auto" lets dynamo make a dim dynamic after it changes once; "true"/"false" force it
    dynamic: Annotated[str, Bounds(choices=tuple(DYNAMIC))] = "auto"
    #: what a compiler error does: fall back to eager with a warning, or raise
    on_error: Annotated[str, Bounds(choices=ON_ERROR)] = "eager"
    #: Inductor/FX cache directory; None = $TORCHKILN_CACHE/compile or ~/.cache/torchkiln/compile
    cache_dir: str | None = None
    #: load a checkpoint's compile artifacts even when this user did not sign them: they hold pickles and
    #: native kernels, i.e. code that runs; only for runs you trust (default: only your own runs' files)
    trust_artifacts: bool = False
    #: bound on recompiles of any one compiled frame, as dynamo's own limit is per frame (each costs compile
    #: time; many mean unmarked dynamic dims or data-dependent code); a model split by graph breaks
    #: recompiles every frame once for evaluation
    max_recompiles: Annotated[int, Bounds(ge=0)] = 8
    #: bound on seconds spent in recompiles, or 4x the first compile's seconds if more: the <= 3 recompiles
    #: bucketed lengths cost (one graph per bucket) plus an eval-mode one, each as long as the first, are
    #: expected; recompiles of an unbucketed or dynamic-shape graph can each take minutes
    max_recompile_seconds: Annotated[float, Bounds(ge=0)] = 120.0
    #: what passing either bound does: "eager" runs the model eager from then on (a recompiling model spends
    #: more time compiling than compiled code saves); "warn" logs once and keeps compiling
    on_recompile_limit: Annotated[str, Bounds(choices=("eager", "warn"))] = "eager"
    #: fail on graph breaks instead of splitting the graph (torchtitan compiles blocks this way)
    fullgraph: bool = False
    #: timed probe steps per side (compiled, eager) under policy=auto, after one warm-up each
    auto_steps: Annotated[int, Bounds(ge=1)] = 3
    #: policy=auto keeps compile only if eager_ms / compiled_ms >= this (margin against timing noise)
    auto_min_speedup: Annotated[float, Bounds(gt=0)] = 1.02
    #: what policy=auto compiles and times against eager, fastest kept (each costs a cold compile); empty =
    #: per device (`default_auto_candidates`): whole model on CPU, per block elsewhere
    auto_candidates: Annotated[list[str], Bounds(choices=("full", "regional"))] = field(default_factory=list)
    #: policy=auto stays eager when the planned run's eager time is below this: a cold CPU compile, and the
    #: toolchain probe the first time on a machine, cost tens of seconds (BENCHMARKS.md § Compile), which a
    #: short run can never earn back
    auto_min_run_seconds: Annotated[float, Bounds(ge=0)] = 300.0

    def validate(self) -> CompileConfig:
        """Raise ConfigError naming the first bad key; return self."""
        values = dataclasses.asdict(self)
        values["dynamic"] = str(self.dynamic).lower()  # YAML may give a bool
        check_values("compile", values, CompileConfig)
        return self
