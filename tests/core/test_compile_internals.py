"""core/compile/torch_internals.py: every private torch API core.compile touches is where it expects it.

A torch upgrade that moves one fails here, by name, instead of deep inside a training run. Nothing else in
core/compile may reach for a private torch name: that keeps this list complete.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from core.compile import torch_internals as ti

COMPILE_DIR = Path(__file__).resolve().parents[2] / "core" / "compile"


def test_every_private_api_is_present_on_this_torch() -> None:
    assert ti.missing() == []


def test_a_moved_api_is_reported_by_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import codecache

    monkeypatch.delattr(codecache, "_HEADER_DIR")
    assert ti.missing() == ["torch._inductor.codecache._HEADER_DIR"]
    assert ti.inductor_header_dir() is None  # an optional one: its caller goes without
    assert ti.missing(include_optional=False) == []


def test_accessors_do_what_core_compile_relies_on(tmp_path: Path) -> None:
    lin = nn.Linear(2, 2)
    assert ti.compiled_call(lin) is None
    lin.compile(backend="eager")
    assert callable(ti.compiled_call(lin))
    ti.set_compiled_call(lin, lambda *a, **k: "compiled")
    x = torch.ones(1, 2)
    assert lin(x) == "compiled" and torch.equal(
        ti.eager_call(lin, x), torch.nn.functional.linear(x, lin.weight, lin.bias)
    )
    ti.set_compiled_call(lin, None)
    seen: list[str] = []
    ti.add_load_state_dict_pre_hook(lin, lambda module, sd, prefix, *rest: seen.append(prefix))
    lin.load_state_dict(nn.Linear(2, 2).state_dict())
    assert seen == [""]
    with ti.file_lock(str(tmp_path / "x.lock"), timeout=5):
        assert (tmp_path / "x.lock").exists()
    assert ti.dynamo_counters()["graph_break"] is not None


def test_no_other_compile_module_touches_private_torch_names() -> None:
    private = re.compile(
        r"torch\._(?!_)|\._compiled_call_impl|\._call_impl|_register_load_state_dict_pre_hook"
    )
    offenders = [
        f"{path.name}:{i}"
        for path in sorted(COMPILE_DIR.glob("*.py"))
        if path.name != "torch_internals.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line) and not line.lstrip().startswith(("#", '"', "`"))
    ]
    assert offenders == []
    assert private.search((COMPILE_DIR / "torch_internals.py").read_text())  # the rule has teeth
