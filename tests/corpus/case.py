"""One corpus model with its example inputs and the loss its users train it with, and how to
draw another batch of the same signature (`Case.second`): the example is not the data."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class Tokens:
    """Token ids in [0, vocab)."""

    vocab: int

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        return torch.randint(0, self.vocab, like.shape)


@dataclass(frozen=True)
class Labels:
    """Targets of a language-model loss: token ids, drawn apart from the inputs, with
    IGNORE_INDEX (-100, what transformers' collators put on padding and prompts) at random
    positions."""

    vocab: int
    ignored: float = 0.25

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        labels = torch.randint(0, self.vocab, like.shape)
        return labels.masked_fill(torch.rand(like.shape) < self.ignored, IGNORE_INDEX)


@dataclass(frozen=True)
class Classes:
    """Class indices in [0, n)."""

    n: int

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        return torch.randint(0, self.n, like.shape)


@dataclass(frozen=True)
class PaddingMask:
    """A tokenizer's attention_mask for padded rows: the first row padded on the left, the others
    on the right, each by a random count that leaves at least a quarter of its tokens."""

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        rows, length = like.shape
        mask = torch.ones(rows, length, dtype=like.dtype)
        for row in range(rows):
            pad = int(torch.randint(1, max(2, length * 3 // 4), ()))
            if row == 0:
                mask[row, :pad] = 0
            else:
                mask[row, length - pad:] = 0
        return mask


@dataclass(frozen=True)
class Normal:
    """Images, noise: standard normal values."""

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, dtype=like.dtype)


@dataclass(frozen=True)
class Uniform:
    """Values drawn uniformly in [0, high): a diffusion model's timesteps."""

    high: float

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        return torch.rand(like.shape, dtype=like.dtype) * self.high


IGNORE_INDEX = -100
SECOND_SEEDS = (1, 2, 3)  # the second batch every check draws, and the next where float32 cannot decide


@dataclass
class Case:
    model: torch.nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    # output -> scalar loss; the model's own (HF `.loss` with labels) or cross-entropy on targets
    loss: Callable = None
    # what each tensor input is, by position (args) or name (kwargs): how a second batch draws it
    kinds: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.loss is None:
            self.loss = own_loss

    def second(self, seed: int = SECOND_SEEDS[0]) -> "Case":
        """Another batch of the same shapes and dtypes, drawn independently of the example: other
        token ids, labels apart from the inputs with -100 at random positions, padded attention
        masks, other images and targets."""
        torch.manual_seed(seed)
        args = tuple(self._draw(i, a) for i, a in enumerate(self.args))
        kwargs = {k: self._draw(k, v) for k, v in self.kwargs.items()}
        loss = self.loss.drawn() if hasattr(self.loss, "drawn") else self.loss
        return Case(self.model, args, kwargs, loss, self.kinds)

    def _draw(self, key, value):
        if not isinstance(value, torch.Tensor):
            return value
        if key not in self.kinds:
            raise KeyError(f"corpus case of {type(self.model).__name__}: no kind for input {key!r} to draw it by")
        return self.kinds[key].draw(value)

    def repeated(self, k: int) -> "Case":
        """The same model on k copies of the batch (targets too): activations k times larger."""
        def grow(t):
            return t.repeat(k, *[1] * (t.dim() - 1)) if t.dim() else t
        args, kwargs = pytree.tree_map_only(torch.Tensor, grow, (self.args, self.kwargs))
        loss = self.loss.repeated(k) if hasattr(self.loss, "repeated") else self.loss
        return Case(self.model, args, kwargs, loss, self.kinds)

    def with_rows(self, n: int) -> "Case":
        """The same model on a batch of n rows: the batch repeated as needed, then its first n."""
        rows = min(t.shape[0] for t in pytree.tree_leaves((self.args, self.kwargs))
                   if isinstance(t, torch.Tensor) and t.dim())
        grown = self.repeated(-(-n // rows))

        def first(t):
            return t[:n] if t.dim() and t.shape[0] == rows * -(-n // rows) else t
        args, kwargs = pytree.tree_map_only(torch.Tensor, first, (grown.args, grown.kwargs))
        loss = grown.loss.first(n) if hasattr(grown.loss, "first") else grown.loss
        return Case(self.model, args, kwargs, loss, self.kinds)

    def _sequences(self) -> list[torch.Tensor]:
        """The tensor inputs of two or more dimensions: token ids, masks, labels, audio, images."""
        return [t for t in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(t, torch.Tensor) and t.dim() >= 2]

    def length(self) -> int:
        """The example's sequence length: the longest dim 1 of its token inputs (integer tensors
        of two or more dimensions), else the last dim of its float inputs (an audio's samples,
        an image's width)."""
        tokens = [t.shape[1] for t in self._sequences() if not t.is_floating_point()]
        return max(tokens or [t.shape[-1] for t in self._sequences()])

    def with_length(self, n: int) -> "Case":
        """The same model on a batch of sequence length n (Case.length), every input drawn again as
        the second batch draws it: where the length is the tokens', their dims of that size past
        dim 0 become n; else the float inputs' last dim (an image's last two) of that size."""
        old = self.length()
        tokens = any(not t.is_floating_point() and t.shape[1] == old for t in self._sequences())

        def resize(t):
            if t.dim() < 2 or t.is_floating_point() == tokens:
                return t
            first = 1 if tokens else t.dim() - (2 if t.dim() == 4 else 1)
            shape = [n if size == old and d >= first else size for d, size in enumerate(t.shape)]
            return torch.zeros(shape, dtype=t.dtype)
        args, kwargs = pytree.tree_map_only(torch.Tensor, resize, (self.args, self.kwargs))
        return Case(self.model, args, kwargs, self.loss, self.kinds).second()


def own_loss(out) -> torch.Tensor:
    """The loss a model with labels computes itself (transformers' ModelOutput.loss), or the scalar
    a training module returns."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    return out["loss"] if isinstance(out, dict) else out.loss


@dataclass
class cross_entropy:  # noqa: N801 (used as a function: the loss of a Case)
    """Cross-entropy of a classifier's logits against fixed targets."""

    targets: torch.Tensor
    classes: int

    def __call__(self, out) -> torch.Tensor:
        logits = out if isinstance(out, torch.Tensor) else out[0]
        return F.cross_entropy(logits.float(), self.targets)

    def repeated(self, k: int) -> "cross_entropy":
        return cross_entropy(self.targets.repeat(k), self.classes)

    def first(self, n: int) -> "cross_entropy":
        return cross_entropy(self.targets[:n], self.classes)

    def drawn(self) -> "cross_entropy":
        return cross_entropy(Classes(self.classes).draw(self.targets), self.classes)


def images(batch: int = 2, size: int = 64, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))


def image_case(model: torch.nn.Module, batch: int = 2, size: int = 64, classes: int = 10) -> Case:
    x, y = images(batch, size, classes)
    return Case(model, (x,), {}, cross_entropy(y, classes), {0: Normal()})
