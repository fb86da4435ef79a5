"""The device a user asks for, checked before anything runs on it."""
from __future__ import annotations

import torch

from ..errors import UsageError


def check_device(device) -> torch.device:
    """torch.device(device), or UsageError saying what is missing for it (a CUDA build of torch,
    a visible GPU, that many GPUs)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"{device!r} is not a device torch knows ({e}); give e.g. 'cpu' or 'cuda:0'.") from None
    if device.type != "cuda":
        return device
    if not torch.backends.cuda.is_built():
        raise UsageError(f"device {str(device)!r} needs a CUDA build of torch, and this one ({torch.__version__}) "
                         "is built for CPU only: install torch for CUDA, or run on 'cpu'.")
    count = torch.cuda.device_count()
    if count == 0:
        raise UsageError(f"device {str(device)!r} was asked for, but torch sees no CUDA device (check the driver "
                         "and CUDA_VISIBLE_DEVICES), or run on 'cpu'.")
    if device.index is not None and device.index >= count:
        raise UsageError(f"device {str(device)!r} was asked for, but torch sees {count} CUDA device(s): "
                         f"use an index below {count}.")
    return device
