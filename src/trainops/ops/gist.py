"""GIST: activations stored for the backward pass in compressed form (ONNX Runtime's GistBinarize /
GistPack1 / GistPack8 / GistPack16 encoders and decoders): the ReLU that keeps one bit an element,
its Triton kernels, CPU path, registrations and custom ops, and the lossy packing of other stashed
activations (a composite of torch's casts).

    gist_relu(x)                   -> (y, bits)   y = relu(x) as torch's on the same device: NaN kept,
                                                  -0.0 kept on the CPU, +0.0 from the Triton kernel
                                                  bits: bit i % 8 of byte i // 8 = not (y_i <= 0)
    gist_relu_backward(dy, bits)   -> dx          dx_i = dy_i where bit i is set, else 0

The ReLU backward needs only where the output is not <= 0 (torch's ``threshold_backward(dy, y,
0)``: dy where y is positive or NaN), so the gradient is exact, bit for bit torch's, from
ceil(numel / 8) bytes instead of the output itself: 1/32 of a float32 output, 1/16 of a half one. Element i is the i-th element of the
tensors' memory order, not of their logical order: x may be any dense layout (contiguous,
channels_last, any permutation of a dense tensor), read in place, y has x's strides (as torch's
``empty_like``), and the backward reads dy in the same layout (a dy of other strides is copied to
it first: the one copy, said here). A non-dense x (a slice, an expanded tensor) is copied to a
contiguous one first. Dtypes: float32, float16, bfloat16, float64; no arithmetic (a select and a
comparison, made in float32, or float64 for float64: exact), so nothing is rounded and the kernels
are deterministic. NaN: y keeps it and its bit is set, so dy passes there, as in torch. The sign of
a zero follows torch on each device: torch's CPU relu keeps -0.0 (so does the CPU path), its CUDA
relu gives +0.0 (so does the Triton kernel, also under the interpreter); checked on the H100,
torch 2.11. A NaN's payload is not kept (torch's own NaN payloads differ between its CPU paths).

Bytes (the fewest the ops must move): forward reads x and writes y and the bits, n (2s + 1/8)
bytes for elements of s bytes; backward reads dy and the bits and writes dx, the same. Triton plan
(``GistHeuristics``): one-dimensional, a program owns ``block`` consecutive elements as a (block /
8, 8) tile, each row of 8 one byte of bits. On the H100 both kernels run at about 2.6 TB/s (86% of
the copy ceiling) at 32x256x56x56 bf16; forward + backward take 0.082 ms of GPU time against
torch's 0.096, which reads its saved output back (benchmarks/NOTES.md, "GIST").

Lossy packing (``pack_stash`` / ``unpack_stash``), for stashed activations whose values the
backward needs (a convolution's or linear layer's input, a batch norm's): ``STASH_FORMATS``

    "e4m3"  float8 e4m3fn, 1 byte   3 mantissa bits: relative error <= 2**-4 per element
    "e5m2"  float8 e5m2, 1 byte     2 mantissa bits: <= 2**-3
    "fp16"  float16, 2 bytes        10 mantissa bits: <= 2**-11
    "bf16"  bfloat16, 2 bytes       7 mantissa bits: <= 2**-8

Each tensor is scaled by a power of two chosen from its largest magnitude so that it fits the
format's range (e4m3 448, e5m2 57344, fp16 65504; bf16 needs no scale: float32's range), then
rounded to the nearest value of the format (round-to-nearest-even casts); unpacking multiplies by
the inverse power of two (exact) in the original dtype (a float64 tensor is scaled in float64,
bf16 too, so that its range fits). A power of two is exact in every format,
so the only error is the format's rounding (and values below its smallest subnormal, relative to
the largest, flush to zero). The scale is computed on the device (no host synchronisation): a
tensor holding inf or NaN gets a NaN scale, so it unpacks as all NaN and the gradients it feeds
become NaN, which a GradScaler or ``skip_nonfinite`` step then skips (never a silently finite
wrong value). Bytes, as torch's ops run it: pack reads the tensor for its largest magnitude (an
infinity norm), then scales it into a temporary of its size and casts that to the packed copy
(three reads, two writes; a fused kernel would need two reads and one write); unpack reads the
packed copy, writes a tensor of the original dtype and scales it in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import next_pow2
from ..library import PLAIN_TENSORS, custom_op
from ..plan import (KernelChoice, Launch, Plan, _tracked, cached_plan, check_tensor, checked_shape, heuristics,
                    heuristics_for, keep_heuristics, keeps_plans, record_use)
from ..registry import FLOATS, normalize_device, pinned_backend, register, register_op, triton_available
from ._common import float_dtype
from .dropout import pack_bits, unpack_bits

GIST_OPS = ("gist_relu", "gist_relu_backward")


# ----------------------------------------------------------------------------------------------
# Heuristics, problem, descriptor
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GistHeuristics:
    """The GIST ReLU kernels' tunables (trainops.heuristics(...) overrides them).

    block: elements one program owns (a power of two >= 8; smaller for tensors that need fewer);
    warps: its warps. Measured on the H100 (2026-11-26, benchmarks/NOTES.md "GIST", 32x256x56x56
    bf16): blocks of 1024 to 8192 with 4 to 16 warps all ran at 2,555-2,622 GB/s forward and
    backward, so dropout's choice for the same tile stays.
    """

    block: int = 2048
    warps: int = 8


def dense_strides(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` and ``strides`` covers a block of memory exactly once (some
    permutation of a contiguous tensor: contiguous, channels_last, a transpose of either; an empty
    tensor covers none, whatever its strides)."""
    if 0 in tuple(shape):
        return True
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(shape, strides) if s != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class GistReluProblem:
    """One GIST ReLU problem: ``numel`` elements of a dense layout (``shape``, ``strides``).

    Forward ("gist_relu"): inputs (x,) -> (y, bits). Backward ("gist_relu_backward"): inputs (dy,
    bits) -> dx. x, y, dy and dx share ``strides``; bits are contiguous uint8 of ceil(numel / 8).
    """

    op: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    heuristics: GistHeuristics
    index_dtype = None

    @property
    def backward(self) -> bool:
        return self.op == "gist_relu_backward"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes_bits(self) -> int:
        return (self.numel + 7) // 8

    def check(self, tensors: Sequence, out) -> None:
        """Cheap checks of concrete arguments against the plan (shape, strides, dtype, device)."""
        names = ("dy", "bits") if self.backward else ("x",)
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(names)} arguments ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        check_tensor(self.op, names[0], tensors[0], self.shape, self.dtype, self.device, self.strides)
        if self.backward:
            bits = tensors[1]
            check_tensor(self.op, "bits", bits, (self.nbytes_bits,), torch.uint8, self.device)
            if not bits.is_contiguous():
                raise argument_error(InvalidProblemError, self.op, "bits", "must be contiguous (the forward's)")
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    def new_output(self):
        """Forward: (y, bits); backward: dx. y and dx in the problem's strides."""
        y = torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device=self.device)
        if self.backward:
            return y
        return y, torch.empty((self.nbytes_bits,), dtype=torch.uint8, device=self.device)


def _describe(op: str, shape, dtype, device="cuda", *, strides=None, heuristics=None) -> GistReluProblem:
    """Validate a GIST ReLU descriptor.

    shape: x's (dy's) sizes, any rank. dtype: x's (dy's): float32, float16, bfloat16, float64.
    strides: None (contiguous) or a dense layout's strides (see ``dense_strides``). heuristics: a
    GistHeuristics.
    """
    first = "dy" if op == "gist_relu_backward" else "x"
    shape = checked_shape(op, "shape", shape)
    dtype = float_dtype(op, first, dtype)
    device, heuristics = _device_and_heuristics(op, device, heuristics)
    contiguous = []
    step = 1
    for size in reversed(shape):
        contiguous.append(step)
        step *= max(size, 1)
    contiguous = tuple(reversed(contiguous))
    strides = contiguous if strides is None else tuple(int(s) for s in strides)
    if len(strides) != len(shape) or not dense_strides(shape, strides):
        raise argument_error(InvalidProblemError, op, "strides", f"{strides} of shape {shape} are not a dense layout; "
                             "copy the tensor first (the custom op does)")
    return GistReluProblem(op, shape, strides, dtype, device, heuristics)


def _device_and_heuristics(op: str, device, heuristics) -> tuple[torch.device, GistHeuristics]:
    """The descriptors' device (normalised) and GistHeuristics (the one in force when None), or the
    error naming the argument."""
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    if heuristics is None:
        heuristics = heuristics_for(GistHeuristics)
    elif not isinstance(heuristics, GistHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"must be a GistHeuristics, got {type(heuristics).__name__}")
    if heuristics.block < 8 or heuristics.block & (heuristics.block - 1):
        raise argument_error(InvalidProblemError, op, "heuristics", f"block must be a power of two >= 8, got "
                             f"{heuristics.block}")
    return device, heuristics


def _describer(op: str):
    def describe(shape, dtype, device="cuda", *, strides=None, heuristics=None) -> GistReluProblem:
        return _describe(op, shape, dtype, device, strides=strides, heuristics=heuristics)
    describe.__doc__ = _describe.__doc__
    return describe


GistReluDescriptor, GistReluBackwardDescriptor = (register_op(op, _describer(op)) for op in GIST_OPS)


def _memory(t: Tensor, numel: int) -> Tensor:
    """The flat view of a dense tensor's memory, in memory order."""
    return t.as_strided((numel,), (1,), t.storage_offset())


# ----------------------------------------------------------------------------------------------
# CPU path
# ----------------------------------------------------------------------------------------------

def _prepare_cpu(problem: GistReluProblem) -> Launch:
    n = problem.numel

    def run(tensors, outputs):
        if not n:
            return
        if problem.backward:
            dy, bits = tensors
            keep = unpack_bits(bits, n)
            flat = _memory(dy, n)
            _memory(outputs, n).copy_(torch.where(keep, flat, torch.zeros((), dtype=flat.dtype)))
            return
        (x,) = tensors
        y, bits = outputs
        flat = _memory(x, n)
        y_flat = _memory(y, n)
        y_flat.copy_(torch.where(flat < 0, torch.zeros((), dtype=flat.dtype), flat))
        bits.copy_(pack_bits(~(y_flat <= 0)))   # torch's threshold_backward: dy where not (y <= 0), NaN too

    return Launch(run, KernelChoice(f"{problem.op}_cpu", "cpu", ()), problem.dtype)


for _op in GIST_OPS:
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator="none (no arithmetic)",
             name=f"{_op}_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _gist_relu_fwd(X, Y, BITS, n, BLOCK: tl.constexpr, INT64: tl.constexpr, ACC: tl.constexpr):
        """y = relu(x) and its bits, BLOCK elements of memory order a program as (BLOCK / 8, 8).
        Compared in ACC (float32, or float64 for float64): exact for every input dtype."""
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK if INT64 else pid * BLOCK
        rows = tl.arange(0, BLOCK // 8)
        lane = tl.arange(0, 8)[None, :]
        local = rows[:, None] * 8 + lane
        mask = local < n - base
        x = tl.load(X + base + local, mask=mask, other=0.0).to(ACC)
        y = tl.where(x <= 0, 0.0, x)         # NaN stays; -0.0 becomes 0.0, as torch's CUDA relu
        tl.store(Y + base + local, y.to(Y.dtype.element_ty), mask=mask)
        keep = (y <= 0) == 0                 # torch's threshold_backward passes dy where not (y <= 0): NaN too
        byte = tl.sum(tl.where(keep & mask, 1 << lane, 0), 1)
        first_byte = base // 8
        tl.store(BITS + first_byte + rows, byte.to(tl.uint8), mask=rows < (n + 7) // 8 - first_byte)

    @triton.jit
    def _gist_relu_bwd(DY, BITS, DX, n, BLOCK: tl.constexpr, INT64: tl.constexpr):
        """dx = dy where the forward's bit is set, else 0 (the forward's tiles)."""
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK if INT64 else pid * BLOCK
        rows = tl.arange(0, BLOCK // 8)
        lane = tl.arange(0, 8)[None, :]
        local = rows[:, None] * 8 + lane
        mask = local < n - base
        first_byte = base // 8
        byte = tl.load(BITS + first_byte + rows, mask=rows < (n + 7) // 8 - first_byte, other=0)
        keep = ((byte.to(tl.int32)[:, None] >> lane) & 1) != 0
        dy = tl.load(DY + base + local, mask=mask, other=0.0)
        tl.store(DX + base + local, tl.where(keep, dy, 0.0).to(DX.dtype.element_ty), mask=mask)


def _prepare_triton(problem: GistReluProblem) -> Launch:
    h = problem.heuristics
    n = problem.numel
    block = max(8, min(h.block, next_pow2(max(n, 1))))
    int64 = n + block >= 2 ** 31
    kernel = _gist_relu_bwd if problem.backward else _gist_relu_fwd
    meta = dict(BLOCK=block, INT64=int64, num_warps=h.warps)
    if not problem.backward:
        meta["ACC"] = tl.float64 if problem.dtype == torch.float64 else tl.float32
    launch = launcher(kernel, (triton.cdiv(max(n, 1), block),), trailing=(n,), **meta)

    if problem.backward:
        def run(tensors, dx):
            if n:
                dy, bits = tensors
                launch(_memory(dy, n), bits, _memory(dx, n))
    else:
        def run(tensors, outputs):
            if n:
                y, bits = outputs
                launch(_memory(tensors[0], n), _memory(y, n), bits)

    name = "gist_relu_bwd" if problem.backward else "gist_relu_fwd"
    return Launch(run, KernelChoice(name, "triton", (("BLOCK", block), ("num_warps", h.warps))), problem.dtype)


if triton_available():
    for _op in GIST_OPS:
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True, accumulator="none (no arithmetic)",
                 name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.gist_relu / gist_relu_backward, with autograd
# ----------------------------------------------------------------------------------------------

def _dense(t: Tensor) -> Tensor:
    """``t`` itself when its layout is dense, else a contiguous copy (the one copy, said above)."""
    return t if t.is_contiguous() or dense_strides(t.shape, t.stride()) else t.contiguous()


def _gist_relu_impl(x: Tensor) -> tuple[Tensor, Tensor]:
    x = _dense(x)
    descriptor = GistReluDescriptor(x.shape, x.dtype, x.device, strides=x.stride(),
                                    heuristics=heuristics_for(GistHeuristics))
    return cached_plan(descriptor).run_unchecked((x,))


def _gist_relu_fake(x):
    y = x if x.is_contiguous() or dense_strides(x.shape, x.stride()) else x.contiguous()
    return torch.empty_strided(y.shape, y.stride(), dtype=x.dtype, device=x.device), \
        x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


def _in_layout(t: Tensor, shape, strides) -> Tensor:
    """``t`` with ``strides``: itself when it has them, a view of its one element (or none) under
    them, else a copy in that layout."""
    if tuple(t.stride()) == tuple(strides):
        return t
    if t.numel() <= 1:
        return t.as_strided(shape, strides)
    return torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _gist_relu_backward_impl(dy: Tensor, bits: Tensor, strides: list[int]) -> Tensor:
    op = "gist_relu_backward"
    dy = _in_layout(dy, dy.shape, strides)
    descriptor = GistReluBackwardDescriptor(dy.shape, dy.dtype, dy.device, strides=dy.stride(),
                                            heuristics=heuristics_for(GistHeuristics))
    plan = cached_plan(descriptor)
    if bits.shape != (plan.problem.nbytes_bits,) or bits.dtype != torch.uint8 or bits.device != dy.device \
            or not bits.is_contiguous():
        plan.problem.check((dy, bits), None)
    return plan.run_unchecked((dy, bits))


def _gist_relu_backward_fake(dy, bits, strides):
    return torch.empty_strided(dy.shape, tuple(strides), dtype=dy.dtype, device=dy.device)


def _save(ctx, inputs, outputs) -> None:
    y, bits = outputs
    ctx.mark_non_differentiable(bits)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(bits)   # the bits alone: not x, not y
    ctx.strides = list(y.stride())
    ctx.heuristics = heuristics_for(GistHeuristics)


def _grad(ctx, dy, dbits) -> dict:
    if dy is None or not ctx.needs_grad.x:
        return {}
    if torch.is_grad_enabled():   # create_graph=True: the backward op records no graph of its own
        raise UnsupportedError("trainops.gist.relu: double backward (create_graph=True) is not supported")
    (bits,) = ctx.saved_tensors
    with heuristics(ctx.heuristics):
        return {"x": gist_relu_backward_op(dy, bits, ctx.strides)}


gist_relu_backward_op = custom_op("gist_relu_backward", _gist_relu_backward_impl, _gist_relu_backward_fake)
gist_relu_op = custom_op("gist_relu", _gist_relu_impl, _gist_relu_fake, backward=_grad, save=_save)


class _EagerPlans(NamedTuple):
    """The plans of one eager GIST ReLU (``eager_relu``): the forward's, and the backward's for a dy
    laid out as y (``strides``)."""

    heuristics: GistHeuristics
    forward: Plan
    backward: Plan
    strides: tuple[int, ...]


_NO_EAGER_PATH = object()   # a layout the op path copies first
# (x's shape, strides, dtype, device, id(heuristics), pinned backend) -> _EagerPlans or _NO_EAGER_PATH
_EAGER_PLANS: dict = keeps_plans({})
_EAGER_CACHE_SIZE = 1024


def eager_relu(x: Tensor) -> Tensor | None:
    """``gist_relu_op(x)[0]`` in plain eager mode, its two plans made once per layout: the forward
    launches, and its autograd node's backward (run on autograd's device thread, where Python is
    slowest) launches the backward's plan when dy comes with y's strides, dtype and device (else
    the backward op, as ``_grad``). The same plans, so the same bits, as the op path. None where the
    op path must run: under torch.compile or a functorch transform, for a tensor subclass or under a
    __torch_function__ mode, for a layout that is not dense."""
    if (type(x) not in PLAIN_TENSORS or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._is_torch_function_mode_enabled()):   # (a plain x: has_torch_function's one other case)
        return None
    h = heuristics_for(GistHeuristics)
    key = (x.shape, x.stride(), x.dtype, x.device, id(h), pinned_backend())
    plans = _EAGER_PLANS.get(key)
    if plans is None or (plans is not _NO_EAGER_PATH and plans.heuristics is not h):
        plans = _eager_plans(x, h)
        if len(_EAGER_PLANS) >= _EAGER_CACHE_SIZE:
            _EAGER_PLANS.clear()
        _EAGER_PLANS[key] = plans
    if plans is _NO_EAGER_PATH:
        return None
    if _tracked:
        record_use(plans.forward)
    if x.requires_grad and torch.is_grad_enabled():
        return _EagerGistRelu.apply(x, plans)
    return plans.forward.run_unchecked((x,))[0]


def _eager_plans(x: Tensor, h: GistHeuristics):
    if _dense(x) is not x:
        return _NO_EAGER_PATH
    # (not counted here: eager_relu and the backward count each run, record_use)
    forward = cached_plan(GistReluDescriptor(x.shape, x.dtype, x.device, strides=x.stride(), heuristics=h),
                          count=False)
    strides = forward.problem.strides   # y's (new_output's empty_strided)
    backward = cached_plan(GistReluBackwardDescriptor(x.shape, x.dtype, x.device, strides=strides, heuristics=h),
                           count=False)
    return _EagerPlans(h, forward, backward, strides)


class _EagerGistRelu(torch.autograd.Function):
    """``eager_relu``'s autograd node: the op's ``_save`` and ``_grad`` with both plans made."""

    @staticmethod
    def forward(ctx, x, plans):
        y, bits = plans.forward.run_unchecked((x,))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(bits)   # the bits alone: not x, not y
        ctx.plans = plans
        return y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return None, None
        if torch.is_grad_enabled():   # create_graph=True: the backward op records no graph of its own
            raise UnsupportedError("trainops.gist.relu: double backward (create_graph=True) is not supported")
        (bits,) = ctx.saved_tensors
        plans = ctx.plans
        problem = plans.backward.problem
        if (type(dy) in PLAIN_TENSORS and dy.stride() == problem.strides and dy.dtype == problem.dtype
                and dy.device == problem.device and dy.shape == problem.shape and type(bits) in PLAIN_TENSORS
                and bits.shape == (problem.nbytes_bits,) and bits.dtype == torch.uint8 and bits.device == dy.device
                and bits.is_contiguous()):
            if _tracked:   # (the op's cached_plan counts it on the other path)
                record_use(plans.backward)
            return plans.backward.run_unchecked((dy, bits)), None
        # another layout (copied into y's by the op), a subclass, or bits a saved-tensor hook moved
        with keep_heuristics(plans.heuristics):
            return gist_relu_backward_op(dy, bits, list(plans.strides)), None


# ----------------------------------------------------------------------------------------------
# ReLU followed by 2-D max pooling: the pooling positions alone (GIST's Binarize pair)
# ----------------------------------------------------------------------------------------------

POOL_OPS = ("gist_relu_max_pool2d", "gist_relu_max_pool2d_backward")
NO_POSITION = 255   # a window whose maximum is <= 0: the ReLU passes no gradient through it


def pool_output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """torch's max_pool2d output size along one axis (dilation 1, ceil_mode False)."""
    return (size + 2 * padding - kernel) // stride + 1


def memory_order(shape: Sequence[int], strides: Sequence[int]) -> list[int]:
    """The axes of a dense tensor from outermost to innermost in memory: by stride, largest first,
    ties by axis (a size-1 axis, whose stride says nothing about memory, sits where its stride puts
    it: channels_last's H of 1 stays between N and W, as torch lays such outputs out)."""
    return sorted(range(len(shape)), key=lambda d: (-strides[d], d))


def like_strides(shape: Sequence[int], like_shape: Sequence[int], like_strides_: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for ``shape`` whose axes lie in memory in the order (``memory_order``) of a
    dense tensor of ``like_shape`` / ``like_strides_`` (contiguous stays contiguous, channels_last
    channels_last)."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(memory_order(like_shape, like_strides_)):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


@dataclass(frozen=True)
class GistPoolProblem:
    """One fused ReLU + max-pool problem over x of ``shape`` (N, C, H, W) and dense ``strides``.

    Forward ("gist_relu_max_pool2d"): inputs (x,) -> (z, positions): z = max_pool2d(relu(x)) of
    shape (N, C, Ho, Wo) in x's memory order, positions uint8 of z's shape and strides (the window
    position k_h * kernel_w + k_w of the maximum, NO_POSITION where it is <= 0). Backward: inputs
    (dz, positions) -> dx in x's strides (dz in z's strides).
    """

    op: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dtype: torch.dtype
    device: torch.device
    heuristics: GistHeuristics
    index_dtype = None

    @property
    def backward(self) -> bool:
        return self.op == "gist_relu_max_pool2d_backward"

    @property
    def out_shape(self) -> tuple[int, ...]:
        n, c, h, w = self.shape
        return (n, c, pool_output_size(h, self.kernel[0], self.stride[0], self.padding[0]),
                pool_output_size(w, self.kernel[1], self.stride[1], self.padding[1]))

    @property
    def out_strides(self) -> tuple[int, ...]:
        return like_strides(self.out_shape, self.shape, self.strides)

    def check(self, tensors: Sequence, out) -> None:
        """Cheap checks of concrete arguments against the plan (shape, strides, dtype, device)."""
        if self.backward:
            if len(tensors) != 2:
                raise InvalidProblemError(f"trainops.{self.op}: expected 2 arguments (dz, positions), got "
                                          f"{len(tensors)}")
            check_tensor(self.op, "dz", tensors[0], self.out_shape, self.dtype, self.device, self.out_strides)
            check_tensor(self.op, "positions", tensors[1], self.out_shape, torch.uint8, self.device, self.out_strides)
        else:
            if len(tensors) != 1:
                raise InvalidProblemError(f"trainops.{self.op}: expected 1 argument (x), got {len(tensors)}")
            check_tensor(self.op, "x", tensors[0], self.shape, self.dtype, self.device, self.strides)
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    def new_output(self):
        """Forward: (z, positions) in the output's strides; backward: dx in x's strides."""
        if self.backward:
            return torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device=self.device)
        shape, strides = self.out_shape, self.out_strides
        return (torch.empty_strided(shape, strides, dtype=self.dtype, device=self.device),
                torch.empty_strided(shape, strides, dtype=torch.uint8, device=self.device))


def _pair(op: str, name: str, value, minimum: int) -> tuple[int, int]:
    values = (value, value) if isinstance(value, int) and not isinstance(value, bool) else tuple(value)
    if len(values) == 1:   # torch's max_pool2d takes one value for both axes
        values = values * 2
    if len(values) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
        raise argument_error(InvalidProblemError, op, name, f"is {value!r}; expected an int >= {minimum} or two")
    return values


def _describe_pool(op: str, shape, dtype, device="cuda", *, kernel_size=2, stride=None, padding=0, strides=None,
                   heuristics=None) -> GistPoolProblem:
    """Validate a fused ReLU + max-pool descriptor.

    shape: x's (N, C, H, W). dtype: float32, float16, bfloat16, float64. kernel_size, stride
    (default: kernel_size), padding: an int or two (torch's max_pool2d; dilation 1, ceil_mode
    False), kernel_h * kernel_w <= 255 and padding at most half the kernel (as torch). strides: x's,
    a dense layout (default contiguous). heuristics: a GistHeuristics.
    """
    shape = checked_shape(op, "shape", shape)
    if len(shape) != 4:
        raise argument_error(InvalidProblemError, op, "shape", f"is {shape}; expected (N, C, H, W)")
    dtype = float_dtype(op, "dz" if op.endswith("_backward") else "x", dtype)
    device, heuristics = _device_and_heuristics(op, device, heuristics)
    kernel, stride, padding = pool_window(op, shape, kernel_size, stride, padding)
    strides = tuple(int(v) for v in strides) if strides is not None else like_strides(shape, shape, (4, 3, 2, 1))
    if len(strides) != 4 or not dense_strides(shape, strides):
        raise argument_error(InvalidProblemError, op, "strides", f"{strides} of shape {shape} are not a dense layout; "
                             "copy the tensor first (the custom op does)")
    return GistPoolProblem(op, shape, strides, kernel, stride, padding, dtype, device, heuristics)


def pool_window(op: str, shape, kernel_size, stride, padding) -> tuple[tuple[int, int], ...]:
    """(kernel, stride, padding) as pairs, checked as torch's max_pool2d checks them, against the
    one byte a position and, unless ``shape`` is None, against ``shape`` (N, C, H, W); errors
    name ``op``."""
    if shape is not None and 0 in tuple(shape)[2:]:
        raise argument_error(InvalidProblemError, op, "input", f"has shape {tuple(shape)}; its height and width must "
                             "be non-zero (as torch's max_pool2d)")
    kernel = _pair(op, "kernel_size", kernel_size, 1)
    stride = kernel if stride is None or (isinstance(stride, (list, tuple)) and not stride) else \
        _pair(op, "stride", stride, 1)
    padding = _pair(op, "padding", padding, 0)
    if kernel[0] * kernel[1] >= NO_POSITION:
        raise argument_error(UnsupportedError, op, "kernel_size", f"is {kernel}; windows of at most {NO_POSITION - 1} "
                             "positions (a position is kept in one byte)")
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise argument_error(InvalidProblemError, op, "padding", f"is {padding}; it must be at most half the kernel "
                             f"{kernel} (as torch's max_pool2d)")
    if shape is not None and any(pool_output_size(size, k, s_, p) < 1
                                 for size, k, s_, p in zip(tuple(shape)[2:], kernel, stride, padding)):
        raise argument_error(InvalidProblemError, op, "shape", f"is {tuple(shape)}: the {kernel} window with padding "
                             f"{padding} leaves no output")
    return kernel, stride, padding


def _pool_describer(op: str):
    def describe(shape, dtype, device="cuda", *, kernel_size=2, stride=None, padding=0, strides=None,
                 heuristics=None) -> GistPoolProblem:
        return _describe_pool(op, shape, dtype, device, kernel_size=kernel_size, stride=stride, padding=padding,
                              strides=strides, heuristics=heuristics)
    describe.__doc__ = _describe_pool.__doc__
    return describe


GistPoolDescriptor, GistPoolBackwardDescriptor = (register_op(op, _pool_describer(op)) for op in POOL_OPS)


def _window_starts(problem: GistPoolProblem, device) -> tuple[Tensor, Tensor]:
    """(rows, columns) of each output window's first input position (padding included)."""
    _, _, ho, wo = problem.out_shape
    rows = torch.arange(ho, device=device) * problem.stride[0] - problem.padding[0]
    cols = torch.arange(wo, device=device) * problem.stride[1] - problem.padding[1]
    return rows, cols


def _prepare_pool_cpu(problem: GistPoolProblem) -> Launch:
    n, c, h, w = problem.shape
    kh, kw = problem.kernel
    acc = torch.float64 if problem.dtype == torch.float64 else torch.float32

    def forward(tensors, outputs):
        (x,) = tensors
        z, positions = outputs
        pooled, flat = torch.nn.functional.max_pool2d(torch.relu(x), problem.kernel, problem.stride,
                                                      problem.padding, return_indices=True)
        rows, cols = _window_starts(problem, x.device)
        position = (flat // w - rows[:, None]) * kw + (flat % w - cols[None, :])
        z.copy_(pooled)
        positions.copy_(torch.where(pooled <= 0, NO_POSITION, position).to(torch.uint8))

    def backward(tensors, dx):
        dz, positions = tensors
        rows, cols = _window_starts(problem, dz.device)
        p = positions.to(torch.int64)
        flat = (rows[:, None] + p // kw) * w + cols[None, :] + p % kw
        kept = positions != NO_POSITION
        grads = torch.where(kept, dz.to(acc), 0.0).reshape(n * c, -1)
        sums = torch.zeros(n * c, h * w, dtype=acc, device=dz.device)
        sums.scatter_add_(1, torch.where(kept, flat, 0).reshape(n * c, -1), grads)
        dx.copy_(sums.view(n, c, h, w))

    compute = backward if problem.backward else forward
    numel = math.prod(problem.shape)

    def run(tensors, outputs):
        if numel:
            compute(tensors, outputs)

    return Launch(run, KernelChoice(f"{problem.op}_cpu", "cpu", ()), acc)


for _op in POOL_OPS:
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator="float32 (float64 for float64)",
             name=f"{_op}_cpu")(_prepare_pool_cpu)


if triton_available():
    @triton.jit
    def _pick(q0, q1, q2, q3, P: tl.constexpr):
        """The coordinate at memory-order position P of (q0, q1, q2, q3)."""
        if P == 0:
            return q0
        elif P == 1:
            return q1
        elif P == 2:
            return q2
        else:
            return q3

    @triton.jit
    def _coords(i, S1, S2, S3, PN: tl.constexpr, PC: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr):
        """(n, c, h, w) of flat memory-order index i over sizes (S0, S1, S2, S3) in memory order."""
        q3 = i % S3
        t = i // S3
        q2 = t % S2
        t = t // S2
        q1 = t % S1
        q0 = t // S1
        return (_pick(q0, q1, q2, q3, PN), _pick(q0, q1, q2, q3, PC), _pick(q0, q1, q2, q3, PH),
                _pick(q0, q1, q2, q3, PW))

    @triton.jit
    def _gist_pool_fwd(X, Z, POS, n_out, H, W, S1, S2, S3, xsn, xsc, xsh, xsw,
                       KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                       PADH: tl.constexpr, PADW: tl.constexpr, PN: tl.constexpr, PC: tl.constexpr,
                       PH: tl.constexpr, PW: tl.constexpr, BLOCK: tl.constexpr, INT64: tl.constexpr,
                       ACC: tl.constexpr):
        """BLOCK outputs of z's memory order a program: each window's maximum (the first in
        row-major window order; the last NaN wins, as torch's), z = relu of it, and its position (NO_POSITION if <= 0)."""
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK if INT64 else pid * BLOCK
        i = base + tl.arange(0, BLOCK)
        inside = i < n_out
        n, c, oh, ow = _coords(i, S1, S2, S3, PN, PC, PH, PW)
        plane = n * xsn + c * xsc
        best = tl.full((BLOCK,), float("-inf"), ACC)
        arg = tl.zeros((BLOCK,), tl.int32)
        for kh in tl.static_range(KH):
            h = oh * SH - PADH + kh
            for kw in tl.static_range(KW):
                w = ow * SW - PADW + kw
                valid = inside & (h >= 0) & (h < H) & (w >= 0) & (w < W)
                v = tl.load(X + plane + h * xsh + w * xsw, mask=valid, other=float("-inf")).to(ACC)
                take = (v > best) | (v != v)       # a NaN wins, the last one (torch's `val > max || isnan(val)`)
                best = tl.where(take, v, best)
                arg = tl.where(take, kh * KW + kw, arg)
        z = tl.where(best <= 0, 0.0, best)          # relu: NaN kept, -0.0 -> +0.0 (torch's CUDA relu)
        tl.store(Z + i, z.to(Z.dtype.element_ty), mask=inside)
        tl.store(POS + i, tl.where(best <= 0, 255, arg).to(tl.uint8), mask=inside)

    @triton.jit
    def _gist_pool_bwd(DZ, POS, DX, n_in, Ho, Wo, S1, S2, S3, zsn, zsc, zsh, zsw,
                       KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                       PADH: tl.constexpr, PADW: tl.constexpr, PN: tl.constexpr, PC: tl.constexpr,
                       PH: tl.constexpr, PW: tl.constexpr, BLOCK: tl.constexpr, INT64: tl.constexpr,
                       ACC: tl.constexpr):
        """BLOCK inputs of x's memory order a program: dx = the sum of dz over the windows whose
        kept position is this input, in a fixed order (the candidate windows row by row): no atomics."""
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK if INT64 else pid * BLOCK
        i = base + tl.arange(0, BLOCK)
        inside = i < n_in
        n, c, h, w = _coords(i, S1, S2, S3, PN, PC, PH, PW)
        plane = n * zsn + c * zsc
        acc = tl.zeros((BLOCK,), ACC)
        last_oh = (h + PADH) // SH
        last_ow = (w + PADW) // SW
        for a in tl.static_range((KH + SH - 1) // SH):
            oh = last_oh - a
            r = h + PADH - oh * SH
            for b in tl.static_range((KW + SW - 1) // SW):
                ow = last_ow - b
                col = w + PADW - ow * SW
                valid = inside & (oh >= 0) & (oh < Ho) & (ow >= 0) & (ow < Wo) & (r < KH) & (col < KW)
                offset = plane + oh * zsh + ow * zsw
                pos = tl.load(POS + offset, mask=valid, other=255).to(tl.int32)
                hit = valid & (pos == r * KW + col)
                acc += tl.where(hit, tl.load(DZ + offset, mask=hit, other=0.0).to(ACC), 0.0)
        tl.store(DX + i, acc.to(DX.dtype.element_ty), mask=inside)


def _prepare_pool_triton(problem: GistPoolProblem) -> Launch:
    h = problem.heuristics
    order = memory_order(problem.shape, problem.strides)
    where = {axis: order.index(axis) for axis in range(4)}
    grid_shape = problem.shape if problem.backward else problem.out_shape
    sizes = [grid_shape[axis] for axis in order]
    numel = math.prod(grid_shape)
    block = max(8, min(h.block, next_pow2(max(numel, 1))))
    other = problem.out_strides if problem.backward else problem.strides   # the strides the kernel gathers through
    span = max(math.prod(problem.shape), math.prod(problem.out_shape))
    meta = dict(KH=problem.kernel[0], KW=problem.kernel[1], SH=problem.stride[0], SW=problem.stride[1],
                PADH=problem.padding[0], PADW=problem.padding[1], PN=where[0], PC=where[1], PH=where[2], PW=where[3],
                BLOCK=block, INT64=span + block >= 2 ** 31,
                ACC=tl.float64 if problem.dtype == torch.float64 else tl.float32, num_warps=4)
    kernel = _gist_pool_bwd if problem.backward else _gist_pool_fwd
    extent = problem.out_shape[2:] if problem.backward else problem.shape[2:]
    launch = launcher(kernel, (triton.cdiv(max(numel, 1), block),),
                      trailing=(numel, *extent, *sizes[1:], *other), **meta)

    if problem.backward:
        def run(tensors, dx):
            if numel:
                dz, positions = tensors
                launch(dz, positions, _memory(dx, numel))
    else:
        def run(tensors, outputs):
            if numel:
                z, positions = outputs
                n_out = math.prod(problem.out_shape)
                launch(tensors[0], _memory(z, n_out), _memory(positions, n_out))

    name = "gist_pool_bwd" if problem.backward else "gist_pool_fwd"
    return Launch(run, KernelChoice(name, "triton", (("BLOCK", block), ("num_warps", 4))),
                  torch.float64 if problem.dtype == torch.float64 else torch.float32)


if triton_available():
    for _op in POOL_OPS:
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True,
                 accumulator="float32 (float64 for float64)", name=f"{_op}_triton")(_prepare_pool_triton)


def _pool_impl(x: Tensor, kernel_size: list[int], stride: list[int], padding: list[int]) -> tuple[Tensor, Tensor]:
    x = _dense(x)
    descriptor = GistPoolDescriptor(x.shape, x.dtype, x.device, kernel_size=tuple(kernel_size), stride=tuple(stride),
                                    padding=tuple(padding), strides=x.stride(),
                                    heuristics=heuristics_for(GistHeuristics))
    return cached_plan(descriptor).run_unchecked((x,))


def _pool_fake(x, kernel_size, stride, padding):
    x_strides = x.stride() if dense_strides(x.shape, x.stride()) else like_strides(x.shape, x.shape, (4, 3, 2, 1))
    n, c, h, w = x.shape
    shape = (n, c, *(pool_output_size(s_, k, st, p) for s_, k, st, p in zip((h, w), kernel_size, stride, padding)))
    strides = like_strides(shape, x.shape, x_strides)
    return (torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device),
            torch.empty_strided(shape, strides, dtype=torch.uint8, device=x.device))


def _pool_backward_impl(dz: Tensor, positions: Tensor, x_shape: list[int], x_strides: list[int],
                        kernel_size: list[int], stride: list[int], padding: list[int]) -> Tensor:
    descriptor = GistPoolBackwardDescriptor(tuple(x_shape), dz.dtype, dz.device, kernel_size=tuple(kernel_size),
                                            stride=tuple(stride), padding=tuple(padding), strides=tuple(x_strides),
                                            heuristics=heuristics_for(GistHeuristics))
    plan = cached_plan(descriptor)
    problem = plan.problem
    dz = _in_layout(dz, problem.out_shape, problem.out_strides)
    if positions.stride() != problem.out_strides or positions.dtype != torch.uint8 or positions.device != dz.device:
        problem.check((dz, positions), None)
    return plan.run_unchecked((dz, positions))


def _pool_backward_fake(dz, positions, x_shape, x_strides, kernel_size, stride, padding):
    return torch.empty_strided(tuple(x_shape), tuple(x_strides), dtype=dz.dtype, device=dz.device)


def _pool_save(ctx, inputs, outputs) -> None:
    _, positions = outputs
    ctx.mark_non_differentiable(positions)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(positions)   # one byte a window: not x, not the ReLU's output
    x = inputs.x
    ctx.x_shape = list(x.shape)
    ctx.x_strides = list(x.stride() if dense_strides(x.shape, x.stride()) else like_strides(x.shape, x.shape,
                                                                                            (4, 3, 2, 1)))
    ctx.window = (list(inputs.kernel_size), list(inputs.stride), list(inputs.padding))
    ctx.heuristics = heuristics_for(GistHeuristics)


def _pool_grad(ctx, dz, dpositions) -> dict:
    if dz is None or not ctx.needs_grad.x:
        return {}
    if torch.is_grad_enabled():
        raise UnsupportedError("trainops.gist.relu_max_pool2d: double backward (create_graph=True) is not supported")
    (positions,) = ctx.saved_tensors
    with heuristics(ctx.heuristics):
        return {"x": gist_relu_max_pool2d_backward_op(dz, positions, ctx.x_shape, ctx.x_strides, *ctx.window)}


gist_relu_max_pool2d_backward_op = custom_op("gist_relu_max_pool2d_backward", _pool_backward_impl,
                                             _pool_backward_fake)
gist_relu_max_pool2d_op = custom_op("gist_relu_max_pool2d", _pool_impl, _pool_fake, backward=_pool_grad,
                                    save=_pool_save)


# ----------------------------------------------------------------------------------------------
# Lossy packing of stashed activations (composite: torch's casts)
# ----------------------------------------------------------------------------------------------

class StashFormat(NamedTuple):
    dtype: torch.dtype
    largest: float | None   # the largest finite magnitude the scale maps to (None: no scale)


STASH_FORMATS = {
    "e4m3": StashFormat(torch.float8_e4m3fn, 448.0),
    "e5m2": StashFormat(torch.float8_e5m2, 57344.0),
    "fp16": StashFormat(torch.float16, 65504.0),
    "bf16": StashFormat(torch.bfloat16, None),
}


class Stashed:
    """A packed tensor: ``data`` in the format's dtype (the original's shape and, where it was
    dense, strides), ``scale`` a 0-d float32 tensor (float64 for a float64 original: a power of
    two, or NaN) or None, and the original dtype. Weak-referenceable (saved_tensors's cache)."""

    __slots__ = ("data", "scale", "dtype", "__weakref__")

    def __init__(self, data: Tensor, scale: Tensor | None, dtype: torch.dtype):
        self.data, self.scale, self.dtype = data, scale, dtype


def check_stash_format(op: str, name: str, format) -> StashFormat:
    """The StashFormat named ``format``; InvalidProblemError naming the argument otherwise."""
    if not isinstance(format, str) or format not in STASH_FORMATS:
        raise argument_error(InvalidProblemError, op, name, f"is {format!r}; expected one of "
                             f"{', '.join(map(repr, STASH_FORMATS))}")
    return STASH_FORMATS[format]


def pack_stash(t: Tensor, format: str) -> Stashed:
    """``t`` (float32, float16, bfloat16, float64) in the packed ``format`` (see the module docstring)."""
    spec = check_stash_format("gist.pack_stash", "format", format)
    if not isinstance(t, Tensor) or not t.is_floating_point() or t.dtype not in FLOATS:
        raise argument_error(UnsupportedError, "gist.pack_stash", "t", "must be a float32, float16, bfloat16 or "
                             f"float64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    wide = t.dtype == torch.float64
    target = spec.largest if spec.largest is not None else (torch.finfo(spec.dtype).max if wide else None)
    if target is None:   # bf16 of a float32 / float16 / bf16 tensor: float32's range, no scale needed
        return Stashed(t.detach().to(spec.dtype), None, t.dtype)
    with torch.no_grad():
        scale_dtype = torch.float64 if wide else torch.float32
        # the largest magnitude in one read (an infinity norm: no |t| temporary), exact in t's dtype
        largest = (torch.linalg.vector_norm(t, float("inf")).to(scale_dtype) if t.numel()
                   else torch.zeros((), dtype=scale_dtype, device=t.device))
        # the power of two that maps the largest magnitude into [format's largest / 2, its largest],
        # kept within what t's dtype represents (2**15 for float16, 2**127 for float32 and bfloat16,
        # 2**1023 for float64)
        bound = math.frexp(torch.finfo(t.dtype).max)[1] - 1   # the largest power of two the dtype holds
        exponent = torch.floor(torch.log2(target / largest)).clamp(-bound, bound)
        scale = torch.where(largest > 0, torch.exp2(exponent), 1.0)
        scale = torch.where(torch.isfinite(largest), scale, torch.nan)   # inf / NaN: all NaN (see above)
        data = (t * scale.to(t.dtype)).to(spec.dtype)
    return Stashed(data, scale, t.dtype)


def unpack_stash(stashed: Stashed) -> Tensor:
    """The tensor ``pack_stash`` packed, in its original dtype (with the format's rounding)."""
    data, scale, dtype = stashed.data, stashed.scale, stashed.dtype
    out = data.to(dtype)
    if scale is not None:
        out.mul_((1.0 / scale).to(dtype))   # a power of two: exact in every dtype
    return out


__all__ = ["GIST_OPS", "NO_POSITION", "POOL_OPS", "GistHeuristics", "GistPoolProblem", "GistReluProblem", "eager_relu",
           "STASH_FORMATS", "Stashed", "StashFormat", "check_stash_format", "dense_strides",
           "gist_relu_backward_op", "gist_relu_max_pool2d_backward_op", "gist_relu_max_pool2d_op", "gist_relu_op",
           "like_strides", "memory_order", "pack_stash", "pool_output_size", "pool_window", "unpack_stash"]
