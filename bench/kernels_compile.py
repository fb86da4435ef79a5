"""Every kernel the GPU benchmarks launch, compiled for a GPU without one: Triton's interpreter runs
the benchmarks' CPU mode and records each launch, then Triton's compiler builds each kernel for
an sm_90 target (Hopper) down to its cubin.

    python bench/kernels_compile.py [--arch 90] [--only fuse,rows,head_loss | samples]
        [--compiler-python PY]        # PY's Triton compiles: a venv with the GPU machine's versions

The interpreter accepts programs the compiler rejects (it runs Python on NumPy), so tests on a
machine without a GPU say nothing of whether a kernel builds; this does, before device time is
spent. A kernel's arguments are typed as its launch passed them; its constexprs (block sizes) are
those the CPU chose, and, for the elementwise kernels, the GPU's block size as well.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPILING = "--compile" in sys.argv  # the second process: the interpreter's patches of triton.language stay put
os.environ["TRITON_INTERPRET"] = "0" if COMPILING else "1"
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

POINTER = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "i1"}
LAUNCHES: dict = {}  # (file, kernel, signature, constexprs) -> how many launches


def _record(run):
    def recording(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        bound = dict(zip(names, args)) | kwargs
        signature, constexprs = {}, {}
        for name in names:
            value = bound.get(name)
            if isinstance(value, torch.Tensor):
                signature[name] = "*" + POINTER[value.dtype]
            elif name in kwargs or value is None:
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{self.fn.__name__}: argument {name} of type {type(value).__name__}")
        key = (self.fn.__code__.co_filename, self.fn.__name__, tuple(signature.items()), tuple(constexprs.items()))
        LAUNCHES[key] = LAUNCHES.get(key, 0) + 1
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    return recording


def launch_samples() -> None:
    """A few kernels of each kind in seconds (the test of this script): an RMSNorm written as
    transformers writes it and a softmax (row kernels), an elementwise chain with constant powers."""
    import graphopt

    class Sample(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(64))

        def forward(self, x, scores):
            norm = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
            chain = torch.nn.functional.gelu(x) * torch.sigmoid(x) + x.pow(3) * 0.5
            return norm.sum() + chain.sum() + torch.softmax(scores * 0.125, -1).pow(2).sum()

    args = (torch.randn(8, 64, requires_grad=True), torch.randn(2, 4, 16, requires_grad=True))
    graphopt.optimize(Sample(), args, passes="fuse")(*args).backward()


def launch_benchmarks(only: list[str]) -> None:
    interpreter.InterpretedFunction.run = _record(interpreter.InterpretedFunction.run)
    if "samples" in only:
        launch_samples()
    if "fuse" in only:
        import gpu_fuse
        gpu_fuse.run(with_compile=False, log=lambda row: None)
    if "rows" in only:
        import gpu_rows
        gpu_rows.run(with_compile=False, log=lambda row: None)
    if "head_loss" in only:
        import head_loss
        head_loss.main(["--size", "256,64,8000", "--out", os.devnull])


def compiled_module(path: str):
    """The kernel file imported in a process where @triton.jit makes compilable functions, with the
    helpers a GPU's kernel has where the interpreter's differ (codegen/kernel.py: bf16 rounding)."""
    from graphopt.codegen.kernel import HELPERS, INTERPRETED_HELPERS

    source = Path(path).read_text()
    for name, text in INTERPRETED_HELPERS.items():
        source = source.replace(text, HELPERS[name])
    path = str(Path(tempfile.mkdtemp(prefix="graphopt-compile-")) / Path(path).name)
    Path(path).write_text(source)
    spec = importlib.util.spec_from_file_location(f"compile_check_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_all(launches: list, arch: int, gpu_block: int) -> list[dict]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, modules, rows = GPUTarget("cuda", arch, 32), {}, []
    variants = set()
    for path, name, signature, constexprs in launches:
        variants.add((path, name, signature, constexprs))
        if dict(constexprs).keys() == {"BLOCK"}:  # the elementwise kernels: the GPU launches them with its block
            variants.add((path, name, signature, (("BLOCK", gpu_block),)))
    for path, name, signature, constexprs in sorted(variants, key=lambda v: (v[1], v[0], str(v[3]))):
        module = modules.get(path) or modules.setdefault(path, compiled_module(path))
        started = time.perf_counter()
        row = {"kernel": name, "file": Path(path).name, "constexprs": dict(constexprs)}
        kernel = getattr(module, name)
        options = {"debug": True} if getattr(kernel, "debug", False) else None  # its device assertions built too
        try:
            done = triton.compile(ASTSource(kernel, signature=dict(signature), constexprs=dict(constexprs)),
                                  target=target, options=options)
            row |= {"ok": True, "registers": done.n_regs if hasattr(done, "n_regs") else None,
                    "spills": getattr(done, "n_spills", None), "warps": done.metadata.num_warps}
        except Exception as error:  # the point of the check: a kernel that does not build is reported, all of them
            row |= {"ok": False, "error": f"{type(error).__name__}: {str(error).strip()[:2000]}"}
        row["seconds"] = round(time.perf_counter() - started, 2)
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="the CUDA compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--only", default="fuse,rows,head_loss",
                        help="which benchmarks' kernels (or samples: a few of each kind, in seconds)")
    parser.add_argument("--compiler-python", default=sys.executable,
                        help="the python whose Triton compiles (a GPU machine's version, say); default this one")
    parser.add_argument("--compile", metavar="LAUNCHES", help=argparse.SUPPRESS)  # the second process's input
    args = parser.parse_args(argv)
    if not args.compile:
        launch_benchmarks(args.only.split(","))
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"graphopt-launches-{os.getpid()}.json"
        path.write_text(json.dumps([[p, n, list(s), list(c)] for p, n, s, c in LAUNCHES]))
        return subprocess.call([args.compiler_python, __file__, "--arch", str(args.arch), "--compile", str(path)])
    launches = [(p, n, tuple(map(tuple, s)), tuple(map(tuple, c))) for p, n, s, c in json.loads(Path(args.compile).read_text())]
    from graphopt.runtime.fused import GPU_BLOCK
    rows = compile_all(launches, args.arch, GPU_BLOCK)
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} kernels built for sm_{args.arch} "
          f"({len(launches)} distinct launches)")
    for row in failed:
        print(f"FAILED {row['kernel']} ({row['file']}, {row['constexprs']}):\n{row['error']}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
