"""`apply`: compile a plain model in place, per block or whole, measured under policy=auto, never fatal:
a compiler error, or recompiles past their bounds, put the whole model back to eager with one line."""

from __future__ import annotations

import contextlib
import copy
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.compile import metrics, shapes, torch_internals
from core.compile.blocks import find_blocks
from core.compile.cache import configure_cache
from core.compile.config import DYNAMIC, CompileConfig
from core.compile.report import CompileReport, describe
from core.compile.state_dict import accept_prefixed_keys
from core.logging.messages import say

log = logging.getLogger("torchkiln.compile")


def is_compiled(model: nn.Module) -> bool:
    """Whether `apply` left `model` (or its blocks) compiled: its compile_report names full or regional."""
    report = getattr(model, "compile_report", None)
    return report is not None and report.compiled != "none"


class _Fallback:
    """Stands in for a module's compiled call: on a compiler error, runs eager and reverts the whole model."""

    def __init__(self, compiled: Callable[..., Any], module: nn.Module, state: _ModelState) -> None:
        self.compiled, self.module, self.state = compiled, module, state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        metrics.install_callbacks()
        events = metrics.events
        if events.on_limit == "eager" and metrics.over_recompile_bounds():
            self.state.revert(
                f"{events.recompiles} recompiles in {events.recompile_seconds:.1f} s, "
                f"{metrics.most_frame_recompiles()} of one frame (bounds: "
                f"compile.max_recompiles={events.max_recompiles} a frame, "
                f"{metrics.recompile_seconds_bound():.1f} s from compile.max_recompile_seconds="
                f"{events.max_recompile_seconds:g} or "
                f"{metrics.RECOMPILE_SECONDS_PER_FIRST}x the first compile)",
                failed=False,
            )
            return torch_internals.eager_call(self.module, *args, **kwargs)
        if self.state.propagate_marks and shapes.marked_sizes:
            shapes.mark_matching_dims((args, kwargs))
        try:
            return self.compiled(*args, **kwargs)
        except Exception as exc:
            if self.state.on_error == "raise":
                raise
            # an error eager reproduces is the user's, not the compiler's: let eager raise it
            out = torch_internals.eager_call(self.module, *args, **kwargs)
            self.state.revert(describe(exc))
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
            torch_internals.set_compiled_call(module, None)
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
            torch_internals.set_compiled_call(module, impl)


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
    cfg = torch_internals.dynamo_config()
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


def time_ms(model: nn.Module, probe: Callable[[nn.Module], None], steps: int) -> list[float]:
    """Wall ms of each of `steps` calls of `probe(model)`, the device synchronised around each."""
    out = []
    for _ in range(steps):
        _sync(model)
        t0 = time.perf_counter()
        probe(model)
        _sync(model)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


class Preserved:
    """Restores RNG streams and buffers (e.g. BatchNorm statistics) that probe steps advance."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> Preserved:
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
            fallback = _Fallback(torch_internals.compiled_call(module), module, state)
            torch_internals.set_compiled_call(module, fallback)
    except Exception as exc:
        if state.on_error == "raise":
            raise
        state.revert(describe(exc))
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
        state.revert(describe(exc))
    return time.perf_counter() - t0


#: a timed candidate: (median compiled step ms, kind, compiled modules, their compiled calls, compile seconds)
_Tried = tuple[float, str, list[nn.Module], list[Any], float]


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
    metrics.reset_metrics(cfg.max_recompiles, cfg.on_recompile_limit, cfg.max_recompile_seconds)
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
        _compile_first_candidate(model, cfg, candidates[0], kwargs, probe, report)
    elif not _too_short_to_repay(model, cfg, probe, planned_steps, report):
        eager_ms, tried = _timed_candidates(model, cfg, candidates, kwargs, probe, report)
        _keep_the_fastest(cfg, eager_ms, tried, report)
    return model


def _compile_first_candidate(
    model: nn.Module,
    cfg: CompileConfig,
    candidate: tuple[str, list[nn.Module]],
    kwargs: dict[str, Any],
    probe: Callable[[nn.Module], None] | None,
    report: CompileReport,
) -> None:
    """Compile `candidate` untimed against eager (policy=on/regional/full, or auto without a probe, which
    cannot measure); the probe's first step, when given, compiles it here."""
    kind, targets = candidate
    state = _start(kind, targets, report, cfg.on_error)
    if not _compile_in_place(targets, kwargs, state):
        return
    if probe is None:
        report.reason = f"compile.policy={cfg.policy}: {kind} compile, not timed (no probe)"
    else:
        with Preserved(model):
            report.compile_seconds = _first_step(model, probe, state)
        if report.compiled == "none":
            return  # reverted to eager and warned
        report.reason = f"compile.policy={cfg.policy}: first step (compile) {report.compile_seconds:.1f} s"
    say(report.reason, log)  # once: the log (with the recipes) or stdout


def _too_short_to_repay(
    model: nn.Module,
    cfg: CompileConfig,
    probe: Callable[[nn.Module], None],
    planned_steps: int | None,
    report: CompileReport,
) -> bool:
    """Whether the planned run, timed eager, is shorter than compile.auto_min_run_seconds (then it stays
    eager, the reason reported)."""
    if planned_steps is None:
        return False
    with Preserved(model):
        time_ms(model, probe, 1)  # warm-up
        step_ms = statistics.median(time_ms(model, probe, 1) + time_ms(model, probe, 1))
    eager_total = step_ms * planned_steps / 1000
    if eager_total >= cfg.auto_min_run_seconds:
        return False
    report.eager_step_ms = step_ms
    report.reason = (
        f"compile.policy=auto: eager, the run is too short to repay a compile ({planned_steps} "
        f"steps x {step_ms:.1f} ms = {eager_total:.0f} s < "
        f"compile.auto_min_run_seconds={cfg.auto_min_run_seconds:g})"
    )
    say(report.reason, log)  # once: the log (with the recipes) or stdout
    return True


def _keep_the_fastest(
    cfg: CompileConfig, eager_ms: list[float], tried: list[_Tried], report: CompileReport
) -> None:
    """policy=auto: keep the fastest candidate `tried` compiled if it beats the `eager_ms` steps by the margin
    (compile.auto_min_speedup); the reason names every candidate."""
    if not tried:
        return  # every candidate fell back to eager, with a warning each
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
    say(report.reason, log)  # once: the log (with the recipes) or stdout


def _timed_candidates(
    model: nn.Module,
    cfg: CompileConfig,
    candidates: list[tuple[str, list[nn.Module]]],
    kwargs: dict[str, Any],
    probe: Callable[[nn.Module], None],
    report: CompileReport,
) -> tuple[list[float], list[_Tried]]:
    """(eager step times in ms, (median compiled ms, kind, targets, compiled calls, compile seconds) per
    candidate that compiled); the model is left eager."""
    # per candidate, compile (first probe step), then alternate eager and compiled steps so drift in
    # machine load hits both sides alike
    eager_ms: list[float] = []
    tried: list[_Tried] = []
    with Preserved(model):
        for kind, targets in candidates:
            state = _start(kind, targets, report, cfg.on_error)
            if not _compile_in_place(targets, kwargs, state):
                continue
            seconds = _first_step(model, probe, state)
            if report.compiled == "none":
                continue  # this candidate failed to compile; reverted and warned
            impls = [torch_internals.compiled_call(m) for m in targets]
            time_ms(model, probe, 1)  # compiled warm-up (allocator, autotuned kernels)
            state.revert()
            time_ms(model, probe, 1)  # eager warm-up
            ours: list[float] = []
            for _ in range(cfg.auto_steps):
                eager_ms += time_ms(model, probe, 1)
                state.restore(impls)
                ours += time_ms(model, probe, 1)
                state.revert()
            tried.append((statistics.median(ours), kind, targets, impls, seconds))
    return eager_ms, tried


def _start(kind: str, targets: list[nn.Module], report: CompileReport, on_error: str) -> _ModelState:
    """Record that `kind` is being compiled and return the state that reverts it as a whole."""
    report.compiled, report.blocks = kind, len(targets) if kind == "regional" else 0
    if kind == "regional":
        _allow_per_instance_graphs(len(targets))
    return _ModelState(targets, on_error, report, propagate_marks=kind == "regional")


def revert(model: nn.Module) -> nn.Module:
    """Undo in-place compilation of `model` and all its submodules (e.g. before export or debugging)."""
    for module in model.modules():
        torch_internals.set_compiled_call(module, None)
    return model


def copy_uncompiled(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with no compiled state (compiled callables do not deep-copy)."""
    saved = {m: torch_internals.compiled_call(m) for m in model.modules()}
    try:
        revert(model)
        return copy.deepcopy(model)
    finally:
        for m, impl in saved.items():
            torch_internals.set_compiled_call(m, impl)


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """The submodules of `model` (itself included) that run a compiled call now, in `modules()` order."""
    return [m for m in model.modules() if torch_internals.compiled_call(m) is not None]


def bucket_for_compiled(model: nn.Module, x: torch.Tensor, limit: int, value: int = 0) -> torch.Tensor:
    """`x` (B, T, ...) for `model`, whose T varies every call (sampled completions): where `model` runs
    compiled now, right-padded with `value` to T's `shapes.length_bucket` and that dim marked static, so
    each bucket compiles one static graph (dynamo would otherwise make T dynamic, or compile once per T); a
    model running eagerly gets `x` itself. The caller keeps the first T positions of what `model` returns,
    which a causal model computes as without the padding."""
    if not compiled_modules(model):
        return x
    width = shapes.length_bucket(x.shape[1], limit)
    if width > x.shape[1]:
        pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)
        x = torch.cat([x, pad], dim=1)
    torch_internals.mark_static(x, 1)
    return x


@contextlib.contextmanager
def run_eagerly() -> Iterator[None]:
    """Inside: compiled modules and functions run their eager code, compiling nothing (for work whose shapes
    change each call, e.g. token-by-token generation, or a flop counter's one step); torch < 2.6 has no
    stance to set, and compiles as before."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    with set_stance("force_eager") if set_stance is not None else contextlib.nullcontext():
        yield
