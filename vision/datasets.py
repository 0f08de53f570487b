"""Image datasets registered by name: scikit-learn's bundled digits and any torchvision ImageFolder tree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from core.bounds import Bounds
from core.errors import ConfigError, DataError
from core.registry import DATASETS


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


@DATASETS.register("digits")
def digits(
    *,
    val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.2,
    split_seed: Annotated[int, Bounds(ge=0)] = 0,
    augment: bool = True,
) -> VisionData:
    """scikit-learn's bundled 1,797 8x8 handwritten digits (no download), split 80/20 per class."""
    from sklearn.datasets import load_digits

    d = load_digits()
    # pixel values are 0..16; centre them so the first layer starts well-conditioned
    images = (torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.5) / 0.5
    labels = torch.tensor(d.target, dtype=torch.long)
    tr, va = stratified_split(labels, val_fraction, split_seed)
    # +-1 pixel shifts: a cheap v2 augmentation that still helps on 8x8 digits
    aug = v2.RandomCrop(8, padding=1) if augment else None
    return VisionData(
        TensorImages(images[tr], labels[tr], aug),
        TensorImages(images[va], labels[va]),
        num_classes=10,
        in_channels=1,
        image_size=8,
        in_memory=True,
    )


@DATASETS.register("imagefolder")
def imagefolder(
    *,
    root: str = "",
    image_size: Annotated[int, Bounds(ge=1)] = 32,
    channels: Annotated[int, Bounds(choices=(1, 3))] = 3,
    augment: bool = True,
    hflip: bool = True,
) -> VisionData:
    """A torchvision ImageFolder tree: ROOT/train/<class>/* and ROOT/val/<class>/*."""
    from torchvision.datasets import ImageFolder

    if not root:
        raise ConfigError(
            "data.root is required for data=imagefolder: set data.root=DIR (DIR/train, DIR/val)"
        )
    base = Path(root).expanduser()
    for split in ("train", "val"):
        if not (base / split).is_dir():
            raise DataError(
                f"data.root={root}: missing folder {base / split} (expected DIR/{split}/<class>/*)"
            )
    norm = [0.5] * channels
    common: list[Any] = [v2.ToImage()] + ([v2.Grayscale(1)] if channels == 1 else [])
    train_tf = common + (
        [v2.RandomResizedCrop(image_size, scale=(0.7, 1.0), antialias=True)]
        + ([v2.RandomHorizontalFlip()] if hflip else [])
        if augment
        else [v2.Resize((image_size, image_size), antialias=True)]
    )
    val_tf = [*common, v2.Resize((image_size, image_size), antialias=True)]
    tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(norm, norm)]
    try:
        train = ImageFolder(str(base / "train"), transform=v2.Compose(train_tf + tail))
        val = ImageFolder(str(base / "val"), transform=v2.Compose(val_tf + tail))
    except (FileNotFoundError, RuntimeError) as e:
        raise DataError(f"data.root={root}: {str(e).splitlines()[0]}") from None
    if train.classes != val.classes:
        raise DataError(
            f"data.root={root}: train classes {train.classes} differ from val classes {val.classes}; "
            "give both splits the same class folders"
        )
    return VisionData(train, val, num_classes=len(train.classes), in_channels=channels, image_size=image_size)
