"""Every GPU benchmark in one command (`make gpu`), each in a process of its own with its own time limit.

    python bench/gpu_all.py [--out DIR] [--budget-s 480]

Runs, most telling first: gpu_step_time.py (whole training steps against eager, autocast,
torch.compile and its reduce-overhead mode, graphopt with CUDA graphs; then, its --memory all,
the memory promise on five corpus models, each in a process of its own), gpu_fuse.py
(elementwise chains), gpu_rows.py (row kernels), both against eager and torch.compile;
gpu_recompute.py (the recompute figures at GPU sizes);
gpu_precision.py (bf16 against float32 and autocast); head_loss.py (an LM head and its loss:
step peaks); recompute_sweep.py on the corpus's GPT-2 (predicted against measured peak from
graphopt's least budget to eager); gpu_memory_gap.py (CUDA only: each zoo model's estimate
against its measured step, and the allocator's snapshot of the step); host_link.py (the host
step's rates: pinned copies each way, the host's AdamW step); gpu_host_step.py (a Llama planned
below its device's reach: the host tier measured against its prediction and torchao's
CPUOffloadOptimizer, and its blocks offloaded against checkpointed); gpu_rank_host.py (one FSDP2
rank with its shards on the host, against CPUOffloadPolicy by hand); gpu_prefetch.py (an image
step with and without graphopt.prefetch). Each
one's limit is its share of the budget plus what the ones before it left unused, so the whole run
stays within the budget; the matrices (fuse, rows) are told to stop starting rows in time to
write what they measured. A crash, a hang or a spent limit
loses that benchmark only (a hang is interrupted, so its stderr ends with where it stood).

Writes DIR/<device>-<date>/ (device: "h100", "h200", ... from torch.cuda.get_device_name, "cpu"
without CUDA): each benchmark's files, its stdout (<name>.log) and stderr (<name>.stderr), and
README.md, the index: per benchmark its command, limit, wall time, whether it finished, and the
tail of its stderr where it did not. With $OUT set and no --out (a device machine, whose $OUT
comes back only as a few files), the folder is packed into $OUT/<device>-<date>.tar.gz beside a
copy of the index, $OUT/<device>-<date>.md.

Needs only a python with torch (and triton, networkx, numpy; transformers and matplotlib for the
sweep): it installs nothing, and takes graphopt from this checkout. Without CUDA each script runs
its reduced CPU mode, kernels in Triton's interpreter, with fewer timed steps and smaller sizes
where a 2-core machine would take long (Benchmark.cpu_args).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

STARTED = time.perf_counter()  # the budget counts from here: importing graphopt (and torch) below takes seconds
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)]

from graphopt.errors import OptionError, UsageError  # noqa: E402

# a log past this keeps its end: the packed folder must stay well under what a device machine returns
LOG_LIMIT = 1 << 20
TAIL_LINES = 20
GRACE_S = 5  # between the interrupt at a benchmark's limit and the kill


@dataclass
class Benchmark:
    name: str
    what: str
    argv: list[str]  # after the python; {folder} is the results folder, {seconds} the time to stop starting work
    share_s: float  # of the default 480 s budget: the fixed work enough to finish, the matrices (fuse, rows) the rest
    cpu_args: list[str] = field(default_factory=list)  # without CUDA: less of the same, for a 2-core machine
    cpu_env: dict = field(default_factory=dict)  # without CUDA: what the script asks of its environment
    gpu_args: list[str] = field(default_factory=list)  # with CUDA
    cuda_only: bool = False  # no CPU mode: skipped without CUDA
    outcome: dict = field(default_factory=dict)


BENCHMARKS = [
    Benchmark("step_time", "training steps of GPT-2 124M, the corpus GPT-2 and a small Llama: eager, autocast, "
              "torch.compile (and reduce-overhead), graphopt, graphopt bf16, graphopt with CUDA graphs",
              ["bench/gpu_step_time.py", "--out", "{folder}", "--seconds", "{seconds}"], 165,
              cpu_args=["--steps", "2"]),
    Benchmark("memory_promise", "five corpus models, each in a process of its own: predicted against measured "
              "peak, budgets held", ["bench/gpu_step_time.py", "--memory", "all", "--out", "{folder}", "--seconds",
                                     "{seconds}"], 45, cuda_only=True),
    Benchmark("fuse", "elementwise chains: eager, graphopt, torch.compile; first training step",
              ["bench/gpu_fuse.py", "--out", "{folder}", "--seconds", "{seconds}"], 40),
    Benchmark("rows", "norms, softmax, cross-entropy, batch norm, LM head: eager, graphopt, torch.compile, Liger",
              ["bench/gpu_rows.py", "--out", "{folder}", "--seconds", "{seconds}"], 45),
    Benchmark("recompute", "recompute at f = 0.3, 0.5, 0.7 on the zoo MLP, CNN and GPT; estimate error; solver time",
              ["bench/gpu_recompute.py", "--out", "{folder}"], 35,
              cpu_args=["--models", "mlp", "--steps", "3"]),
    Benchmark("precision", "GPT step in float32, graphopt bf16 and torch.autocast bf16",
              ["bench/gpu_precision.py", "--out", "{folder}"], 35, cpu_args=["--steps", "3"]),
    Benchmark("head_loss", "LM head + cross-entropy: step peak, eager against fused and chunked",
              ["bench/head_loss.py", "--out", "{folder}/head_loss.md"], 20, cpu_args=["--size", "256,64,8000"],
              cpu_env={"TRITON_INTERPRET": "1"}),
    Benchmark("recompute_sweep", "corpus GPT-2: predicted and measured peak and step time, least budget to eager",
              ["bench/recompute_sweep.py", "--device", "{device}", "--models", "hf_gpt2", "--out",
               "{folder}/recompute_sweep"], 15, cpu_args=["--points", "2"], gpu_args=["--points", "5"]),
    Benchmark("memory_gap", "zoo models: estimated against measured step peak, the allocator's snapshot of each step",
              ["bench/gpu_memory_gap.py", "--out", "{folder}/memory_gap"], 15, cuda_only=True),
    Benchmark("host_link", "pinned host-device copies each way and the host's AdamW step: the host step's rates",
              ["bench/host_link.py", "--out", "{folder}/host_link.md"], 5, cpu_args=["--mb", "64"]),
    Benchmark("host_step", "a Llama planned below its device's reach: what moved to the host, predicted against "
              "measured peak, step time against eager and torchao's CPUOffloadOptimizer",
              ["bench/gpu_host_step.py", "--out", "{folder}/host_step.md"], 30,
              cpu_args=["--layers", "2", "--width", "256", "--tokens", "128", "--steps", "2"]),
    Benchmark("rank_host", "one FSDP2 rank with its shards on the host (CPUOffloadPolicy): predicted against "
              "measured device peak, step time and losses against FSDP2 with CPUOffloadPolicy by hand",
              ["bench/gpu_rank_host.py", "--out", "{folder}/rank_host.md"], 20,
              cpu_args=["--layers", "2", "--width", "128", "--tokens", "128", "--steps", "2"]),
    Benchmark("prefetch", "an image step with and without graphopt.prefetch",
              ["bench/gpu_prefetch.py", "--out", "{folder}/prefetch.md"], 10,
              cpu_args=["--steps", "8", "--batch", "8", "--size", "64"]),
]
DEFAULT_BUDGET_S = 480
RESERVE_S = 10  # the runner's own work: finding the device, the index, packing
LEAST_S = 15  # below this a benchmark cannot even import torch on a busy machine: it is skipped


def device_slug(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100": the first model number, memory
    sizes aside; without one, the whole name as a file name."""
    for token in re.split(r"[\s\-_/]+", name):
        if re.fullmatch(r"[A-Za-z]*\d+[A-Za-z]*", token) and not re.fullmatch(r"\d+[GMT]B", token, re.I):
            return token.lower()
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "unknown"


def find_device(python: str) -> dict:
    """The device the benchmarks will see, asked in a process of its own (the runner keeps no CUDA context)."""
    probe = ("import json, os, torch; cuda = torch.cuda.is_available(); print(json.dumps({'cuda': cuda, 'name': "
             "torch.cuda.get_device_name() if cuda else f'cpu ({os.cpu_count()} cores)', 'torch': torch.__version__}))")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise UsageError(f"{python} took over 120 s to import torch and find its device: check the GPU's driver "
                         "(nvidia-smi), then run make gpu again") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UsageError(f"{python} cannot import torch or find its device ({said}): "
                         "run with a python that has torch, e.g. make gpu GPU_PYTHON=/path/to/python")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"  # a killed benchmark's log still holds every row it printed
    env.setdefault("HF_HUB_OFFLINE", "1")  # the corpus builds from configs: no network to wait on
    env.pop("OUT", None)  # each script is told where to write; $OUT is the runner's
    # on a GPU the kernels must run compiled; off it, the scripts that run kernels in the interpreter ask for it
    env.pop("TRITON_INTERPRET", None)
    return env


def run_one(bench: Benchmark, python: str, folder: Path, limit_s: float, env: dict, device: str) -> dict:
    """Runs one benchmark in its own session (killed whole at the limit, compile workers too); returns its outcome."""
    seconds = max(1, int(limit_s - max(20.0, 0.25 * limit_s)))  # room for the last row, the writing and the exit
    given = bench.argv + (bench.cpu_args if device == "cpu" else bench.gpu_args)
    argv = [python, *(a.format(folder=folder, seconds=seconds, device=device) for a in given)]
    env = {**env, **(bench.cpu_env if device == "cpu" else {})}
    before = _stamps(folder)
    log, err = folder / f"{bench.name}.log", folder / f"{bench.name}.stderr"
    started = time.perf_counter()
    with open(log, "wb") as out, open(err, "wb") as errors:
        child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=errors, start_new_session=True,
                                 preexec_fn=_interruptible)
        timed_out = False
        try:
            child.wait(timeout=max(limit_s - GRACE_S, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            child.send_signal(signal.SIGINT)  # its traceback, in its stderr, says where the limit found it
            try:
                child.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _kill(child)  # the whole session: compile workers outlive their parent otherwise
        rc = child.wait()
    wall = time.perf_counter() - started
    for path in (log, err):
        _keep_end(path)
    if timed_out:
        status = f"timed out at its {limit_s:.0f} s limit"
    else:
        status = "finished" if rc == 0 else f"failed (exit status {rc})"
    written = sorted(str(p.relative_to(folder)) for p, stamp in _stamps(folder).items() if before.get(p) != stamp)
    return {"command": " ".join(argv[1:]).replace(str(folder) + "/", "").replace(str(folder), "."),
            "limit_s": round(limit_s), "wall_s": round(wall, 1), "status": status, "finished": status == "finished",
            "files": written, "tail": [] if status == "finished" else _tail(err) or _tail(log)}


def _stamps(folder: Path) -> dict:
    """Each file's modification time: what a benchmark wrote is what changed, a run earlier the same day aside."""
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def _interruptible() -> None:
    """In the child before it starts: SIGINT as Python expects it. A runner started in the background
    (nohup, `&`) passes SIGINT on ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _keep_end(path: Path) -> None:
    if path.stat().st_size > LOG_LIMIT:
        with open(path, "rb") as f:
            f.seek(-LOG_LIMIT, os.SEEK_END)
            end = f.read()
        path.write_bytes(b"[... the start is cut: only the last MiB is kept]\n" + end)


def _tail(path: Path) -> list[str]:
    return path.read_text(errors="replace").rstrip().splitlines()[-TAIL_LINES:]


def run_all(benchmarks: list[Benchmark], folder: Path, budget_s: float, python: str, device: dict,
            log=print) -> list[Benchmark]:
    """Runs each benchmark with its share of the budget plus what the earlier ones left; fills each outcome."""
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    scale = (budget_s - RESERVE_S) / sum(b.share_s for b in benchmarks)
    env = child_env()
    for i, bench in enumerate(benchmarks):
        later = sum(b.share_s for b in benchmarks[i + 1:]) * scale
        limit = budget_s - RESERVE_S - (time.perf_counter() - started) - later
        if bench.cuda_only and not device["cuda"]:
            bench.outcome = {"command": "", "limit_s": 0, "wall_s": 0.0, "finished": True,
                             "status": "skipped: it measures CUDA's allocator", "files": [], "tail": []}
        elif limit < LEAST_S:
            bench.outcome = {"command": "", "limit_s": round(max(limit, 0)), "wall_s": 0.0, "finished": False,
                             "status": "skipped: the budget was spent before it", "files": [], "tail": []}
        else:
            log(f"{bench.name}: up to {limit:.0f} s", flush=True)
            bench.outcome = run_one(bench, python, folder, limit, env, "cuda" if device["cuda"] else "cpu")
        log(f"{bench.name}: {bench.outcome['status']} in {bench.outcome['wall_s']} s", flush=True)
    return benchmarks


def index(benchmarks: list[Benchmark], device: dict, date: str, budget_s: float, wall_s: float) -> str:
    finished = sum(b.outcome["finished"] for b in benchmarks)
    lines = [f"# GPU benchmarks: {device['name']}, {date}", "",
             f"`make gpu` (bench/gpu_all.py): torch {device['torch']}, budget {budget_s:.0f} s, "
             f"{wall_s:.0f} s in all; {finished} of {len(benchmarks)} finished. Each benchmark ran in a process of "
             "its own, its limit its share of the budget plus what those before it left unused; `<name>.log` holds "
             "its stdout (a row per measurement), `<name>.stderr` its stderr.", "",
             "| benchmark | what | command | limit s | wall s | result | files |", "|---|---|---|---|---|---|---|"]
    for b in benchmarks:
        o = b.outcome
        command = f"`{o['command']}`" if o["command"] else ""
        lines.append(f"| {b.name} | {b.what} | {command} | {o['limit_s']} | {o['wall_s']} | {o['status']} | "
                     f"{', '.join(o['files'])} |")
    for b in benchmarks:
        o = b.outcome
        if not o["finished"] and o["tail"]:
            lines += ["", f"## {b.name}: {o['status']}", "", "```", *o["tail"], "```"]
    return "\n".join(lines) + "\n"


def pack(folder: Path) -> tuple[Path, Path]:
    """folder -> folder.tar.gz and a copy of its index beside it; the folder itself goes (few files come back)."""
    archive, summary = folder.with_name(folder.name + ".tar.gz"), folder.with_name(folder.name + ".md")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    shutil.copyfile(folder / "README.md", summary)
    shutil.rmtree(folder)
    return archive, summary


def main(argv=None, started: float | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out",
                        help="where the <device>-<date> folder goes (default: $OUT, packed; else bench/results)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for everything, the benchmarks' limits included (default 480)")
    parser.add_argument("--only", help="comma-separated benchmark names, to run a few: " +
                        ", ".join(b.name for b in BENCHMARKS))
    args = parser.parse_args(argv)
    started = time.perf_counter() if started is None else started
    packed = args.out is None and bool(os.environ.get("OUT"))
    out = Path(args.out or os.environ.get("OUT") or HERE / "results")
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only.split(",")]
    if not chosen:
        raise OptionError(f"--only {args.only} names no benchmark: name some of "
                          + ", ".join(b.name for b in BENCHMARKS))
    device = find_device(sys.executable)
    date = datetime.date.today().isoformat()
    folder = out / f"{device_slug(device['name']) if device['cuda'] else 'cpu'}-{date}"
    print(f"{device['name']}, torch {device['torch']}: results in {folder}", flush=True)
    run_all(chosen, folder, args.budget_s - (time.perf_counter() - started), sys.executable, device)
    (folder / "README.md").write_text(index(chosen, device, date, args.budget_s, time.perf_counter() - started))
    print(f"wrote {folder / 'README.md'}")
    if packed:
        print("packed into", *pack(folder))
    return 0 if all(b.outcome["finished"] for b in chosen) else 1


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
