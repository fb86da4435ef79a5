"""graphopt.plan on a model built on the meta device: what the real model's step needs, nothing
allocated; CUDA's allocator rules where planned for CUDA; refusals that say what to do."""
from __future__ import annotations

import os

import pytest
import torch

import graphopt
from graphopt.__main__ import main
from graphopt.analysis.memory import GB, measure_peak
from graphopt.analysis.planning_device import planning_for
from graphopt.analysis.memory import CUDA_HEADROOM
from graphopt.training.microbatch_choice import MicrobatchChoice

transformers = pytest.importorskip("transformers")


def tiny_llama(device: str = "meta", layers: int = 1):
    """(model, args, kwargs): a Llama of one layer (or `layers`) with its own loss on labels=input_ids."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (4, 32)).to(device)
    return model, (ids,), {"labels": ids}


def test_a_meta_model_plans_what_the_real_model_measures():
    meta, args, kwargs = tiny_llama("meta")
    least = graphopt.plan(meta, args, kwargs, device="cpu").least_bytes
    budget_gb = 0.9 * least / GB  # the whole batch does not fit: microbatches
    planned = graphopt.plan(meta, args, kwargs, budget_gb=budget_gb, device="cpu")
    assert planned.fits and planned.microbatches > 1 and planned.predicted_peak_bytes <= budget_gb * GB

    real, rargs, rkwargs = tiny_llama("cpu")
    step = graphopt.train_step(real, rargs, rkwargs, budget_gb=budget_gb)
    assert (step.microbatches, step.predicted_peak_bytes) == (planned.microbatches, planned.predicted_peak_bytes)
    assert measure_peak(lambda: step(*rargs, **rkwargs), real, *rargs, *rkwargs.values()) == planned.predicted_peak_bytes
    with pytest.raises(graphopt.BudgetError) as refused:
        graphopt.train_step(real, rargs, rkwargs, budget_gb=1e-9, microbatches=1)
    assert refused.value.min_budget_bytes == least


@pytest.mark.slow  # 12 s: make test-real, beside the least's test below
def test_a_rank_s_step_under_fsdp_is_estimated_on_the_meta_device_as_on_the_real_model():
    """A meta model's fakes are made on the CPU, each tensor its own (a temporary's id was reused:
    one weight took another's shape)."""
    options = dict(shard="fsdp", world_size=2, optimizer="adamw")
    meta, args, kwargs = tiny_llama("meta", layers=2)
    with planning_for("cpu"):
        planned = graphopt.optimize(meta, args, example_kwargs=kwargs, **options)
    real, rargs, rkwargs = tiny_llama("cpu", layers=2)
    measured = graphopt.optimize(real, rargs, example_kwargs=rkwargs, **options)
    assert planned.graphopt_report.passes[-1].stats == measured.graphopt_report.passes[-1].stats


@pytest.mark.slow  # half a minute: make test-real
def test_a_rank_s_least_under_fsdp_plans_on_the_meta_device_as_on_the_real_model():
    """shard='fsdp', world_size=2: the least of a rank's step, its units sharded over a fake group, is
    the real model's to the byte (a meta model's fakes are made on the CPU, each tensor its own)."""
    options = dict(shard="fsdp", world_size=2, optimizer="adamw")
    meta, args, kwargs = tiny_llama("meta", layers=2)
    planned = graphopt.plan(meta, args, kwargs, device="cpu", **options)
    assert "one rank's step under FSDP2 over 2 ranks needs a budget of at least" in str(planned)
    real, rargs, rkwargs = tiny_llama("cpu", layers=2)
    with pytest.raises(graphopt.BudgetError, match="one rank's training step under FSDP2 over 2 ranks") as refused:
        graphopt.train_step(real, rargs, rkwargs, budget_gb=1e-9, microbatches=1, **options)
    assert refused.value.min_budget_bytes == planned.least_bytes
    # at the least a rank's shards are on the host, and the plan says so
    at_least = graphopt.plan(meta, args, kwargs, budget_gb=planned.least_bytes / GB, device="cpu", **options)
    assert at_least.fits and at_least.rank_host_bytes > 0 and "CPUOffloadPolicy" in str(at_least)


def test_the_optimizer_counts_as_on_the_real_model_and_nothing_is_allocated():
    meta, args, kwargs = tiny_llama("meta")
    real, rargs, rkwargs = tiny_llama("cpu")
    found = [graphopt.plan(m, a, k, budget_gb=1.0, device="cpu", optimizer="adamw")
             for m, a, k in ((meta, args, kwargs), (real, rargs, rkwargs))]
    assert found[0] == found[1] and found[0].microbatches == 1
    without = graphopt.plan(meta, args, kwargs, budget_gb=1.0, device="cpu")
    params = sum(p.numel() * p.element_size() for p in meta.parameters())
    assert found[0].predicted_peak_bytes >= without.predicted_peak_bytes + 2 * params  # AdamW's two moments
    assert all(p.is_meta and p.grad is None for p in meta.parameters())


def small_convnet(device: str):
    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                    torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
                                    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))
    return model, (torch.randn(8, 3, 32, 32).to(device),)


def test_a_vision_model_with_its_loss_outside_plans_as_the_real_one():
    labels = torch.randint(0, 10, (8,))  # on the CPU: the loss closes over them

    def loss(out, *args, **kwargs):
        return torch.nn.functional.cross_entropy(out, labels)

    meta, args = small_convnet("meta")
    least = graphopt.plan(meta, args, device="cpu", loss_fn=loss).least_bytes
    real, rargs = small_convnet("cpu")
    with pytest.raises(graphopt.BudgetError) as refused:
        graphopt.train_step(real, rargs, budget_gb=1e-9, microbatches=1, loss_fn=loss)
    assert refused.value.min_budget_bytes == least
    with pytest.raises(graphopt.UsageError, match="built on the CPU"):  # labels on the meta device
        graphopt.plan(meta, args, device="cpu", loss_fn=lambda out, *a, **k: torch.nn.functional.cross_entropy(
            out, labels.to("meta")))


@pytest.mark.slow  # 44 s of four plans; make test keeps the headroom's path in the train_step test below
def test_cuda_rounds_blocks_and_keeps_its_headroom(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:1")  # no workspaces: a tiny model's step would be mostly theirs
    meta, args, kwargs = tiny_llama("meta")
    cpu = graphopt.plan(meta, args, kwargs, device="cpu")
    cuda = graphopt.plan(meta, args, kwargs, device="cuda")
    assert cuda.least_bytes > cpu.least_bytes  # 512-byte blocks, and the headroom on top
    unplanned = graphopt.plan(meta, args, kwargs, budget_gb=1.0, device="cuda").predicted_peak_bytes
    # the step as it is fits the budget but not the budget less CUDA's headroom: it must be planned
    budget_gb = unplanned / (1 - CUDA_HEADROOM / 2) / GB
    planned = graphopt.plan(meta, args, kwargs, budget_gb=budget_gb, device="cuda")
    # planned below the step as it is (segments, microbatches, or a chunked head and loss)
    assert planned.fits and planned.predicted_peak_bytes <= budget_gb * GB * (1 - CUDA_HEADROOM) < unplanned


def test_the_answer_says_the_headroom(recwarn):
    meta, args, kwargs = tiny_llama("meta")
    roomy = graphopt.plan(meta, args, kwargs, budget_gb=80, device="cuda")
    assert not [w for w in recwarn if issubclass(w.category, graphopt.BudgetWarning)]  # the README's 80 GB
    text = str(roomy)
    assert roomy.headroom == CUDA_HEADROOM and "the 5% of the budget kept free" in text
    assert "nothing recomputed" in text and "within the budget less the 5% kept free" in text
    assert "kept free" not in str(graphopt.plan(meta, args, kwargs, device="cpu"))


@pytest.mark.slow  # 20 s, every microbatch count refused twice (on the device, then with the host): make test-real
def test_the_answer_says_why_a_budget_does_not_fit():
    meta, args, kwargs = tiny_llama("meta")
    least = graphopt.plan(meta, args, kwargs, device="cuda").least_bytes
    tight = graphopt.plan(meta, args, kwargs, budget_gb=0.5 * least / GB, device="cuda")
    assert not tight.fits
    # the refusal's own words: the least with its parts, and the ways down
    assert "does not fit in any number of equal microbatches: budget_gb=" in str(tight)
    assert "parameters" in tight.refusal and "precision='bf16'" in tight.refusal


def test_train_step_holds_a_cuda_plan_to_the_budget_less_its_headroom():
    """train_step's fit check asks the headroom of the device the plan is for, as recompute does
    (analysis/memory.headroom): the same bytes the recompute row's BudgetFit was held to."""
    meta, args, kwargs = tiny_llama("meta")
    with planning_for("cuda"):
        graph = graphopt.optimize(meta, args, example_kwargs=kwargs, budget_gb=1.0)
        assert MicrobatchChoice._target(graph, 10**6) == round(10**6 * (1 - CUDA_HEADROOM))
        assert MicrobatchChoice._target(graph, 10**9) == graph.graphopt_report.recompute().budget.planned_for_bytes


@pytest.mark.parametrize("options, words", [
    ({"device": "tpu"}, "one of cpu, cuda"),
    ({"device": "cpu", "calibrate": True}, "calibrate=True needs real steps"),
])
def test_plan_refuses_what_it_cannot_do_without_the_device(options, words):
    meta, args, kwargs = tiny_llama("meta")
    with pytest.raises(graphopt.OptionError, match=words):
        graphopt.plan(meta, args, kwargs, budget_gb=1.0, **options)


def test_a_model_on_another_device_than_planned_is_refused():
    real, args, kwargs = tiny_llama("cpu")
    with pytest.raises(graphopt.OptionError, match="torch.device\\('meta'\\)"):
        graphopt.plan(real, args, kwargs, device="cuda")


def test_the_command_line_plans_a_factory_on_the_meta_device(capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    assert main(["plan", "test_plan:tiny_llama", "--device", "cpu", "--budget-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "device cpu: one step needs a budget of at least" in out and "fits as the whole batch" in out
