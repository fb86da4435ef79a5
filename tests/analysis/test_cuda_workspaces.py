"""cuBLAS's workspaces in a CUDA step's estimate: sized as torch sizes them, one per thread that multiplies."""
from __future__ import annotations

import torch

import graphopt
from graphopt.analysis.cuda_workspaces import HOPPER, OTHERS, workspace_bytes
from graphopt.analysis.memory import CUDA_HEADROOM


def test_the_workspace_is_sized_as_torch_reads_its_setting():
    cuda = torch.device("cuda")
    assert workspace_bytes(cuda, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == HOPPER == 32 * 2**20
    assert workspace_bytes(cuda, {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == OTHERS
    assert workspace_bytes(cuda, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 16 * 1024 * 8  # deterministic mode's
    if not torch.cuda.is_available():
        assert workspace_bytes(cuda, {}) == HOPPER  # a plan for a device this process cannot see: the larger


def _least(model, x, device, workspaces: str | None, monkeypatch) -> int:
    if workspaces is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", workspaces)
    plan = graphopt.plan(model, (x,), device=device, loss_fn=lambda out, x: out.float().pow(2).mean())
    return plan.least_bytes


def test_a_cuda_training_step_that_multiplies_holds_two_workspaces_and_one_that_does_not_none(monkeypatch):
    with torch.device("meta"):
        mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    x, image = torch.empty(16, 64, device="meta"), torch.empty(2, 3, 8, 8, device="meta")
    with_them = _least(mlp, x, "cuda", ":1024:1", monkeypatch)
    # forward's and backward's, within the budget less recompute's CUDA headroom
    assert abs(with_them - _least(mlp, x, "cuda", ":0:1", monkeypatch) - 2 * 1024 * 1024 / (1 - CUDA_HEADROOM)) <= 1
    assert _least(conv, image, "cuda", ":1024:1", monkeypatch) == _least(conv, image, "cuda", ":0:1", monkeypatch)
    assert _least(mlp, x, "cpu", ":1024:1", monkeypatch) == _least(mlp, x, "cpu", ":0:1", monkeypatch)
