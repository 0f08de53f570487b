"""bench/startup.py: each row's median, its excess over the floor, the other checkout's and their ratio, and
the heavy libraries each command loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import startup


def test_the_table_times_each_command_against_the_floor_and_the_other_checkout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # two cheap commands stand in for the real ones (each real row is a torch import or more)
    commands = (("import torch", ["-c", "pass"]), ("sympy", ["-c", "import sympy"]))
    monkeypatch.setattr(startup, "COMMANDS", commands)
    medians = startup.main(["--rounds", "1", "--other", str(Path(startup.__file__).parents[1])])
    assert set(medians) == {"this", "other"} and all(
        set(m) == {"import torch", "sympy"} for m in medians.values()
    )
    assert all(s > 0 for m in medians.values() for s in m.values())
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if "|" in line}
    cells = [c.strip() for c in rows["sympy"].strip("|").split("|")]
    assert cells[2] == f"{medians['this']['sympy'] - medians['this']['import torch']:+.2f}"
    assert cells[5] == f"{medians['this']['sympy'] / medians['other']['sympy']:.2f}x"
    assert cells[6] == "sympy / sympy" and rows["import torch"].rstrip().endswith("| none / none |")
