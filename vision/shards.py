"""Images in tar shards (`core.data.sample_shards`): an ImageFolder tree written once by
`python -m recipes.prepare +task=image_classification`, then trained from with `data=image_shards
data.path=SHARDS`.

Each image is stored as its file's bytes (`KEY.jpg`, `KEY.png`, ...: not re-encoded) beside `KEY.cls`, its
class index as text (WebDataset's convention); the manifest holds the class names in label order, as
torchvision's ImageFolder numbers them, so a run from shards and one from the tree agree on every label.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

from torch.utils.data import Dataset

from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy, BadSamples
from core.data.sample_shards import Sample, SampleShards, file_stamp, prepare_samples, read_member
from core.errors import ConfigError, DataError
from core.registry import DATASETS
from vision.datasets import (
    DECODE_ERRORS,
    DEFAULT_AUGMENT,
    VisionData,
    _header_problem,
    folder_transforms,
    same_classes,
    split_folders,
)
from vision.transforms import Augment

KIND = "images"
SPLITS = ("train", "val")


def load_image(item: tuple[str, int, str]) -> tuple[dict[str, bytes], dict[str, Any]] | str:
    """One image for a shard: (members, index facts), or why it is bad (the header check a tree's run makes
    when it starts)."""
    path, label, source = item
    problem = _header_problem(path)
    if problem:
        return problem
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return f"unreadable ({e.strerror})"
    ext = Path(path).suffix.lstrip(".").lower() or "img"
    return {ext: data, "cls": str(label).encode()}, {"label": label, "source": source}


def _describe(item: tuple[str, int, str]) -> str:
    return item[0]


def image_sources(root: str) -> tuple[list[str], dict[str, list[tuple[str, int, str]]]]:
    """(class names, (image file, label, path under root) per split) of an ImageFolder tree ROOT/train,
    ROOT/val, labelled as torchvision's ImageFolder labels them."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    base = split_folders(root)
    try:
        classes, to_idx = find_classes(str(base / "train"))
        val_classes, _ = find_classes(str(base / "val"))
    except FileNotFoundError as e:
        raise DataError(f"data.root={root}: {str(e).splitlines()[0]}", key="data.root", value=root) from None
    same_classes(root, classes, val_classes)
    splits = {}
    for split in SPLITS:
        rows = make_dataset(str(base / split), to_idx, extensions=IMG_EXTENSIONS)
        splits[split] = [(p, int(label), str(Path(p).relative_to(base))) for p, label in rows]
    return classes, splits


def prepare_images(
    root: str,
    out: str,
    *,
    shard_mb: float = 256,
    workers: int = 0,
    policy: BadSamplePolicy = DEFAULT_POLICY,
    progress: bool = True,
) -> dict[str, Any]:
    """Write the ImageFolder tree `root` (train/, val/) into image shards in `out`; the manifest."""
    classes, sources = image_sources(root)
    inputs = {
        "shard_mb": shard_mb,
        "classes": classes,
        "splits": {
            s: [[src, label, file_stamp(p)] for p, label, src in items] for s, items in sources.items()
        },
    }
    return prepare_samples(
        out,
        kind=KIND,
        splits=sources,
        load=load_image,
        describe=_describe,
        inputs=inputs,
        facts={"classes": classes},
        shard_bytes=int(shard_mb * 2**20),
        workers=workers,
        policy=policy,
        progress=progress,
        noun="images",
    )


class ShardImages(Dataset):
    """Images of one split of an image shard folder -> (transformed image, label), decoded as ImageFolder
    decodes its files (PIL, RGB); an image that fails to decode goes by the run's bad-sample policy."""

    def __init__(
        self, samples: Sequence[Sample], transform: Callable, bad: BadSamples, window_shards: int
    ) -> None:
        """`samples` and `bad` from `SampleShards.samples` (then `bad.check`)."""
        self.samples, self.transform, self.bad = list(samples), transform, bad
        self.window_shards = window_shards
        self.targets = [int(s.facts["label"]) for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def shard_of(self) -> list[int]:
        """The shard each image lies in."""
        return [s.shard for s in self.samples]

    def describe(self, i: int) -> str:
        """Sample `i` as `SHARD.tar:KEY`."""
        return self.samples[i].where

    def __getitem__(self, i: int) -> Any:
        return self.bad.load(i, self._read, self.describe, DECODE_ERRORS)

    def _read(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        s = self.samples[i]
        ext = next(e for e in s.members if e != "cls")
        with Image.open(io.BytesIO(read_member(s.members[ext]))) as im:
            return self.transform(im.convert("RGB")), self.targets[i]


@DATASETS.register("image_shards")
def image_shards(
    *,
    path: Annotated[str, Bounds(exists="dir")] = "",
    image_size: Annotated[int, Bounds(ge=1)] = 32,
    channels: Annotated[int, Bounds(choices=(1, 3))] = 3,
    augment: bool = True,
    crop_scale: Annotated[tuple[float, float], Bounds(gt=0, le=1, length=2)] = (0.7, 1.0),
    crop_ratio: Annotated[tuple[float, float], Bounds(gt=0, length=2)] = (0.75, 4 / 3),
    val_resize: Annotated[int, Bounds(ge=0)] = 0,
    window_shards: Annotated[int, Bounds(ge=1)] = 4,
    augmentation: Augment = DEFAULT_AUGMENT,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> VisionData:
    """Image shards written by `python -m recipes.prepare +task=image_classification`, with the transforms
    of data=imagefolder.

    path: the prepared folder (required)
    image_size: side of the square images the model sees, in pixels
    channels: 1 (grayscale) or 3 (RGB)
    augment: random resized crops, flips and the other augmentation keys on training images
    crop_scale: the random resized crop's [min,max] area, as a fraction of the image
    crop_ratio: the random resized crop's [min,max] aspect ratio (width / height)
    val_resize: validation: the shorter side resized to this, then the centre square; 0: to image_size
    window_shards: shards an epoch reads at a time (their images are shuffled together)
    augmentation: its fields are set flat (data.hflip_prob, data.auto_augment, ...)
    """
    if not path:
        raise ConfigError(
            "data=image_shards needs data.path=DIR, a folder python -m recipes.prepare "
            "+task=image_classification wrote",
            key="data.path",
            value="",
            valid=("DIR",),
        )
    train_tf, val_tf = folder_transforms(
        image_size, channels, augment, crop_scale, crop_ratio, val_resize, augmentation
    )
    shards = SampleShards(path, KIND)
    out = []
    for split, tf in (("train", train_tf), ("val", val_tf)):
        bad = BadSamples(policy, f"split '{split}' of {shards.root}", "images")
        samples = shards.samples(split, bad)
        bad.check(len(samples) + len(bad.found))
        if not samples:
            raise DataError(f"split '{split}' of {shards.root} has no usable images")
        out.append(ShardImages(samples, tf, bad, window_shards))
    classes = list(shards.manifest["classes"])
    return VisionData(
        out[0], out[1], num_classes=len(classes), in_channels=channels, image_size=image_size, classes=classes
    )
