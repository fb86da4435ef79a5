"""The memory promise on the real-model corpus (tests/corpus/memory.py), at a batch where
activations outweigh parameters: the predicted peak of the user's step is within 3% of the
measured one (never under by more than 1%) without recompute and at every plan; a plan at
f = 0.3, 0.5, 0.7 of the activations measures within its budget or is refused with a least
budget above it; and the budget the model's own checkpointing meets is never refused.

`make test` runs corpus.QUICK and corpus.MEMORY_REGRESSIONS; `make test-real` every model,
through the export frontend too.
"""
import pytest

from corpus import MEMORY_REGRESSIONS
from corpus.memory import memory_case, memory_points, point_problems

pytestmark = pytest.mark.realmodels


def pytest_generate_tests(metafunc):
    all_ = metafunc.config.getoption("--corpus") == "all"
    if "memory_frontend" in metafunc.fixturenames:
        metafunc.parametrize("memory_frontend", ["auto", "export"] if all_ else ["auto"])
    if "memory_regression" in metafunc.fixturenames:
        metafunc.parametrize("memory_regression", [] if all_ else MEMORY_REGRESSIONS)


def _promise(name: str, frontend: str = "auto") -> None:
    points = memory_points(memory_case(name), frontend=frontend)
    problems = [p for point in points for p in point_problems(point)]
    assert not problems, problems


def test_memory_promise_holds(corpus_model, memory_frontend):
    _promise(corpus_model, memory_frontend)


def test_memory_promise_that_once_broke(memory_regression):
    _promise(memory_regression)
