"""`python -m recipes.detect ckpt=RUN_DIR input=IMAGE|DIR [out=DIR] [score=0.5]`: draw a trained detector's
boxes on images.

RUN_DIR is a `+task=detection` run directory (or one of its `checkpoints/step_*` folders). Each image (a
file, or every PNG/JPEG/BMP/WebP in a folder) is written to OUT as `<name>.png` with its boxes, class names
and scores drawn, and one line per image goes to OUT/detections.jsonl: boxes (xyxy, the input's pixels),
scores, labels and class names. The model scales each image itself (its longer side to the trained size).
A bad argument, image or run is one line and exit 2; a write that fails (a full disk, `out=` under a file)
is one line and exit 74 (core.errors.CheckpointWriteError).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TextIO

import torch

from core.bounds import Bounds
from core.errors import CheckpointWriteError, ConfigError, DataError
from recipes.cli.command import command
from recipes.cli.options import help_text, parse_options
from recipes.cli.runs import Run, load_run

USAGE = "usage: python -m recipes.detect ckpt=RUN_DIR input=IMAGE|DIR [out=DIR] [score=0.5]"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
#: drawn images are enlarged (nearest neighbour) to at least this longer side, so labels stay legible
MIN_DRAWN_SIDE = 384


@dataclass
class DetectConfig:
    """Command-line options (key=value)."""

    #: the detection run directory (its model.safetensors), or one of its checkpoints/step_* folders
    ckpt: str = ""
    #: an image, or a folder of PNG/JPEG/BMP/WebP images
    input: str = ""
    #: the folder the drawings and detections.jsonl go to
    out: str = "detections"
    #: the lowest score of a box kept
    score: Annotated[float, Bounds(ge=0, le=1)] = 0.5
    #: cpu, cuda, cuda:N, mps or auto
    device: str = "auto"


def images_of(path: Path) -> list[Path]:
    """`path` itself, or the images in the folder `path`, sorted."""
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise DataError(f"input={path}: no {'/'.join(s[1:] for s in IMAGE_SUFFIXES)} files in it")
        return found
    if not path.is_file():
        raise DataError(f"input={path}: no such file or folder")
    return [path]


def read_image(path: Path) -> torch.Tensor:
    """The image at `path` as RGB uint8 (3, H, W); an unreadable file is a DataError naming it."""
    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor

    try:
        with Image.open(path) as im:
            return pil_to_tensor(im.convert("RGB"))
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f"cannot read {path} as an image ({type(e).__name__}); give a PNG or JPEG") from None


def draw(image: torch.Tensor, found: dict[str, Any], classes: list[str]) -> torch.Tensor:
    """`image` (uint8, enlarged if small) with each box outlined in its class's colour and labelled."""
    from torchvision.utils import draw_bounding_boxes

    k = max(1, -(-MIN_DRAWN_SIDE // max(image.shape[-2:])))
    big = image.repeat_interleave(k, -1).repeat_interleave(k, -2)
    palette = ["red", "lime", "blue", "yellow", "magenta", "cyan", "orange", "white", "pink", "springgreen"]
    labels = [f"{classes[c]}: {s:.2f}" for c, s in zip(found["labels"], found["scores"], strict=True)]
    colors = [palette[c % len(palette)] for c in found["labels"]]
    boxes = torch.tensor(found["boxes"], dtype=torch.float32).reshape(-1, 4) * k
    return draw_bounding_boxes(big, boxes, labels, colors, width=2)


def detect(cfg: DetectConfig) -> Path:
    """Run the detector of `cfg.ckpt` on `cfg.input`; returns the folder the drawings and JSONL went to."""
    paths = images_of(Path(cfg.input).expanduser())
    loaded = load_run(cfg.ckpt, device=cfg.device, tasks=("detection",), command="recipes.detect")
    out = Path(cfg.out).expanduser()
    if any(p.parent.resolve() == out.resolve() for p in paths):
        raise ConfigError(
            f"out={cfg.out} holds the input images, which the drawings would overwrite; pick another"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "detections.jsonl", "w") as lines:
            draw_all(loaded, paths, cfg.score, out, lines)
    except OSError as e:  # a full disk, or out= under a file: one line, the exit code of a failed write
        where = e.filename or out
        why = f"could not write {where}: {e.strerror or e}; choose another out=DIR"
        raise CheckpointWriteError(why) from None
    return out


def draw_all(run: Run, paths: list[Path], score: float, out: Path, lines: TextIO) -> None:
    """Detect the boxes of each image of `paths`, keep those scoring `score` or more, and write the drawing
    into `out` and one JSON line to `lines`."""
    from PIL import Image

    classes = run.task.classes
    device = next(run.model.parameters()).device
    with torch.no_grad():
        for path in paths:
            image = read_image(path)
            pred = run.model([image.to(device, torch.float32) / 255])[0]
            keep = pred["scores"] >= score
            found = {
                "image": str(path),
                "boxes": [[round(v, 2) for v in b] for b in pred["boxes"][keep].tolist()],
                "scores": [round(s, 4) for s in pred["scores"][keep].tolist()],
                "labels": pred["labels"][keep].tolist(),
            }
            found["names"] = [classes[c] for c in found["labels"]]
            lines.write(json.dumps(found) + "\n")
            drawn = draw(image, found, classes)
            Image.fromarray(drawn.permute(1, 2, 0).numpy()).save(out / f"{path.stem}.png")
            print(f"{path}: {len(found['boxes'])} box(es) -> {out / (path.stem + '.png')}", flush=True)


def run(argv: list[str]) -> int:
    """The command: detect and draw; one line per image on stdout."""
    detect(parse_options(argv, DetectConfig, usage=USAGE, required=("ckpt", "input")))
    return 0


def describe() -> str:
    """`--help`: the keys."""
    doc = __doc__.split("\n\n", 1)[1].strip()
    return help_text(USAGE, doc, [("keys", DetectConfig)])


main = command(run, usage=USAGE, describe=describe)


if __name__ == "__main__":
    sys.exit(main())
