"""vision.shards: an ImageFolder tree written into tar shards reads back image for image and label for label
as torchvision's ImageFolder reads the tree, and a classification run from the shards resumes bit-exact with
any number of loader workers."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from recipes.prepare import main as prepare_main
from tests.helpers import train
from vision.datasets import imagefolder
from vision.shards import image_shards

CLASSES = ("ant", "bee", "cat")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """ROOT/{train,val}/<class>/ of small PNG and JPEG images of several sizes."""
    rng = np.random.default_rng(0)
    root = tmp_path / "tree"
    for split, n in (("train", 14), ("val", 4)):
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 255, (20 + i % 5, 24 + c, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


def prepared(tree: Path, out: Path) -> Path:
    code = prepare_main(
        ["+task=image_classification", f"data.root={tree}", f"out={out}", "shard_mb=0.005", "progress=false"]
    )
    assert code == 0
    return out


def test_shards_read_back_image_for_image_as_imagefolder_reads_the_tree(tree: Path, tmp_path: Path) -> None:
    out = prepared(tree, tmp_path / "shards")
    got = image_shards(path=str(out), image_size=16, augment=False)
    want = imagefolder(root=str(tree), image_size=16, augment=False)
    assert got.classes == want.classes == list(CLASSES) and got.num_classes == 3
    assert len(set(got.train.shard_of)) > 3
    for a, b in ((got.train, want.train), (got.val, want.val)):
        assert len(a) == len(b) > 0
        for i in range(len(a)):
            (xa, ya), (xb, yb) = a[i], b[i]
            assert ya == yb and torch.equal(xa, xb), i


RUN = [
    "+task=image_classification",
    "data=image_shards",
    "data.image_size=16",
    "model.width=8",
    "trainer=smoke",
    "trainer.batch_size=8",
    "trainer.ckpt_every=2",
    "trainer.keep_last=10",
    "trainer.export=last",
    "logger=none",
]


@pytest.mark.slow  # a whole run (default suite time)
def test_a_run_from_shards_resumes_bit_exact_with_other_loader_workers(tree: Path, tmp_path: Path) -> None:
    out = prepared(tree, tmp_path / "shards")
    data = [f"data.path={out}", "data.window_shards=2"]
    straight = train(tmp_path / "a", [*RUN, *data, "trainer.num_workers=0"])
    ckpt = "step_00000002"
    shutil.copytree(straight / "checkpoints" / ckpt, tmp_path / "b" / "checkpoints" / ckpt)
    resumed = train(tmp_path / "b", [*RUN, *data, "trainer.num_workers=2", "resume=auto"])
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
