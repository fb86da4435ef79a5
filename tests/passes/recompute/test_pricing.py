"""A recompute plan priced from one step's log (passes/recompute/pricing.py) against the fake
step of the graph rewritten with that plan: the estimate the pass confirms its choice with."""
import random

import pytest

import graphopt
from graphopt.analysis.memory import estimate_peak
from graphopt.analysis.saved import record_step
from graphopt.passes.recompute.pricing import PlanPricer
from graphopt.passes.recompute.tidy import attributes_first, hoist_state_writes
from graphopt.passes.recompute.rewrite import checkpoint_segments, inline_segments, recomputable
from graphopt.passes.recompute.solver import Segment
from graphopt.testing import zoo
from graphopt.frontend.graph_inputs import placeholder_values

MODELS = {
    "gpt": lambda: zoo.gpt(batch=4, seq=32, layers=3),
    "llama": lambda: zoo.llama(batch=4, seq=32),
    "convnet": lambda: zoo.convnet(batch=4, blocks=3),
    "mlp": lambda: zoo.mlp(batch=64, width=64, depth=6),
    "hf_gpt2": lambda: zoo.hf_gpt2(batch=2, seq=16, layers=2),
    "hf_bert": lambda: zoo.hf_bert(batch=2, seq=16, layers=2),
}


def _random_plans(ok: list[bool], sel: list[int], rng: random.Random, count: int) -> list[list[Segment]]:
    """Up to three disjoint segments each, over runs of nodes that may run twice, some selective."""
    runs, start = [], None
    for i, good in enumerate([*ok, False]):
        if good and start is None:
            start = i
        elif not good and start is not None:
            runs.append((start, i))
            start = None
    plans = []
    for _ in range(count):
        segments, taken = [], set()
        for a, b in rng.sample(runs, min(len(runs), rng.randint(1, 3))):
            lo = rng.randrange(a, b)
            hi = rng.randrange(lo + 1, b + 1)
            if taken.isdisjoint(range(lo, hi)):
                taken.update(range(lo, hi))
                segments.append(Segment(lo, hi, any(sel[lo:hi]) and rng.random() < 0.3))
        plans.append(sorted(segments, key=lambda s: s.start))
    return plans


@pytest.mark.parametrize("name", list(MODELS))
def test_a_plan_priced_from_the_log_is_its_fake_steps_peak(name):
    model, args, kwargs = MODELS[name]()
    gm = graphopt.trace(model, args, kwargs)
    attributes_first(gm)
    hoist_state_writes(gm)
    gm.recompile()
    inputs = placeholder_values(gm, args, kwargs)
    nodes = list(gm.graph.nodes)
    facts = record_step(gm, inputs)
    sel = [facts.policy_bytes.get(n.name, 0) for n in nodes]
    ok = [n.op.startswith("call") and recomputable(n, gm) is None for n in nodes]
    pricer = PlanPricer(estimate_peak(gm, inputs).log, facts, nodes, facts.save_points(nodes))
    for segments in _random_plans(ok, sel, random.Random(name), 8):
        checkpoint_segments(gm, [nodes[s.start:s.stop] for s in segments], [s.selective for s in segments])
        real = estimate_peak(gm, inputs).peak_bytes
        inline_segments(gm)
        nodes[:] = list(gm.graph.nodes)
        priced = pricer.price(segments)
        # a selective segment's rerun takes back what its policy kept: inside a decomposed
        # attention the order of those ops' frees is modelled less closely (BERT: 3%)
        tolerance = 0.05 if any(s.selective for s in segments) else 0.01
        assert abs(priced - real) <= tolerance * real, (segments, priced, real)
