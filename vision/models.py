"""Image classifiers by name: a small CNN, ResNet-18 (its stem fits the image size), a small ViT, and any
torchvision (or, with the optional extra, timm) classification architecture, optionally with pretrained
weights from a local file."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import torch
from torch import nn

from core.bounds import Bounds, LazyChoices
from core.checkpoint import load_model_state, read_weights
from core.errors import CheckpointError, ConfigError
from core.nn.transformer import Block
from core.registry import MODELS

log = logging.getLogger(__name__)


@MODELS.register("small_cnn")
def small_cnn(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    width: Annotated[int, Bounds(ge=1)] = 32,
    dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.1,
) -> nn.Module:
    """Two conv stages (3x3 conv-BN-GELU pairs, then pooling) and a linear head.

    width: channels of the first stage (the second has twice as many)
    dropout: dropout probability before the head
    """

    def stage(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU()]

    return nn.Sequential(
        *stage(in_channels, width),
        *stage(width, width),
        nn.MaxPool2d(2),
        *stage(width, 2 * width),
        *stage(2 * width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * width, num_classes),
    )


#: the largest image side that gets ResNet-18's small-input stem under `small_input=auto`
SMALL_INPUT_MAX = 32


@MODELS.register("resnet18")
def resnet18(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    small_input: Annotated[bool | Literal["auto"], Bounds(choices=("auto", True, False))] = "auto",
) -> nn.Module:
    """torchvision's ResNet-18 (random init); for small images the stem keeps full resolution.

    small_input: a 3x3 stride-1 stem without max-pooling (true), torchvision's 7x7 stride-2 stem (false), or
        auto: the small stem for images of 32 px or less
    """
    if small_input == "auto":
        # The ImageNet stem (7x7 stride 2, then a stride-2 max-pool) divides each side by 4 and the whole net
        # by 32: at CIFAR's 32 px and below its last stage would see 1x1 maps, so small images get the small
        # stem. Larger ones keep the ImageNet stem, which still leaves the last stage 2x2 or more, where the
        # small stem would run every stage on 16x the positions (issue #17: the ImageFolder recipe at 64 px).
        small_input = image_size <= SMALL_INPUT_MAX
    import torchvision  # here, not at import: see _torchvision_archs

    net = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if small_input or in_channels != 3:
        stride = 1 if small_input else 2
        net.conv1 = nn.Conv2d(
            in_channels, 64, 3 if small_input else 7, stride, 1 if small_input else 3, bias=False
        )
    if small_input:
        net.maxpool = nn.Identity()
    return net


@MODELS.register("vit")
class ViT(nn.Module):
    """A small Vision Transformer sized for tiny images: patch embedding, learned positions, a [CLS] token
    and a stack of core.nn.transformer blocks."""

    def __init__(
        self,
        *,
        num_classes: int,
        in_channels: int,
        image_size: int,
        patch_size: Annotated[int, Bounds(ge=1)] = 2,
        dim: Annotated[int, Bounds(ge=1)] = 96,
        depth: Annotated[int, Bounds(ge=1)] = 4,
        heads: Annotated[int, Bounds(ge=1)] = 4,
        mlp_ratio: Annotated[float, Bounds(gt=0)] = 2.0,
        dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.0,
    ) -> None:
        """`num_classes`, `in_channels` and `image_size` come from the dataset.

        patch_size: side of the square patches in pixels (must divide the image size)
        dim: width of the patch embeddings and the blocks
        depth: transformer blocks
        heads: attention heads per block (must divide dim)
        mlp_ratio: hidden width of each block's MLP, as a multiple of dim
        dropout: dropout probability in the blocks
        """
        if image_size % patch_size or dim % heads:
            raise ConfigError(
                f"model.patch_size={patch_size} must divide the image size {image_size} and "
                f"model.heads={heads} must divide model.dim={dim}",
                key="model.patch_size" if image_size % patch_size else "model.heads",
                value=str(patch_size if image_size % patch_size else heads),
            )
        super().__init__()
        n = (image_size // patch_size) ** 2
        self.patch = nn.Conv2d(in_channels, dim, patch_size, patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(
            Block(dim, heads, dropout, bias=True, mlp_ratio=mlp_ratio) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def no_weight_decay(self) -> set[str]:
        """The class token and position embeddings: learned offsets, not weights (core.optim.param_groups
        leaves them undecayed, as timm and torchvision's reference do)."""
        return {"cls", "pos"}

    #: parameter names of the blocks before they were core.nn.transformer's (vision had its own block)
    _OLD_BLOCK_KEYS = {"norm1.": "ln1.", "norm2.": "ln2.", "mlp.0.": "fc.", "mlp.2.": "fc_out."}

    def upgrade_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with block keys of checkpoints written before the shared block renamed to today's."""
        out = {}
        for key, value in state.items():
            parts = key.split(".", 2)  # blocks, i, rest
            if len(parts) == 3 and parts[0] == "blocks":
                for old, new in self._OLD_BLOCK_KEYS.items():
                    if parts[2].startswith(old):
                        key = f"blocks.{parts[1]}.{new}{parts[2][len(old) :]}"
            out[key] = value
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, C, H, W) -> logits (B, num_classes)."""
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x[:, 0]))


def _torchvision_archs() -> list[str]:
    """torchvision's classification architectures."""
    # torchvision is imported where a model or transform of it is built, not when `vision` registers its
    # builders: importing it imports dynamo (torchvision.ops), seconds of every process start, most of which
    # (an LM run, a CLI error, a listing) never touch it (BENCHMARKS.md § Start-up)
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


#: torchvision's classification architectures: model=torchvision model.arch=NAME
TORCHVISION_ARCHS = LazyChoices(_torchvision_archs)
#: the smallest image side model=torchvision and model=timm take: ImageNet architectures downsample by 32,
#: so smaller images leave their last stages under one position (digits' 8 px are 1x1 after the second
#: stage); an architecture's torchvision weights may state a larger minimum (meta["min_size"], e.g. 75 for
#: inception_v3)
IMAGENET_MIN_SIZE = 32
#: how every vision dataset here normalizes pixels p in [0, 1]: (p - DATA_MEAN) / DATA_STD, i.e. to [-1, 1]
DATA_MEAN, DATA_STD = 0.5, 0.5
#: architectures whose torchvision weights take (p - 0.5) / 0.5 inputs: torchvision feeds them
#: ImageNet-normalized pixels and maps those back inside the model (`transform_input`), which is left off
#: here; so are their auxiliary heads (the task trains one output), whose weights a file may hold
_HALF_NORMALIZED = {"googlenet": ("aux1.", "aux2."), "inception_v3": ("AuxLogits.",)}


class PretrainedInput(nn.Module):
    """A 3-channel image classifier behind what its input needs: 1-channel images repeated to RGB (as
    torchvision's Grayscale(3) does), and the datasets' (p - 0.5) / 0.5 pixels re-normalized to the mean and
    std its pretrained weights were trained with (when given)."""

    def __init__(
        self,
        net: nn.Module,
        in_channels: int,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ) -> None:
        """Wrap `net`; `mean`/`std` (per RGB channel): its weights' input normalization, None: the data's."""
        super().__init__()
        self.net, self.in_channels = net, in_channels
        self.renormalize = mean is not None and std is not None
        if self.renormalize:
            m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
            s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
            # (p - m) / s for p = x * DATA_STD + DATA_MEAN as one multiply-add; not saved (the config says it)
            self.register_buffer("scale", DATA_STD / s, persistent=False)
            self.register_buffer("shift", (DATA_MEAN - m) / s, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, in_channels, H, W) normalized as the datasets do -> logits (B, num_classes)."""
        if self.in_channels == 1:
            x = x.expand(-1, 3, -1, -1)
        if self.renormalize:
            x = x * self.scale + self.shift
        return self.net(x)


def _check_input(model: str, arch: str, in_channels: int, image_size: int, minimum: int) -> None:
    if in_channels not in (1, 3):
        raise ConfigError(
            f"model={model} takes 1- or 3-channel images; the data has {in_channels} channels",
            key="in_channels",
            value=str(in_channels),
            valid=("1", "3"),
        )
    if image_size < minimum:
        raise ConfigError(
            f"model.arch={arch} needs images of at least {minimum} px, the data's are {image_size} px: give "
            "larger ones (e.g. data=fashion_mnist data.image_size=32) or use a small-image model (small_cnn, "
            "resnet18)",
            key="image_size",
            value=str(image_size),
            valid=(f">= {minimum}",),
        )


def _torchvision_weights(arch: str, weights_name: str) -> Any:
    """The enum member `weights_name` (e.g. "ResNet50_Weights.IMAGENET1K_V2") among `arch`'s weights."""
    import torchvision

    enum = torchvision.models.get_model_weights(arch)
    valid = {f"{enum.__name__}.{w.name}": w for w in enum}
    if weights_name not in valid:
        raise ConfigError(
            f"model.weights_name={weights_name} is not a weights name of model.arch={arch}; valid: "
            f"{', '.join(valid)}",
            key="model.weights_name",
            value=weights_name,
            valid=tuple(valid),
        )
    return valid[weights_name]


def _load_pretrained(net: nn.Module, path: str, num_classes: int, skip: tuple[str, ...] = ()) -> None:
    """Load `path`'s weights into `net` strictly, apart from keys starting with `skip` and a classifier head
    sized for another number of classes (kept at its random init, and said so)."""
    state = {k: v for k, v in read_weights(path, "model.weights").items() if not k.startswith(skip)}
    own = net.state_dict()
    # a head is a tensor whose first dimension is the classes: the data's here, the file's there
    heads = [
        k
        for k, v in state.items()
        if k in own
        and v.shape != own[k].shape
        and own[k].shape[0] == num_classes
        and v.shape[1:] == own[k].shape[1:]
    ]
    if heads:
        log.info(
            "model.weights: %s has a %d-class head and the data %d classes: %s start from random",
            path,
            state[heads[0]].shape[0],
            num_classes,
            ", ".join(heads),
        )
    state.update({k: own[k] for k in heads})
    load_model_state(net, state, path)


@MODELS.register("torchvision")
def torchvision_classifier(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    arch: Annotated[str, Bounds(choices=TORCHVISION_ARCHS)] = "resnet50",
    weights: str = "",
    weights_name: str = "",
) -> nn.Module:
    """Any torchvision classification architecture by name: random init, or its weights from a local file.

    arch: the architecture, e.g. resnet50, convnext_tiny, efficientnet_b0, vit_b_16 (any of
        torchvision.models.list_models(); a wrong name lists them); images of 32 px or more (some need more:
        inception_v3 75, vit/swin/maxvit 224); 1-channel images are repeated to RGB
    weights: a local weights file for arch: a torchvision state dict (.pth, read with weights_only=True) or
        .safetensors; nothing downloads. A classifier head for another number of classes starts from random
    weights_name: the file's torchvision weights, e.g. ResNet50_Weights.IMAGENET1K_V2 (needs weights): inputs
        are normalized with their mean/std, as their transforms() do
    """
    import torchvision

    named = _torchvision_weights(arch, weights_name) if weights_name else None
    if named is not None and not weights:
        raise ConfigError(
            f"model.weights_name={weights_name} names the normalization of pretrained weights; give their "
            "file with model.weights=PATH (nothing downloads)",
            key="model.weights",
            value="",
            valid=("PATH of the weights file",),
        )
    sizes = [
        w.meta["min_size"][0] for w in ([named] if named else torchvision.models.get_model_weights(arch))
    ]
    _check_input("torchvision", arch, in_channels, image_size, max(IMAGENET_MIN_SIZE, min(sizes)))
    kwargs: dict[str, Any] = {}
    if arch.startswith("vit_"):  # positional embeddings for the data's size, not only 224
        kwargs["image_size"] = image_size
    elif arch.startswith("maxvit_"):
        kwargs["input_size"] = (image_size, image_size)
    elif arch in _HALF_NORMALIZED:
        kwargs.update(aux_logits=False, init_weights=True)
    try:
        net = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
    except (ValueError, AssertionError, RuntimeError) as e:  # e.g. a size the architecture cannot tile
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"model.arch={arch} cannot be built for {image_size} px images: {first}",
            key="image_size",
            value=str(image_size),
            valid=(),  # the architecture says why, not which sizes
        ) from None
    if weights:
        _load_pretrained(net, weights, num_classes, _HALF_NORMALIZED.get(arch, ()))
    mean = std = None
    if named is not None and arch not in _HALF_NORMALIZED:
        preset = named.transforms()
        mean, std = preset.mean, preset.std
    return PretrainedInput(net, in_channels, mean, std)


def _timm_pretrained_cfg(timm: Any, arch: str, in_channels: int, image_size: int) -> Any:
    """timm's pretrained config of `arch`, or the ConfigError for a name timm lacks or images it cannot take
    (too small, or not a fixed-size model's size)."""
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=5)
        raise ConfigError(
            f"model.arch={arch} is not a timm model; close names: {', '.join(close) or 'none'} "
            "(all: python -c 'import timm; print(timm.list_models())')",
            key="model.arch",
            value=arch,
            valid=close,
        )
    _check_input("timm", arch, in_channels, image_size, IMAGENET_MIN_SIZE)
    cfg = timm.models.get_pretrained_cfg(arch)
    fixed = cfg.input_size[-1] if cfg is not None and cfg.fixed_input_size else None
    if fixed is not None and image_size != fixed:
        raise ConfigError(
            f"model.arch={arch} takes {fixed} px images only; the data's are {image_size} px",
            key="image_size",
            value=str(image_size),
            valid=(str(fixed),),
        )
    return cfg


@MODELS.register("timm")
def timm_classifier(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    arch: str = "resnet50",
    weights: str = "",
) -> nn.Module:
    """Any timm model by name (the optional timm extra): random init, or its weights from a local file.

    arch: a timm model name, e.g. resnet50, convnext_nano, efficientnet_b0 (timm.list_models()); images of
        32 px or more, exactly the model's size for fixed-size ones (most ViTs); 1-channel images are
        repeated to RGB
    weights: a local weights file for arch (.pth/.bin read with weights_only=True, or .safetensors); nothing
        downloads. Inputs are then normalized with the arch's pretrained mean/std (its timm pretrained_cfg);
        a classifier head for another number of classes starts from random
    """
    try:
        import timm
    except ImportError:
        raise ConfigError("model=timm needs the optional timm package: pip install -e '.[timm]'") from None
    cfg = _timm_pretrained_cfg(timm, arch, in_channels, image_size)
    overlay = None
    if weights:
        state = read_weights(weights, "model.weights")
        heads = [cfg.classifier] if isinstance(cfg.classifier, str) else list(cfg.classifier or ())
        given = [state[f"{h}.weight"].shape[0] for h in heads if f"{h}.weight" in state]
        # the file's own head size (not the registry's 1000): timm keeps a head that matches the data's
        # classes and drops one that does not; "source" empty so nothing resolves to the Hugging Face hub
        overlay = {"state_dict": state, "source": "", **({"num_classes": given[0]} if given else {})}
    try:
        net = timm.create_model(
            arch,
            pretrained=bool(weights),
            num_classes=num_classes,
            in_chans=3,
            pretrained_cfg_overlay=overlay,
        )
    except RuntimeError as e:  # load_state_dict's key or shape mismatch
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"model.weights={weights} does not match model.arch={arch}: {first}") from None
    mean = std = None
    if weights:
        mean, std = net.pretrained_cfg["mean"], net.pretrained_cfg["std"]
    return PretrainedInput(net, in_channels, mean, std)
