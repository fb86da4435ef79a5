"""torchvision classification models at their default configs (Swin shrunk), on 2x3x64x64 images."""
from __future__ import annotations

from .case import image_case
from .vision_import import import_torchvision

LIBRARY = "torchvision"


def _models():
    return import_torchvision().models


def resnet18():
    return image_case(_models().resnet18(num_classes=10))


def efficientnet_b0():
    return image_case(_models().efficientnet_b0(num_classes=10))


def mobilenet_v3_small():
    return image_case(_models().mobilenet_v3_small(num_classes=10))


def regnet_y_400mf():
    return image_case(_models().regnet_y_400mf(num_classes=10))


def swin_t():
    # swin_t's own layout (patch 4, window 7, stochastic depth) at a width and depth that run in a second
    _models()
    from torchvision.models.swin_transformer import SwinTransformer
    return image_case(SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                      window_size=[7, 7], stochastic_depth_prob=0.2, num_classes=10))


def convnext_tiny():
    _models()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    settings = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)]
    return image_case(ConvNeXt(settings, stochastic_depth_prob=0.1, num_classes=10))


BUILDERS = {f"tv_{f.__name__}": f for f in (resnet18, efficientnet_b0, mobilenet_v3_small, regnet_y_400mf, swin_t,
                                            convnext_tiny)}
