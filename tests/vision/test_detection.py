"""Object detection: exact, deterministic digit scenes; box-aware transforms; the list-of-targets collate;
COCO mAP through the task's evaluate; the COCO-format reader; `+task=detection` and `recipes.detect` end to
end (vision/detection.py, vision/detection_data.py, vision/detectors.py, recipes/detect.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn
from torchvision import tv_tensors

from core.data.bad_samples import BadSamplePolicy
from core.errors import ConfigError, DataError
from core.registry import DATASETS, TASKS
from recipes.detect import main as detect_main
from tests.helpers import cli_env, fault, read_metrics
from vision.detection_data import (
    box_transform,
    coco,
    collate_detection,
    digit_pools,
    digit_scenes,
    render_scene,
    write_scenes,
)

SCENE = {"image_size": 96, "digit_size": (16, 40), "max_digits": 4, "noise": 0.08}


def test_scenes_are_deterministic_with_tight_exact_boxes() -> None:
    pools = digit_pools()
    assert sum(len(p[1]) for p in pools.values()) == 1797  # every bundled digit in exactly one pool
    for i in range(30):
        a = render_scene(pools["train"], 0, "train", i, keep_ink=True, **SCENE)
        b = render_scene(pools["train"], 0, "train", i, **SCENE)
        assert torch.equal(a.image, b.image) and torch.equal(a.boxes, b.boxes)
        assert torch.equal(a.labels, b.labels)
        assert 1 <= len(a.boxes) <= 4 and a.labels.dtype == torch.long
        for j, (x0, y0, x1, y1) in enumerate(a.boxes.long().tolist()):
            ys, xs = a.ink[j].nonzero(as_tuple=True)
            # tight: the box is exactly the extent of the digit's nonzero pixels (x1, y1 one past the last)
            assert [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] == [x0, y0, x1, y1]
            assert 16 * 0.85 * 0.5 <= max(x1 - x0, y1 - y0) <= 40 * 1.15 + 1
            others = torch.cat([a.ink[:j], a.ink[j + 1 :]])
            assert not others[:, y0:y1, x0:x1].any()  # no other digit's ink in this box
    other = render_scene(pools["val"], 0, "val", 0, **SCENE)
    assert not torch.equal(other.image, render_scene(pools["train"], 0, "train", 0, **SCENE).image)


def test_scene_dataset_serves_three_channel_floats_and_held_out_splits() -> None:
    data = digit_scenes(train_size=4, val_size=3, test_size=2, augment=False)
    assert (len(data.train), len(data.val), data.classes, data.image_size) == (4, 3, list("0123456789"), 96)
    image, target = data.val[0]
    assert image.shape == (3, 96, 96) and image.dtype == torch.float32
    assert 0 <= image.min() <= image.max() <= 1
    assert type(image) is torch.Tensor and type(target["boxes"]) is torch.Tensor  # no tv_tensor wrappers
    assert len(digit_scenes(train_size=4, val_size=3, test_size=2, eval_split="test").val) == 2
    with pytest.raises(ConfigError) as e:
        DATASETS.build("digit_scenes", digit_size=[16, 120])
    assert fault(e.value) == ("data.digit_size", "[16, 120]", ("<= data.image_size=96",))


def test_collate_keeps_a_list_of_images_and_a_list_of_targets() -> None:
    data = digit_scenes(train_size=3, val_size=1, test_size=1)
    images, targets = collate_detection([data.train[i] for i in range(3)])
    assert isinstance(images, list) and isinstance(targets, list) and len(images) == len(targets) == 3
    assert all(t["boxes"].shape == (len(t["labels"]), 4) for t in targets)


def test_training_transform_moves_boxes_with_the_pixels() -> None:
    image = torch.zeros(3, 96, 96)
    image[:, 30:60, 20:44] = 1.0  # one bright rectangle, its box (x0, y0, x1, y1) = (20, 30, 44, 60)
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[20.0, 30, 44, 60]]), format="XYXY", canvas_size=(96, 96))
    tf = box_transform(True, augment=True)
    moved = 0
    for seed in range(8):
        torch.manual_seed(seed)
        out, target = tf(tv_tensors.Image(image), {"boxes": boxes, "labels": torch.tensor([3])})
        gray = out[0]
        ys, xs = (gray > (gray.min() + gray.max()) / 2).nonzero(as_tuple=True)
        bright = torch.tensor([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=torch.float32)
        # within 1.5 px (interpolation at the edges): the box is where the rectangle went
        assert torch.allclose(target["boxes"][0], bright, atol=1.5), (seed, target["boxes"], bright)
        assert target["labels"].tolist() == [3]
        moved += not torch.allclose(target["boxes"][0], boxes[0], atol=0.5)
    assert moved >= 6  # the jitter does move things


class _Replay(nn.Module):
    """A stand-in detector that returns fixed detections."""

    def __init__(self, detections: list[dict[str, torch.Tensor]]) -> None:
        super().__init__()
        self.detections = detections

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return self.detections


def test_map_is_one_for_perfect_detections_and_lower_for_shifted_ones() -> None:
    task = TASKS.build("detection", model={"name": "fcos"}, data={"name": "digit_scenes"})
    data = digit_scenes(train_size=1, val_size=6, test_size=1, augment=False)
    images, targets = collate_detection([data.val[i] for i in range(6)])

    def mean_ap(shift: float) -> dict[str, float]:
        dets = []
        for t in targets:
            b = t["boxes"].clone()
            b[:, [0, 2]] += shift * (b[:, 2:3] - b[:, 0:1])  # move right by a share of the box's width
            dets.append({"boxes": b, "scores": torch.ones(len(b)), "labels": t["labels"]})
        return task.evaluate(_Replay(dets), [(images, targets)])

    perfect, shifted, far = mean_ap(0.0), mean_ap(0.2), mean_ap(0.6)
    assert perfect["map"] == pytest.approx(1.0) and perfect["map_50"] == pytest.approx(1.0)
    assert perfect["map_75"] == pytest.approx(1.0)
    # a 20% shift keeps IoU = 0.8/1.2 = 0.67: found at IoU 0.5, missed at 0.75 and above
    assert shifted["map_50"] == pytest.approx(1.0) and shifted["map_75"] < 0.05 and shifted["map"] < 0.5
    assert far["map_50"] < 0.05  # IoU 0.4/1.6 = 0.25


def test_a_missing_evaluator_is_one_line_with_the_install_command(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    hide = lambda name, *a: None if name == "pycocotools" else real(name, *a)
    monkeypatch.setattr(importlib.util, "find_spec", hide)
    with pytest.raises(ConfigError) as e:
        TASKS.build("detection", model={"name": "fcos"}, data={"name": "digit_scenes"})
    assert fault(e.value) == ("task", "detection", ("pycocotools installed",)) and "\n" not in str(e.value)


def _coco_folder(root: Path) -> Path:
    """Three 40x30 PNGs and a COCO file: categories with ids 3 (cat) and 7 (dog), one crowd region."""
    root.mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (40, 30), (10 * i, 0, 0)).save(root / f"im{i}.png")
    doc = {
        "images": [{"id": 10 + i, "file_name": f"im{i}.png", "width": 40, "height": 30} for i in range(3)],
        "categories": [{"id": 7, "name": "dog"}, {"id": 3, "name": "cat"}],
        "annotations": [
            {"id": 1, "image_id": 10, "category_id": 7, "bbox": [4, 5, 10, 20], "iscrowd": 0},
            {"id": 2, "image_id": 10, "category_id": 3, "bbox": [20, 2, 8, 8], "iscrowd": 0},
            {"id": 3, "image_id": 11, "category_id": 3, "bbox": [0, 0, 40, 30], "iscrowd": 1},
            {"id": 4, "image_id": 12, "category_id": 3, "bbox": [1, 1, 5, 5]},
        ],
    }
    (root / "ann.json").write_text(json.dumps(doc))
    return root


def test_coco_reader_maps_ids_converts_boxes_and_scales_images(tmp_path: Path) -> None:
    root = _coco_folder(tmp_path / "coco")
    data = coco(
        images=str(root),
        annotations=str(root / "ann.json"),
        val_annotations=str(root / "ann.json"),
        image_size=80,
        augment=False,
    )
    assert data.classes == ["cat", "dog"] and data.image_size == 80  # ids 3, 7 -> labels 0, 1
    image, target = data.val[0]
    assert image.shape == (3, 60, 80)  # the longer side scaled to image_size (x2)
    assert target["labels"].tolist() == [1, 0]
    # bbox [x, y, w, h] -> [x0, y0, x1, y1], then x2 with the image
    assert torch.allclose(target["boxes"], torch.tensor([[8.0, 10, 28, 50], [40, 4, 56, 20]]))
    assert len(data.val[1][1]["boxes"]) == 0  # the crowd region is left out
    held = coco(images=str(root), annotations=str(root / "ann.json"), val_fraction=0.34)
    assert (len(held.train), len(held.val)) == (2, 1)


def test_coco_reader_names_the_bad_file(tmp_path: Path) -> None:
    root = _coco_folder(tmp_path / "coco")
    (root / "broken.json").write_text("{not json")
    with pytest.raises(DataError) as e:
        coco(images=str(root), annotations=str(root / "broken.json"))
    assert fault(e.value)[:2] == ("data.annotations", str(root / "broken.json"))
    (root / "im1.png").unlink()
    with pytest.raises(DataError) as e:
        coco(images=str(root), annotations=str(root / "ann.json"), policy=BadSamplePolicy("error"))
    assert fault(e.value) == ("sample", str(root / "im1.png"), ())
    with pytest.raises(ConfigError) as e:
        coco()
    assert fault(e.value) == ("data.images", "", ("DIR",))


@pytest.fixture(scope="module")
def detection_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seconds-long `+task=detection` CLI run on a few tiny scenes."""
    run = tmp_path_factory.mktemp("det") / "run"
    args = [
        "+task=detection",
        "trainer=smoke",
        "trainer.max_steps=2",
        "trainer.batch_size=4",
        "model.width=32",
        "data.train_size=8",
        "data.val_size=4",
        "data.test_size=1",
        f"hydra.run.dir={run}",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "recipes.train", *args],
        cwd=run.parent,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_cli_trains_a_detector_and_writes_its_outputs(detection_run: Path) -> None:
    assert (detection_run / "model.safetensors").is_file()
    rows = read_metrics(detection_run)
    evals = [r for r in rows if "val/map_50" in r]
    assert evals and all(0 <= r["val/map_50"] <= 1 and "val/map" in r and "val/map_75" in r for r in evals)
    assert json.loads((detection_run / "classes.json").read_text()) == {
        "classes": list("0123456789"),
        "image_size": 96,
    }


def test_detect_draws_boxes_and_writes_jsonl(detection_run: Path, tmp_path: Path, capsys) -> None:
    scenes = write_scenes(tmp_path / "scenes", count=2)
    out = tmp_path / "drawn"
    code = detect_main([f"ckpt={detection_run}", f"input={scenes}", f"out={out}", "score=0"])
    assert code == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in (out / "detections.jsonl").read_text().splitlines()]
    assert [Path(x["image"]).name for x in lines] == ["test_0000.png", "test_0001.png"]
    for x in lines:
        assert len(x["boxes"]) == len(x["scores"]) == len(x["labels"]) == len(x["names"])
        assert all(s >= 0 for s in x["scores"]) and all(n in "0123456789" for n in x["names"])
        with Image.open(out / Path(x["image"]).name) as im:
            assert im.format == "PNG" and im.mode == "RGB" and im.size == (384, 384)  # 96 px drawn at x4


def test_detect_errors_are_one_line_exit_2(detection_run: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "bad.png").write_bytes(b"not an image")
    for args, named in [
        ([f"ckpt={detection_run}", f"input={tmp_path / 'none.png'}"], "none.png"),
        ([f"ckpt={detection_run}", f"input={tmp_path / 'bad.png'}", f"out={tmp_path / 'o'}"], "bad.png"),
        ([f"ckpt={detection_run}", f"input={tmp_path}", f"out={tmp_path}"], "overwrite"),
        ([f"ckpt={detection_run}", "input=x.png", "scale=2"], "unknown key"),
    ]:
        assert detect_main(args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and named in err, err


def test_detect_exit_codes_are_the_error_types(detection_run: Path, tmp_path: Path, capsys) -> None:
    scenes = write_scenes(tmp_path / "scenes", count=1)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    # a write that fails (out= under a file, as a full disk would): CheckpointWriteError's 74, no traceback
    assert detect_main([f"ckpt={detection_run}", f"input={scenes}", f"out={a_file / 'drawn'}"]) == 74
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: could not write {a_file / 'drawn'}: ")
    # a config error (score= out of range) and a data error (no such input) stay 2
    assert detect_main([f"ckpt={detection_run}", f"input={scenes}", "score=-1"]) == 2
    assert capsys.readouterr().err.startswith("error: score=-1.0 ")
    assert detect_main([f"ckpt={detection_run}", f"input={tmp_path / 'none'}"]) == 2
    assert capsys.readouterr().err.startswith(f"error: input={tmp_path / 'none'}: ")
