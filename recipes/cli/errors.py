"""Turns Hydra/OmegaConf composition failures into the one-line messages the CLI prints."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from omegaconf.errors import OmegaConfBaseException


def one_line(exc: BaseException, keep: Callable[[str, str], bool] | None = None) -> str:
    """A single line naming the key or option at fault, the valid choices, and the fix; `keep(group, option)`
    narrows the options listed for an unknown one (e.g. to those the chosen task can use)."""
    chain = [exc]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    msg = str(exc)
    m = re.search(
        r"Could not find '([^']+)/([^']+)'\s*\nAvailable options in '[^']+':\s*\n((?:\t.*\n?)*)", msg
    )
    if m:
        group, choice, opts = m.group(1), m.group(2), m.group(3).split()
        opts = [o for o in opts if keep is None or keep(group, o)]
        use = "+task" if group == "task" else group
        return f"unknown {group} '{choice}'; available: {', '.join(opts)} (use {use}=NAME)"
    m = re.search(r"Could not load '([^/']+)/([^']+)'", msg)  # one option of a list (logger=[csv,bogus])
    if m:
        from recipes.cli.config import CONF_DIR

        group, choice = m.group(1), m.group(2)
        opts = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return f"unknown {group} '{choice}'; available: {', '.join(opts)} (use {group}=[NAME,...])"
    if isinstance(root, OmegaConfBaseException):
        key = getattr(root, "full_key", None)
        obj_type = getattr(root, "object_type", None)
        first = str(root).splitlines()[0]
        if "not in" in first or "is not in struct" in first or "Key '" in first and "not" in first:
            valid = (
                sorted(f.name for f in dataclasses.fields(obj_type))
                if dataclasses.is_dataclass(obj_type)
                else []
            )
            hint = f"; valid keys: {', '.join(valid)}" if valid else ""
            return f"unknown config key '{key}'{hint}"
        if key:
            return f"{key}: {first}"
        return first
    m = re.search(r"Could not override '([^']+)'", msg)
    if m:
        return f"unknown config key '{m.group(1)}' (check the spelling, or add it with +{m.group(1)}=VALUE)"
    return " ".join(msg.split())
