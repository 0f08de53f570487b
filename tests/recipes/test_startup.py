"""A command's start imports no library it may not use: torchvision, dynamo, sympy and Inductor load where a
vision model or transform is built or a model compiles (their cost: BENCHMARKS.md § Start-up)."""

from __future__ import annotations

import pkgutil
from pathlib import Path

from bench.startup import HEAVY, heavy_imports

REPO = Path(__file__).resolve().parents[2]


def test_every_command_imports_no_vision_library_and_no_compiler(tmp_path: Path) -> None:
    commands = sorted(m.name for m in pkgutil.iter_modules([str(REPO / "recipes")]) if m.name != "cli")
    assert {"train", "eval", "generate", "list", "export"} <= set(commands)
    code = "; ".join(f"import recipes.{name}" for name in commands)
    assert heavy_imports(REPO, ["-c", code], str(tmp_path)) == []
    # the check reads what it is meant to: a process that imports one of them has it named
    assert heavy_imports(REPO, ["-c", "import sympy"], str(tmp_path)) == [HEAVY["sympy"]]
