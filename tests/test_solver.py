"""The recompute solver against brute force, and its speed."""
import itertools
import random
import time

from graphopt.solver import Atom, make_atoms, solve


def _model_peak(atoms, segments):
    """The solver's cost model, written out independently: walk the atoms holding what each
    keeps; a checkpointed run's backward holds the prefix, its inputs, its selective outputs
    and what it saves again."""
    held = peak = 0
    starts = {a: (b, selective) for a, b, selective in segments}
    i = 0
    while i < len(atoms):
        if i in starts:
            j, selective = starts[i]
            sel = sum(a.sel for a in atoms[i:j]) if selective else 0
            peak = max(peak, held + atoms[i].cross + sel + sum(a.kept for a in atoms[i:j]))
            held += atoms[i].cross + sel
            i = j
        else:
            held += atoms[i].kept
            i += 1
    return max(peak, held)


def _segmentations(atoms):
    """Every way to mark runs of recomputable atoms as checkpointed segments, full or selective."""
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
                    yield [(i, j, False)] + rest
                    yield [(i, j, True)] + rest

    yield from rec(0)


def _cost(atoms, segments):
    return sum(atoms[k].cost - (atoms[k].sel_cost if selective else 0)
               for a, b, selective in segments for k in range(a, b))


def _brute(atoms, allowance):
    costs = [_cost(atoms, segs) for segs in _segmentations(atoms) if _model_peak(atoms, segs) <= allowance]
    return min(costs, default=None)


def test_matches_brute_force_on_small_instances():
    rng = random.Random(0)
    checked = selective = 0
    for _ in range(200):
        n = rng.randint(2, 6)
        atoms = []
        for i in range(n):
            flops, keeps = rng.randint(1, 50), rng.random() < 0.4
            atoms.append(Atom(i, i + 1, rng.randint(1, 20), rng.randint(0, 8), flops, rng.random() > 0.2,
                              rng.randint(1, 10) if keeps else 0, rng.randint(1, flops) if keeps else 0))
        total = sum(a.kept for a in atoms)
        allowance = rng.randint(total // 2, total)
        expected = _brute(atoms, allowance)
        plan = solve(atoms, allowance, buckets=10**6)  # one-byte units: exact
        if expected is None:
            assert plan is None
            continue
        assert plan is not None
        # Segments are node ranges; atoms here are one node each.
        chosen = [(s.start, s.stop, s.selective) for s in plan.segments]
        assert plan.recompute_cost == expected == _cost(atoms, chosen), (atoms, allowance, plan)
        assert _model_peak(atoms, chosen) == plan.predicted_peak <= allowance
        checked += 1
        selective += any(s.selective for s in plan.segments)
    assert checked > 30 and selective > 5  # instances where some plan fits, some of them selective


def test_no_recompute_when_everything_fits():
    atoms = [Atom(i, i + 1, 10, 2, 5, True) for i in range(4)]
    plan = solve(atoms, 40)
    assert plan.segments == [] and plan.recompute_cost == 0


def test_two_thousand_nodes_solve_fast_and_deterministically():
    rng = random.Random(1)
    n = 2000
    kept = [rng.randint(0, 1 << 20) for _ in range(n)]
    live = [rng.randint(1 << 18, 1 << 22) for _ in range(n)]
    flops = [rng.randint(1, 1 << 30) for _ in range(n)]
    ok = [rng.random() > 0.02 for _ in range(n)]
    start = time.perf_counter()
    atoms = make_atoms(kept, live, flops, ok)
    plan = solve(atoms, sum(kept) // 2)
    elapsed = time.perf_counter() - start
    assert plan is not None and plan.segments
    assert elapsed < 2.0, elapsed
    again = solve(make_atoms(kept, live, flops, ok), sum(kept) // 2)
    assert again.segments == plan.segments and again.recompute_cost == plan.recompute_cost


def test_atoms_keep_unrecomputable_nodes_alone():
    atoms = make_atoms([5] * 6, [1] * 6, [1] * 6, [True, True, False, True, True, True], max_cuts=0)
    assert [(a.start, a.stop, a.recomputable) for a in atoms] == [(0, 2, True), (2, 3, False), (3, 6, True)]
    assert list(itertools.chain.from_iterable(range(a.start, a.stop) for a in atoms)) == list(range(6))
