import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# every plan made afresh (the plan cache is tested with its own directories)
os.environ.setdefault("GRAPHOPT_PLAN_CACHE", "off")

import pytest

_FIGURES: list[tuple[str, dict]] = []


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", default=False,
                     help="smallest sizes, one round: keeps the benchmarks from rotting in `make test`")


@pytest.fixture
def quick(request):
    return request.config.getoption("--quick")


@pytest.fixture
def figures(request):
    """Record the ratios a benchmark measured; they are printed at the end of the run."""
    def record(**values):
        _FIGURES.append((request.node.name, values))
    return record


def rounds(quick: bool, full: int) -> int:
    return 1 if quick else full


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    terminalreporter.section("graphopt figures (ratios measured in this run)")
    for name, values in _FIGURES:
        terminalreporter.write_line(f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
