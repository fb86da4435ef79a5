import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", default=False,
                     help="smallest sizes, one round: keeps the benchmarks from rotting in `make test`")


@pytest.fixture
def quick(request):
    return request.config.getoption("--quick")


def rounds(quick: bool, full: int) -> int:
    return 1 if quick else full
