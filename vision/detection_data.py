"""Detection datasets registered by name: digit scenes made from scikit-learn's bundled digits (no download)
and any COCO-format folder (an images folder plus an annotations JSON).

A sample is `(image, target)`: a float (3, H, W) image in [0, 1] and `{"boxes": (N, 4) xyxy pixels,
"labels": (N,) int64}`, the layout torchvision's detection models take. Training transforms are torchvision
v2 transforms applied to the image and its `tv_tensors.BoundingBoxes` together, so boxes move with pixels.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy, BadSamples
from core.errors import ConfigError, DataError
from core.registry import DATASETS
from vision.datasets import DECODE_ERRORS, bundled_digits, stratified_split

if TYPE_CHECKING:  # imported where a transform is built: vision.models._torchvision_archs says why
    from torchvision.transforms import v2

Target = dict[str, torch.Tensor]
Sample = tuple[torch.Tensor, Target]
Batch = tuple[list[torch.Tensor], list[Target]]


@dataclass
class DetectionData:
    """Train/held-out detection datasets plus what a detector needs to know about them."""

    train: Dataset
    val: Dataset
    #: class names, label i is classes[i]
    classes: list[str]
    #: the longer image side the model works at, in pixels
    image_size: int
    in_memory: bool = False


def collate_detection(batch: Sequence[Sample]) -> Batch:
    """(images, targets) as two lists: images may differ in size and targets in box count, so nothing is
    stacked (the detector batches images itself)."""
    return [x for x, _ in batch], [t for _, t in batch]


def box_transform(train: bool, *, augment: bool, hflip: bool = False) -> v2.Compose:
    """The joint image+boxes transform: for training, small scale/shift jitter (flips only if `hflip`: a
    mirrored digit is another glyph) and brightness/contrast jitter; boxes pushed off the canvas are clipped,
    and those left smaller than 2 px dropped with their labels."""
    from torchvision.transforms import v2

    steps: list[Any] = []
    if train and augment:
        steps += [v2.RandomAffine(degrees=0, translate=(0.05, 0.05), scale=(0.85, 1.15))]
        steps += [v2.RandomHorizontalFlip()] if hflip else []
        steps += [v2.ColorJitter(brightness=0.3, contrast=0.3)]
    steps += [v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes(min_size=2)]
    return v2.Compose(steps)


def _plain(image: torch.Tensor, target: dict[str, Any]) -> Sample:
    """Drop the tv_tensor wrappers: the model takes plain tensors."""
    return image.as_subclass(torch.Tensor), {
        "boxes": target["boxes"].as_subclass(torch.Tensor).float(),
        "labels": target["labels"],
    }


# ---- digit scenes ---------------------------------------------------------------------------------------
#: the id of each split in a scene's seed, so train, val and test scenes never share a random stream
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
#: ink below this (of a digit's 0..1 scaled pixels) is set to 0: a box is the extent of its nonzero pixels
INK_FLOOR = 0.05


def _apart(a: tuple[int, int, int, int], b: tuple[int, int, int, int], gap: int) -> bool:
    """Whether rectangles a and b (x0, y0, x1, y1) are at least `gap` pixels apart on some axis."""
    return a[0] >= b[2] + gap or b[0] >= a[2] + gap or a[1] >= b[3] + gap or b[1] >= a[3] + gap


@dataclass
class Scene:
    """One generated scene: the image, its exact boxes and labels, and each digit's own ink (for tests)."""

    image: torch.Tensor  # (H, W) uint8
    boxes: torch.Tensor  # (N, 4) float xyxy, pixel edges: x2 = last inked column + 1
    labels: torch.Tensor  # (N,) int64
    ink: torch.Tensor  # (N, H, W) float, each digit's pasted pixels before background and noise (keep_ink)


def digit_pools(split_seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The 1,797 bundled 8x8 digits (0..1 floats) split per class 70/15/15 into train/val/test pools, so
    held-out scenes show digit images no training scene contains."""
    pixels, labels = bundled_digits()
    images = pixels / 16.0
    train, held = stratified_split(labels, 0.3, split_seed)
    val, test = stratified_split(labels[held], 0.5, split_seed)
    val, test = held[val], held[test]
    return {name: (images[i], labels[i]) for name, i in (("train", train), ("val", val), ("test", test))}


def render_scene(
    pool: tuple[torch.Tensor, torch.Tensor],
    seed: int,
    split: str,
    index: int,
    *,
    image_size: int,
    digit_size: Sequence[int],
    max_digits: int,
    noise: float,
    keep_ink: bool = False,
) -> Scene:
    """Scene `index` of `split`, a function of (seed, split, index) alone: 1..max_digits digits from `pool`,
    each scaled to digit_size[0]..digit_size[1] px (aspect within +-15%), pasted without touching one another
    on a background of random level and gradient, plus Gaussian noise; `keep_ink` keeps each digit's own
    pixels (`Scene.ink`, else empty: 37 KB per digit at 96 px)."""
    rng = np.random.default_rng([seed, SPLIT_CODES[split], index])
    digits, digit_labels = pool
    h = w = image_size
    lo, hi = min(digit_size), max(digit_size)
    placed: list[tuple[int, int, int, int]] = []  # the patches' rectangles (x0, y0, x1, y1)
    boxes, labels, inks = [], [], []
    fg = np.zeros((h, w), np.float32)
    for _ in range(int(rng.integers(1, max_digits + 1))):
        k = int(rng.integers(len(digits)))
        side = float(rng.uniform(lo, hi))
        aspect = float(rng.uniform(0.85, 1.15))
        ph, pw = min(h, round(side * aspect)), min(w, round(side / aspect))
        for _try in range(20):  # a digit that finds no free place within 20 draws is left out
            y0, x0 = int(rng.integers(0, h - ph + 1)), int(rng.integers(0, w - pw + 1))
            # a 2 px gap keeps digits apart, so every box holds exactly one digit's ink
            if all(_apart((x0, y0, x0 + pw, y0 + ph), b, gap=2) for b in placed):
                break
        else:
            continue
        patch = F.interpolate(digits[k][None, None], (ph, pw), mode="bilinear", align_corners=False)[0, 0]
        patch = patch.numpy()
        patch = np.where(patch >= INK_FLOOR, np.minimum(patch, 1.0), 0.0) * float(rng.uniform(0.6, 1.0))
        ys, xs = np.nonzero(patch)
        if len(ys) == 0:
            continue
        fg[y0 : y0 + ph, x0 : x0 + pw] = patch
        placed.append((x0, y0, x0 + pw, y0 + ph))
        boxes.append([x0 + xs.min(), y0 + ys.min(), x0 + xs.max() + 1, y0 + ys.max() + 1])
        labels.append(int(digit_labels[k]))
        if keep_ink:
            inks.append(np.zeros((h, w), np.float32))
            inks[-1][y0 : y0 + ph, x0 : x0 + pw] = patch
    # background: a random level plus a linear gradient in a random direction
    ramp_y, ramp_x = np.linspace(-0.5, 0.5, h)[:, None], np.linspace(-0.5, 0.5, w)[None, :]
    gx, gy = rng.uniform(-0.2, 0.2, size=2)
    background = rng.uniform(0.0, 0.3) + gx * ramp_x + gy * ramp_y
    image = background * (1 - fg) + fg + noise * rng.standard_normal((h, w))
    return Scene(
        image=torch.from_numpy((image.clip(0, 1) * 255).round().astype(np.uint8)),
        boxes=torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        labels=torch.tensor(labels, dtype=torch.long),
        ink=torch.from_numpy(np.stack(inks)) if inks else torch.zeros(0, h, w),
    )


class SceneImages(Dataset):
    """Rendered scenes held in memory (grayscale uint8), served as 3-channel floats through `transform`."""

    def __init__(self, scenes: list[Scene], transform: Callable) -> None:
        self.images = torch.stack([s.image for s in scenes])
        self.targets = [(s.boxes, s.labels) for s in scenes]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> Sample:
        from torchvision import tv_tensors

        boxes, labels = self.targets[i]
        h, w = self.images.shape[-2:]
        image = tv_tensors.Image(self.images[i].float().div(255).expand(3, h, w))
        boxes = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(h, w))
        return _plain(*self.transform(image, {"boxes": boxes, "labels": labels}))


@DATASETS.register("digit_scenes")
def digit_scenes(
    *,
    train_size: Annotated[int, Bounds(ge=1)] = 4000,
    val_size: Annotated[int, Bounds(ge=1)] = 500,
    test_size: Annotated[int, Bounds(ge=1)] = 500,
    eval_split: Annotated[str, Bounds(choices=("val", "test"))] = "val",
    image_size: Annotated[int, Bounds(ge=16)] = 96,
    digit_size: Annotated[list[int], Bounds(ge=4, length=2)] = [16, 40],  # noqa: B006 - read only
    max_digits: Annotated[int, Bounds(ge=1)] = 4,
    noise: Annotated[float, Bounds(ge=0)] = 0.08,
    seed: Annotated[int, Bounds(ge=0)] = 0,
    augment: bool = True,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> DetectionData:
    """Scenes of bundled 8x8 digits pasted at random sizes and places on a noisy canvas, with exact boxes.

    train_size: training scenes
    val_size: validation scenes (digits from a held-out 15% of the bundled images)
    test_size: test scenes (digits from another held-out 15%)
    eval_split: the held-out split evaluated during training: val or test
    image_size: side of the square canvas in pixels
    digit_size: smallest and largest digit side in pixels, [MIN, MAX]
    max_digits: digits per scene at most (1 at least; fewer where no free place is found)
    noise: standard deviation of the Gaussian pixel noise (pixels are 0..1)
    seed: seed of the scenes (scene i of a split is a function of seed, split and i alone)
    augment: jitter training scenes' scale, position, brightness and contrast (boxes follow)
    policy: accepted like every data section's, with nothing to skip in generated scenes
    """
    if max(digit_size) > image_size:
        raise ConfigError(
            f"data.digit_size={list(digit_size)} exceeds data.image_size={image_size}",
            key="data.digit_size",
            value=str(list(digit_size)),
            valid=(f"<= data.image_size={image_size}",),
        )
    pools = digit_pools()
    sizes = {"train": train_size, eval_split: val_size if eval_split == "val" else test_size}

    def split(name: str) -> SceneImages:
        scenes = [
            render_scene(
                pools[name],
                seed,
                name,
                i,
                image_size=image_size,
                digit_size=digit_size,
                max_digits=max_digits,
                noise=noise,
            )
            for i in range(sizes[name])
        ]
        return SceneImages(scenes, box_transform(name == "train", augment=augment))

    classes = [str(d) for d in range(10)]
    return DetectionData(split("train"), split(eval_split), classes, image_size, in_memory=True)


# ---- COCO-format folders --------------------------------------------------------------------------------
@dataclass
class CocoIndex:
    """What an annotations file says: each image's file and boxes, and the category names."""

    files: list[str]
    boxes: list[torch.Tensor]  # per image (N, 4) xyxy in the file's pixels
    labels: list[torch.Tensor]
    classes: list[str]
    category_ids: list[int]


def read_coco(annotations: Path, category_ids: list[int] | None = None) -> CocoIndex:
    """Parse a COCO detection JSON: `bbox` [x, y, w, h] -> xyxy, category ids -> contiguous labels in id
    order (or in the order of `category_ids`, another file's, so that two splits share labels); crowd regions
    and boxes under 1 px are left out. A malformed file is a DataError naming it."""
    try:
        doc = json.loads(annotations.read_text())
        cats = sorted((int(c["id"]), str(c["name"])) for c in doc["categories"])
        images = {int(im["id"]): str(im["file_name"]) for im in doc["images"]}
        anns = doc.get("annotations", [])
        if not cats:
            raise ValueError("no categories")
        ids = category_ids or [c for c, _ in cats]
        label_of = {c: i for i, c in enumerate(ids)}
        per_image: dict[int, list[tuple[list[float], int]]] = {i: [] for i in images}
        for a in anns:
            x, y, w, h = (float(v) for v in a["bbox"])
            cat, image_id = int(a["category_id"]), int(a["image_id"])
            if image_id not in per_image:
                raise ValueError(f"annotation {a.get('id')}: image_id {image_id} is not among the images")
            if cat not in label_of:
                raise ValueError(f"annotation {a.get('id')}: category_id {cat} is not among the categories")
            if a.get("iscrowd", 0) or w < 1 or h < 1:
                continue
            per_image[image_id].append(([x, y, x + w, y + h], label_of[cat]))
    except FileNotFoundError:
        raise DataError(f"data.annotations: {annotations} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
        raise DataError(
            f"{annotations}: not a COCO detection file ({what})",
            key="data.annotations",
            value=str(annotations),
            valid=("a COCO detection file",),
        ) from None
    names = dict(cats)
    order = sorted(images)
    return CocoIndex(
        files=[images[i] for i in order],
        boxes=[torch.tensor([b for b, _ in per_image[i]], dtype=torch.float32).reshape(-1, 4) for i in order],
        labels=[torch.tensor([c for _, c in per_image[i]], dtype=torch.long) for i in order],
        classes=[names.get(c, str(c)) for c in ids],
        category_ids=ids,
    )


class CocoImages(Dataset):
    """Images of a COCO index, read from `root`, scaled so the longer side is `image_size`, then through
    `transform`; unreadable files follow the run's bad-sample policy."""

    def __init__(
        self,
        root: Path,
        index: CocoIndex,
        keep: list[int],
        image_size: int,
        transform: Callable,
        policy: BadSamplePolicy,
        split: str,
    ) -> None:
        from torchvision.transforms import v2

        self.root, self.index, self.transform = root, index, transform
        self.resize = v2.Resize(size=None, max_size=image_size, antialias=True)
        self.bad = BadSamples(policy, f"split '{split}'", "images")
        for i in keep:
            if not (root / index.files[i]).is_file():
                self.bad.add(str(root / index.files[i]), "no such file")
        missing = {p for p, _ in self.bad.found}
        self.keep = [i for i in keep if str(root / index.files[i]) not in missing]
        self.bad.check(len(keep))

    def __len__(self) -> int:
        return len(self.keep)

    def describe(self, i: int) -> str:
        """The file of sample `i`."""
        return str(self.root / self.index.files[self.keep[i]])

    def _load(self, i: int) -> Sample:
        from PIL import Image
        from torchvision import tv_tensors
        from torchvision.transforms import v2

        j = self.keep[i]
        with Image.open(self.describe(i)) as im:
            image = tv_tensors.Image(v2.functional.pil_to_tensor(im.convert("RGB")))
        h, w = image.shape[-2:]
        target = {
            "boxes": tv_tensors.BoundingBoxes(self.index.boxes[j], format="XYXY", canvas_size=(h, w)),
            "labels": self.index.labels[j],
        }
        image, target = self.resize(image, target)
        image = v2.functional.to_dtype(image, torch.float32, scale=True)
        return _plain(*self.transform(image, target))

    def __getitem__(self, i: int) -> Sample:
        return self.bad.load(i, self._load, self.describe, DECODE_ERRORS)


@DATASETS.register("coco")
def coco(
    *,
    images: Annotated[str, Bounds(exists="dir")] = "",
    annotations: Annotated[str, Bounds(exists="file")] = "",
    val_images: Annotated[str, Bounds(exists="dir")] = "",
    val_annotations: Annotated[str, Bounds(exists="file")] = "",
    val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.1,
    split_seed: Annotated[int, Bounds(ge=0)] = 0,
    image_size: Annotated[int, Bounds(ge=32)] = 320,
    augment: bool = True,
    hflip: bool = True,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> DetectionData:
    """A COCO-format detection dataset: a folder of images and an annotations JSON (boxes; masks ignored).

    images: the folder the annotations' file_name entries are relative to (required)
    annotations: the COCO JSON of the training images (required)
    val_images: the validation images' folder (empty: the training folder)
    val_annotations: the validation COCO JSON (empty: hold out val_fraction of the training images)
    val_fraction: share of the training images held out when val_annotations is empty
    split_seed: seed of that hold-out
    image_size: the longer image side the model sees, in pixels (images are scaled to it)
    augment: jitter training images' scale, position, brightness and contrast (boxes follow)
    hflip: also flip training images left-right when augmenting (off for glyphs, text, signs)
    """
    if not images or not annotations:
        raise ConfigError(
            "data=coco needs data.images=DIR and data.annotations=FILE.json (a COCO detection file)",
            key="data.annotations" if images else "data.images",
            value="",
            valid=("FILE.json",) if images else ("DIR",),
        )
    root, ann = Path(images).expanduser(), Path(annotations).expanduser()
    if not root.is_dir():
        raise DataError(f"data.images={images}: no such folder")
    train_index = read_coco(ann)
    train_tf = box_transform(True, augment=augment, hflip=hflip)
    val_tf = box_transform(False, augment=False)
    if val_annotations:
        val_root = Path(val_images).expanduser() if val_images else root
        val_index = read_coco(Path(val_annotations).expanduser(), train_index.category_ids)
        train_keep, val_keep = list(range(len(train_index.files))), list(range(len(val_index.files)))
    else:
        val_root, val_index = root, train_index
        order = torch.randperm(len(train_index.files), generator=torch.Generator().manual_seed(split_seed))
        k = max(1, round(len(order) * val_fraction))
        val_keep, train_keep = sorted(order[:k].tolist()), sorted(order[k:].tolist())
        if not train_keep:
            raise DataError(f"{ann}: {len(order)} image(s) leave none to train on; lower data.val_fraction")
    return DetectionData(
        CocoImages(root, train_index, train_keep, image_size, train_tf, policy, "train"),
        CocoImages(val_root, val_index, val_keep, image_size, val_tf, policy, "val"),
        train_index.classes,
        image_size,
    )


def write_scenes(out: Path, split: str = "test", count: int = 8, **scene_args: Any) -> Path:
    """Write `count` scenes of `split` as PNGs plus a COCO annotations file (`annotations.json`); returns
    the folder. `data=coco data.images=OUT data.annotations=OUT/annotations.json` reads them back."""
    from PIL import Image

    args = {"image_size": 96, "digit_size": (16, 40), "max_digits": 4, "noise": 0.08, **scene_args}
    seed = args.pop("seed", 0)
    pool = digit_pools()[split]
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"images": [], "annotations": [], "categories": []}
    doc["categories"] = [{"id": d, "name": str(d)} for d in range(10)]
    for i in range(count):
        scene = render_scene(pool, seed, split, i, **args)
        name = f"{split}_{i:04d}.png"
        Image.fromarray(scene.image.numpy()).save(out / name)
        side = args["image_size"]
        doc["images"].append({"id": i, "file_name": name, "height": side, "width": side})
        for (x0, y0, x1, y1), label in zip(scene.boxes.tolist(), scene.labels.tolist(), strict=True):
            doc["annotations"].append(
                {
                    "id": len(doc["annotations"]),
                    "image_id": i,
                    "category_id": label,
                    "bbox": [x0, y0, x1 - x0, y1 - y0],
                    "area": (x1 - x0) * (y1 - y0),
                    "iscrowd": 0,
                }
            )
    (out / "annotations.json").write_text(json.dumps(doc))
    return out
