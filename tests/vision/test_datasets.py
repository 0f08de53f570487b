"""vision.datasets: the digits split is deterministic and stratified; ImageFolder problems are DataErrors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from core.errors import ConfigError, DataError
from core.registry import DATASETS
from vision.datasets import digits, imagefolder


def test_digits_split_is_deterministic_stratified_80_20() -> None:
    a, b = digits(), digits()
    assert (len(a.train), len(a.val)) == (1438, 359)  # 1,797 bundled images, 20% of each class rounded
    assert torch.equal(a.val.labels, b.val.labels) and torch.equal(a.val.images, b.val.images)
    counts = torch.bincount(a.val.labels, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # ~20% of each ~180-image class
    assert a.num_classes == 10 and a.in_channels == 1 and a.image_size == 8
    assert a.val.images.min() == -1 and a.val.images.max() == 1


def test_digits_augments_train_only() -> None:
    d = digits()
    torch.manual_seed(0)
    draws = {tuple(d.train[0][0].flatten().tolist()) for _ in range(20)}
    assert 3 <= len(draws) <= 9  # a +-1 px random crop has 9 possible placements
    assert torch.equal(d.val[0][0], d.val[0][0])
    assert torch.equal(digits(augment=False).train[0][0], digits(augment=False).train[0][0])
    with pytest.raises(ConfigError, match=r"^data.val_fraction=1.5 is out of range; valid: > 0 and < 1$"):
        DATASETS.build("digits", val_fraction=1.5)  # the registry checks the builder's declared bounds


def _tree(root: Path, splits: dict[str, list[str]]) -> None:
    for split, classes in splits.items():
        for c in classes:
            (root / split / c).mkdir(parents=True)
            Image.new("RGB", (10, 12), (200, 10, 10)).save(root / split / c / "a.png")


def test_imagefolder_reads_tree(tmp_path: Path) -> None:
    _tree(tmp_path, {"train": ["cat", "dog"], "val": ["cat", "dog"]})
    d = imagefolder(root=str(tmp_path), image_size=16)
    x, y = d.val[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y == 0
    assert d.num_classes == 2 and torch.allclose(x[0], torch.full((16, 16), 200 / 255 * 2 - 1), atol=1e-2)


def test_imagefolder_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.root is required"):
        imagefolder()
    _tree(tmp_path, {"train": ["cat"]})
    with pytest.raises(DataError, match=r"missing folder .*/val \(expected DIR/val/<class>/\*\)"):
        imagefolder(root=str(tmp_path))
    _tree(tmp_path, {"val": ["dog"]})
    with pytest.raises(DataError, match=r"train classes \['cat'\] differ from val classes \['dog'\]"):
        imagefolder(root=str(tmp_path))
