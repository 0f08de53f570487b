"""Image datasets registered by name: scikit-learn's bundled digits and any torchvision ImageFolder tree.

ImageFolder files are checked cheaply when the tree is read (each file's header: empty, foreign or cut
short within its header); a file that fails to decode later (a truncated JPEG) is found when it is loaded.
Both follow the run's bad-sample policy (`core.data.bad_samples`): skipped and named, or a one-line stop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy
from core.errors import ConfigError, DataError
from core.registry import DATASETS
from vision.transforms import Augment, eval_preset, normalized, train_preset

if TYPE_CHECKING:  # imported where a transform is built: vision.models._torchvision_archs says why
    from torchvision.transforms import v2

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
    #: the class names, in label order (saved with a run, so its predictions are named)
    classes: list[str] = field(default_factory=list)


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


def bundled_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 bundled 8x8 digits: images (N, 8, 8) float32 in 0..16 and labels (N,) int64, as
    `sklearn.datasets.load_digits` gives them."""
    import importlib.util

    # its data file read directly: importing sklearn.datasets (and scipy with it) cost a digits run more than
    # reading the file (BENCHMARKS.md § Test suite and CI); load_digits where the file is not where
    # scikit-learn keeps it
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    roots = list(spec.submodule_search_locations or ()) if spec is not None else []
    path = Path(roots[0]) / "datasets" / "data" / "digits.csv.gz" if roots else None
    if path is not None and path.is_file():
        import numpy as np

        data = np.loadtxt(path, delimiter=",")
        images, target = data[:, :-1].reshape(-1, 8, 8), data[:, -1]
    else:
        from sklearn.datasets import load_digits

        d = load_digits()
        images, target = d.images, d.target
    return torch.tensor(images, dtype=torch.float32), torch.tensor(target, dtype=torch.long)


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
    from torchvision.transforms import v2

    pixels, labels = bundled_digits()
    # pixel values are 0..16: stored in [0, 1], the range the augmentation policies' ops assume, and centred
    # per sample by `normalized` so the first layer starts well-conditioned
    images = pixels.unsqueeze(1) / 16.0
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
        classes=[str(c) for c in range(10)],
    )


#: what `image_files` takes for an image (torchvision's ImageFolder list)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def eval_transform(channels: int, image_size: int) -> v2.Compose:
    """A decoded image (PIL, RGB) as a model sees it outside training: `channels` (1: grayscale), its shorter
    side resized to `image_size` and the centre square cut (an ImageFolder run's validation with its default
    `val_resize`), scaled to [0, 1] and normalized to [-1, 1]. The digits tensors are normalized the same way,
    so an 8x8 digit saved as an image (ink bright on dark) reads back as the dataset's tensor (to 8-bit
    rounding)."""
    from torchvision.transforms import v2

    head = [v2.ToImage(), *([v2.Grayscale(1)] if channels == 1 else [])]
    return eval_preset(image_size, image_size, channels=channels, interpolation="bilinear", head=head)


def image_files(source: Path) -> list[Path]:
    """`source` if it is a file, else every image file under it (recursively, sorted); a missing source or
    a folder without images is a one-line DataError."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DataError(f"{source} does not exist; give an image file or a folder of images")
    found = sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not found:
        raise DataError(f"{source}: no image files ({', '.join(IMAGE_SUFFIXES)}) under it")
    return found


def read_image(path: Path, transform: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """The image at `path` decoded as RGB (as ImageFolder reads its files), through `transform`; a file that
    does not decode is a one-line DataError naming it."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return transform(im.convert("RGB"))
    except (*DECODE_ERRORS, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else "unreadable"
        raise DataError(f"{path}: cannot read as an image ({type(e).__name__}: {first})") from None


def _header_problem(path: str) -> str | None:
    """Why the image at `path` cannot be opened (None if its header reads); pixels are not decoded."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.size  # noqa: B018 - the header's size: what a file cut short inside its header lacks
    except (*DECODE_ERRORS, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'}"
    return None


def folder_transforms(
    image_size: int,
    channels: int,
    augment: bool,
    crop_scale: tuple[float, float],
    crop_ratio: tuple[float, float],
    val_resize: int,
    augmentation: Augment,
) -> tuple[Callable, Callable]:
    """(train, val) transforms of decoded image files, as data=imagefolder and data=image_shards set them;
    crop ranges that are not [min,max] and a val_resize below image_size are one-line ConfigErrors."""
    from torchvision.transforms import v2

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
    return train_tf, val_tf


def split_folders(root: str) -> Path:
    """The ImageFolder tree `root` (expanded), once it holds train/ and val/; else a DataError naming it."""
    base = Path(root).expanduser()
    for split in ("train", "val"):
        if not (base / split).is_dir():
            raise DataError(
                f"data.root={root}: missing folder {base / split} (expected DIR/{split}/<class>/*)",
                key="data.root",
                value=str(root),
                valid=(f"DIR/{split}/<class>/*",),
            )
    return base


def same_classes(root: str, train: list[str], val: list[str]) -> None:
    """A DataError naming the tree `root` when its train and val class folders differ."""
    if train != val:
        raise DataError(
            f"data.root={root}: train classes {train} differ from val classes {val}; "
            "give both splits the same class folders",
            key="val classes",
            value=", ".join(val),
            valid=tuple(train),
        )


@DATASETS.register("imagefolder")
def imagefolder(
    *,
    root: Annotated[str, Bounds(exists="dir")] = "",
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
            "data.root is required for data=imagefolder: set data.root=DIR (DIR/train, DIR/val)",
            key="data.root",
            value=root,
            valid=("DIR holding train/ and val/",),
        )
    base = split_folders(root)
    train_tf, val_tf = folder_transforms(
        image_size, channels, augment, crop_scale, crop_ratio, val_resize, augmentation
    )
    from vision.image_folder import CheckedImageFolder  # torchvision's ImageFolder: imported when used

    try:
        train = CheckedImageFolder(base / "train", train_tf, policy, "train")
        val = CheckedImageFolder(base / "val", val_tf, policy, "val")
    except (FileNotFoundError, RuntimeError) as e:
        raise DataError(f"data.root={root}: {str(e).splitlines()[0]}") from None
    same_classes(root, train.classes, val.classes)
    return VisionData(
        train,
        val,
        num_classes=len(train.classes),
        in_channels=channels,
        image_size=image_size,
        classes=list(train.classes),
    )


#: Fashion-MNIST's classes, in label order (github.com/zalandoresearch/fashion-mnist)
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


def read_idx(path: Path) -> torch.Tensor:
    """The unsigned bytes of an IDX file (gzipped when its name ends in .gz): a 4-byte magic 00 00 08 NDIM,
    NDIM big-endian int32 sizes, then the data; anything else is a one-line DataError naming the file."""
    import gzip
    import math

    import numpy as np

    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut gzip stream an EOFError
        why = str(e).splitlines()[0] or type(e).__name__
        raise DataError(f"{path}: unreadable ({why})", key=path.name, value=type(e).__name__) from None
    # the fields: the file (`key`, its name in the dataset), what it holds and what an IDX file holds there
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08":
        start = raw[:4].hex() or "empty"
        raise DataError(
            f"{path}: not an IDX file of unsigned bytes (it starts {start})",
            key=path.name,
            value=start,
            valid=("000008NN",),
        )
    ndim, header = raw[3], 4 + 4 * raw[3]
    if len(raw) < header:
        raise DataError(
            f"{path}: cut short inside its header",
            key=path.name,
            value=f"{len(raw)} bytes",
            valid=(f">= {header} bytes",),
        )
    shape = tuple(int(n) for n in np.frombuffer(raw, ">i4", ndim, offset=4))
    if len(raw) - header != math.prod(shape):
        raise DataError(
            f"{path}: holds {len(raw) - header} bytes of data, its header promises {math.prod(shape)} "
            f"({'x'.join(map(str, shape))}); the file is cut short or damaged",
            key=path.name,
            value=f"{len(raw) - header} bytes",
            valid=(f"{math.prod(shape)} bytes",),
        )
    return torch.from_numpy(np.frombuffer(raw, np.uint8, offset=header).reshape(shape).copy())


def _idx_file(base: Path, stem: str, root: str) -> Path:
    """base/stem, else base/stem.gz."""
    for path in (base / stem, base / f"{stem}.gz"):
        if path.is_file():
            return path
    raise DataError(
        f"data.root={root}: missing {base / stem}[.gz]; put Fashion-MNIST's four IDX files there "
        "(Debian: apt install dataset-fashion-mnist, then data.root=/usr/share/datasets/fashion-mnist)",
        key="data.root",
        value=str(root),
        valid=(stem, f"{stem}.gz"),
    )


def _fashion_mnist_split(base: Path, split: str, root: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, 1, H, W) uint8, labels (N,) long) of a Fashion-MNIST split (train or t10k) in `base`, or
    the DataError for files that hold no images or labels of the 10 classes, one per image."""
    images_path = _idx_file(base, f"{split}-images-idx3-ubyte", root)
    labels_path = _idx_file(base, f"{split}-labels-idx1-ubyte", root)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise DataError(f"{images_path}: holds {images.ndim}-D data, expected images (N x height x width)")
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataError(
            f"{labels_path}: holds {tuple(labels.shape)} labels for {len(images)} images",
            key=labels_path.name,
            value=str(tuple(labels.shape)),
            valid=(str((len(images),)),),
        )
    if len(labels) and int(labels.max()) >= len(FASHION_MNIST_CLASSES):
        raise DataError(
            f"{labels_path}: label {int(labels.max())} is not one of Fashion-MNIST's 10 classes",
            key=labels_path.name,
            value=str(int(labels.max())),
            valid=(f"0..{len(FASHION_MNIST_CLASSES) - 1}",),
        )
    return images.unsqueeze(1), labels.long()


@DATASETS.register("fashion_mnist")
def fashion_mnist(
    *,
    root: Annotated[str, Bounds(exists="dir")] = "",
    image_size: Annotated[int, Bounds(ge=1)] = 28,
    augment: bool = True,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> VisionData:
    """Fashion-MNIST: 70,000 28x28 grayscale images of 10 kinds of clothing, read from its IDX files.

    root: the folder holding train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and
        t10k-labels-idx1-ubyte, each plain or .gz (required); the 10,000 t10k images are the validation split
    image_size: side of the images the model sees: 28 as stored, or resized (e.g. 32 for model=torchvision)
    augment: random shifts of up to 2 pixels and horizontal flips of training images
    policy: accepted like every data section's; a bad file stops the run, naming it
    """
    from torchvision.transforms import v2

    if not root:
        raise ConfigError(
            "data.root is required for data=fashion_mnist: set data.root=DIR holding its IDX files",
            key="data.root",
            value=root,
            valid=("DIR holding the IDX files",),
        )
    base = Path(root).expanduser()
    splits = [_fashion_mnist_split(base, split, root) for split in ("train", "t10k")]
    # the pixels stay uint8 in memory (47 MB, not 188 as floats) and are scaled per sample; shifts pad with
    # black, the images' background, before scaling
    common: list[Any] = [v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5], [0.5])]
    if image_size != splits[0][0].shape[-1]:
        common.append(v2.Resize((image_size, image_size), antialias=True))
    aug = [v2.RandomCrop(splits[0][0].shape[-1], padding=2), v2.RandomHorizontalFlip()] if augment else []
    (train_x, train_y), (val_x, val_y) = splits
    train = TensorImages(train_x, train_y, v2.Compose(aug + common))
    val = TensorImages(val_x, val_y, v2.Compose(common))
    train.classes = val.classes = list(FASHION_MNIST_CLASSES)  # as torchvision's datasets name them
    return VisionData(
        train,
        val,
        num_classes=len(FASHION_MNIST_CLASSES),
        in_channels=1,
        image_size=image_size,
        in_memory=True,
        classes=list(FASHION_MNIST_CLASSES),
    )
