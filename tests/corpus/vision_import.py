"""Import torchvision (and timm, which needs it) beside the CPU build of torch.

The registry's torchvision wheel for torch 2.13 (0.28.0) is built against CUDA torch: its
compiled operators (nms, roi_align, deform_conv2d, ...) do not load beside the CPU build.
torchvision copes with that (`extension._has_ops()` is False and each op raises "Couldn't
load custom C++ ops"), except that its import registers fake kernels for `nms` and `qnms`
without asking, and so fails. The Makefile installs the wheel outside site-packages
(`.venv/torchvision`, so nothing else in the venv imports it); here, when the plain import
fails that way, the two operators' schemas are defined, with no kernels, and the import is
retried. The models are pure Python and run; a torchvision operator still raises
torchvision's own error. A torchvision whose operators load is imported untouched.
"""
from __future__ import annotations

import os
import sys

import torch

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = []  # the Library must stay alive for its definitions to


def import_torchvision():
    # On sys.path only while importing: a process spawned later (gloo ranks) copies sys.path, and
    # its transformers would import torchvision without the schemas.
    site = os.path.join(sys.prefix, "torchvision")
    added = os.path.isdir(site) and site not in sys.path
    if added:
        sys.path.append(site)
    try:
        return _import()
    finally:
        if added:
            sys.path.remove(site)


def _import():
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        library = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            library.define(schema)
        _LIBRARY.append(library)
        import torchvision
    return torchvision
