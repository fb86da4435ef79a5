"""Host time of graphopt's training steps against eager's, kernels left out (bench/host_time.py holds
the rows and the measurement): issue 62's goals, graphopt's time over eager's in the same run, at
most GOALS's; syncs per step no more than eager's."""
import host_time


def test_host_time_goals(benchmark, figures, quick):
    rows = host_time.run(quick)
    missed = [f"{r.name}: {r.ratio:.3f} > {r.goal:g} ({r.graphopt_us:.1f} against {r.baseline_us:.1f})"
              for r in rows if r.goal is not None and r.ratio > r.goal]
    figures(**{r.name.replace(" ", "_"): round(r.ratio, 3) for r in rows if r.baseline != "none"})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    assert not missed, "host time over its goal: " + "; ".join(missed)
