"""The training command line before any job starts: its `key=value` overrides apart from Hydra's flags, and
every variant a sweep would run (each swept value, each end of an interval, each value of an Optuna search
space) composed and validated (`recipes.cli.validate`), so a bad value anywhere is one line and exit 2
before the first job, not a failure in the middle of the sweep."""

from __future__ import annotations

import contextlib
import importlib.util

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from core.errors import TorchkilnError
from recipes.cli.config import CONF_DIR
from recipes.cli.errors import one_line
from recipes.cli.loggers import unchosen_logger_key
from recipes.cli.validate import check_pairing, usable_option, validate

# Hydra flags that take a value, so the value is not mistaken for an override
_FLAGS_WITH_VALUE = {
    "--cfg",
    "-c",
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--config-dir",
    "-cd",
    "--package",
    "-p",
    "--experimental-rerun",
}


def overrides_of(argv: list[str]) -> list[str]:
    """The key=value overrides in a command line, without Hydra's own flags."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _FLAGS_WITH_VALUE:
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def check_overrides(overrides: list[str], *, multirun: bool = False) -> str | None:
    """Compose and validate each sweep value once (others at their first value) before any job starts, and
    likewise each value of an Optuna search space (`hydra.sweeper.params`; an interval at both ends); a
    one-line error, or None if every variant is valid."""
    single, where = overrides, ""
    try:
        missing = missing_sweeper(overrides)
        if missing:
            return missing
        parsed = OverridesParser.create().parse_overrides(overrides)
        seen: dict[str, str] = {}
        for o in parsed:
            key = o.get_key_element().lstrip("+~")
            if key in seen:
                return f"{key} is given twice ({seen[key]}, {o.input_line}); give it once"
            seen[key] = o.input_line
        values = [sweep_values(o) if o.is_sweep_override() else [None] for o in parsed]
        first = [
            o.input_line if v[0] is None else f"{o.get_key_element()}={v[0]}"
            for o, v in zip(parsed, values, strict=True)
        ]
        variants = [first]
        for i, (o, vs) in enumerate(zip(parsed, values, strict=True)):
            variants += [first[:i] + [f"{o.get_key_element()}={v}"] + first[i + 1 :] for v in vs[1:]]
        for single in variants:
            cfg = compose_valid(single, multirun)
        # the search space: each value with the command line's first variant; a key the command line
        # gives is fixed there (the sweeper drops it from the search)
        space = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
        where = "hydra.sweeper.params: "
        for key, value in space.items():
            if str(key).lstrip("+~") not in seen:
                o = OverridesParser.create().parse_override(f"{key}={value}")
                for v in sweep_values(o) if o.is_sweep_override() else [o.get_value_element_as_str()]:
                    single = [*first, f"{o.get_key_element()}={v}"]
                    compose_valid(single, multirun)
    except TorchkilnError as e:
        return f"{where}{e}"
    except Exception as e:  # any composition failure is a user error here
        return where + (unchosen_logger_key(str(CONF_DIR), single) or one_line(e, keep=usable_option(single)))
    finally:
        GlobalHydra.instance().clear()
    return None


def compose_valid(overrides: list[str], multirun: bool) -> DictConfig:
    """The config `overrides` compose to (with `hydra`), validated; raises at the first problem."""
    check_pairing(overrides)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
        validate(cfg, multirun=multirun)
    return cfg


def sweep_values(o: Override) -> list[str]:
    """The values a swept override stands for; for an interval, its two ends: a key's declared range
    (core.bounds) that admits both admits every value between."""
    if o.is_interval_sweep():
        return [str(o.value().start), str(o.value().end)]
    return list(o.sweep_string_iterator())


def missing_sweeper(overrides: list[str]) -> str | None:
    """A one-line error when the command line picks Optuna's sweeper and it is not installed."""
    choice = {k.lstrip("+~"): v for k, _, v in (o.partition("=") for o in overrides)}
    search = choice.get("hparams_search", "null")
    if search == "null" and choice.get("hydra/sweeper") != "optuna":
        return None
    with contextlib.suppress(ImportError):
        if importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None:
            return None
    what = f"hparams_search={search}" if search != "null" else "hydra/sweeper=optuna"
    return f"{what} needs Optuna's sweeper: pip install -c constraints.txt -e '.[optuna]' (make venv has it)"
