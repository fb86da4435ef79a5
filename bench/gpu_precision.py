"""The precision pass's whole measurement in one call, for a GPU machine (CPU works too, slowly).

    python bench/gpu_precision.py --out bench/results          # writes precision-<device>-<date>.{json,md}

Needs only torch (and numpy, networkx) importable: graphopt is taken from this checkout.
Figures (see precision_figures.py): a GPT training step in float32, graphopt bf16 and
torch.autocast bf16 (times, ratios, measured peaks, loss agreement); and, on the same model,
each node's dtype against what this device's torch.autocast gives it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402

import graphopt  # noqa: E402
import precision_figures as pf  # noqa: E402
from graphopt.analysis.autocast_plan import autocast_dtypes, dtypes_of  # noqa: E402
from graphopt.analysis.meta import tensor_info  # noqa: E402
from graphopt.frontend.trace import placeholder_values  # noqa: E402
from results_files import device_name, today, write_results  # noqa: E402


def autocast_agreement(size: str) -> dict:
    """Nodes whose dtype after the pass differs from the one this device's autocast gives them."""
    model, args, kwargs = pf.build(size)
    # the cleanups alone beside the precision pass: the default's inplace (and fuse, on CUDA) rename nodes
    given = graphopt.optimize(model, args, example_kwargs=kwargs, passes="normalize,cse,dce")
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, passes="normalize,cse,dce", precision="bf16")
    reference = autocast_dtypes(given, placeholder_values(given, args, kwargs), torch.bfloat16, pf.DEVICE)
    compared = [n for n in opt.graph.nodes if n.op.startswith("call_") and n.name in reference]
    wrong = [f"{n.name}: {dtypes_of(tensor_info(n))} vs autocast {reference[n.name]}"
             for n in compared if dtypes_of(tensor_info(n)) != reference[n.name]]
    return {"nodes_compared": len(compared), "mismatches": wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results"), help="directory for the .json and .md files")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per variant and round (median)")
    options = parser.parse_args()

    started = time.perf_counter()
    size = pf.DEVICE
    agreement = autocast_agreement(size)
    print("autocast agreement", agreement, flush=True)
    run = pf.precision_run(size, options.steps)
    print("step times", run, flush=True)

    # float32 matmuls on TF32 tensor cores would narrow the gap to bf16: say which ran
    tf32 = torch.backends.cuda.matmul.allow_tf32 if torch.cuda.is_available() else None
    result = {"device": device_name(), "date": today(), "torch": torch.__version__, "model": {"gpt": pf.SIZES[size]},
              "tf32": tf32, "seconds": round(time.perf_counter() - started, 1), "autocast_agreement": agreement,
              "step": run}
    paths = write_results("precision", result, markdown(result), options.out)
    print("wrote", *paths)


def markdown(result: dict) -> str:
    r, a = result["step"], result["autocast_agreement"]
    lines = [f"# precision on {result['device']} ({result['date']}, torch {result['torch']})", "",
             f"GPT {result['model']['gpt']}, training step (forward, loss, backward), best of 3 medians.", "",
             "| | float32 | graphopt bf16 | torch.autocast bf16 |", "|---|---|---|---|",
             f"| step ms | {r['float32_ms']} | {r['graphopt_bf16_ms']} | {r['autocast_bf16_ms']} |"]
    if "float32_peak_mb" in r:
        lines.append(f"| measured peak MB | {r['float32_peak_mb']} | {r['graphopt_bf16_peak_mb']} | {r['autocast_bf16_peak_mb']} |")
    lines += ["", f"- graphopt bf16: {r['graphopt_speedup_vs_float32']}x float32's speed (goal >= 1.8); "
              f"time {r['graphopt_time_vs_autocast']} of autocast's (goal <= 1.05)",
              f"- torch.autocast bf16: {r['autocast_speedup_vs_float32']}x float32's speed",
              f"- loss: relative difference {r['loss_rel_diff_vs_autocast']} from autocast's",
              f"- the pass: {r['casts_inserted']} casts, ops by dtype {r['ops_by_dtype']}, "
              f"estimated activation bytes saved {r['estimated_bytes_saved']}",
              f"- dtypes against this device's autocast: {a['nodes_compared']} nodes compared, "
              f"{len(a['mismatches'])} differ" + (": " + "; ".join(a["mismatches"][:10]) if a["mismatches"] else ""), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
