"""Every private torch API `core.compile` touches, and nothing else: one place to mend after a torch upgrade.

Each accessor looks its API up when called, so a moved name fails where it is used with the name in the
error, and `missing()` lists every moved one at once (`tests/core/test_compile_internals.py` asserts it is
empty on the pinned torch). Names marked optional are absent from some supported torch versions; their
callers degrade (e.g. no recompile counts on torch 2.3) rather than fail.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: (module, attribute, optional) of each private API used below
USED: dict[str, tuple[str, str, bool]] = {
    "dynamo counters": ("torch._dynamo.utils", "counters", False),
    "compile callbacks": ("torch._dynamo.callback", "callback_handler", True),
    # callbacks are called with these since torch 2.6; earlier ones call them with nothing to count by
    "compile callback args": ("torch._dynamo.callback", "CallbackArgs", True),
    "Inductor header dir": ("torch._inductor.codecache", "_HEADER_DIR", True),
    # used only with the header dir, which torch versions without this lock lack too (torch 2.3)
    "file lock": ("torch.utils._filelock", "FileLock", True),
    "dynamo config": ("torch._dynamo", "config", False),
    "mark static": ("torch._dynamo", "mark_static", False),
    "mark dynamic": ("torch._dynamo", "maybe_mark_dynamic", False),
    # torch.compiler.disable imports dynamo (2 s of every process start) where it decorates; this one imports
    # it when the function first runs (torch decorates its optimizers and DDP with it)
    "lazy disable": ("torch", "_disable_dynamo", False),
    "global forward hooks": ("torch.nn.modules.module", "_global_forward_hooks", False),
    "global forward pre-hooks": ("torch.nn.modules.module", "_global_forward_pre_hooks", False),
    "no dispatch modes": ("torch.utils._python_dispatch", "_disable_current_modes", False),
    # dynamo traces it (fullgraph) and answers False for a dynamic dim without a guard; absent in torch 2.3
    "static value": ("torch.fx.experimental.symbolic_shapes", "has_static_value", True),
}
#: nn.Module attributes in-place compile works through (`module.compile()` sets the first)
MODULE_ATTRIBUTES = (
    "_compiled_call_impl",
    "_call_impl",
    "_register_load_state_dict_pre_hook",
    "_forward_hooks",
    "_forward_pre_hooks",
)


def _lookup(what: str) -> Any:
    module, attr, _ = USED[what]
    return getattr(importlib.import_module(module), attr)


def missing(include_optional: bool = True) -> list[str]:
    """'module.attribute' of every private API this torch lacks (optional ones too unless told not to)."""
    out = []
    for what, (module, attr, optional) in USED.items():
        if optional and not include_optional:
            continue
        try:
            _lookup(what)
        except (ImportError, AttributeError):
            out.append(f"{module}.{attr}")
    probe = nn.Linear(1, 1)
    if hasattr(nn.Module, "compile"):
        probe.compile()  # sets _compiled_call_impl (lazily compiled: nothing runs)
    out += [f"nn.Module.{a}" for a in MODULE_ATTRIBUTES if not hasattr(probe, a)]
    return out


def dynamo_counters() -> Any:
    """dynamo's global event counters (graph breaks, FX-graph and AOTAutograd cache hits and misses)."""
    return _lookup("dynamo counters")


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as torch.compiler.disable makes it (never traced: eager between compiled pieces), importing dynamo
    only when it is first called, not when a module decorates it."""
    return _lookup("lazy disable")(fn)


def compile_callbacks() -> Any | None:
    """dynamo's compile start/end callback registry, None on a torch whose callbacks get no arguments."""
    try:
        _lookup("compile callback args")
        return _lookup("compile callbacks")
    except (ImportError, AttributeError):
        return None


def inductor_header_dir() -> Path | None:
    """Where Inductor builds its precompiled kernel header (a temp dir), None where this torch has none."""
    try:
        where = _lookup("Inductor header dir")  # read only: Inductor keeps building there
    except (ImportError, AttributeError):
        return None
    return Path(where) if isinstance(where, str) else None


def file_lock(path: str, timeout: float) -> AbstractContextManager:
    """Inductor's own file lock, so torchkiln and Inductor exclude each other on the same lock files."""
    return _lookup("file lock")(path, timeout=timeout)


def no_dispatch_modes() -> AbstractContextManager:
    """Within it, no TorchDispatchMode (the FLOP counter, fake tensors) sees the ops run: a measurement taken
    in the middle of a counted step is neither counted nor faked."""
    return _lookup("no dispatch modes")()


def dynamo_config() -> Any:
    """dynamo's config module (recompile limits)."""
    return _lookup("dynamo config")


def static_size_check() -> Callable[[Any], bool]:
    """A test of a size that compiled code may call: False for a dynamic dim while dynamo traces, where
    `type(n) is int` holds for a symbolic size too (dynamo answers for the int it stands for); torch
    versions without one get that type test."""
    try:
        return _lookup("static value")
    except (ImportError, AttributeError):
        return lambda n: type(n) is int


def mark_static(tensor: torch.Tensor, dim: int) -> None:
    """Keep `dim` of `tensor` static under dynamo."""
    _lookup("mark static")(tensor, dim)


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """A weak dynamic mark: a model that specialises the dim still runs (and recompiles, which is counted)."""
    _lookup("mark dynamic")(tensor, dim)


def compiled_call(module: nn.Module) -> Callable[..., Any] | None:
    """The compiled callable `module.compile()` installed, None when the module runs eager."""
    return module._compiled_call_impl


def set_compiled_call(module: nn.Module, impl: Callable[..., Any] | None) -> None:
    """Install (or, with None, remove) the callable a module's `__call__` runs instead of its forward."""
    module._compiled_call_impl = impl


def eager_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run `module` eagerly (hooks included) even while a compiled call is installed."""
    return module._call_impl(*args, **kwargs)


def add_load_state_dict_pre_hook(module: nn.Module, hook: Callable[..., None]) -> None:
    """Register `hook(module, state_dict, prefix, ...)` to run before `module.load_state_dict`."""
    module._register_load_state_dict_pre_hook(hook, with_module=True)


def runs_only_forward(module: nn.Module) -> bool:
    """Whether calling `module` runs its `forward` and nothing else: no forward hooks of its own or global
    ones, no compiled call installed (backward hooks do nothing where no gradient is taken)."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._compiled_call_impl is not None
        or _lookup("global forward hooks")
        or _lookup("global forward pre-hooks")
    )
