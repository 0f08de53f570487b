"""vision.datasets: the digits split is deterministic and stratified; ImageFolder problems are DataErrors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from core.data.bad_samples import BadSamplePolicy
from core.errors import ConfigError, DataError
from core.registry import DATASETS
from tests.helpers import cli_env, fault
from vision.datasets import bundled_digits, digits, imagefolder


def test_digits_split_is_deterministic_stratified_80_20() -> None:
    a, b = digits(), digits()
    assert (len(a.train), len(a.val)) == (1438, 359)  # 1,797 bundled images, 20% of each class rounded
    assert torch.equal(a.val.labels, b.val.labels) and torch.equal(a.val.images, b.val.images)
    counts = torch.bincount(a.val.labels, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # ~20% of each ~180-image class
    assert a.num_classes == 10 and a.in_channels == 1 and a.image_size == 8
    assert a.val.images.min() == 0 and a.val.images.max() == 1  # stored in [0, 1], as augmentation expects
    centred = torch.stack([a.val[i][0] for i in range(len(a.val))])
    assert centred.min() == -1 and centred.max() == 1


def test_bundled_digits_are_scikit_learns_without_importing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    ref = load_digits()
    images, labels = bundled_digits()
    assert torch.equal(images, torch.tensor(ref.images, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(ref.target, dtype=torch.long))
    # the data file read directly, so a run on digits does not pay sklearn's (and scipy's) import
    code = "import sys, vision.datasets as d; d.bundled_digits()"
    code += "; print([m for m in sys.modules if 'sklearn' in m])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
    # where scikit-learn keeps the file elsewhere: its loader, the same arrays
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    again = bundled_digits()
    assert torch.equal(again[0], images) and torch.equal(again[1], labels)


def test_digits_augments_train_only() -> None:
    d = digits()
    torch.manual_seed(0)
    draws = {tuple(d.train[0][0].flatten().tolist()) for _ in range(20)}
    assert 3 <= len(draws) <= 9  # a +-1 px random crop has 9 possible placements
    assert torch.equal(d.val[0][0], d.val[0][0])
    assert torch.equal(digits(augment=False).train[0][0], digits(augment=False).train[0][0])
    with pytest.raises(ConfigError) as e:
        DATASETS.build("digits", val_fraction=1.5)  # the registry checks the builder's declared bounds
    assert fault(e.value) == ("data.val_fraction", "1.5", ("> 0 and < 1",))


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
    with pytest.raises(ConfigError) as e:
        imagefolder()
    assert fault(e.value)[:2] == ("data.root", "")
    _tree(tmp_path, {"train": ["cat"]})
    with pytest.raises(DataError) as e:
        imagefolder(root=str(tmp_path))
    assert fault(e.value) == ("data.root", str(tmp_path), ("DIR/val/<class>/*",))
    _tree(tmp_path, {"val": ["dog"]})
    with pytest.raises(DataError) as e:
        imagefolder(root=str(tmp_path))
    assert fault(e.value) == ("val classes", "dog", ("cat",))


def _jpeg_tree(root: Path, n: int) -> list[Path]:
    """root/{train,val}/{a,b}/*.jpg: n noisy JPEGs per class and split."""
    g = torch.Generator().manual_seed(0)
    paths = []
    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (24, 24, 3), generator=g, dtype=torch.uint8).numpy()
                paths.append(root / split / c / f"{i:03d}.jpg")
                Image.fromarray(pixels).save(paths[-1], quality=90)
    return paths


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_a_truncated_jpeg_is_skipped_named_and_counted_or_stops_the_run(tmp_path: Path, caplog) -> None:
    _jpeg_tree(tmp_path, 60)
    broken = tmp_path / "train" / "a" / "007.jpg"
    _truncate(broken, 0.6)  # the header reads; the pixels end early
    d = imagefolder(root=str(tmp_path), image_size=16, augment=False)
    assert len(d.train) == 120  # found only when decoded
    x, y = d.train[7]  # the bad sample's place is taken by the next one, deterministically
    assert torch.equal(x, d.train[8][0]) and y == d.train[8][1] == 0
    assert d.train.bad.count == 1 and str(broken) in caplog.text
    strict = imagefolder(root=str(tmp_path), image_size=16, policy=BadSamplePolicy("error"))
    with pytest.raises(DataError) as e:
        strict.train[7]
    assert fault(e.value) == ("sample", str(broken), ())
    tight = imagefolder(root=str(tmp_path), image_size=16, policy=BadSamplePolicy(max_bad_fraction=0.0))
    with pytest.raises(DataError) as e:
        tight.train[7]
    assert fault(e.value) == ("data.max_bad_fraction", "1/120", ("<= 0",))


def test_an_image_cut_inside_its_header_or_not_an_image_is_left_out_when_the_tree_is_read(
    tmp_path: Path,
) -> None:
    paths = _jpeg_tree(tmp_path, 110)
    _truncate(paths[0], 0.01)
    (tmp_path / "train" / "b" / "notes.png").write_bytes(b"not an image")
    d = imagefolder(root=str(tmp_path), image_size=16)
    assert len(d.train) == 219 and d.train.bad.count == 2  # 2 of 221 files: under data.max_bad_fraction
    assert {p for p, _ in d.train.bad.found} == {str(paths[0]), str(tmp_path / "train" / "b" / "notes.png")}
    with pytest.raises(DataError) as e:
        imagefolder(root=str(tmp_path), policy=BadSamplePolicy("error"))
    assert fault(e.value) == ("sample", str(paths[0]), ())


# data=fashion_mnist: IDX files read with numpy; tiny ones written here, gzipped and plain


def _idx(path: Path, values: torch.Tensor) -> None:
    """Write `values` (uint8) as an IDX file: 00 00 08 NDIM, big-endian int32 sizes, the bytes."""
    import gzip
    import struct

    raw = b"\x00\x00\x08" + bytes([values.ndim]) + struct.pack(f">{values.ndim}i", *values.shape)
    raw += values.to(torch.uint8).numpy().tobytes()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


def _fashion(
    root: Path, n_train: int = 6, n_val: int = 4, gz: tuple[bool, ...] = (True, False, False, True)
) -> None:
    g = torch.Generator().manual_seed(0)
    files = [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ]
    root.mkdir(parents=True, exist_ok=True)
    for name, zipped in zip(files, gz, strict=True):
        n = n_train if name.startswith("train") else n_val
        values = torch.randint(0, 256, (n, 28, 28), generator=g) if "images" in name else torch.arange(n) % 10
        if "images" in name:
            values[0, 0, 0], values[0, 0, 1] = 0, 255
        _idx(root / (name + (".gz" if zipped else "")), values)


def test_fashion_mnist_reads_gzipped_and_plain_idx_files(tmp_path: Path) -> None:
    from vision.datasets import FASHION_MNIST_CLASSES, fashion_mnist

    _fashion(tmp_path)
    d = fashion_mnist(root=str(tmp_path), augment=False)
    assert (len(d.train), len(d.val), d.num_classes, d.in_channels, d.image_size) == (6, 4, 10, 1, 28)
    x, y = d.train[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y == 0 and d.val[3][1] == 3
    assert (x[0, 0, 0], x[0, 0, 1]) == (-1.0, 1.0)  # black -1, white 1: the datasets' (p - 0.5) / 0.5
    assert d.train.classes == list(FASHION_MNIST_CLASSES) and d.train.classes[9] == "Ankle boot"
    assert fashion_mnist(root=str(tmp_path), image_size=32).val[0][0].shape == (1, 32, 32)
    torch.manual_seed(0)
    augmented = fashion_mnist(root=str(tmp_path))
    assert len({tuple(augmented.train[0][0].flatten().tolist()) for _ in range(10)}) > 1
    assert torch.equal(augmented.val[0][0], d.val[0][0])


def _damage(root: Path, how: str) -> tuple:
    """Break the training labels `how`; the fields of the error, which name the file."""
    name = "train-labels-idx1-ubyte"
    labels = root / name
    if how == "missing":
        labels.unlink()
        return ("data.root", str(root), (name, f"{name}.gz"))
    if how == "magic":
        labels.write_bytes(b"\x00\x00\x0d\x01" + labels.read_bytes()[4:])
        return (name, "00000d01", ("000008NN",))
    if how == "truncated":
        labels.write_bytes(labels.read_bytes()[:-2])
        return (name, "4 bytes", ("6 bytes",))
    if how == "count":
        _idx(labels, torch.zeros(5))
        return (name, "(5,)", ("(6,)",))
    if how == "class":
        _idx(labels, torch.full((6,), 10))
        return (name, "10", ("0..9",))
    labels.unlink()  # "gzip": a .gz that is not gzip
    (root / f"{name}.gz").write_bytes(b"\x00\x00\x08\x01 plain bytes")
    return (f"{name}.gz", "BadGzipFile", ())


@pytest.mark.parametrize("how", ["missing", "magic", "truncated", "count", "class", "gzip"])
def test_fashion_mnist_bad_files_are_one_line_data_errors_naming_the_file(tmp_path: Path, how: str) -> None:
    from vision.datasets import fashion_mnist

    _fashion(tmp_path, gz=(False,) * 4)
    expected = _damage(tmp_path, how)
    with pytest.raises(DataError) as e:
        fashion_mnist(root=str(tmp_path))
    assert fault(e.value) == expected and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        fashion_mnist()
    assert fault(e.value)[:2] == ("data.root", "")


@pytest.mark.parametrize(
    "model", [["model=small_cnn"], ["model=torchvision", "model.arch=resnet18", "data.image_size=32"]]
)
def test_fashion_mnist_trains_with_image_classification(tmp_path: Path, model: list[str]) -> None:
    from hydra import compose, initialize_config_dir

    from recipes.cli.config import CONF_DIR, register_configs
    from recipes.cli.tasks import build_task
    from recipes.cli.validate import validate

    register_configs()
    _fashion(tmp_path)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(
            "train", ["+task=image_classification", "data=fashion_mnist", f"data.root={tmp_path}", *model]
        )
    validate(cfg)
    task = build_task(cfg)
    net = task.build_model()
    batch = torch.stack([task.data.train[i][0] for i in range(2)]), torch.tensor([0, 1])
    out = task.step(net, batch)
    assert torch.isfinite(out.loss) and out.count == 2


def test_fashion_mnist_files_missing_is_exit_2_naming_the_file(tmp_path: Path, cli_here) -> None:
    r = cli_here(
        "+task=image_classification",
        "data=fashion_mnist",
        f"data.root={tmp_path}",
        f"hydra.run.dir={tmp_path}/run",
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    # the DataError's key and value and the file it wants (its fields: the test above), not its wording
    last = r.stderr.strip().splitlines()[-1]
    assert f"data.root={tmp_path}" in last and "train-images-idx3-ubyte" in last
