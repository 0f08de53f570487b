"""LoRA (Hu et al., 2021): a frozen linear layer plus a trainable low-rank update,
y = W x + b + (B A dropout(x)) * alpha / rank.

`apply_lora` swaps the targeted `nn.Linear`s for `LoRALinear` in place and freezes every other parameter;
`merge_lora` folds each update into its base weight and puts plain `nn.Linear`s back. The math, the default
initialization (A kaiming-uniform with a = sqrt(5), B zeros, so the model starts as the base) and the
adapter tensor names follow peft's LoRA, whose adapter folders hold `<module path>.lora_A.weight` (rank x in)
and `.lora_B.weight` (out x rank) under `base_model.model.`; `adapter_state` gives those names.
Targets match the way peft's `target_modules` list does: a module whose name equals an entry or ends with
`.` + entry.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn

from core.bounds import Bounds
from core.distributed.tensor_parallel import local_shard
from core.errors import ConfigError

#: the prefix peft's adapter files put before a module's path in the base model
PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAConfig:
    """`trainer.lora.*`: low-rank adapters on the targeted linear layers, the rest of the model frozen."""

    #: the adapters' rank; 0: off (every parameter trains)
    rank: Annotated[int, Bounds(ge=0)] = 0
    #: the update's scale is alpha / rank (peft's lora_alpha)
    alpha: Annotated[float, Bounds(gt=0)] = 16.0
    #: dropout on the adapters' input (the base layer sees the input as is)
    dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.0
    #: module-name suffixes to adapt (peft's target_modules list): a linear layer whose name, or the name its
    #: model gives it in Hugging Face's layout (e.g. mlp.gate_proj), is one or ends with "." + one
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])


class LoRALinear(nn.Linear):
    """An `nn.Linear` whose frozen `weight`/`bias` keep their names, plus `lora_A` and `lora_B`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        """Adapters of `rank` on `base`, whose parameters this layer takes over (shared, not copied)."""
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        #: False while `adapters_off` holds: the layer is its base alone (a preference task's reference)
        self.adapters_on = True
        self.reset_lora()

    @torch.no_grad()
    def reset_lora(self) -> None:
        """A as nn.Linear's default (peft's default too), B zeros: the update starts at exactly zero. A
        sharded A (a DTensor: FSDP2 made it after a meta-device build) gets its slice of one whole draw,
        the same on every rank, so its rows stay independent across ranks."""
        a = self.lora_A.weight
        local, index = local_shard(a)
        if index is None:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        else:
            whole = torch.empty(a.shape, dtype=a.dtype, device=local.device)
            nn.init.kaiming_uniform_(whole, a=math.sqrt(5))
            local.copy_(whole[index])
        local_shard(self.lora_B.weight)[0].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer's output plus the scaled low-rank update of `x` (`adapters_off`: the base's)."""
        if not self.adapters_on:
            return F.linear(x, self.weight, self.bias)
        return (
            F.linear(x, self.weight, self.bias)
            + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        )

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain `nn.Linear` holding W + B A x alpha / rank (and the same bias)."""
        out = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        delta = (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling
        out.weight.copy_((self.weight.float() + delta).to(self.weight.dtype))
        if self.bias is not None:
            out.bias.copy_(self.bias)
        out.requires_grad_(True)
        return out


def _matches(names: Sequence[str], targets: Sequence[str]) -> bool:
    return any(n == t or n.endswith("." + t) for n in names for t in targets)


def apply_lora(
    model: nn.Module, cfg: LoRAConfig, *, external_name: Callable[[str], str] | None = None
) -> list[str]:
    """Wrap `model`'s targeted linear layers in `LoRALinear` (in place) and freeze every other parameter;
    `external_name` maps a module name to the layout users name targets in (e.g. Hugging Face's). Returns
    the wrapped modules' names; a ConfigError naming trainer.lora.targets when they match no linear layer."""
    if cfg.rank <= 0:
        return []
    wrapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, LoRALinear):
            continue
        names = [name] + ([external_name(name)] if external_name is not None else [])
        if _matches(names, cfg.targets):
            wrapped.append(name)
    if not wrapped:
        raise ConfigError(
            f"trainer.lora.targets={list(cfg.targets)} match no linear layer of {type(model).__name__}",
            key="trainer.lora.targets",
            value=str(list(cfg.targets)),
            valid=("a linear layer's name, or a dotted suffix of it",),
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name in wrapped:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, LoRALinear(getattr(owner, leaf), cfg.rank, cfg.alpha, cfg.dropout))
    return wrapped


def is_adapter(name: str) -> bool:
    """Whether a parameter name (`model.named_parameters()`) is an adapter's (`...lora_A.weight`, B's)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """name -> each `LoRALinear` of `model`."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def reset_adapters(model: nn.Module) -> int:
    """`reset_lora` on every adapter of `model` (their storage made after a meta-device build); how many."""
    adapters = lora_modules(model)
    for module in adapters.values():
        module.reset_lora()
    return len(adapters)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with every adapter switched off, its base weights alone (peft's `disable_adapter`): the frozen
    reference of a preference loss, with no second copy of the model in memory."""
    adapters = lora_modules(model).values()
    for module in adapters:
        module.adapters_on = False
    try:
        yield model
    finally:
        for module in adapters:
            module.adapters_on = True


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, in place: plain `nn.Linear`s again, all trainable."""
    for name, module in lora_modules(model).items():
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, module.merged())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def adapter_state(
    model: nn.Module, external_name: Callable[[str], str] | None = None
) -> dict[str, torch.Tensor]:
    """The adapters' tensors under peft's file names (`base_model.model.<path>.lora_A.weight`), the path
    mapped by `external_name` (e.g. to Hugging Face's layout) when given."""
    out = {}
    for name, module in lora_modules(model).items():
        path = external_name(name) if external_name is not None else name
        for part in ("lora_A", "lora_B"):
            out[f"{PEFT_PREFIX}{path}.{part}.weight"] = getattr(module, part).weight.detach()
    return out
