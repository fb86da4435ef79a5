"""`make gpu`'s runner (gpu_all.py) on tiny stand-in benchmarks: limits from the budget, failures and
hangs recorded with their stderr, the index, the packing for a device machine's $OUT. The real
benchmarks are not run here (each is checked by its own test_bench_*.py)."""
import sys
import tarfile

import gpu_all

WRITES = ["-c", "import pathlib, sys; pathlib.Path(sys.argv[1], 'fake-result.md').write_text('a row')", "{folder}"]
BREAKS = ["-c", "import sys; print('a row'); sys.stderr.write('ValueError: the fake broke\\n'); sys.exit(3)"]
HANGS = ["-c", "import time; print('started', flush=True); time.sleep(120)"]
QUIET = lambda *args, **kwargs: None  # noqa: E731
CPU = {"cuda": False, "name": "cpu", "torch": "test"}


def test_finished_and_failed_are_recorded_in_the_index(tmp_path):
    benchmarks = [gpu_all.Benchmark("writes", "a file", WRITES, 10), gpu_all.Benchmark("breaks", "an exit", BREAKS, 10)]
    budget = gpu_all.RESERVE_S + 60
    gpu_all.run_all(benchmarks, tmp_path, budget, sys.executable, CPU, log=QUIET)
    writes, breaks = (b.outcome for b in benchmarks)
    assert writes["status"] == "finished" and "fake-result.md" in writes["files"]
    assert breaks["status"] == "failed (exit status 3)" and breaks["tail"] == ["ValueError: the fake broke"]
    assert (tmp_path / "breaks.log").read_text() == "a row\n"
    # the first is held to its share (half of 60 s); the second gets its own and what the first left
    assert writes["limit_s"] == 30 and 50 < breaks["limit_s"] <= 60
    text = gpu_all.index(benchmarks, CPU, "2026-01-01", budget, 1.0)
    assert "| writes | a file | `-c import pathlib" in text and "sys.argv[1], 'fake-result.md')" in text
    assert "| 30 |" in text and "| finished | fake-result.md, writes.log, writes.stderr |" in text
    assert "## breaks: failed (exit status 3)" in text and "ValueError: the fake broke" in text
    assert "1 of 2 finished" in text
    again = gpu_all.run_one(benchmarks[0], sys.executable, tmp_path, 30.0, gpu_all.child_env(), "cpu")
    assert again["files"] == writes["files"]  # a second run the same day rewrites the same files


def test_a_hang_is_stopped_at_its_limit_with_its_traceback(tmp_path):
    outcome = gpu_all.run_one(gpu_all.Benchmark("hangs", "a sleep", HANGS, 10), sys.executable, tmp_path, 2.0,
                              gpu_all.child_env(), "cpu")
    assert outcome["status"] == "timed out at its 2 s limit"
    assert outcome["tail"][-1] == "KeyboardInterrupt"  # interrupted in its sleep, its traceback kept
    assert (tmp_path / "hangs.log").read_text() == "started\n"


def test_each_benchmark_gets_the_checkout_and_only_its_own_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # on a GPU machine this would run every kernel interpreted
    monkeypatch.setenv("OUT", str(tmp_path / "device-out"))
    shows = ["-c", "import os, sys; print(os.environ.get('TRITON_INTERPRET'), os.environ.get('OUT'), "
                   "sys.argv[1:], sys.path[1] == os.getcwd())", "{device}"]
    bench = gpu_all.Benchmark("shows", "its settings", shows, 10, cpu_args=["--small"],
                              cpu_env={"TRITON_INTERPRET": "1"}, gpu_args=["--large"])
    for device, want in (("cuda", "None None ['cuda', '--large'] True"), ("cpu", "1 None ['cpu', '--small'] True")):
        outcome = gpu_all.run_one(bench, sys.executable, tmp_path, 30.0, gpu_all.child_env(), device)
        assert outcome["status"] == "finished"
        assert (tmp_path / "shows.log").read_text() == want + "\n"


def test_no_time_left_skips_the_rest(tmp_path):
    benchmarks = [gpu_all.Benchmark("writes", "a file", WRITES, 10)]
    gpu_all.run_all(benchmarks, tmp_path, gpu_all.RESERVE_S + gpu_all.LEAST_S - 1, sys.executable, CPU, log=QUIET)
    assert benchmarks[0].outcome["status"] == "skipped: the budget was spent before it"
    assert not (tmp_path / "fake-result.md").exists()


def test_device_names_become_folder_names():
    assert gpu_all.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_all.device_slug("NVIDIA H200") == "h200"
    assert gpu_all.device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_all.device_slug("NVIDIA GeForce RTX 4090") == "4090"
    assert gpu_all.device_slug("Some Accelerator") == "some-accelerator"


def test_packing_leaves_two_files(tmp_path):
    folder = tmp_path / "h100-2026-01-01"
    folder.mkdir()
    (folder / "README.md").write_text("# index\n")
    (folder / "fuse.log").write_text("a row\n")
    archive, summary = gpu_all.pack(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h100-2026-01-01.md", "h100-2026-01-01.tar.gz"]
    assert summary.read_text() == "# index\n"
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["h100-2026-01-01", "h100-2026-01-01/README.md", "h100-2026-01-01/fuse.log"]


def test_a_matrix_out_of_time_still_writes_what_it_has(tmp_path, monkeypatch):
    import gpu_fuse
    import gpu_rows

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fuse pass's kernels, off CUDA
    fuse = gpu_fuse.run(sizes=gpu_fuse.CPU_SIZES[:1], lengths=(2,), dtypes=("float32",), device="cpu", seconds=0)
    assert fuse["first_call"] == [] and fuse["rows"] == []
    assert fuse["stopped"] == "the 0 s given ran out: 0 of 1 first calls, 0 of 2 rows measured"
    rows = gpu_rows.run(device="cpu", seconds=0)
    assert rows["rows"] == [] and rows["stopped"] == "the 0 s given ran out: 0 of 12 rows measured"
    for kind, script, result in (("fuse", gpu_fuse, fuse), ("rows", gpu_rows, rows)):
        _, md = gpu_fuse.write_results(kind, result, script.markdown(result), tmp_path)
        assert "Stopped early: the 0 s given ran out" in md.read_text()
