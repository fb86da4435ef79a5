"""graphopt.passes.causal_masks: a causal mask built from sizes becomes is_causal, checked at sizes it
was not decided for; other masks stay."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from conftest import assert_same_step


class CausalAttention(nn.Module):
    """Attention whose boolean mask is built from the sequence length alone, as exported
    transformers models build theirs: causal, or within a sliding window (causal while the
    sequence is no longer than the window), or made from the input's values or from a buffer."""

    def __init__(self, mask: str = "causal", window: int = 8):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.kind, self.window = mask, window
        self.register_buffer("tril", torch.ones(6, 6, dtype=torch.bool).tril())

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 4).permute(2, 0, 3, 1, 4)
        if self.kind == "buffer":
            mask = self.tril[:s, :s]
        else:
            i = torch.arange(s, device=x.device)
            mask = i[None, :] <= i[:, None]
            if self.kind == "window":
                mask = mask & (i[:, None] - i[None, :] < self.window)
            if self.kind == "values":
                mask = mask & (x[:, None, :, :1] > -10)  # True everywhere here, but read from x
        mask = mask.expand(b, 1, s, s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_causal_mask_made_from_sizes_becomes_is_causal(frontend):
    model, args = CausalAttention(), (torch.randn(2, 6, 16),)
    opt = graphopt.optimize(model, args, passes="normalize,dce", frontend=frontend)
    assert opt.graphopt_report.passes[0].stats["causal_masks"] == 1
    (attention,) = [n for n in opt.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert not [n for n in opt.graph.nodes if "arange" in str(n.target)]  # the mask is no longer built
    assert_same_step(model, opt, args, {}, exact=False)
    other = (torch.randn(3, 6, 16),) if frontend == "export" else (torch.randn(3, 11, 16),)
    assert_same_step(model, opt, other, {}, exact=False)  # other sizes: checked, still causal


def test_a_mask_causal_only_at_the_example_sizes_is_refused_at_others():
    model = CausalAttention("window", window=8)
    opt = graphopt.optimize(model, (torch.randn(2, 6, 16),), passes="normalize", frontend="fx")
    assert opt.graphopt_report.passes[0].stats["causal_masks"] == 1
    assert_same_step(model, opt, (torch.randn(2, 8, 16),), {}, exact=False)  # within the window: causal
    with pytest.raises(graphopt.UsageError, match="they are not causal.*Optimize the model again"):
        opt(torch.randn(2, 9, 16))  # past it the window masks keys causality keeps


@pytest.mark.parametrize("kind", ["values", "buffer"])
def test_a_mask_read_from_values_or_state_stays(kind):
    model, args = CausalAttention(kind), (torch.randn(2, 6, 16),)
    for frontend in ("fx", "export"):
        opt = graphopt.optimize(model, args, passes="normalize", frontend=frontend)
        assert opt.graphopt_report.passes[0].stats["causal_masks"] == 0
        assert_same_step(model, opt, args, {}, exact=True)
