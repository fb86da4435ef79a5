"""The memory promise on the real-model corpus (tests/corpus/memory.py), at a batch where
activations outweigh parameters: the predicted peak of the user's step is within 3% of the
measured one (never under by more than 1%) without recompute and at every plan; a plan at
f = 0.3, 0.5, 0.7 of the activations measures within its budget or is refused with a least
budget above it; and the budget the model's own checkpointing meets is never refused.

`make test` runs corpus.QUICK; `make test-real` every model, through the export frontend too.
"""
import pytest

from corpus.memory import memory_case, memory_points, point_problems

pytestmark = pytest.mark.realmodels


def pytest_generate_tests(metafunc):
    if "memory_frontend" in metafunc.fixturenames:
        all_ = metafunc.config.getoption("--corpus") == "all"
        metafunc.parametrize("memory_frontend", ["auto", "export"] if all_ else ["auto"])


def test_memory_promise_holds(corpus_model, memory_frontend):
    points = memory_points(memory_case(corpus_model), frontend=memory_frontend)
    problems = [p for point in points for p in point_problems(point)]
    assert not problems, problems
