"""Generated kernels build for a GPU, not only run in Triton's interpreter (which accepts programs
its compiler rejects): a sample of each kind, compiled for sm_90 by bench/kernels_compile.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).resolve().parents[2]


def test_sampled_kernels_build_for_hopper(tmp_path):
    env = {**os.environ, "GRAPHOPT_KERNEL_DIR": str(tmp_path / "kernels"), "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_compile.py"), "--only", "samples"],
                          capture_output=True, text=True, env=env, timeout=300)
    built = [line for line in done.stdout.splitlines() if "kernels built" in line]
    assert done.returncode == 0 and built, done.stdout[-3000:] + done.stderr[-3000:]
    assert built[0].split()[0] == built[0].split()[2] != "0"  # "12 of 12 kernels built"
