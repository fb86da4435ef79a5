"""timm models at their default configs (sizes shrunk only where a model is fixed to 224 px).

Created as users create them, `timm.create_model(name, num_classes=10)`, on 2x3x64x64 images
with cross-entropy: BatchNorm with in-place activations, squeeze-excite, depthwise and
grouped convolutions, drop-path, attention hybrids.
"""
from __future__ import annotations

from .case import image_case
from .vision_import import import_torchvision

LIBRARY = "timm"

# name -> overrides of the model's defaults
MODELS = {
    "efficientnet_b0": {},
    "mobilenetv3_small_100": {},
    "ghostnet_100": {},
    "tf_efficientnetv2_b0": {},
    "regnetx_002": {},
    "densenet121": {},
    "resnext26ts": {},
    "nfnet_l0": {},
    "resnet18": {},
    "convnext_atto": {},
    "levit_128s": {"img_size": 64},
    "coatnet_nano_rw_224": {"img_size": 64},
    "mobilevit_xxs": {},
    "vit_tiny_patch16_224": {"img_size": 64},
    "swin_tiny_patch4_window7_224": {"img_size": 64, "window_size": 4, "embed_dim": 32, "depths": (2, 2),
                                     "num_heads": (2, 4)},
    "mvitv2_tiny": {"img_size": 64},
}


def _builder(name, overrides):
    def build():
        import_torchvision()
        import timm

        return image_case(timm.create_model(name, pretrained=False, num_classes=10, **overrides))
    build.__name__ = name
    return build


BUILDERS = {f"timm_{name}": _builder(name, overrides) for name, overrides in MODELS.items()}
