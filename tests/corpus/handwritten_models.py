"""Models written by hand the way their users write them, in plain PyTorch.

A decoder written torchtitan's way: rotary embeddings as complex numbers (view_as_complex,
view_as_real), key/value heads repeated by repeat_interleave, scaled_dot_product_attention with
is_causal, RMSNorm, SwiGLU, the loss taken by F.cross_entropy. Its full activation checkpointing
is torchtitan's: torch.utils.checkpoint around each block (set_grad_checkpointing, as timm names
the switch, is what the memory promise compares graphopt's plans with).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .case import Case, Labels, Tokens

LIBRARY = "handwritten"
BATCH, SEQ, VOCAB = 2, 32, 256


def rotary_frequencies(head_dim: int, length: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, _, d = xq.shape
    q = torch.view_as_complex(xq.float().reshape(b, s, -1, d // 2, 2))
    k = torch.view_as_complex(xk.float().reshape(b, s, -1, d // 2, 2))
    freqs = freqs.view(1, s, 1, d // 2)
    return torch.view_as_real(q * freqs).flatten(3).type_as(xq), torch.view_as_real(k * freqs).flatten(3).type_as(xk)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = rotate(q, k, freqs)
        repeats = self.heads // self.kv_heads
        k, v = torch.repeat_interleave(k, dim=2, repeats=repeats), torch.repeat_interleave(v, dim=2, repeats=repeats)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attention, self.feed_forward = Attention(dim, heads, kv_heads), FeedForward(dim, 4 * dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 max_seq: int = 128):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", rotary_frequencies(dim // heads, max_seq), persistent=False)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.checkpointing = enable

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers:
            h = checkpoint(layer, h, freqs, use_reentrant=False) if self.checkpointing else layer(h, freqs)
        logits = self.output(self.norm(h)).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def titan_decoder():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return Case(Decoder(), (ids,), {"labels": Labels(VOCAB).draw(ids)},
                kinds={0: Tokens(VOCAB), "labels": Labels(VOCAB)})


BUILDERS = {"hand_titan_decoder": titan_decoder}
