"""vision.models: every registered model maps images to logits, and bad shapes are config errors."""

from __future__ import annotations

import pytest
import torch
import torchvision

from core.errors import ConfigError
from core.registry import MODELS
from tests.helpers import fault
from vision import models as _registers_vision_models  # noqa: F401
from vision.models import TORCHVISION_ARCHS


@pytest.mark.parametrize("name", ["small_cnn", "resnet18", "vit"])
@pytest.mark.parametrize(("channels", "size"), [(1, 8), (3, 16)])
def test_forward_backward_shapes(name: str, channels: int, size: int) -> None:
    model = MODELS.build(name, num_classes=7, in_channels=channels, image_size=size)
    x = torch.randn(2, channels, size, size, requires_grad=True)
    out = model(x)
    assert out.shape == (2, 7)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_vit_rejects_indivisible_patch() -> None:
    with pytest.raises(ConfigError) as e:
        MODELS.build("vit", num_classes=2, in_channels=1, image_size=8, patch_size=3)
    assert fault(e.value)[:2] == ("model.patch_size", "3")


def test_unknown_model_and_keyword_are_config_errors() -> None:
    with pytest.raises(ConfigError) as e:
        MODELS.build("nope")
    assert fault(e.value)[:2] == ("model", "nope") and "small_cnn" in fault(e.value)[2]
    with pytest.raises(ConfigError) as e:
        MODELS.build("small_cnn", num_classes=2, in_channels=1, image_size=8, depth=3)
    key, value, valid = fault(e.value)
    assert (key, value) == ("model.depth", "3") and "depth" not in valid and "num_classes" in valid


def test_vit_checkpoints_from_before_the_shared_block_still_load() -> None:
    # ViT's blocks became core.nn.transformer's: a checkpoint with the old names (norm1, norm2, mlp.0, mlp.2)
    # and the old fused q/k/v layout loads through core.checkpoint, and the model computes exactly what the
    # one that saved it did
    from core import checkpoint
    from tests.core.qkv_layout import old_qkv_layout

    torch.manual_seed(0)
    src = MODELS.build("vit", num_classes=3, in_channels=1, image_size=8)
    renames = {"ln1.": "norm1.", "ln2.": "norm2.", "fc.": "mlp.0.", "fc_out.": "mlp.2."}
    old = {}
    for key, value in src.state_dict().items():
        for new, before in renames.items():
            key = key.replace(f".{new}", f".{before}") if key.startswith("blocks.") else key
        old[key] = value
    old = old_qkv_layout(old, n_head=4)  # the ViT's default heads
    assert "blocks.0.norm1.weight" in old and "blocks.3.mlp.2.bias" in old and "blocks.0.qkv.weight" in old
    dst = MODELS.build("vit", num_classes=3, in_channels=1, image_size=8)
    checkpoint.load_model_state(dst, old, "old.pt")
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)


# model=torchvision: any torchvision classification architecture, weights only from a local file


def _torchvision(
    arch: str, channels: int = 3, size: int = 32, classes: int = 5, **kw: object
) -> torch.nn.Module:
    return MODELS.build(
        "torchvision", arch=arch, num_classes=classes, in_channels=channels, image_size=size, **kw
    )


@pytest.mark.parametrize("arch", ["resnet18", "squeezenet1_1", "googlenet"])  # fc, conv and auxiliary heads
@pytest.mark.parametrize(("channels", "size"), [(1, 32), (3, 40)])
def test_torchvision_architectures_map_images_to_logits(arch: str, channels: int, size: int) -> None:
    model = _torchvision(arch, channels, size, classes=7).train()
    x = torch.randn(2, channels, size, size, requires_grad=True)
    out = model(x)
    assert out.shape == (2, 7)  # one output in training too (googlenet's auxiliary heads are left off)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"arch": "resnet5"}, ("model.arch", "resnet5", tuple(TORCHVISION_ARCHS))),
        ({"arch": "resnet18", "image_size": 8}, ("image_size", "8", (">= 32",))),
        ({"arch": "inception_v3", "image_size": 64}, ("image_size", "64", (">= 75",))),
        ({"arch": "resnet18", "in_channels": 2}, ("in_channels", "2", ("1", "3"))),
        ({"arch": "maxvit_t", "image_size": 256}, ("image_size", "256", ())),  # the architecture refuses it
        (
            {
                "weights_name": "ResNet50_Weights.IMAGENET1K_V2"
            },  # names the normalization; the file is missing
            ("model.weights", "", ("PATH of the weights file",)),
        ),
        (
            {"weights_name": "ResNet18_Weights.IMAGENET1K_V1", "weights": "x.pth"},
            (
                "model.weights_name",
                "ResNet18_Weights.IMAGENET1K_V1",
                ("ResNet50_Weights.IMAGENET1K_V1", "ResNet50_Weights.IMAGENET1K_V2"),
            ),
        ),
        (
            {"arch": "resnet18", "weights": "/nonexistent/r18.pth"},
            ("model.weights", "/nonexistent/r18.pth", (".pth", ".pt", ".safetensors")),
        ),
    ],
)
def test_torchvision_refusals_are_one_line_config_errors(kwargs: dict, expected: tuple) -> None:
    args = {"arch": "resnet50", "in_channels": 3, "image_size": 256, **kwargs}
    with pytest.raises(ConfigError) as e:
        MODELS.build("torchvision", num_classes=5, **args)
    assert fault(e.value) == expected and "\n" not in str(e.value)


def _saved(tmp_path, arch: str, classes: int, fmt: str, nest: bool = False):
    torch.manual_seed(0)
    src = torchvision.models.get_model(arch, weights=None, num_classes=classes)
    state = src.state_dict()
    path = tmp_path / f"{arch}.{fmt}"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save({"model": state, "epoch": 3} if nest else state, path)
    return src, path


@pytest.mark.parametrize(("fmt", "nest"), [("pth", False), ("pth", True), ("safetensors", False)])
def test_weights_load_from_a_local_file_exactly(tmp_path, fmt: str, nest: bool) -> None:
    src, path = _saved(tmp_path, "resnet18", 5, fmt, nest)
    model = _torchvision("resnet18", weights=str(path))
    for k, v in src.state_dict().items():
        assert torch.equal(model.net.state_dict()[k], v), k
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model.eval()(x), src.eval()(x), rtol=0, atol=0)  # no normalization added


def test_a_head_for_other_classes_starts_from_random_and_is_named(tmp_path, caplog) -> None:
    import logging

    src, path = _saved(tmp_path, "resnet18", 1000, "pth")
    with caplog.at_level(logging.INFO, logger="vision.models"):
        model = _torchvision("resnet18", classes=3, weights=str(path))
    assert model.net.fc.weight.shape == (3, 512)
    body = {k: v for k, v in src.state_dict().items() if not k.startswith("fc.")}
    assert all(torch.equal(model.net.state_dict()[k], v) for k, v in body.items())
    assert "has a 1000-class head and the data 3 classes: fc.weight, fc.bias start from random" in caplog.text


class _Opaque:
    """A class of this test module's: torch.load(weights_only=True) refuses to build it."""


def test_weights_of_another_architecture_or_not_weights_are_one_line_checkpoint_errors(tmp_path) -> None:
    import argparse

    from core.errors import CheckpointError

    _, path = _saved(tmp_path, "resnet34", 5, "pth")
    with pytest.raises(CheckpointError) as e:
        _torchvision("resnet18", weights=str(path))
    assert fault(e.value) == ("checkpoint", str(path), ())
    pickled = tmp_path / "train_checkpoint.pth"
    torch.save({"model": {}, "args": _Opaque()}, pickled)  # an object of a class weights_only does not know
    with pytest.raises(CheckpointError) as e:  # not unpickled: nothing of the file's runs
        _torchvision("resnet18", weights=str(pickled))
    assert fault(e.value) == ("model.weights", str(pickled), ("tensors", "plain containers"))
    # torchvision's reference scripts save their command line as an argparse.Namespace beside the weights:
    # a plain attribute bag, which loads (the weights under "model")
    src, _ = _saved(tmp_path, "resnet18", 5, "pth")
    reference = tmp_path / "checkpoint.pth"
    args = argparse.Namespace(lr=0.1, epochs=90)
    torch.save({"model": src.state_dict(), "epoch": 3, "args": args}, reference)
    model = _torchvision("resnet18", classes=5, weights=str(reference))
    assert all(torch.equal(model.net.state_dict()[k], v) for k, v in src.state_dict().items())
    (tmp_path / "junk.pth").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError) as e:
        _torchvision("resnet18", weights=str(tmp_path / "junk.pth"))
    assert fault(e.value)[:2] == ("model.weights", str(tmp_path / "junk.pth"))


@pytest.mark.parametrize("channels", [3, 1])
def test_weights_name_gives_the_same_input_as_its_transforms(tmp_path, channels: int) -> None:
    # reference: torchvision's own eval preprocessing, ResNet18_Weights.IMAGENET1K_V1.transforms() (resize the
    # short side to 256, centre-crop 224, ImageNet mean/std) of an RGB image (a grayscale one as RGB) against
    # this repo's data pipeline (the same crop, (p - 0.5) / 0.5) followed by the model's re-normalization
    from PIL import Image
    from torchvision.transforms import v2

    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (256, 256, channels), dtype=torch.uint8, generator=g)
    image = Image.fromarray(pixels.squeeze(-1).numpy())
    want = weights.transforms()(image.convert("RGB"))  # 256 px: the resize keeps every pixel
    data = v2.Compose(
        [
            v2.ToImage(),
            v2.CenterCrop(224),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.5] * channels, [0.5] * channels),
        ]
    )
    _, path = _saved(tmp_path, "resnet18", 1000, "pth")
    model = _torchvision(
        "resnet18", channels, 224, classes=1000, weights=str(path), weights_name=str(weights)
    ).eval()
    seen = []
    model.net.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    model(data(image)[None])
    assert seen[0].shape == (1, 3, 224, 224)
    torch.testing.assert_close(seen[0][0], want, rtol=0, atol=2e-6)  # float32 rounding of two affine maps


# model=timm: only where the optional extra is installed


def test_timm_models_build_load_local_weights_and_refuse_bad_names(tmp_path) -> None:
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    model = MODELS.build("timm", arch="test_resnet", num_classes=4, in_channels=1, image_size=32)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 4)
    torch.manual_seed(0)
    src = timm.create_model("test_resnet", num_classes=1000)
    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    model = MODELS.build(
        "timm",
        arch="test_resnet",
        num_classes=4,
        in_channels=3,
        image_size=32,
        weights=str(tmp_path / "w.safetensors"),
    )
    body = {k: v for k, v in src.state_dict().items() if not k.startswith("fc.")}
    assert all(torch.equal(model.net.state_dict()[k], v) for k, v in body.items())
    assert model.net.fc.weight.shape[0] == 4
    same = MODELS.build(
        "timm",
        arch="test_resnet",
        num_classes=1000,
        in_channels=3,
        image_size=32,
        weights=str(tmp_path / "w.safetensors"),
    )
    assert torch.equal(same.net.fc.weight, src.fc.weight)  # a head for the data's classes is kept
    with pytest.raises(ConfigError) as e:
        MODELS.build("timm", arch="resnet5x", num_classes=4, in_channels=3, image_size=32)
    key, value, close = fault(e.value)
    assert (
        (key, value) == ("model.arch", "resnet5x") and close and all(c.startswith("resnet5") for c in close)
    )
    with pytest.raises(ConfigError) as e:
        MODELS.build("timm", arch="test_vit", num_classes=4, in_channels=3, image_size=32)
    assert fault(e.value) == ("image_size", "32", ("160",))
