"""A device asked for that is not there (runtime/devices.py): a UsageError, not a raw error."""
import pytest
import torch

from graphopt import UsageError


@pytest.mark.parametrize("device", ["tpu9", "cuda", "cuda:99"])
def test_devices_that_are_not_there(device):
    from graphopt.runtime.devices import check_device

    if device.startswith("cuda") and torch.cuda.is_available() and device == "cuda":
        pytest.skip("a CUDA device is there")
    with pytest.raises(UsageError):
        check_device(device)
