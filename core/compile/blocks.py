"""Which submodules regional compile compiles one by one: a model's repeated blocks."""

from __future__ import annotations

from torch import nn

from core.errors import ConfigError


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """Repeated blocks to compile one by one: `model.compile_blocks` if declared, else the outermost
    ModuleList/Sequential children that share a class with a sibling and are not leaf layers."""
    declared = getattr(model, "compile_blocks", None)
    if declared is not None:
        if callable(declared) and not isinstance(declared, nn.Module):
            declared = declared()
        blocks = [model.get_submodule(b) if isinstance(b, str) else b for b in declared]
        for b in blocks:
            if not isinstance(b, nn.Module):
                raise ConfigError(
                    f"{type(model).__name__}.compile_blocks holds {type(b).__name__}, not modules"
                )
        return blocks
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            classes = [type(c) for c in children]
            repeated = [c for c in children if classes.count(type(c)) > 1 and any(True for _ in c.children())]
            if repeated:
                found.extend(repeated)
                children = [c for c in children if all(c is not r for r in repeated)]
        for child in children:
            visit(child)

    visit(model)
    return found
