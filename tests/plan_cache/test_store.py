"""The plan cache's store: JSON entries written whole, read or refused with a warning, bounded,
one planner at a time per key across processes."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import graphopt
from graphopt.__main__ import main
from graphopt.plan_cache.store import PlanStore, digest, plan_store


def test_an_entry_reads_back_and_a_missing_one_is_none(tmp_path):
    store = PlanStore(tmp_path)
    assert store.get("k", "recompute") is None
    store.put("k", "recompute", {"segments": [[0, 3, False]]})
    assert store.get("k", "recompute") == {"segments": [[0, 3, False]]}
    assert store.get("k", "other kind") is None  # not what this reader wrote: a miss
    assert digest({"b": 1, "a": [1, 2]}) == digest({"a": [1, 2], "b": 1})


@pytest.mark.parametrize("text", ["", '{"format": 1, "kind": "recompute", "pay', "[]", "not json at all",
                                  '{"format": 999, "kind": "recompute", "payload": {}}'])
def test_a_corrupt_or_truncated_entry_warns_and_is_a_miss(tmp_path, text):
    store = PlanStore(tmp_path)
    store.put("k", "recompute", {"x": 1})
    (store.dir / "k.json").write_text(text)
    with pytest.warns(graphopt.GraphoptWarning, match="unreadable.*planning again"):
        assert store.get("k", "recompute") is None
    store.put("k", "recompute", {"x": 2})  # rewritten whole
    assert store.get("k", "recompute") == {"x": 2}


def test_a_write_that_fails_midway_leaves_no_entry_and_no_temporary(tmp_path, monkeypatch):
    store = PlanStore(tmp_path)

    def crash(*args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.warns(graphopt.GraphoptWarning, match="could not write its plan cache"):
        store.put("k", "recompute", {"x": 1})
    assert list(store.dir.iterdir()) == []
    assert store.get("k", "recompute") is None


def test_the_least_recently_used_entries_go_first(tmp_path):
    store = PlanStore(tmp_path, max_entries=2)
    for k, name in enumerate("abc"):
        store.put(name, "recompute", {"k": k})
        os.utime(store.dir / f"{name}.json", (k, k))
    assert sorted(p.stem for p in store.dir.glob("*.json")) == ["b", "c"]
    store.get("b", "recompute")  # touched: now the newest
    store.put("d", "recompute", {"k": 3})
    assert sorted(p.stem for p in store.dir.glob("*.json")) == ["b", "d"]


def test_the_option_the_environment_and_dumps_turn_it_off(tmp_path, monkeypatch):
    monkeypatch.delenv("GRAPHOPT_PLAN_CACHE", raising=False)
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "default"))
    assert plan_store(True).root == tmp_path / "default"
    assert plan_store(str(tmp_path / "mine")).root == tmp_path / "mine"
    assert plan_store(False) is None and plan_store(True, dump_dir=tmp_path) is None
    monkeypatch.setenv("GRAPHOPT_PLAN_CACHE", "off")
    assert plan_store(True) is None and plan_store(tmp_path) is not None  # a directory given is used
    with pytest.raises(graphopt.OptionError, match="plan_cache must be True, False or a directory"):
        plan_store(3)


def test_the_command_line_shows_and_clears_it(tmp_path, capsys):
    store = PlanStore(tmp_path)
    store.put("a", "recompute", {})
    store.put("b", "recompute", {})
    assert main(["cache", "show", "--dir", str(tmp_path)]) == 0
    assert "2 plans in" in capsys.readouterr().out
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 2 plans" in capsys.readouterr().out and len(store) == 0


_RANK = textwrap.dedent("""
    import json, sys, time
    from graphopt.plan_cache.store import PlanStore
    store = PlanStore(sys.argv[1])
    with store.planning("k"):
        found = store.get("k", "recompute")
        if found is None:
            time.sleep(0.5)  # planning: the others wait on the lock meanwhile
            store.put("k", "recompute", {"planned_by": sys.argv[2]})
    print(json.dumps({"rank": sys.argv[2], "found": found}))
""")


@pytest.mark.slow  # three fresh processes: make test-real
def test_ranks_starting_at_once_plan_once_and_the_others_read_the_whole_entry(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's graphopt
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(tmp_path), str(r)], stdout=subprocess.PIPE, text=True,
                              cwd=root) for r in range(3)]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in ranks]
    planners = [r for r in results if r["found"] is None]
    assert len(planners) == 1
    assert all(r["found"] == {"planned_by": planners[0]["rank"]} for r in results if r["found"] is not None)
