"""Object detectors by name: torchvision's FCOS on a small feature pyramid, trained from scratch.

torchvision's detection models resize every image so its shorter side is `min_size` (800 px by default); here
both `min_size` and `max_size` are the data's image size, so an image's longer side becomes that size and
small data is never upscaled. The backbone is a small CNN or torchvision's ResNet-18 trunk (no pretrained
weights), topped by a feature pyramid (FPN) on the levels the head predicts on.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated

from torch import Tensor, nn

from core.bounds import Bounds
from core.errors import ConfigError
from core.registry import MODELS

#: the trunks a detector can stand on (model.backbone)
BACKBONES = ("tiny", "resnet18")


def _conv(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


def tiny_trunk(width: int, deepest: int) -> tuple[nn.Sequential, list[int]]:
    """A plain CNN whose stage `c{l}` has stride 2**l (l = 1..deepest), each a strided conv then a conv, with
    width/4, width/2, width, 2*width, ... channels; returns the trunk and each stage's channels."""
    chans = [max(8, width * 2**level // 8) for level in range(1, deepest + 1)]
    stages, cin = OrderedDict(), 3
    for level, cout in enumerate(chans, start=1):
        stages[f"c{level}"] = nn.Sequential(*_conv(cin, cout, 2), *_conv(cout, cout))
        cin = cout
    return nn.Sequential(stages), chans


def resnet18_trunk() -> tuple[nn.Module, list[int]]:
    """torchvision's ResNet-18 (random init, no classifier) with its stages named by level: c2..c5."""
    import torchvision  # where a detector is built, not at import (vision.models._torchvision_archs)

    net = torchvision.models.resnet18(weights=None)
    trunk = nn.Sequential(
        OrderedDict(
            c1=nn.Sequential(net.conv1, net.bn1, net.relu),
            c2=nn.Sequential(net.maxpool, net.layer1),
            c3=net.layer2,
            c4=net.layer3,
            c5=net.layer4,
        )
    )
    return trunk, [64, 64, 128, 256, 512]


class PyramidBackbone(nn.Module):
    """A trunk's stages at `levels`, merged top-down by an FPN into `out_channels`-wide maps (one per level),
    the interface torchvision's detectors expect of a backbone."""

    def __init__(self, trunk: nn.Module, chans: list[int], levels: list[int], out_channels: int) -> None:
        super().__init__()
        from torchvision.models._utils import IntermediateLayerGetter
        from torchvision.ops import FeaturePyramidNetwork

        self.body = IntermediateLayerGetter(trunk, {f"c{lv}": str(lv) for lv in levels})
        self.fpn = FeaturePyramidNetwork([chans[lv - 1] for lv in levels], out_channels)
        self.out_channels = out_channels

    def forward(self, x: Tensor) -> OrderedDict[str, Tensor]:
        return self.fpn(self.body(x))


@MODELS.register("fcos")
def fcos(
    *,
    num_classes: int,
    image_size: int,
    backbone: Annotated[str, Bounds(choices=BACKBONES)] = "tiny",
    width: Annotated[int, Bounds(ge=32)] = 64,
    levels: Annotated[list[int], Bounds(ge=2, le=5)] = [3, 4],  # noqa: B006 - read only; a plain default
    head_convs: Annotated[int, Bounds(ge=1)] = 2,
    score_thresh: Annotated[float, Bounds(ge=0, lt=1)] = 0.05,
    nms_thresh: Annotated[float, Bounds(gt=0, le=1)] = 0.6,
    detections_per_img: Annotated[int, Bounds(ge=1)] = 100,
) -> nn.Module:
    """torchvision's FCOS (anchor-free, one point per location) on a small pyramid, from scratch.

    backbone: the trunk: tiny (a 2-conv-per-stage CNN) or resnet18 (torchvision's, random init)
    width: channels of the pyramid and the head (a multiple of 32: the head's GroupNorm has 32 groups);
        the tiny trunk's stride-8 stage has as many
    levels: pyramid levels the head predicts on, level l at stride 2**l; FCOS gives each level the objects
        whose farthest box side is 4..8 strides from the point, the first level everything smaller and the
        last everything larger
    head_convs: 3x3 conv layers in each head branch (classification, box regression)
    score_thresh: lowest score a detection is kept with (low: mAP counts low-scored hits)
    nms_thresh: IoU above which non-maximum suppression drops the lower-scored of two same-class boxes
    detections_per_img: most detections kept per image
    """
    from torchvision.models.detection import FCOS
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.fcos import FCOSHead

    levels = sorted(set(levels))
    if not levels:
        raise ConfigError("model.levels is empty; give the pyramid levels to predict on, e.g. [3,4]")
    if width % 32:
        raise ConfigError(f"model.width={width} must be a multiple of 32 (the FCOS head's GroupNorm groups)")
    if backbone == "tiny":
        trunk, chans = tiny_trunk(width, max(levels))
    else:
        trunk, chans = resnet18_trunk()
    # FCOS's convention: one point per location, its "anchor" as wide as the level's stride; the scale ranges
    # and the centre-sampling radius are multiples of it
    anchors = AnchorGenerator(tuple((2**lv,) for lv in levels), ((1.0,),) * len(levels))
    return FCOS(
        PyramidBackbone(trunk, chans, levels, width),
        num_classes,
        min_size=image_size,
        max_size=image_size,
        anchor_generator=anchors,
        head=FCOSHead(width, 1, num_classes, num_convs=head_convs),
        score_thresh=score_thresh,
        nms_thresh=nms_thresh,
        detections_per_img=detections_per_img,
    )
