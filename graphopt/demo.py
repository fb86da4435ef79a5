"""`make demo`: what graphopt does to one training step, in measured numbers and a picture.

A Llama-shaped causal LM (transformers' LlamaForCausalLM when transformers is installed, else
graphopt's own GPT), sized so that activations outweigh parameters, is stepped eagerly, then
through optimize() at a budget of about half its activations, alone and with the passes that
apply on its device. Every line is measured in the same run.
"""
from __future__ import annotations

import sys
import time

import torch

from .analysis.memory import GB, size_text
from .before_after import BeforeAfter, measure
from .runtime.step import step_peak

BATCH, TOKENS, WIDTH, LAYERS = 4, 256, 256, 4


def demo_model(device: str = "cpu") -> tuple[torch.nn.Module, tuple, dict, str]:
    """(model, args, kwargs, description): the model computes its own loss from labels."""
    torch.manual_seed(0)
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        config = transformers.LlamaConfig(vocab_size=2048, hidden_size=WIDTH, intermediate_size=4 * WIDTH,
                                          num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                                          max_position_embeddings=TOKENS, use_cache=False)
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (BATCH, TOKENS))
        kind = "transformers LlamaForCausalLM"
    else:
        from .testing import zoo

        model, (ids,), _ = zoo.gpt(batch=BATCH, seq=TOKENS, layers=LAYERS, dim=WIDTH, heads=8)
        kind = "graphopt's GPT (transformers is not installed)"
    model.train().to(device)
    ids = ids.to(device)
    params = sum(p.numel() for p in model.parameters())
    text = (f"{kind}: {LAYERS} layers, {WIDTH} wide, {params / 1e6:.1f} M parameters; "
            f"batch {BATCH} x {TOKENS} tokens")
    return model, (ids,), {"labels": ids}, text


def demo_configs(budget_gb: float, device: str) -> dict[str, dict]:
    """The budget alone, then with each pass that applies on the device (fuse's kernels pay on
    CUDA only), then in bf16."""
    configs = {"graphopt: budget": {"budget_gb": budget_gb},
               "budget + inplace": {"passes": "normalize,cse,dce,inplace", "budget_gb": budget_gb}}
    if device == "cuda":
        configs["budget + fuse"] = {"passes": "normalize,cse,dce,fuse", "budget_gb": budget_gb}
    configs["budget + bf16"] = {"budget_gb": budget_gb, "precision": "bf16"}
    return configs


def run_demo(dump_dir: str, share: float = 0.5, device: str = "cpu", progress=None) -> tuple[BeforeAfter, int]:
    """The demo's measurements, written to dump_dir; (result, exit status): 1 when a measured
    peak exceeds the budget."""
    started = time.perf_counter()

    def say(text):
        (progress or (lambda t: print(f"  [{time.perf_counter() - started:5.1f} s] {t}", file=sys.stderr,
                                     flush=True)))(text)

    model, args, kwargs, text = demo_model(device)
    print(f"graphopt demo: {text}, training step on {device}")
    say("measuring the eager step")
    eager = step_peak(model, model, args, kwargs)
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # parameters and their gradients
    budget = fixed + share * (eager - fixed)
    say(f"eager peak {size_text(eager)}; budget = parameters + gradients + {share:.0%} of the rest "
        f"= {size_text(int(budget))}")
    result = measure(model, args, kwargs, demo_configs(budget / GB, device), budget_bytes=int(budget),
                     name=text, progress=say, dump_dir=dump_dir)
    result.write(dump_dir)
    say("done")
    return result, 1 if result.over_budget() else 0
