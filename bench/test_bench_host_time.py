"""Host time of graphopt's training steps against eager's, kernels left out (bench/host_time.py holds
the rows and the measurement): issue 62's goals, graphopt's time over eager's in the same run, at
most GOALS's; syncs per step no more than eager's. A row over its goal is measured again, twice at
most, and its best run counts: a regression stays over in each run, a shared machine's bad
stretch does not."""
import host_time

ATTEMPTS = 3


def _missed(rows):
    return [r for r in rows if r.goal is not None and r.ratio > r.goal]


def test_host_time_goals(benchmark, figures, quick):
    rows = {r.name: r for r in host_time.run(quick)}
    attempts = 1
    while _missed(rows.values()) and attempts < ATTEMPTS:
        attempts += 1
        for r in host_time.run(quick):
            if r.ratio < rows[r.name].ratio:
                rows[r.name] = r
    figures(attempts=attempts, **{r.name.replace(" ", "_"): round(r.ratio, 3)
                                  for r in rows.values() if r.baseline != "none"})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    missed = [f"{r.name}: {r.ratio:.3f} > {r.goal:g} ({r.graphopt_us:.1f} against {r.baseline_us:.1f})"
              for r in _missed(rows.values())]
    assert not missed, f"host time over its goal in each of {attempts} runs: " + "; ".join(missed)
