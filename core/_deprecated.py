"""Old import paths kept for one release after core was grouped into packages (`core.loop`, `core.logging`,
...)."""

from __future__ import annotations

import importlib
import sys
import warnings


def moved(old: str, new: str) -> None:
    """Make module `old` the module `new`, with a DeprecationWarning naming where to import it from now."""
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    # the import system hands back whatever sys.modules holds for `old` once its file has run, so
    # `import core.trainer` and `from core.trainer import Trainer` both get the new module's own objects
    sys.modules[old] = importlib.import_module(new)
