"""graphopt's FakeTensorMode (fake_kernels.Fakes) lays out and holds outputs as the real kernels do on
CPU, where torch's own fakes do otherwise: each rule of its table against the real kernel, on
inputs laid out several ways; then a model whose estimate missed by 11% for it (PatchTST's batch
norm over transposed patches, its MSE loss)."""
import pytest
import torch

from graphopt.analysis import fake_kernels
from graphopt.analysis.estimate_check import check_estimate
from graphopt.frontend.graph_inputs import placeholder_values

aten = torch.ops.aten
LAYOUTS = {  # an input laid out otherwise than contiguous: transposed (3-d), permuted or channels-last (4-d)
    "transposed": lambda: torch.randn(8, 4, 16).transpose(1, 2),
    "permuted": lambda: torch.randn(8, 16, 4, 4).permute(0, 2, 1, 3),
    "channels_last": lambda: torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),
    "contiguous": lambda: torch.randn(4, 6, 5),
}


def _batch_norms(x, make):
    c = x.shape[1]
    w, b, rm, rv = (make(torch.randn(c)), make(torch.randn(c)), make(torch.zeros(c)), make(torch.ones(c)))
    out = aten.native_batch_norm.default(x, w, b, rm, rv, True, 0.1, 1e-5)
    g = make(torch.ones(out[0].shape))
    return {
        "native_batch_norm": out[0],
        "legit": aten._native_batch_norm_legit.default(x, w, b, rm, rv, True, 0.1, 1e-5)[0],
        "no_stats": aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)[0],
        "functional": aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)[0],
        "no_training": aten._native_batch_norm_legit_no_training.default(x, w, b, rm, rv, 0.1, 1e-5)[0],
        "backward": aten.native_batch_norm_backward.default(g, x, w, rm, rv, out[1], out[2], True, 1e-5,
                                                           [True, True, True])[0],
    }


def _losses(x, make):
    t, p = make(torch.randn(x.shape)), make(torch.rand(x.shape))
    probs = torch.sigmoid(x)
    one, ones = make(torch.tensor(1.0)), make(torch.ones(x.shape))
    found = {}
    for r in (0, 1, 2):
        found |= {f"mse_loss_{r}": aten.mse_loss.default(x, t, r), f"smooth_l1_{r}": aten.smooth_l1_loss.default(x, t, r, 1.0),
                  f"soft_margin_{r}": aten.soft_margin_loss.default(x, t, r),
                  f"bce_{r}": aten.binary_cross_entropy.default(probs, p, None, r)}
    return found | {
        "mse_loss_backward": aten.mse_loss_backward.default(one, x, t, 1),
        "smooth_l1_backward": aten.smooth_l1_loss_backward.default(one, x, t, 1, 1.0),
        "huber_backward": aten.huber_loss_backward.default(one, x, t, 1, 1.0),
        "log_sigmoid_forward": aten.log_sigmoid_forward.default(x)[0],
        "bce_backward": aten.binary_cross_entropy_backward.default(ones, probs, p, None, 0),
    }


def _facts(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.untyped_storage().nbytes()


@pytest.mark.parametrize("outputs", [_batch_norms, _losses], ids=["batch_norm", "losses"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fakes_lay_out_and_hold_outputs_as_the_real_kernels_do(outputs, layout):
    x = LAYOUTS[layout]()
    real = {k: _facts(v) for k, v in outputs(x, lambda t: t).items()}
    with fake_kernels.Fakes() as mode:
        fake = {k: _facts(v) for k, v in outputs(mode.from_tensor(x), mode.from_tensor).items()}
    assert fake == real


def test_a_batch_norm_over_transposed_patches_is_estimated_storage_for_storage():
    """PatchTST's step: the estimate missed 11% (a copy before a matmul, an MSE loss's buffer)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.PatchTSTConfig(num_input_channels=4, context_length=64, prediction_length=16, patch_length=8,
                                         patch_stride=8, d_model=64, num_hidden_layers=2, num_attention_heads=4,
                                         ffn_dim=128, dropout=0.0, attention_dropout=0.0, positional_dropout=0.0,
                                         path_dropout=0.0, ff_dropout=0.0, head_dropout=0.0)
    import graphopt
    model = transformers.PatchTSTForPrediction(config).train()
    args, kwargs = (torch.randn(8, 64, 4),), {"future_values": torch.randn(8, 16, 4)}
    gm = graphopt.optimize(model, args, example_kwargs=kwargs, passes="normalize,cse,dce")
    checked = check_estimate(gm, placeholder_values(gm, args, kwargs), (args, kwargs))
    assert checked.divergence is None and checked.predicted_bytes == checked.measured_bytes
