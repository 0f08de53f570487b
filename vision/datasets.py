"""Image datasets registered by name: scikit-learn's bundled digits and any torchvision ImageFolder tree.

ImageFolder files are checked cheaply when the tree is read (each file's header: empty, foreign or cut
short within its header); a file that fails to decode later (a truncated JPEG) is found when it is loaded.
Both follow the run's bad-sample policy (`core.badsamples`): skipped and named, or a one-line stop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from core.badsamples import DEFAULT_POLICY, BadSamplePolicy, BadSamples
from core.bounds import Bounds
from core.errors import ConfigError, DataError
from core.registry import DATASETS
from vision.transforms import Augment, eval_preset, normalized, train_preset

#: what PIL raises for a file it cannot decode (truncated data: OSError; some corrupt formats: SyntaxError)
DECODE_ERRORS = (OSError, SyntaxError)


@dataclass
class VisionData:
    """Train/val datasets plus the facts a model needs about them."""

    train: Dataset
    val: Dataset
    num_classes: int
    in_channels: int
    image_size: int
    in_memory: bool = False


class TensorImages(Dataset):
    """Images held in one tensor (N, C, H, W) with labels, transformed per sample."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable | None = None) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[i]
        return (self.transform(x) if self.transform else x), self.labels[i]


def stratified_split(
    labels: torch.Tensor, val_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-class split of indices into (train, val)."""
    g = torch.Generator().manual_seed(seed)
    train, val = [], []
    for c in labels.unique(sorted=True):
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        k = round(len(idx) * val_fraction)
        val.append(idx[:k])
        train.append(idx[k:])
    return torch.cat(train).sort().values, torch.cat(val).sort().values


#: ImageFolder's augmentation: the reference's defaults (a flip half the time, no policy, no erasing)
DEFAULT_AUGMENT = Augment()
#: digits' augmentation: none beyond the +-1 pixel shift unless a key is set (8x8 digits are not
#: mirror-symmetric, so no flips by default)
DIGITS_AUGMENT = Augment(hflip_prob=0.0)


@DATASETS.register("digits")
def digits(
    *,
    val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.2,
    split_seed: Annotated[int, Bounds(ge=0)] = 0,
    augment: bool = True,
    augmentation: Augment = DIGITS_AUGMENT,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> VisionData:
    """scikit-learn's bundled 1,797 8x8 handwritten digits (no download), split 80/20 per class.

    val_fraction: fraction of each class held out for validation
    split_seed: seed of the train/validation split
    augment: shift training images by up to one pixel at random, then the augmentation keys (hflip_prob,
        auto_augment, random_erase: off by default here)
    augmentation: its fields are set flat (data.hflip_prob, data.auto_augment, ...)
    policy: accepted like every data section's, with nothing to skip in these checked-in images
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    # pixel values are 0..16: stored in [0, 1], the range the augmentation policies' ops assume, and centred
    # per sample by `normalized` so the first layer starts well-conditioned
    images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(d.target, dtype=torch.long)
    tr, va = stratified_split(labels, val_fraction, split_seed)
    # +-1 pixel shifts: a cheap v2 augmentation that still helps on 8x8 digits; the padding is the mid-grey
    # (0 once normalised) these shifts have always filled with
    shift = [v2.RandomCrop(8, padding=1, fill=0.5)]
    aug = shift + augmentation.geometric() if augment else []
    tail = augmentation.after_normalize() if augment else []
    return VisionData(
        TensorImages(images[tr], labels[tr], v2.Compose([*aug, *normalized(1), *tail])),
        TensorImages(images[va], labels[va], v2.Compose(normalized(1))),
        num_classes=10,
        in_channels=1,
        image_size=8,
        in_memory=True,
    )


def _header_problem(path: str) -> str | None:
    """Why the image at `path` cannot be opened (None if its header reads); pixels are not decoded."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.size  # noqa: B018 - the header's size: what a file cut short inside its header lacks
    except (*DECODE_ERRORS, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'}"
    return None


class CheckedImageFolder(ImageFolder):
    """torchvision's ImageFolder with its unreadable files left out and any file that fails to decode when
    loaded replaced by the next good one, per the run's bad-sample policy."""

    def __init__(self, root: Path, transform: Callable, policy: BadSamplePolicy, split: str) -> None:
        """Read the tree under `root` and check each file's header."""
        super().__init__(str(root), transform=transform)
        self.bad = BadSamples(policy, f"split '{split}'", "images")
        total = len(self.samples)
        for path, _ in self.samples:
            problem = _header_problem(path)
            if problem:
                self.bad.add(path, problem)
        bad = {p for p, _ in self.bad.found}
        self.samples = [s for s in self.samples if s[0] not in bad]
        self.imgs, self.targets = self.samples, [t for _, t in self.samples]
        self.bad.check(total)

    def describe(self, i: int) -> str:
        """The file of sample `i`."""
        return self.samples[i][0]

    def __getitem__(self, i: int) -> Any:
        return self.bad.load(i, super().__getitem__, self.describe, DECODE_ERRORS)


@DATASETS.register("imagefolder")
def imagefolder(
    *,
    root: str = "",
    image_size: Annotated[int, Bounds(ge=1)] = 32,
    channels: Annotated[int, Bounds(choices=(1, 3))] = 3,
    augment: bool = True,
    crop_scale: Annotated[tuple[float, float], Bounds(gt=0, le=1, length=2)] = (0.7, 1.0),
    crop_ratio: Annotated[tuple[float, float], Bounds(gt=0, length=2)] = (0.75, 4 / 3),
    val_resize: Annotated[int, Bounds(ge=0)] = 0,
    augmentation: Augment = DEFAULT_AUGMENT,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> VisionData:
    """A torchvision ImageFolder tree: ROOT/train/<class>/* and ROOT/val/<class>/*.

    root: the folder holding train/<class>/* and val/<class>/* (required)
    image_size: side of the square images the model sees, in pixels (the training crop and the
        validation centre crop)
    channels: 1 (grayscale) or 3 (RGB)
    augment: random resized crops, flips and the other augmentation keys on training images (false: the
        validation transform)
    crop_scale: the random resized crop's [min,max] area, as a fraction of the image (the reference's
        ImageNet recipe: [0.08,1]; the default keeps most of a small image)
    crop_ratio: the random resized crop's [min,max] aspect ratio (width / height)
    val_resize: validation: the shorter side resized to this, then the centre image_size square (the
        reference's 232 -> 224); 0: to image_size (only the longer side is cropped)
    augmentation: its fields are set flat (data.hflip_prob, data.auto_augment, ...)
    """
    if not root:
        raise ConfigError(
            "data.root is required for data=imagefolder: set data.root=DIR (DIR/train, DIR/val)"
        )
    if crop_scale[0] > crop_scale[1] or crop_ratio[0] > crop_ratio[1]:
        raise ConfigError(
            f"data.crop_scale={list(crop_scale)} and data.crop_ratio={list(crop_ratio)} must each be "
            "[min,max]"
        )
    if 0 < val_resize < image_size:
        raise ConfigError(
            f"data.val_resize={val_resize} is smaller than data.image_size={image_size}: set it to at least "
            "image_size, or 0"
        )
    base = Path(root).expanduser()
    for split in ("train", "val"):
        if not (base / split).is_dir():
            raise DataError(
                f"data.root={root}: missing folder {base / split} (expected DIR/{split}/<class>/*)"
            )
    # decoded to a uint8 tensor first: the crop and the policies run on uint8, as the reference's v2 path
    head: list[Any] = [v2.ToImage()] + ([v2.Grayscale(1)] if channels == 1 else [])
    val_tf = eval_preset(
        image_size,
        val_resize or image_size,
        channels=channels,
        interpolation=augmentation.interpolation,
        head=head,
    )
    train_tf = val_tf
    if augment:
        train_tf = train_preset(
            image_size, augmentation, channels=channels, scale=crop_scale, ratio=crop_ratio, head=head
        )
    try:
        train = CheckedImageFolder(base / "train", train_tf, policy, "train")
        val = CheckedImageFolder(base / "val", val_tf, policy, "val")
    except (FileNotFoundError, RuntimeError) as e:
        raise DataError(f"data.root={root}: {str(e).splitlines()[0]}") from None
    if train.classes != val.classes:
        raise DataError(
            f"data.root={root}: train classes {train.classes} differ from val classes {val.classes}; "
            "give both splits the same class folders"
        )
    return VisionData(train, val, num_classes=len(train.classes), in_channels=channels, image_size=image_size)
