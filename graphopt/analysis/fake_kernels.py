"""FakeTensor kernels for ATen ops whose own fake kernel refuses inputs their real kernel takes, or
lays out its output otherwise than the real kernel does.

`torch._grouped_mm`, the grouped matmul that transformers' mixture-of-experts layers run
their experts through, has a fake (meta) kernel that takes bfloat16 only, while the kernel
eager runs (ATen's GroupedMMUtils.h, on CPU and as CUDA's fallback) takes float32, bfloat16 and
float16; its fake also lays the output out contiguously where the real kernel pads each row to
16 bytes. A float32 MoE model trains eagerly, yet graphopt's FakeTensor forward before export
(which runs that eager path: under export transformers hands non-bf16 experts to its own op)
failed on it, and a bf16 one's graph got row strides the real step does not have.

Batch norm's real kernels (CPU's batch_norm_cpu, CUDA's native and cuDNN ones) lay their output,
and the backward its input's gradient, out in the input's suggested memory format: contiguous,
or channels-last for a channels-last 4-d or 5-d input. Their fakes (torch's decompositions) keep
the input's strides. A batch norm over a transposed tensor (PatchTST normalizes its patches so,
and transposes back) then reads as contiguous after the transpose in the fake step, where the
real one copies it before the next matmul: the estimate would miss that copy and the lifetimes
after it. Some losses' backwards allocate their gradient contiguous whatever
their input's layout (mse_loss, smooth_l1_loss, huber_loss), and some CPU kernels lay theirs out
as their input is laid out, or contiguous, where their fakes follow TensorIterator's rules
(_LAYOUTS). Losses that ATen reduces in the buffer of their elementwise values (mse_loss,
smooth_l1_loss, soft_margin_loss; on CPU binary_cross_entropy too) return their mean or sum as a
0-dim tensor over that whole buffer, which lives as long as the loss does (through the
backward): their fakes hold 4 bytes. `Fakes`, the FakeTensorMode graphopt's analyses run in,
gives such outputs the real kernel's layout and storage after the op's own fake ran.
tests/analysis/test_fake_kernels.py holds each against the real kernel on CPU.

`active()` puts a fake that mirrors the real kernel's checks and output layout in place while
graphopt traces and runs its FakeTensor analyses, and takes it out again on exit: the user's
process keeps torch's own behaviour outside graphopt's calls.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

aten = torch.ops.aten
_GROUPED_MM = aten._grouped_mm.default
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NAMES = {torch.float32: "Float32", torch.bfloat16: "BFloat16", torch.float16: "Float16"}


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def _check_strides(mat: torch.Tensor) -> None:
    """The real kernel's operand check: row- or column-major in the last two dims, the leading
    stride a multiple of 16 bytes."""
    size, stride = mat.shape, mat.stride()
    alignment = 16 // mat.element_size()
    if stride[-2] == 1 and stride[-1] >= max(1, size[-2]):
        _check(stride[-1] % alignment == 0, "strides should be multiple of 16 bytes")
    elif stride[-1] == 1 and stride[-2] >= max(1, size[-1]):
        _check(stride[-2] % alignment == 0, "strides should be multiple of 16 bytes")
    else:
        _check(False, f"Invalid strides/sizes, got {list(stride)} for strides and {list(size)} for sizes")


def grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> tuple[list[int], list[int], torch.dtype]:
    """(size, stride, dtype) of torch._grouped_mm's result, after the real kernel's checks
    (ATen's _grouped_mm_validate_inputs and create_grouped_gemm_output_tensor)."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        _check(mat.dtype in _GROUPED_MM_DTYPES, f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
    _check(mat_a.dim() in (2, 3), "mat_a has to be 2 or 3d")
    _check(mat_b.dim() in (2, 3), "mat_b has to be 2 or 3d")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not a_2d or not b_2d:
        _check(mat_a.size(-1) == mat_b.size(-2), "contraction dimension of mat_a and mat_b must match")
    _check_strides(mat_a)
    _check_strides(mat_b)
    _check((offs is not None) == (a_2d or b_2d),
           "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        _check(offs.dim() == 1, "offs has to be 1D")
        _check(offs.dtype == torch.int32, "Offsets have to be int32")
    _check(bias is None, "Bias not supported yet")
    dtype = out_dtype if out_dtype is not None else mat_a.dtype
    _check(dtype == mat_a.dtype, "Grouped gemm output dtype must match `mat_a` dtype")
    _check(mat_a.dtype == mat_b.dtype,
           f"expected m1 and m2 to have the same dtype, but got: {_NAMES[mat_a.dtype]} != {_NAMES[mat_b.dtype]}")
    if a_2d and b_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a_2d:
        _check(offs.size(0) == mat_b.size(0), "matrix batch sizes have to match")
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        _check(offs.size(0) == mat_a.size(0), "matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        _check(mat_a.size(0) == mat_b.size(0), "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    alignment = 16 // dtype.itemsize
    # rows padded to 16 bytes for the TMA loads of CUDA's kernel (CPU's shares the allocation);
    # ROCm's kernel allocates a plain contiguous output
    padded = size[-1] if torch.version.hip else (size[-1] + alignment - 1) // alignment * alignment
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    return size, stride, dtype


def _grouped_mm_fake(fake_mode: FakeTensorMode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    size, stride, dtype = grouped_mm_output(mat_a, mat_b, offs, bias, out_dtype)
    with fake_mode:
        return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


# torch.rand(size, generator=None) and its kin dispatch to the `generator` overloads, whose kernel
# on the meta device, which their fakes run, takes concrete sizes only: exported with a dynamic
# batch, diffusers' latent sampling (randn_tensor) failed. Their output is the plain overload's.
_WITHOUT_GENERATOR = {
    aten.rand.generator: aten.rand.default,
    aten.randn.generator: aten.randn.default,
    aten.randint.generator: aten.randint.default,
    aten.randint.low_generator: aten.randint.low,
}


def _random_fake(fake_mode: FakeTensorMode, func, *args, generator=None, **kwargs):
    with fake_mode:
        return _WITHOUT_GENERATOR[func](*args, **kwargs)


_FAKES = {_GROUPED_MM: _grouped_mm_fake, **{op: _random_fake for op in _WITHOUT_GENERATOR}}
# Where a real kernel lays its first output out otherwise than its fake: (the rule, the devices
# whose kernel does so; None: every device). "suggested": the suggested memory format of the input
# it reads (a batch norm's, its backward's second argument); "contiguous": contiguous whatever the
# inputs (ATen's legacy-contiguous allocations); "input": as its input is laid out.
_LAYOUTS = {
    aten.native_batch_norm.default: ("suggested", None),
    aten._native_batch_norm_legit.default: ("suggested", None),
    aten._native_batch_norm_legit.no_stats: ("suggested", None),
    aten._native_batch_norm_legit_functional.default: ("suggested", None),
    aten._native_batch_norm_legit_no_training.default: ("suggested", None),
    aten.native_batch_norm_backward.default: ("suggested", None),
    aten.mse_loss_backward.default: ("contiguous", None),
    aten.smooth_l1_loss_backward.default: ("contiguous", None),
    aten.huber_loss_backward.default: ("contiguous", None),
    aten.log_sigmoid_forward.default: ("contiguous", {"cpu"}),
    aten.binary_cross_entropy.default: ("input", {"cpu"}),  # reduction="none"; reduced: _REDUCED_IN_PLACE_ON_CPU
    aten.binary_cross_entropy_backward.default: ("input", {"cpu"}),
}
_READS_SECOND = {aten.native_batch_norm_backward.default, aten.binary_cross_entropy_backward.default}


def suggested_format(x: torch.Tensor) -> torch.memory_format:
    """The memory format ATen's suggest_memory_format gives x: channels-last where x is laid out
    so (and is not also contiguous), else contiguous."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _laid_out(func, args, first: FakeTensor) -> FakeTensor:
    """The op's first output as the real kernel lays it out (_LAYOUTS): a new fake where it differs
    (a fake's memory is its layout alone)."""
    rule, devices = _LAYOUTS[func]
    if devices is not None and first.device.type not in devices:
        return first
    source = args[1] if func in _READS_SECOND else args[0]
    if rule == "input":
        same = first.shape != source.shape or first.stride() == source.stride()  # a reduced loss: not this rule's
        return first if same else first.new_empty_strided(source.shape, source.stride())
    layout = suggested_format(source) if rule == "suggested" else torch.contiguous_format
    return first if first.is_contiguous(memory_format=layout) else torch.empty_like(first, memory_format=layout)


# each loss reduced in its elementwise buffer: the place of its reduction argument
_REDUCED_IN_PLACE = {torch.ops.aten.mse_loss.default: 2, torch.ops.aten.smooth_l1_loss.default: 2,
                     torch.ops.aten.soft_margin_loss.default: 2}
_REDUCED_IN_PLACE_ON_CPU = {torch.ops.aten.binary_cross_entropy.default: 3}


class Fakes(FakeTensorMode):
    """The FakeTensorMode of graphopt's analyses: torch's, with outputs laid out and held as the real
    kernels lay out and hold them where torch's fakes do otherwise (a batch norm's, a reduced loss's)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in _LAYOUTS:
            several = isinstance(out, (tuple, list))
            first = out[0] if several else out
            if isinstance(first, FakeTensor):
                first = _laid_out(func, args, first)
                out = (first, *out[1:]) if several else first
        if isinstance(out, FakeTensor) and out.dim() == 0 and (
                func in _REDUCED_IN_PLACE or (func in _REDUCED_IN_PLACE_ON_CPU and out.device.type == "cpu")):
            at = _REDUCED_IN_PLACE.get(func, _REDUCED_IN_PLACE_ON_CPU.get(func))
            reduction = args[at] if len(args) > at else (kwargs or {}).get("reduction", 1)
            if reduction:  # mean or sum: the scalar over the buffer of the elementwise losses
                whole = torch.broadcast_shapes(args[0].shape, args[1].shape)
                out = args[0].new_empty(whole, dtype=out.dtype).as_strided((), ())
        return out
_lock = threading.Lock()
_depth = 0
_saved: dict = {}


@contextlib.contextmanager
def active():
    """Give FakeTensors the fakes above while the context is open (nested opens share one)."""
    global _depth
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _uninstall()


# FakeTensorMode's own per-op table (torch._subclasses.fake_impls) rather than torch.library:
# it changes only what FakeTensors compute, leaving the op's dispatcher Meta kernel and
# torch.library's registry untouched, and one saved entry restores it exactly.
def _install() -> None:
    for op, fake in _FAKES.items():
        _saved[op] = fake_impls.op_implementations_dict.get(op)
        fake_impls.op_implementations_dict[op] = fake
    _evict_cached()


def _uninstall() -> None:
    for op, previous in _saved.items():
        if previous is None:
            fake_impls.op_implementations_dict.pop(op, None)
        else:
            fake_impls.op_implementations_dict[op] = previous
    _saved.clear()
    _evict_cached()


def _evict_cached() -> None:
    """Drop FakeTensorMode's cached results of these ops: a result cached under one set of
    fakes must not answer a call made under the other."""
    cache = FakeTensorMode.cache
    for key in [k for k in cache if getattr(k, "key", None) and k.key[0] in _FAKES]:
        cache.pop(key, None)
