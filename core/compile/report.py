"""What `apply` decided and why (`CompileReport`), and compiler errors told in one line."""

from __future__ import annotations

from dataclasses import dataclass


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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def describe(exc: BaseException) -> str:
    """One line naming the error and its root cause (dynamo wraps backend errors in BackendCompilerFailed)."""
    out = f"{type(exc).__name__}: {first_line(exc)}"
    cause = getattr(exc, "inner_exception", None) or exc.__cause__
    if isinstance(cause, BaseException) and cause is not exc:
        out += f" <- {type(cause).__name__}: {first_line(cause)}"
    return out
