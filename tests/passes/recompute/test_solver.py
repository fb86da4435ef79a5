"""The recompute solver against brute force."""
import itertools
import random

import pytest

from graphopt.analysis.saved import SAVES_INPUTS, SAVES_NOTHING, SAVES_OWN
from graphopt.passes.recompute.solver import (FULL, SELECTIVE, Atom, _solve, RecomputePlan, Segment, SegmentCost, fits,
                                              make_atoms, model_peak, rerun_cost, rerun_end, solve)


def _segmentations(atoms, kinds=(FULL, SELECTIVE)):
    """Every way to mark runs of recomputable atoms as checkpointed segments of the given kinds."""
    n = len(atoms)

    def rec(i):
        if i == n:
            yield []
            return
        for rest in rec(i + 1):
            yield rest  # atom i kept
        if atoms[i].recomputable:
            for j in range(i + 1, n + 1):
                if not atoms[j - 1].recomputable:
                    break
                for rest in rec(j):
                    for kind in kinds:
                        yield [(i, j, kind)] + rest

    yield from rec(0)


def _cost(atoms, segments):
    """Each segment's rerun: its atoms up to the last that saves anything, that one up to its lead."""
    total = 0
    for a, b, kind in segments:
        last = max((k for k in range(a, b) if atoms[k].saves), default=None)
        if last is None:
            continue
        total += sum(atoms[k].cost - (atoms[k].sel_cost if kind == SELECTIVE else 0) for k in range(a, last))
        total += atoms[last].rerun(kind == SELECTIVE)
    return total


def _brute(atoms, allowance, kinds=(FULL, SELECTIVE)):
    """The least cost over every segmentation that the solver's cost model says fits."""
    costs = [_cost(atoms, segs) for segs in _segmentations(atoms, kinds) if model_peak(atoms, segs) <= allowance]
    return min(costs, default=None)


@pytest.mark.parametrize("selective", [True, False])
def test_matches_brute_force_on_small_instances(selective):
    rng = random.Random(0)
    checked = with_selective = stopped_early = 0
    for _ in range(300):
        n = rng.randint(2, 6)
        atoms = []
        for i in range(n):
            flops, keeps = rng.randint(1, 50), rng.random() < 0.4
            sel_cost = rng.randint(1, flops) if keeps else 0
            lead = rng.randint(0, flops) if rng.random() < 0.5 else None  # its rerun may stop inside it
            atoms.append(Atom(i, i + 1, rng.randint(1, 20), rng.randint(0, 8), flops, rng.random() > 0.2,
                              rng.randint(1, 10) if keeps else 0, sel_cost, lead=lead,
                              lead_sel=None if lead is None else max(lead - sel_cost, 0), saves=rng.random() > 0.2))
        total = sum(a.kept for a in atoms)
        allowance = rng.randint(total // 2, total)
        expected = _brute(atoms, allowance, (FULL, SELECTIVE) if selective else (FULL,))
        plan = solve(atoms, allowance, buckets=10**6, selective=selective)  # one-byte units: exact
        if expected is None:
            assert plan is None
            continue
        assert plan is not None
        # Segments are node ranges; atoms here are one node each.
        chosen = [(s.start, s.stop, SELECTIVE if s.selective else FULL) for s in plan.segments]
        assert plan.recompute_cost == expected == _cost(atoms, chosen), (atoms, allowance, plan)
        assert model_peak(atoms, chosen) <= allowance
        checked += 1
        with_selective += any(s.selective for s in plan.segments)
        stopped_early += _cost(atoms, chosen) < sum(atoms[k].cost for a, b, _ in chosen for k in range(a, b))
    assert checked > 30 and stopped_early > 5
    assert with_selective > 5 if selective else with_selective == 0


def _random_atoms(rng, n):
    kept = [rng.randint(0, 1 << 16) for _ in range(n)]
    live = [rng.randint(1 << 10, 1 << 18) for _ in range(n)]
    cost = [rng.randint(1, 1000) for _ in range(n)]
    matmul = [rng.random() < 0.3 for _ in range(n)]
    return make_atoms(kept, live, cost, [rng.random() > 0.1 for _ in range(n)], sel=[k if m else 0 for k, m in
                      zip(kept, matmul)], sel_cost=[c if m else 0 for c, m in zip(cost, matmul)], max_cuts=24,
                      param_grads=[rng.randint(0, 1 << 12) for _ in range(n)])


def test_fits_says_what_solve_finds_at_every_allowance():
    # the least allowance is bisected with fits: it must agree with solve exactly, rounding included
    rng = random.Random(3)
    agreed = refused = 0
    for _ in range(12):
        atoms = _random_atoms(rng, rng.randint(20, 60))
        high = model_peak(atoms, [])
        for allowance in [rng.randint(0, high) for _ in range(10)] + [high, high + 1, 1, 0]:
            for buckets in (1024, 64):
                found = solve(atoms, allowance, buckets=buckets) is not None
                assert fits(atoms, allowance, buckets=buckets) == found, (allowance, buckets)
                agreed += found
                refused += not found
    assert agreed > 20 and refused > 20


def test_a_bound_on_the_cost_only_saves_time():
    # a bound at, over or under the least cost, or at a smaller allowance's; a floor under,
    # at or over it, or none (guesses from the whole cost): the plain program's plan
    rng = random.Random(4)
    cost = SegmentCost(fixed=5, per_selective_op=1)
    bounded = 0
    for _ in range(6):
        atoms = _random_atoms(rng, rng.randint(20, 60))
        high = model_peak(atoms, [])
        for allowance in sorted(rng.randint(high // 3, high) for _ in range(6)):
            if allowance >= high:
                continue
            plan = _solve(atoms, allowance, 1024, cost, True, None)
            if plan is None:
                continue
            tighter = solve(atoms, allowance * 9 // 10, segment_cost=cost)
            least = plan.recompute_cost
            hints = [(b, None) for b in {least, least - 1, 2 * least, 0, tighter and tighter.recompute_cost}]
            hints += [(None, f) for f in (None, 0, least // 3, least // 2, least, 2 * least)]
            for bound, floor in hints:
                again = solve(atoms, allowance, segment_cost=cost, bound=bound, floor=floor)
                assert (again.segments, again.recompute_cost, again.predicted_peak) == \
                    (plan.segments, plan.recompute_cost, plan.predicted_peak), (bound, floor)
                bounded += bound is not None and bound >= least
    assert bounded > 10


def _whole_grid(space) -> list[RecomputePlan]:
    """Every line at every allowance, the blocks too: the plans the search could look at."""
    from graphopt.passes.recompute.candidates import CANDIDATES, LINES
    plans = {}
    for plan in [space.line_plan(line, k) for line in LINES for k in range(CANDIDATES)] + space.blocks:
        if plan is not None:
            plans.setdefault(tuple(plan.segments), plan)
    return list(plans.values())


def test_a_scan_down_the_lines_finds_the_cheapest_fitting_plan_of_the_whole_grid():
    # LinePlans solves each line from the top until a plan fits, one allowance more; the search's
    # choice, the cheapest plan that fits, is the one every allowance solved would give
    from types import SimpleNamespace

    from graphopt.passes.recompute.candidates import LINES, PlanSpace, LinePlans
    rng = random.Random(5)
    for trial in range(6):
        n = 40
        nodes = [SimpleNamespace(op="call_function", target=None, meta={}) for _ in range(n)]
        matmul = [rng.random() < 0.3 for _ in range(n)]
        space = PlanSpace(nodes, [rng.random() > 0.05 for _ in range(n)], kept=[rng.randint(1, 100) for _ in range(n)],
                          live_after=[rng.randint(50, 300) for _ in range(n)], grads=[0] * n,
                          cost=[rng.randint(5, 60) for _ in range(n)], saves=[SAVES_OWN] * n,
                          sel=[10 if m else 0 for m in matmul], ops=[1] * n, flops=[1000 if m else 0 for m in matmul],
                          segment_cost=SegmentCost(fixed=3, per_selective_op=1))
        # the views differ in cost only: one least allowance serves them all
        memory = lambda atoms: [(a.start, a.stop, a.kept, a.cross, a.sel, a.grads, a.out, a.recomputable)  # noqa: E731
                                for a in atoms]
        assert memory(space.views[0]) == memory(space.views[1]) == memory(space.views[2])
        every = _whole_grid(space)
        # what a line's plan costs in each view's terms, the other lines' bounds, is its solver's cost
        for (line, k), cost in space._costs.items():
            view, selective = line
            assert space.cost_in(space.line_plan(line, k).segments, view, selective) == cost
            first = space.line_plan(LINES[0], k)
            if first is not None and any(s.selective for s in first.segments):
                assert space.cost_in(first.segments, 0, selective=False) > space.cost_in(first.segments)
        peaks = [p.predicted_peak for p in every]
        target = sorted(peaks)[len(peaks) // 2]  # the solver's model stands in for the price
        scan = LinePlans(space)
        found = scan.down(lambda plan: plan.predicted_peak <= target)
        cheapest = lambda plans: min((p.recompute_cost for p in plans if p.predicted_peak <= target), default=None)  # noqa: E731
        assert cheapest(found) == cheapest(p for p in every if p not in space.blocks)
        assert len(found) < len([p for p in every if p not in space.blocks])  # fewer solved
        assert {tuple(p.segments) for p in found + scan.down(lambda plan: False)} == {tuple(p.segments) for p in every
                                                                     if p not in space.blocks}


def test_rerun_stops_at_the_last_node_that_saves():
    # nodes: saves its output, saves nothing, saves only its inputs (a matmul), saves nothing
    saves = [SAVES_OWN, SAVES_NOTHING, SAVES_INPUTS, SAVES_NOTHING]
    cost = [1, 10, 100, 1000]
    assert rerun_end(saves, 0, 4) == 2  # the matmul's inputs are packed before its kernel runs
    assert rerun_cost(cost, saves, 0, 4) == 11
    assert rerun_end(saves, 0, 2) == 1 and rerun_cost(cost, saves, 0, 2) == 1
    assert rerun_end(saves, 1, 2) == 1 and rerun_cost(cost, saves, 1, 2) == 0  # nothing saved: no rerun
    assert rerun_cost(cost, None, 0, 4) == 1111
    atoms = make_atoms([1] * 4, [1] * 4, cost, [True] * 4, max_cuts=0, saves=saves)
    assert len(atoms) == 1 and atoms[0].rerun(False) == 11 and atoms[0].saves


def test_no_recompute_when_everything_fits():
    atoms = [Atom(i, i + 1, 10, 2, 5, True) for i in range(4)]
    plan = solve(atoms, 40)
    assert plan.segments == [] and plan.recompute_cost == 0


def test_two_thousand_nodes_solve_deterministically():
    # (its time is measured in bench/test_bench_recompute.py)
    rng = random.Random(1)
    n = 2000
    kept = [rng.randint(0, 1 << 20) for _ in range(n)]
    live = [rng.randint(1 << 18, 1 << 22) for _ in range(n)]
    flops = [rng.randint(1, 1 << 30) for _ in range(n)]
    ok = [rng.random() > 0.02 for _ in range(n)]
    atoms = make_atoms(kept, live, flops, ok)
    plan = solve(atoms, sum(kept) // 2)
    assert plan is not None and plan.segments
    again = solve(make_atoms(kept, live, flops, ok), sum(kept) // 2)
    assert again.segments == plan.segments and again.recompute_cost == plan.recompute_cost


def test_atoms_keep_unrecomputable_nodes_alone():
    atoms = make_atoms([5] * 6, [1] * 6, [1] * 6, [True, True, False, True, True, True], max_cuts=0)
    assert [(a.start, a.stop, a.recomputable) for a in atoms] == [(0, 2, True), (2, 3, False), (3, 6, True)]
    assert list(itertools.chain.from_iterable(range(a.start, a.stop) for a in atoms)) == list(range(6))


class _Given:
    """A search whose estimates are given: the peaks by candidate, and how many were asked for."""

    def __init__(self, peaks: list[int], leaner: list = (), grown: list = ()):
        from types import SimpleNamespace

        from graphopt.passes.recompute.search import PlanSearch
        self.peaks, self.asked = peaks, []
        search = PlanSearch.__new__(PlanSearch)
        search.estimates, search.prices, search.pricer = {}, {}, None
        search.scan, search.ranks, search.finish = None, {}, None
        search.leaner = lambda plan: list(leaner)
        search.grown = lambda plan: list(grown)

        def estimate(k):
            if k not in search.estimates:
                self.asked.append(k)
                search.estimates[k] = SimpleNamespace(peak_bytes=self.peaks[k])
            return search.estimates[k]
        search.estimate = estimate
        self.search = search


def _plan(name: int, cost: int, matmul: int) -> RecomputePlan:
    return RecomputePlan([Segment(name, name + 1, False)], cost, 0, matmul)


def test_a_fitting_plan_estimated_before_wins_a_tie_on_fewer_matmul_flops():
    # Costs 100 and 102 are a tie (within the time model's resolution); the bisection estimated
    # both, and both fit: the one rerunning no matmul wins, though it was estimated first.
    given = _Given([200, 90, 90, 50])
    given.search.candidates = [_plan(0, 90, 0), _plan(1, 100, 500), _plan(2, 102, 0), _plan(3, 300, 900)]
    # bisection over [0, 3] at target 95: mid 1 fits, mid 0 does not: chosen 1; 2 was not estimated
    given.search.estimate(2)
    plan, est = given.search.cheapest_within(95)
    assert plan.matmul_flops == 0 and plan.recompute_cost == 102 and est.peak_bytes == 90


def test_a_leaner_plan_cutting_more_segments_does_not_win_a_tie():
    # transformers' Phi at its own checkpointing's peak: the tie went to a 4-segment plan with
    # fewer matmul FLOPs over the per-layer 2-segment one, 4% dearer by the estimate and 5%
    # slower measured; a segment's own cost is what the time model knows least.
    given = _Given([200, 90, 90, 50])
    two = RecomputePlan([Segment(0, 5, False), Segment(5, 10, False)], 100, 0, 500)
    four = RecomputePlan([Segment(k, k + 1, False) for k in (0, 3, 5, 8)], 102, 0, 0)
    given.search.candidates = [_plan(0, 90, 0), two, four, _plan(3, 300, 900)]
    given.search.estimate(2)
    plan, _ = given.search.cheapest_within(95)
    assert plan is two


def test_a_leaner_plan_cutting_more_segments_wins_where_it_is_also_cheaper():
    # timm's DenseNet-121 at its own checkpointing's peak: the solver's leaner plan, 22 segments
    # for 7 and no convolution rerun, costs less too (it is estimated last, and fits).
    given = _Given([200, 90, 90, 50, 80])
    seven = RecomputePlan([Segment(k, k + 1, False) for k in range(0, 7)], 100, 0, 500)
    more = RecomputePlan([Segment(k, k + 1, False) for k in range(0, 22)], 98, 0, 0)
    given.search.candidates = [_plan(0, 90, 0), seven, _plan(2, 103, 400), _plan(3, 300, 900)]
    given.search.leaner = lambda plan: [more]
    plan, _ = given.search.cheapest_within(95)
    assert plan is more


def test_a_leaner_plan_over_the_target_is_not_chosen():
    given = _Given([200, 90, 120, 50])
    given.search.candidates = [_plan(0, 90, 0), _plan(1, 100, 500), _plan(2, 102, 0), _plan(3, 300, 900)]
    given.search.estimate(2)
    plan, _ = given.search.cheapest_within(95)
    assert plan.recompute_cost == 100


def test_the_dearest_plan_over_the_target_grown_can_fit_for_less():
    # transformers' BERT at its own checkpointing's peak: two per-layer segments over by 1.5%,
    # the second grown by one node fits, for less than the four-segment plan the bisection found
    grown = [_plan(4, 105, 0), _plan(5, 110, 0), _plan(6, 160, 0)]
    given = _Given([200, 120, 90, 50, 100, 93, 10], grown=grown)
    given.search.candidates = [_plan(0, 90, 0), _plan(1, 100, 0), _plan(2, 150, 0), _plan(3, 300, 0)]
    plan, est = given.search.cheapest_within(95)
    assert plan.recompute_cost == 110 and est.peak_bytes == 93
    assert 6 not in given.asked  # dearer than what fits already: not looked at


def test_growing_a_segment_keeps_to_nodes_that_may_run_twice_and_apart_from_the_others():
    from types import SimpleNamespace

    from graphopt.passes.recompute.candidates import PlanSpace
    ok = [True] * 8 + [False] + [True] * 3
    space = SimpleNamespace(nodes=list(range(12)), ok=ok, priced=lambda segs: RecomputePlan(
        segs, sum(s.stop - s.start for s in segs), 0, 0))
    plan = RecomputePlan([Segment(2, 4, False), Segment(5, 7, False)], 4, 0, 0)
    found = [[(s.start, s.stop) for s in p.segments] for p in PlanSpace.grown(space, plan)]
    # node 8 may not run twice; a segment may end where the next one starts
    assert found == [[(1, 4), (5, 7)], [(2, 5), (5, 7)], [(2, 4), (4, 7)], [(2, 4), (5, 8)], [(0, 4), (5, 7)]]


def test_candidates_hold_plans_of_full_segments_where_selective_ones_are_priced_lower():
    from types import SimpleNamespace

    from graphopt.passes.recompute.candidates import CANDIDATES, PlanSpace, _least_allowance
    n = 12
    nodes = [SimpleNamespace(op="call_function", target=None, meta={}) for _ in range(n)]
    matmul = [i % 2 == 0 for i in range(n)]  # a matmul, then what reads it
    space = PlanSpace(nodes, [True] * n, kept=[100] * n, live_after=[100] * n, grads=[0] * n,
                      cost=[50 if m else 10 for m in matmul], saves=[SAVES_OWN] * n,
                      sel=[10 if m else 0 for m in matmul], ops=[1] * n, flops=[1000 if m else 0 for m in matmul],
                      segment_cost=SegmentCost(fixed=5, per_selective_op=1))
    atoms = space.views[0]
    low, high = _least_allowance(atoms), model_peak(atoms, [])
    allowances = [int(low * (high / low) ** (k / (CANDIDATES - 1))) for k in range(CANDIDATES)]

    def proposed(selective):
        return {tuple(p.segments) for p in (solve(atoms, a, segment_cost=space.segment_cost, selective=selective)
                                            for a in allowances) if p is not None and p.segments}
    only_full = proposed(False) - proposed(True)
    assert only_full  # the solver, free to cut selective segments, never proposes these
    assert only_full <= {tuple(p.segments) for p in _whole_grid(space)}


def test_block_plans_keep_blocks_whose_state_writes_moved_and_cut_them_after_their_first_matmul():
    from types import SimpleNamespace

    from graphopt.passes.recompute.candidates import block_plans

    def node(block):
        return SimpleNamespace(op="call_function", target=None, meta={"nn_module_stack": {block: (block, None)}})
    # each block's BatchNorm counter write, moved to the top (it cannot run twice), then per
    # block: a concatenation, a norm, its activation, a convolution, what reads it
    nodes = [node("layers.0"), node("layers.1")] + [node(f"layers.{b}") for b in (0, 1) for _ in range(5)]
    ok = [False, False] + [True] * 10
    sel = [0, 0] + [0, 0, 0, 8, 0] * 2
    plans = block_plans(nodes, ok, [1] * 12, sel, lambda segs: RecomputePlan(segs, 0, 0, 0))
    found = [[(s.start, s.stop) for s in p.segments] for p in plans]
    assert [(2, 7), (7, 12)] in found  # the blocks whole
    assert [(2, 6), (7, 11)] in found  # up to and with each one's first matmul


def test_a_selective_solve_without_selective_segments_is_the_full_solve():
    """The candidates skip the full-only solve at an allowance where the selective solve chose no
    selective segment: the full-only program chooses among a subset, so it finds the same plan."""
    rng = random.Random(2)
    compared = 0
    for _ in range(300):
        atoms = []
        for i in range(rng.randint(2, 12)):
            flops, keeps = rng.randint(1, 50), rng.random() < 0.4
            sel_cost = rng.randint(1, flops) if keeps else 0
            atoms.append(Atom(i, i + 1, rng.randint(1, 20), rng.randint(0, 8), flops, rng.random() > 0.2,
                              rng.randint(1, 10) if keeps else 0, sel_cost, saves=rng.random() > 0.2))
        total = sum(a.kept for a in atoms)
        allowance = rng.randint(max(total // 3, 1), total)
        with_selective = solve(atoms, allowance, buckets=64)
        if with_selective is not None and any(s.selective for s in with_selective.segments):
            continue
        full = solve(atoms, allowance, buckets=64, selective=False)
        assert (full is None) == (with_selective is None)
        if full is not None:
            assert (full.segments, full.recompute_cost) == (with_selective.segments, with_selective.recompute_cost)
            compared += bool(full.segments)
    assert compared > 30


@pytest.mark.parametrize("off, looked", [(0, False), (3, True)])
def test_a_plan_priced_a_hair_over_gets_a_fake_step_where_prices_were_off(off, looked):
    # candidate 1 fits by price (95 at target 100) and by its fake step (95 + off); candidate 0,
    # cheaper, is priced 0.5% over: worth a look only where a price was seen off its step
    from types import SimpleNamespace

    given = _Given([99, 95 + off, 300])
    prices = {0: 100.5, 1: 95, 2: 300}
    given.search.candidates = [_plan(0, 80, 0), _plan(1, 90, 0), _plan(2, 300, 0)]
    given.search.pricer = SimpleNamespace(price=lambda segments: prices[segments[0].start])
    plan, est = given.search.cheapest_within(100)
    assert (0 in given.asked) == looked
    assert plan.recompute_cost == (80 if looked else 90)


@pytest.mark.parametrize("off, looked", [(0, False), (3, True)])
def test_the_least_looks_at_the_next_lowest_price_where_prices_were_off(off, looked):
    # no plan fits 50: the lowest priced (200) is estimated; the next, priced 0.5% higher, gets
    # a fake step of its own only where the first's was off its price
    from types import SimpleNamespace

    given = _Given([200 + off, 190, 400])
    prices = {0: 200, 1: 201, 2: 400}
    given.search.candidates = [_plan(0, 80, 0), _plan(1, 90, 0), _plan(2, 300, 0)]
    given.search.pricer = SimpleNamespace(price=lambda segments: prices[segments[0].start])
    plan, est = given.search.cheapest_within(50)
    assert plan is None and (1 in given.asked) == looked
    assert est.peak_bytes == (190 if looked else 200)
