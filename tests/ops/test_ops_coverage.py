"""Coverage: every op in real model graphs resolves in the registry (and binds).

Exported HF models (aten level) and fx-traced local models (torch/F/method/module level). Models have
random weights; nothing is downloaded.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops import bind, lookup

transformers = pytest.importorskip("transformers")
CALLS = ("call_function", "call_method", "call_module")


def unresolved(gm, kinds=CALLS):
    return sorted({str(n.target) for n in gm.graph.nodes if n.op in kinds and lookup(n, gm) is None})


def unbound(gm, kinds=CALLS):
    """Nodes whose arguments bind cannot match (higher-order ops are opaque by design)."""
    return sorted({str(n.target) for n in gm.graph.nodes if n.op in kinds and lookup(n, gm) is not None
                   and not lookup(n, gm).name.startswith("wrap_with") and bind(n, gm) is None})


def hf_models():
    t = transformers
    yield "gpt2", t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                                                 use_cache=False))
    yield "bert", t.BertModel(t.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                           intermediate_size=64, vocab_size=100, max_position_embeddings=32))
    yield "llama", t.LlamaForCausalLM(t.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                    num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                                    max_position_embeddings=32, use_cache=False))


@pytest.mark.parametrize("name,model", list(hf_models()), ids=lambda v: v if isinstance(v, str) else "")
def test_exported_hf_model_resolves(name, model):
    gm = torch.export.export(model, (torch.randint(0, 100, (2, 8)),), strict=False).module()
    assert unresolved(gm, ("call_function",)) == [], f"{name}: ops missing from the registry"
    assert unbound(gm, ("call_function",)) == [], f"{name}: ops bind cannot match"


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1),
                                 nn.LayerNorm(32), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu, self.pool, self.head = nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Linear(8, 10)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(x + self.bn2(self.conv2(x)))
        return self.head(torch.flatten(self.pool(x), 1))


class GPTBlock(nn.Module):
    def __init__(self, vocab=100, d=32, heads=2):
        super().__init__()
        self.d, self.heads = d, heads
        self.emb, self.ln1, self.ln2 = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def heads_first(self, t):
        return t.view(t.size(0), t.size(1), self.heads, -1).transpose(1, 2)

    def forward(self, idx):
        x = self.emb(idx)
        parts = self.qkv(self.ln1(x)).split(self.d, dim=-1)
        q, k, v = (self.heads_first(parts[i]) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(y.size(0), y.size(2), -1)
        x = x + F.dropout(self.proj(y), 0.1, self.training)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


@pytest.mark.parametrize("model", [MLP(), CNN(), GPTBlock()], ids=["mlp", "cnn", "gpt_block"])
def test_traced_model_resolves(model):
    gm = torch.fx.symbolic_trace(model)
    assert {n.op for n in gm.graph.nodes} >= {"call_module"}
    assert unresolved(gm) == []
    assert unbound(gm) == []


def test_traced_gpt_block_ops():
    gm = torch.fx.symbolic_trace(GPTBlock())
    names = {lookup(n, gm).name for n in gm.graph.nodes if n.op in CALLS}
    assert names == {"embedding", "layer_norm", "linear", "split", "tuple_getitem", "size", "view", "transpose",
                     "scaled_dot_product_attention", "contiguous", "dropout", "add", "gelu_tanh"}
