"""graphopt.plan on models built on the meta device: a Llama-3-8B shape planned for CUDA, and a
~350M-parameter Llama planned for this CPU and checked against its real, measured step.

    python bench/plan_without_hardware.py [--part 8b,350m,8b-fsdp] [--passes P] [--out DIR]

8B part: 32 layers, 4096 wide, MLP 14336, 32 heads, 8 KV heads, vocabulary 128256, parameters in
bf16 (as users load it), AdamW, its own loss on labels=input_ids, at 1 and 4 x 2048 tokens;
per budget (80 and 24 GB): the least budget of the whole batch, the microbatches and recompute
plan graphopt.train_step would take, the predicted peak and step time (the time model's, the host step
at the host's measured rates), and the seconds plan() took.

8b-fsdp part: the same shape at 1 x 2048 tokens as one rank's step under FSDP2 per block
(shard="fsdp"), over 2 ranks at 24 and 80 GB a rank and over 8 at 24 GB: what a rank needs, the
plan, whether it keeps the rank's shards on the host (FSDP2's CPUOffloadPolicy) and their host
bytes, and the predicted step time.

350M part: 24 layers, 1024 wide, MLP 2816, 16 heads, 8 KV heads, vocabulary 32000, float32, AdamW,
2 x 512 tokens. plan(device="cpu") on the meta model finds the least budget (with the host tier:
the optimizer's state, step and gradients, and the checkpoints, on the host) and the unplanned
step's peak; at two budgets below the unplanned step (part_350m says which), the plan; then the
same config built for real, graphopt.train_step at that budget with the AdamW it plans for, one
step with optimizer.step() to make AdamW's state, and the next step
measured (live storages of the device: the state resident where it is the device's, the host's
copies not counted): predicted against measured.
--passes gives optimize's passes (default: its default pipeline, which on CUDA fuses). With
--out DIR, writes plan_without_hardware-<device>-<date>.json and .md there (with --passes,
plan_without_hardware-<passes>-...).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

os.environ.setdefault("GRAPHOPT_PLAN_CACHE", "off")  # planning time from cold: every plan made afresh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]  # graphopt from this checkout

from results_files import device_name, today, write_results  # noqa: E402  (bench/, beside this script)

GB = 10**9


def llama(config_kwargs: dict, batch: int, tokens: int, device: str, dtype=torch.float32):
    import transformers

    config = transformers.LlamaConfig(**config_kwargs, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    ids = torch.randint(0, config.vocab_size, (batch, tokens)).to(device)
    return model, (ids,), {"labels": ids}


LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
LLAMA_350M = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048)


def part_8b(passes: str | None) -> list[dict]:
    import graphopt

    rows = []
    for batch in (1, 4):
        for budget_gb in (80, 24):
            model, args, kwargs = llama(LLAMA_8B, batch, 2048, "meta", torch.bfloat16)
            start = time.perf_counter()
            found = graphopt.plan(model, args, kwargs, budget_gb=budget_gb, device="cuda", optimizer="adamw",
                                  passes=passes)
            host = found.host_step
            rows.append({"tokens": f"{batch} x 2048", "budget_gb": budget_gb, "least_gb": found.least_bytes / GB,
                         "microbatches": found.microbatches, "segments": found.segments,
                         "host_gb": None if host is None else host.host_bytes / GB,
                         "host_step_s": None if host is None else host.seconds_over(found.microbatches),
                         "host_step_pct": found.host_step_overhead_pct,
                         "predicted_gb": None if found.predicted_peak_bytes is None else found.predicted_peak_bytes / GB,
                         "overhead_pct": found.recompute_overhead_pct, "step_s": found.step_seconds,
                         "seconds": time.perf_counter() - start})
            print(rows[-1], flush=True)
    return rows


def part_8b_fsdp(passes: str | None) -> list[dict]:
    import graphopt

    rows = []
    for world, budget_gb in ((2, 24), (2, 80), (8, 24)):
        model, args, kwargs = llama(LLAMA_8B, 1, 2048, "meta", torch.bfloat16)
        start = time.perf_counter()
        found = graphopt.plan(model, args, kwargs, budget_gb=budget_gb, device="cuda", optimizer="adamw",
                              passes=passes, shard="fsdp", world_size=world)
        rows.append({"ranks": world, "budget_gb": budget_gb, "least_gb": found.least_bytes / GB,
                     "microbatches": found.microbatches, "segments": found.segments,
                     "predicted_gb": None if found.predicted_peak_bytes is None else found.predicted_peak_bytes / GB,
                     "overhead_pct": found.recompute_overhead_pct, "host_gb": found.rank_host_bytes / GB,
                     "step_s": found.step_seconds, "seconds": time.perf_counter() - start})
        print(rows[-1], flush=True)
    return rows


def part_350m(passes: str | None) -> list[dict]:
    """Two budgets: one a quarter of the way from the unplanned step down to the least, and one at
    the least plus the parameters' bytes. At 2 x 512 tokens both are below what the device reaches
    with AdamW's state on it (parameters, gradients and two moments: 5.58 GB), so both step it on
    the host, the second recomputing too."""
    model, args, kwargs = llama(LLAMA_350M, 2, 512, "meta")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    least = graphopt_plan(model, args, kwargs, None, passes).least_bytes  # the optimizer's step on the host
    unplanned = graphopt_plan(model, args, kwargs, 1e3, passes).predicted_peak_bytes
    return [one_350m(passes, least, unplanned, (unplanned - (unplanned - least) / 4) / GB),
            one_350m(passes, least, unplanned, (least + params) / GB)]


def graphopt_plan(model, args, kwargs, budget_gb, passes):
    import graphopt

    return graphopt.plan(model, args, kwargs, budget_gb=budget_gb, device="cpu", optimizer="adamw", passes=passes)


def one_350m(passes: str | None, least: int, unplanned: int, budget_gb: float) -> dict:
    import graphopt
    from graphopt.analysis.memory import measure_peak

    model, args, kwargs = llama(LLAMA_350M, 2, 512, "meta")
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    found = graphopt_plan(model, args, kwargs, budget_gb, passes)
    plan_s = time.perf_counter() - start
    del model
    model, args, kwargs = llama(LLAMA_350M, 2, 512, "cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    step = graphopt.train_step(model, args, kwargs, budget_gb=budget_gb, optimizer=optimizer, passes=passes)

    def one_step():
        step(*args, **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    one_step()  # AdamW's state exists from the first step on (on the host: not the device's)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    measured = measure_peak(one_step, model, *args, *kwargs.values(), *state)
    row = {"parameters": params, "least_gb": least / GB, "unplanned_gb": unplanned / GB, "budget_gb": budget_gb,
           "plan_s": plan_s, "host_step": found.host_step is not None,
           "host_gb": found.host_step.host_bytes / GB if found.host_step else None,
           "planned_microbatches": found.microbatches, "real_microbatches": step.microbatches,
           "planned_segments": found.segments, "predicted_gb": found.predicted_peak_bytes / GB,
           "real_train_step_predicted_gb": step.predicted_peak_bytes / GB, "measured_gb": measured / GB,
           "error_pct": 100 * (found.predicted_peak_bytes - measured) / measured}
    print(row, flush=True)
    return row


def markdown(result: dict) -> str:
    lines = [f"# graphopt.plan without the hardware (bench/plan_without_hardware.py)\n",
             f"{result['device']}, torch {result['torch']}, {result['date']}; passes: {result['passes']}\n"]
    if result.get("llama_8b"):
        lines += ["Llama-3-8B shape, bf16 parameters, AdamW, planned for CUDA on the meta device (least: with the "
                  "optimizer's state, step and gradients, and the checkpoints, on the host):\n",
                  "| tokens | budget | least (whole batch) | microbatches | recompute segments | predicted peak | "
                  "recompute, share of a step | optimizer on the host | predicted step time | plan() took |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["llama_8b"]:
            if r["microbatches"] is None:
                chosen = "none fits | - | - | - | - | -"
            else:
                host = "no" if r.get("host_gb") is None else (f"{r['host_gb']:.1f} GB, {r['host_step_s']:.1f} s a step "
                                                              f"({r['host_step_pct']:g}% of the step on the device)")
                chosen = (f"{r['microbatches']} | {r['segments']} | {r['predicted_gb']:.2f} GB | "
                          f"{r['overhead_pct']:g}% | {host} | {r['step_s']:.2f} s")
            lines.append(f"| {r['tokens']} | {r['budget_gb']} GB | {r['least_gb']:.2f} GB | {chosen} | "
                         f"{r['seconds']:.0f} s |")
    if result.get("llama_8b_fsdp"):
        lines += ["", "The same shape at 1 x 2048 tokens, one rank's step under FSDP2 per block (least: with the rank's "
                  "shards on the host where that is lower):\n",
                  "| ranks | budget a rank | least (whole batch) | microbatches | recompute segments | predicted peak | "
                  "recompute, share of a step | shards on the host (CPUOffloadPolicy) | predicted step time | "
                  "plan() took |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["llama_8b_fsdp"]:
            if r["microbatches"] is None:
                chosen = "none fits | - | - | - | - | -"
            else:
                host = f"{r['host_gb']:.1f} GB a rank" if r["host_gb"] else "no"
                chosen = (f"{r['microbatches']} | {r['segments']} | {r['predicted_gb']:.2f} GB | "
                          f"{r['overhead_pct']:g}% | {host} | {r['step_s']:.2f} s")
            lines.append(f"| {r['ranks']} | {r['budget_gb']} GB | {r['least_gb']:.2f} GB | {chosen} | "
                         f"{r['seconds']:.0f} s |")
    for r in result.get("llama_350m") or []:
        lines += ["", f"~350M Llama ({r['parameters'] / 1e6:.0f}M parameters, float32, AdamW, 2 x 512 tokens) on "
                  "this CPU: planned on the meta device, then built for real and measured (device bytes: the host's "
                  "are not counted):\n",
                  "| least | unplanned | budget | optimizer on the host | plan: microbatches, segments | predicted | "
                  "real train_step's prediction | measured | predicted vs measured |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| {r['least_gb']:.3f} GB | {r['unplanned_gb']:.3f} GB | {r['budget_gb']:.3f} GB | "
                  f"{'%.2f GB' % r['host_gb'] if r.get('host_gb') else 'no'} | {r['planned_microbatches']}, "
                  f"{r['planned_segments']} | {r['predicted_gb']:.4f} GB | {r['real_train_step_predicted_gb']:.4f} GB | "
                  f"{r['measured_gb']:.4f} GB | {r['error_pct']:+.2f}% |"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="8b,350m", help="8b, 350m, 8b-fsdp, comma-separated")
    parser.add_argument("--passes", default=None, help="optimize's passes, comma-separated (default: its default)")
    parser.add_argument("--out", default=None, help="write the figures into this folder")
    args = parser.parse_args(argv)
    parts = args.part.split(",")
    result = {"device": device_name(), "date": today(), "torch": torch.__version__, "passes": args.passes or "default",
              "llama_8b": part_8b(args.passes) if "8b" in parts else [],
              "llama_8b_fsdp": part_8b_fsdp(args.passes) if "8b-fsdp" in parts else [],
              "llama_350m": part_350m(args.passes) if "350m" in parts else []}
    text = markdown(result)
    print(text)
    if args.out:
        kind = "plan_without_hardware" + (f"-{args.passes.replace(',', '-')}" if args.passes else "")
        write_results(kind, result, text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
