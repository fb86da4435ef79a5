"""Row kernels (codegen/row_group.py, row_kernel.py) against eager PyTorch in float64, forward and
backward, in Triton's interpreter: the norms and softmaxes as graphopt writes them, random shapes
(rows of 1 column, non-powers of two, 3-d leading dims), per-row inputs and outputs, ties of a max."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from graphopt.codegen import Step, Unsupported
from graphopt.codegen import row_group as G
from graphopt.codegen.row_kernel import LOOP_BLOCK, MAX_PERSISTENT, source
from graphopt.codegen.row_launch import layout, row_call
from graphopt.codegen.row_program import forward_program
from hypothesis_profiles import examples

# Relative to the largest element, float32 kernels against float64 eager; where float32 eager
# itself is further than that (a norm over one column: its gradient is all cancellation), no
# further than ten times eager's own distance, as the corpus checks.
TOLERANCE = 1e-5


def _eager(name, columns):
    eps = 1e-5
    return {
        "rms_norm": (G.rms_norm(columns, eps), lambda x, w: F.rms_norm(x, (columns,), w, eps), 2),
        "rms_norm_plain": (G.rms_norm(columns, eps, weight=False), lambda x: F.rms_norm(x, (columns,), None, eps), 1),
        "layer_norm": (G.layer_norm(columns, eps), lambda x, w, b: F.layer_norm(x, (columns,), w, b, eps), 3),
        "layer_norm_plain": (G.layer_norm(columns, eps, affine=False), lambda x: F.layer_norm(x, (columns,), eps=eps), 1),
        "softmax": (G.softmax(), lambda x: F.softmax(x, -1), 1),
        "log_softmax": (G.log_softmax(), lambda x: F.log_softmax(x, -1), 1),
    }[name]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.detach().abs().max().clamp_min(1e-30)
    return float((got.detach().double() - want.detach()).abs().max() / scale)


def _within(got, eager32, want) -> bool:
    return _relative(got, want) <= max(TOLERANCE, 10 * _relative(eager32, want))


def _check(name: str, shape: tuple, seed: int = 0, block: int | None = None) -> None:
    group, eager, n = _eager(name, shape[-1])
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(shape, generator=generator)] + [torch.randn(shape[-1], generator=generator) for _ in range(n - 1)]
    inputs = [t.requires_grad_() for t in inputs]
    wide = [t.detach().double().requires_grad_() for t in inputs]
    got, want, plain = row_call(group, *inputs, block=block), eager(*wide), eager(*inputs)
    assert _within(got, plain, want)
    g = torch.randn(shape, generator=generator)
    pairs = zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(plain, inputs, g),
                torch.autograd.grad(want, wide, g.double()))
    for a, p, b in pairs:
        assert a.shape == b.shape and _within(a, p, b), name


NAMES = ["rms_norm", "rms_norm_plain", "layer_norm", "layer_norm_plain", "softmax", "log_softmax"]


@pytest.mark.parametrize("shape", [(4, 64), (3, 37), (2, 3, 100), (5, 1), (2, 1500)], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_norms_and_softmaxes_equal_eager(name, shape):
    _check(name, shape)


@pytest.mark.parametrize("shape, block", [((3, 37), 16), ((2, 100), 32), ((2, 1500), 256), ((2, 64), 16)], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_the_looped_form_equals_eager(name, shape, block):
    """Rows wider than a block, in chunks: passes for the statistics, a last one for the stores."""
    assert layout(shape[-1], block)[0]
    _check(name, shape, block=block)


@settings(max_examples=examples(30), deadline=None)
@given(name=st.sampled_from(NAMES), rows=st.integers(1, 6), columns=st.integers(1, 300), seed=st.integers(0, 99),
       block=st.sampled_from([None, 16, 64]))
def test_random_shapes(name, rows, columns, seed, block):
    _check(name, (rows, columns), seed, block)


def test_a_row_wider_than_one_block_is_looped_and_a_narrow_one_is_not():
    assert layout(MAX_PERSISTENT) == (False, MAX_PERSISTENT)
    assert layout(MAX_PERSISTENT + 1) == (True, LOOP_BLOCK)
    assert layout(37) == (False, 64)
    text = source(G.softmax(), forward_program(G.softmax()), "row_forward", looped=True)
    assert text.count("for start in range(0, C, BLOCK):") == 3  # max, then sum, then the stores


@pytest.mark.parametrize("block", [None, 4])
def test_per_row_inputs_and_outputs(block):
    """A ROW input (a per-row scale) and ROW outputs (the statistics), each with its gradient."""
    b = G.Builder([("x", G.FULL), ("scale", G.ROW)])
    mean = b("mul", b("row_sum", ("input", 0)), 0.125)
    y = b("mul", b("sub", ("input", 0), mean), ("input", 1))
    peak = b("row_max", y)
    group = b.group(y, mean, peak)
    x, s = torch.randn(3, 8, requires_grad=True), torch.randn(3, 1, requires_grad=True)
    got = row_call(group, x, s, block=block)
    xd, sd = x.detach().double().requires_grad_(), s.detach().double().requires_grad_()
    mean_d = xd.mean(-1, keepdim=True)
    yd = (xd - mean_d) * sd
    want = (yd, mean_d, yd.amax(-1, keepdim=True))
    grads = [torch.randn_like(w, dtype=torch.float32) for w in want]
    for a, w in zip(got, want):
        assert a.shape == w.shape and _relative(a, w) <= TOLERANCE
    for a, w in zip(torch.autograd.grad(got, (x, s), grads), torch.autograd.grad(want, (xd, sd), [g.double() for g in grads])):
        assert a.shape == w.shape and _relative(a, w) <= TOLERANCE


@pytest.mark.parametrize("block", [None, 2])
def test_a_max_shares_its_gradient_among_ties_as_amax_does(block):
    b = G.Builder([("x", G.FULL)])
    group = b.group(b("row_max", ("input", 0)))
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]], requires_grad=True)
    (grad,) = torch.autograd.grad(row_call(group, x, block=block), x, torch.ones(1, 1))
    (want,) = torch.autograd.grad(x.amax(-1, keepdim=True), x, torch.ones(1, 1))
    assert torch.equal(grad, want)


def test_an_input_without_a_path_to_a_seeded_output_gets_zeros():
    b = G.Builder([("x", G.FULL), ("w", G.COL)])
    y = b("mul", ("input", 0), ("input", 1))
    group = b.group(y, b("row_sum", ("input", 0)))
    x, w = torch.randn(2, 5, requires_grad=True), torch.randn(5, requires_grad=True)
    _, total = row_call(group, x, w)
    gx, gw = torch.autograd.grad(total, (x, w), torch.ones(2, 1))
    assert torch.equal(gx, torch.ones(2, 5)) and torch.equal(gw, torch.zeros(5))


@pytest.mark.parametrize("build, message", [
    (lambda: G.RowGroup([G.RowInput("x", G.ROW)], [G.Reduce("sum", ("input", 0))], [0]), "not a full row"),
    (lambda: G.RowGroup([G.RowInput("x")], [G.Reduce("min", ("input", 0))], [0]), "row reduction is one of"),
    (lambda: G.RowGroup([G.RowInput("x"), G.RowInput("w", G.COL)], [Step("exp", [("input", 1)])], [0]),
     "does not depend on the row"),
    (lambda: G.RowGroup([G.RowInput("x")], [Step("exp", [("step", 0)])], [0]), "not an step before it"),
    (lambda: G.RowGroup([G.RowInput("x")], [Step("sum", [("input", 0)])], [0]), "only elementwise ops"),
])
def test_malformed_groups_say_what_is_wrong(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_an_input_of_another_dtype_than_its_group_reads_is_declined():
    with pytest.raises(Unsupported, match="where the group reads torch.float32"):
        row_call(G.softmax(), torch.randn(2, 8, dtype=torch.float16))


@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("rows, classes", [(6, 37), (4, 1000)])
def test_cross_entropy_per_row_equals_eager(rows, classes, block):
    """Per-row losses (the target's logit picked by the column index), ignored rows zero; their
    mean over the rows not ignored is F.cross_entropy's, forward and backward."""
    generator = torch.Generator().manual_seed(rows)
    logits = (3 * torch.randn(rows, classes, generator=generator)).requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=generator)
    target[1] = -100
    losses = row_call(G.cross_entropy(), logits, target.reshape(rows, 1), None, block=block)
    assert losses.shape == (rows, 1) and losses[1].item() == 0.0
    got = losses.sum() / (target != -100).sum()
    wide = logits.detach().double().requires_grad_()
    want, plain = F.cross_entropy(wide, target), F.cross_entropy(logits, target)
    assert _within(got, plain, want)
    (a,), (p,), (b,) = (torch.autograd.grad(v, t) for v, t in ((got, logits), (plain, logits), (want, wide)))
    assert _within(a, p, b) and torch.equal(a[1], torch.zeros(classes))


def test_the_column_index_is_made_not_passed():
    with pytest.raises(ValueError, match="pass None"):
        row_call(G.cross_entropy(), torch.randn(2, 5), torch.zeros(2, 1, dtype=torch.long), torch.arange(5.0))
    with pytest.raises(Unsupported, match="per-row ones"):
        row_call(G.softmax(), torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("block", [None, 8])
def test_strided_and_broadcast_inputs_are_read_in_place_and_outputs_laid_out_as_asked(block):
    """softmax(scores + mask) over a transposed score tensor and a mask broadcast over heads: the
    kernel reads both where they are (no copies), writes the output in the scores' dim order, and
    the mask's gradient is summed over the heads it was broadcast to."""
    from graphopt.codegen.row_launch import row_backward, row_forward
    from graphopt.codegen.row_space import RowSpace, dim_order

    b = G.Builder([("scores", G.FULL), ("mask", G.FULL)])
    group = b.group(G.emit_softmax(b, b("add", ("input", 0), ("input", 1))))
    scores = torch.randn(2, 5, 3, 12).transpose(1, 2)  # [2, 3, 5, 12], not contiguous
    mask = torch.randn(2, 1, 5, 12)
    space = RowSpace.last(scores.shape)
    order = dim_order(scores.shape, scores.stride())
    (out,) = row_forward(group, [scores, mask], block=block, space=space, orders=(order,))
    want = F.softmax(scores.double() + mask.double(), -1)
    assert out.stride() == scores.stride() and _relative(out, want) <= TOLERANCE
    g = torch.randn(2, 3, 5, 12)
    ds, dm = row_backward(group, [scores, mask], [g], [True, True], block=block, space=space)
    sd, md = scores.double().requires_grad_(), mask.double().requires_grad_()
    ws, wm = torch.autograd.grad(F.softmax(sd + md, -1), (sd, md), g.double())
    assert ds.shape == scores.shape and dm.shape == mask.shape
    assert _relative(ds, ws) <= TOLERANCE and _relative(dm, wm) <= TOLERANCE


@pytest.mark.parametrize("block", [None, 4])
def test_shifted_reads_rotate_halves_as_rotary_embeddings_do(block):
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., h:], x[..., :h]): x read twice
    shifted by +h and -h, the halves picked by the column index; x's gradient from all three reads."""
    c, h = 12, 6
    b = G.Builder([("x", G.FULL), ("cos", G.FULL), ("sin", G.FULL)])
    cols = b.input("cols", G.INDEX)
    upper, lower = b.input("x", G.FULL, shift=h), b.input("x", G.FULL, shift=-h)
    rotated = b("where", b("lt", cols, float(h)), b("neg", upper), lower)
    group = b.group(b("add", b("mul", ("input", 0), ("input", 1)), b("mul", rotated, ("input", 2))))
    x = torch.randn(3, 5, c).transpose(0, 1).requires_grad_()  # strided too
    cos, sin = torch.randn(5, 1, c), torch.randn(5, 1, c)
    got = row_call(group, x, cos, sin, None, x, x, block=block)

    def rotate_half(t):
        return torch.cat((-t[..., h:], t[..., :h]), -1)

    xd = x.detach().double().requires_grad_()
    want = xd * cos.double() + rotate_half(xd) * sin.double()
    assert _relative(got, want) <= TOLERANCE
    g = torch.randn(5, 3, c)
    (gx,), (wx,) = torch.autograd.grad(got, (x,), g), torch.autograd.grad(want, (xd,), g.double())
    assert _relative(gx, wx) <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("block", [None, 16])
def test_a_half_precision_softmax_rounds_once_as_eager(dtype, log, block):
    """Computed in fp32 from the loaded halves, rounded once to the output's dtype (to nearest
    even, by hand: the interpreter's cast truncates); its backward from the rounded output and
    gradient, rounded once: eager's softmax bit for bit; its log_softmax, whose CPU kernel
    subtracts the max and the log of the sum in another order, within one unit in the last place
    of the largest element."""
    b = G.Builder()
    y = b("log_softmax" if log else "softmax", b.input("x", G.FULL, dtype=dtype))
    b.made_in(y, dtype)
    x = (3 * torch.randn(5, 37, generator=torch.Generator().manual_seed(1))).to(dtype).requires_grad_()
    got = row_call(b.group(y), x, block=block)
    want = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    g = torch.randn(5, 37, generator=torch.Generator().manual_seed(2)).to(dtype)
    pairs = [(got, want), (torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])]
    ulp = torch.finfo(dtype).eps
    for a, w in pairs:
        assert a.dtype == dtype
        if log:
            assert float((a.float() - w.float()).abs().max()) <= ulp * float(w.float().abs().max())
        else:
            assert torch.equal(a, w)
