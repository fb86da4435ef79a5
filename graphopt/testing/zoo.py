"""Models that tests, benchmarks and the demo share, with their example inputs.

Every builder returns (model, args, kwargs). Weights are random and nothing is downloaded;
the transformers models are built from small configs when that package is installed.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, width=64, depth=3, classes=10, dropout=0.1):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(), nn.Dropout(dropout)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)) + x)


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


class ConvNet(nn.Module):
    def __init__(self, channels=16, blocks=2, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*[ResidualBlock(channels) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


@dataclasses.dataclass
class GPTOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class Block(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + F.dropout(self.proj(y), p, self.training)
        h = F.gelu(self.fc(self.ln2(x)), approximate="tanh")
        return x + F.dropout(self.out(h), p, self.training)


class GPT(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm blocks, tied LM head."""

    def __init__(self, vocab=256, dim=64, heads=4, layers=2, context=64, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(dim, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        # GPT-2's initialisation: small embeddings (the LM head shares them) and residual
        # projections scaled by depth, so logits start near uniform.
        for name, p in self.named_parameters():
            if name.endswith("out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif name in ("tok.weight", "pos.weight"):
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return GPTOutput(logits, loss)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """Pre-norm attention and a SwiGLU MLP of its own width (no biases, no dropout)."""

    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A Llama-style decoder: RMSNorm, SwiGLU blocks (one width each: uneven models for the
    pipeline partitioner), an untied LM head, mean cross-entropy when targets are given."""

    def __init__(self, vocab=256, dim=64, heads=4, hidden=(128, 128), tied=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([LlamaBlock(dim, heads, h) for h in hidden])
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx, targets=None):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class TwoHeads(nn.Module):
    """Keyword inputs and structured outputs: returns a tuple, a dict or a dataclass."""

    def __init__(self, dim=16, returns="dict"):
        super().__init__()
        self.returns = returns
        self.enc = nn.Linear(dim, dim)
        self.a = nn.Linear(dim, 4)
        self.b = nn.Linear(dim, 2)

    def forward(self, x, *, mask=None, scale=1.0):
        h = torch.tanh(self.enc(x)) * scale
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        a, b = self.a(h), self.b(h)
        if self.returns == "tuple":
            return a, b
        if self.returns == "dict":
            return {"a": a, "b": b, "h": h}
        return GPTOutput(logits=a, loss=b.square().mean())


def block_segments(gm: "torch.fx.GraphModule") -> list[list["torch.fx.Node"]]:
    """The nodes of each Block of a fx-traced GPT, in order: checkpointing every block by hand,
    the baseline the recompute pass is measured against."""
    nodes = list(gm.graph.nodes)
    names = [n.name for n in nodes]
    starts = [i for i, name in enumerate(names) if name.startswith("blocks_") and name.endswith("_ln1")]
    return [nodes[a:b] for a, b in zip(starts, starts[1:] + [names.index("ln")])]


def block_starts(gm: "torch.fx.GraphModule") -> list[int]:
    """Position of the first node of each `blocks.K` submodule in gm's graph (fx or export):
    where an equal-layer pipeline split may cut."""
    starts = {}
    for i, node in enumerate(gm.graph.nodes):
        for path, _ in node.meta.get("nn_module_stack", {}).values():
            parts = path.split(".")
            if len(parts) >= 2 and parts[-2] == "blocks" and parts[-1].isdigit():
                starts.setdefault(int(parts[-1]), i)
    return [starts[k] for k in sorted(starts)]


def mlp(batch=32, width=64, depth=3):
    return MLP(width, depth), (torch.randn(batch, width),), {}


def convnet(batch=4, channels=16, size=16, blocks=2):
    return ConvNet(channels, blocks), (torch.randn(batch, 3, size, size),), {}


def gpt(batch=4, seq=32, layers=2, dim=64, heads=4, vocab=256, targets=True):
    model = GPT(vocab=vocab, dim=dim, heads=heads, layers=layers, context=max(64, seq))
    idx = torch.randint(0, vocab, (batch, seq))
    kwargs = {"targets": torch.randint(0, vocab, (batch, seq))} if targets else {}
    return model, (idx,), kwargs


def llama(batch=4, seq=32, dim=64, heads=4, hidden=(128, 128), vocab=256, tied=False, targets=True):
    model = Llama(vocab=vocab, dim=dim, heads=heads, hidden=hidden, tied=tied)
    idx = torch.randint(0, vocab, (batch, seq))
    kwargs = {"targets": torch.randint(0, vocab, (batch, seq))} if targets else {}
    return model, (idx,), kwargs


def two_heads(returns="dict", batch=8, dim=16):
    x = torch.randn(batch, dim)
    return TwoHeads(dim, returns), (x,), {"mask": x > 1.5, "scale": 0.5}


def hf_gpt2(batch=2, seq=16, layers=2):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_head=2, n_embd=32, vocab_size=128, n_positions=64,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 128, (batch, seq))
    return GPT2LMHeadModel(cfg), (ids,), {"labels": ids}


def hf_bert(batch=2, seq=16, layers=2):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                     vocab_size=128, max_position_embeddings=64)
    ids = torch.randint(0, 128, (batch, seq))
    return BertModel(cfg), (ids,), {"attention_mask": torch.ones(batch, seq, dtype=torch.long)}


# name -> builder, for the tests, the benchmarks and `python -m graphopt optimize graphopt.testing.zoo:NAME`
ZOO = {"mlp": mlp, "convnet": convnet, "gpt": gpt, "llama": llama, "two_heads": two_heads}
HF_ZOO = {"hf_gpt2": hf_gpt2, "hf_bert": hf_bert}
