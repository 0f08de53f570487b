"""Image transforms after torchvision's classification reference (`references/classification/presets.py`),
built from `torchvision.transforms.v2`, plus the MixUp/CutMix batch collate of its `train.py`.

Order matters for correctness: the crop, the flip and the `auto_augment` policy run on images still in
their stored range (uint8 0..255, or float 0..1), which the policies' ops (posterize, solarize, equalize)
assume; `ToDtype` + `Normalize` come next, and random erasing last, on the normalised tensor, as in the
reference. The data config spells the `Augment` fields flat (`data.hflip_prob`, `data.auto_augment`, ...):
a dataset builder takes `augmentation: Augment = ...` and the registry gathers the keys into it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import torch
from torch.utils.data import default_collate

from core.bounds import Bounds, check_values

if TYPE_CHECKING:  # imported where a transform is built: vision.models._torchvision_archs says why
    from torchvision.transforms import v2

#: data.auto_augment values: the reference's `--auto-augment` names, plus none
AUTO_AUGMENT = ("none", "ra", "ta_wide", "augmix", "imagenet")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")


@dataclass(frozen=True)
class Augment:
    """Training augmentation after the crop (config: `data.hflip_prob`, `data.auto_augment`, ...)."""

    #: probability of flipping each training image left-right (the reference's hflip_prob)
    hflip_prob: Annotated[float, Bounds(ge=0, le=1)] = 0.5
    #: a policy of random ops per training image: none; ra (RandAugment); ta_wide (TrivialAugmentWide);
    #: augmix (AugMix); imagenet (AutoAugment's ImageNet policy)
    auto_augment: Annotated[str, Bounds(choices=AUTO_AUGMENT)] = "none"
    #: RandAugment's magnitude of each op (auto_augment=ra), of 0-30
    ra_magnitude: Annotated[int, Bounds(ge=0, le=30)] = 9
    #: AugMix's severity of each op (auto_augment=augmix), of 1-10
    augmix_severity: Annotated[int, Bounds(ge=1, le=10)] = 3
    #: probability of erasing one random rectangle of each normalised training image (RandomErasing)
    random_erase: Annotated[float, Bounds(ge=0, le=1)] = 0.0
    #: resampling of the resizes, the random resized crop and the policy's geometric ops
    interpolation: Annotated[str, Bounds(choices=INTERPOLATIONS)] = "bilinear"

    def __post_init__(self) -> None:
        check_values("data", dataclasses.asdict(self), Augment)

    @property
    def mode(self) -> v2.InterpolationMode:
        """`interpolation` as torchvision's enum."""
        from torchvision.transforms import v2

        return v2.InterpolationMode(self.interpolation)

    def geometric(self) -> list[v2.Transform]:
        """The flip and the policy, for images in their stored range (before `normalized`)."""
        from torchvision.transforms import v2

        out: list[v2.Transform] = [v2.RandomHorizontalFlip(self.hflip_prob)] if self.hflip_prob > 0 else []
        mode = self.mode
        policy = {
            "none": None,
            "ra": lambda: v2.RandAugment(interpolation=mode, magnitude=self.ra_magnitude),
            "ta_wide": lambda: v2.TrivialAugmentWide(interpolation=mode),
            "augmix": lambda: v2.AugMix(interpolation=mode, severity=self.augmix_severity),
            "imagenet": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=mode),
        }[self.auto_augment]
        return out + ([policy()] if policy else [])

    def after_normalize(self) -> list[v2.Transform]:
        """Random erasing, which the reference applies to the normalised tensor (erased to 0: the mean)."""
        from torchvision.transforms import v2

        return [v2.RandomErasing(self.random_erase, value=0)] if self.random_erase > 0 else []


def normalized(channels: int) -> list[v2.Transform]:
    """To float in [0, 1], then centred to [-1, 1] (every image dataset here uses mean 0.5, std 0.5)."""
    from torchvision.transforms import v2

    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * channels, [0.5] * channels)]


def train_preset(
    image_size: int,
    augmentation: Augment,
    *,
    channels: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    head: Sequence[v2.Transform] = (),
) -> v2.Compose:
    """The reference's ClassificationPresetTrain: random resized crop, flip, policy, normalise, erase;
    `head` runs first (decoding, grayscale)."""
    from torchvision.transforms import v2

    crop = v2.RandomResizedCrop(
        image_size, scale=tuple(scale), ratio=tuple(ratio), interpolation=augmentation.mode, antialias=True
    )
    return v2.Compose(
        [*head, crop, *augmentation.geometric(), *normalized(channels), *augmentation.after_normalize()]
    )


def eval_preset(
    image_size: int,
    resize: int,
    *,
    channels: int,
    interpolation: str,
    head: Sequence[v2.Transform] = (),
) -> v2.Compose:
    """The reference's ClassificationPresetEval: the shorter side resized to `resize`, then the centre
    `image_size` square (aspect ratio kept, where a plain resize would squash the image)."""
    from torchvision.transforms import v2

    mode = v2.InterpolationMode(interpolation)
    return v2.Compose(
        [
            *head,
            v2.Resize(resize, interpolation=mode, antialias=True),
            v2.CenterCrop(image_size),
            *normalized(channels),
        ]
    )


class MixCollate:
    """Collate a batch, then mix it with MixUp, CutMix, or one of the two chosen at random per batch (both
    alphas > 0, as the reference's RandomChoice): labels become (B, num_classes) probabilities.

    A module-level class, not a closure, so DataLoader workers started by spawn or forkserver can take it.
    """

    def __init__(self, num_classes: int, mixup_alpha: float, cutmix_alpha: float) -> None:
        """One or both alphas > 0 (the Beta distribution's concentration of the mixing weight)."""
        from torchvision.transforms import v2

        mixes: list[v2.Transform] = []
        if mixup_alpha > 0:
            mixes.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            mixes.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        if not mixes:
            raise ValueError("MixCollate needs mixup_alpha > 0 or cutmix_alpha > 0")
        self.mix = mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)

    def __call__(self, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = default_collate(samples)
        return self.mix(images, labels)
