"""core.registry: names to builders, presets of one class, one-line errors."""

from __future__ import annotations

import inspect

import pytest

from core.errors import ConfigError
from core.registry import Registry
from tests.helpers import fault


class Net:
    """A stand-in model class with keyword-only settings."""

    def __init__(self, *, width: int, depth: int = 2, dropout: float = 0.0) -> None:
        self.width, self.depth, self.dropout = width, depth, dropout


def test_presets_show_their_defaults_and_take_overrides() -> None:
    reg: Registry = Registry("model")
    reg.register_preset("net_s", Net, "Small.", width=64)
    reg.register_preset("net_l", Net, "Large.", width=512, depth=12)
    sig = inspect.signature(reg.get("net_l"))  # what the config schema is derived from
    assert {n: p.default for n, p in sig.parameters.items()} == {"width": 512, "depth": 12, "dropout": 0.0}
    small, large = reg.build("net_s"), reg.build("net_l", depth=3)
    assert (small.width, small.depth) == (64, 2) and (large.width, large.depth) == (512, 3)
    with pytest.raises(ConfigError) as e:
        reg.build("net_s", heads=4)
    assert fault(e.value) == ("model.heads", "4", ("width", "depth", "dropout"))
    with pytest.raises(ConfigError) as e:
        reg.register_preset("net_bad", Net, "Bad.", heads=4)
    assert fault(e.value) == ("model.heads", "4", ("width", "depth", "dropout"))


def test_sections_build_by_name_and_unknown_names_fail_with_the_choices() -> None:
    reg: Registry = Registry("model")
    reg.register_preset("net_s", Net, "Small.", width=64)
    assert reg.build_section({"name": "net_s", "depth": 5}, dropout=0.1).__dict__ == {
        "width": 64,
        "depth": 5,
        "dropout": 0.1,
    }
    with pytest.raises(ConfigError) as e:
        reg.check_section({"name": "nope"})
    assert fault(e.value) == ("model", "nope", ("net_s",))
