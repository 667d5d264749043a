"""2-D convolution through the registry (ONNX Runtime's Conv / ConvGrad): the forward, and the input,
weight and bias gradients, each with the kernels of two backends, and the choice between them.

    conv2d(x, weight, bias)              -> y                 torch.nn.functional.conv2d's math
    conv2d_backward(dy, x, weight, mask) -> (dx, dweight, dbias)   mask: which of the three to make

Shapes: x (N, C, H, W), weight (O, C / groups, KH, KW), bias (O,), y (N, O, OH, OW) with
OH = (H + 2 padding - dilation (KH - 1) - 1) // stride + 1 (and so for OW); stride, padding and
dilation are pairs of ints (padding zeros). Dtypes: float32, float16, bfloat16, float64, x,
weight and bias alike (as torch requires; ``functional.conv2d`` casts them to autocast's dtype
under torch.autocast, as torch's convolution does). Memory formats, as torch's convolution picks
them: y and dx channels-last when x or the weight is (``output_channels_last``), else contiguous.
dweight takes the weight's format (torch's own makes it channels-last whenever x is; where that
differs from the weight's, it is copied once, so that the gradient matches its parameter). An
absent output (not asked for by the mask) is empty.

Backends and kernels (``trainops.track_kernels`` and ``python -m trainops kernels`` name them):

- ``cudnn`` (CUDA) and ``cpu``: torch's own convolution and convolution backward
  (``aten.convolution`` / ``aten.convolution_backward``: cuDNN on CUDA, oneDNN / ATen on the CPU),
  any groups, strides and layout. Their accumulator and rounding are torch's (float32 for half
  inputs; cuDNN runs float32 convolutions in TF32 while ``torch.backends.cudnn.allow_tf32`` is
  True, torch's default). Determinism: a problem's ``deterministic`` is torch's own switch
  (``torch.use_deterministic_algorithms`` or ``torch.backends.cudnn.deterministic``) unless the
  descriptor sets it; the deterministic cuDNN kernel runs with torch's switch on (turned on for
  the call, under a lock, only where a plan asked for determinism that torch's switch does not
  give), the other takes cuDNN's choice (its weight gradient may then differ in the last bits from
  run to run, as torch's does). Both run with autocast off: the plan's dtype is the one computed.
- ``triton``: depthwise convolutions (groups = C = O: one filter per channel, MobileNet's and
  ConvNeXt's), any stride, padding and dilation, kernel sizes unrolled at compile time (compile
  time grows with KH x KW; tested up to 7 x 7, under the interpreter), contiguous or channels-last, read in
  place. Forward and input gradient gather the taps of each output (no atomics); the weight and
  bias gradients sum over N x OH x OW in programs that write float32 partials (one tap at a time
  over the program's positions), added in a fixed order (``_common.column_sum``): deterministic. Accumulated in float32 (float64 for float64),
  rounded once. And 1x1 convolutions (one group, stride 1, no padding: ResNet's bottlenecks):
  matmuls by tl.dot over the flattened N x H x W positions of either layout, read in place
  (forward and input gradient: one kernel, ``_pw_matmul``; weight and bias gradients: the positions
  split among programs, float32 partials added in a fixed order: deterministic); float32, float16
  and bfloat16 (float32 multiplied exactly, not in TF32), accumulated in float32, rounded once.
  Other convolutions raise UnsupportedError on this backend.

Choice (``choose_backend``): on CUDA, the Triton kernels for the bf16 and float32 depthwise problems
of contiguous (NCHW) x like the measured ones (square kernels up to 5 x 5, padding k // 2, strides
1 or 2, batches from 32) where they were measured faster than cuDNN (``triton_beats_cudnn``:
forward from 14 x 14 output positions (28 x 28 at stride 2), backward from 56 x 56 input positions
with at most 3 x 3 taps, the input gradient alone from 14 x 14), cuDNN for every other problem;
the CPU kernels on the CPU. The Triton 1x1 kernels are never chosen: at ResNet-50's 1x1 shapes the
best of nine tiles reached 0.49x cuDNN's speed (geometric mean; benchmarks/NOTES.md, "1x1
convolutions"). ``trainops.backend(...)`` pins either.

Bytes (the fewest a depthwise convolution must move, for the Triton plans): forward reads x and
writes y (the weight is small); the input gradient reads dy, writes dx; the weight gradient reads
dy and x.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import next_pow2
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics, heuristics_for
from ..registry import (FLOATS, accumulator_dtype, normalize_device, pinned_backend, register,
                        register_op, sm_count, triton_available, triton_interpreting)
from ..registry import backend as pin_backend
from ._common import MAX_GRID_Y, check_heuristic_fields, contiguous_strides, float_dtype

FORWARD_OP, BACKWARD_OP = "conv2d", "conv2d_backward"


# ----------------------------------------------------------------------------------------------
# Heuristics, problem, descriptor
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConvHeuristics:
    """The Triton kernels' tunables, depthwise and 1x1 (trainops.heuristics(...) overrides them).

    block_positions: output positions (input positions for the input gradient; summed positions a
    step for the weight gradient) of a program's tile; block_channels: its channels; None: the
    layout's tile. Contiguous x: (256, 16), positions along the lanes; of three tiles timed on
    MobileNet-V2 / EfficientNet-B0 depthwise layers (H200, bf16, benchmarks/probe_conv.py; NOTES
    "Depthwise convolutions on the GPU") the old (64, 32) won no direction, and (256, 16) won both
    gradients on three of the four shapes the registry sends to Triton, (128, 16) the fourth.
    Channels-last x: (64, 32); none of eight tiles made these kernels faster than cuDNN there (the
    registry does not choose them). warps: a program's warps; programs_per_sm: programs wanted per
    SM before the weight gradient's positions are split among programs; reduce_block /
    reduce_parts: the partial sums' adding kernel (``column_sum``). pointwise_tile: the 1x1
    kernels' (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) (a matmul's tile; each block a power of two
    >= 16); None: ``POINTWISE_TILE``.
    """

    block_positions: Optional[int] = None
    block_channels: Optional[int] = None
    warps: int = 4
    programs_per_sm: int = 4
    reduce_block: int = 128
    reduce_parts: int = 32
    pointwise_tile: Optional[tuple[int, int, int, int, int]] = None

    def __post_init__(self):
        if isinstance(self.pointwise_tile, list):   # hashable (plans are cached by their heuristics)
            object.__setattr__(self, "pointwise_tile", tuple(self.pointwise_tile))

    def tile(self, channels_last: bool) -> tuple[int, int]:
        """(block_positions, block_channels) for x of this layout."""
        positions, channels = (64, 32) if channels_last else (256, 16)
        return (self.block_positions or positions, self.block_channels or channels)


def output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """torch's convolution output size along one axis."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def channels_last_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides torch gives a channels-last (N, C, H, W) tensor of ``shape``."""
    n, c, h, w = (max(s, 1) for s in shape)
    return (h * w * c, 1, w * c, c)


@dataclass(frozen=True)
class Conv2dProblem:
    """One conv2d problem. Forward ("conv2d"): inputs (x, weight, bias or None) -> y. Backward
    ("conv2d_backward"): inputs (dy, x, weight) -> (dx, dweight, dbias), each empty unless ``mask``
    asks for it. ``channels_last``: y's and dx's memory format; ``weight_channels_last``: dweight's."""

    op: str
    x_shape: tuple[int, int, int, int]
    weight_shape: tuple[int, int, int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    dtype: torch.dtype
    device: torch.device
    bias: bool
    mask: tuple[bool, bool, bool]
    channels_last: bool
    weight_channels_last: bool
    deterministic: bool
    heuristics: ConvHeuristics
    index_dtype = None

    @property
    def backward(self) -> bool:
        return self.op == BACKWARD_OP

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        n, _, h, w = self.x_shape
        o, _, kh, kw = self.weight_shape
        return (n, o, output_size(h, kh, self.stride[0], self.padding[0], self.dilation[0]),
                output_size(w, kw, self.stride[1], self.padding[1], self.dilation[1]))

    @property
    def depthwise(self) -> bool:
        """One filter per channel: groups = C = O, one input channel a filter."""
        c, o = self.x_shape[1], self.weight_shape[0]
        return self.groups == c == o and self.weight_shape[1] == 1

    @property
    def pointwise(self) -> bool:
        """A 1x1 convolution of one group, stride 1, no padding (a matmul over the channels at each
        position; any dilation, which a 1x1 kernel does not use)."""
        return (self.groups == 1 and self.weight_shape[2:] == (1, 1) and self.stride == (1, 1)
                and self.padding == (0, 0))

    @property
    def acc_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    @property
    def weight_strides(self) -> tuple[int, ...]:
        return channels_last_strides(self.weight_shape) if self.weight_channels_last else \
            contiguous_strides(self.weight_shape)

    def _like_x(self, shape) -> Tensor:
        strides = channels_last_strides(shape) if self.channels_last else contiguous_strides(shape)
        return torch.empty_strided(shape, strides, dtype=self.dtype, device=self.device)

    def check(self, tensors: Sequence, out) -> None:
        """Cheap checks of concrete arguments against the plan (shapes, dtypes, device)."""
        names = ("dy", "x", "weight") if self.backward else ("x", "weight", "bias")
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(names)} arguments ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        shapes = (self.out_shape, self.x_shape, self.weight_shape) if self.backward else \
            (self.x_shape, self.weight_shape, (self.weight_shape[0],))
        for name, t, shape in zip(names, tensors, shapes):
            if name == "bias" and not self.bias:
                if t is not None:
                    raise argument_error(InvalidProblemError, self.op, "bias", "is given; the plan is for no bias")
                continue
            check_tensor(self.op, name, t, shape, self.dtype, self.device)
            if name == "bias" and not t.is_contiguous():
                raise argument_error(InvalidProblemError, self.op, "bias", "must be contiguous (the functional op "
                                     "copies a strided one)")
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    def new_output(self):
        """Forward: y (x's memory format); backward: (dx, dweight, dbias), empty where not asked."""
        if not self.backward:
            return self._like_x(self.out_shape)
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        dx = self._like_x(self.x_shape) if self.mask[0] else empty
        dw = torch.empty_strided(self.weight_shape, self.weight_strides, dtype=self.dtype, device=self.device) \
            if self.mask[1] else empty.clone()
        db = torch.empty((self.weight_shape[0],), dtype=self.dtype, device=self.device) if self.mask[2] else empty.clone()
        return dx, dw, db


def pair(op: str, name: str, value, minimum: int) -> tuple[int, int]:
    """An int or a pair of ints, each >= minimum, as a pair; InvalidProblemError naming ``name``."""
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        pair = tuple(pair)
        ok = len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in pair)
    except TypeError:
        ok = False
    if not ok:
        raise argument_error(InvalidProblemError, op, name, f"must be an int or a pair of ints >= {minimum}, "
                             f"got {value!r}")
    return pair


def _describe(op: str, x_shape, weight_shape, dtype, device="cuda", *, stride=1, padding=0, dilation=1, groups=1,
              bias=False, mask=(True, True, False), channels_last=False, weight_channels_last=False,
              deterministic=None, heuristics=None) -> Conv2dProblem:
    """Validate a conv2d descriptor.

    x_shape: (N, C, H, W); weight_shape: (O, C / groups, KH, KW); dtype: x's, weight's and bias's
    (float32, float16, bfloat16, float64). stride (>= 1), padding (>= 0), dilation (>= 1): ints or
    pairs. groups: divides C and O. bias: the forward adds one (the backward's bias gradient is
    ``mask[2]``). mask: (input, weight, bias) gradients the backward makes. channels_last: y's and
    dx's memory format; weight_channels_last: dweight's. deterministic: None (torch's switch: ``torch.use_deterministic_algorithms``
    or ``torch.backends.cudnn.deterministic``), True or False. heuristics: a ConvHeuristics.
    """
    x_shape = checked_shape(op, "x_shape", x_shape)
    weight_shape = checked_shape(op, "weight_shape", weight_shape)
    if len(x_shape) != 4:
        raise argument_error(InvalidProblemError, op, "x_shape", f"must be (N, C, H, W), got {x_shape}")
    if len(weight_shape) != 4:
        raise argument_error(InvalidProblemError, op, "weight_shape", f"must be (O, C / groups, KH, KW), got {weight_shape}")
    dtype = float_dtype(op, "x", dtype)
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    stride, padding, dilation = (pair(op, "stride", stride, 1), pair(op, "padding", padding, 0),
                                 pair(op, "dilation", dilation, 1))
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise argument_error(InvalidProblemError, op, "groups", f"must be an int >= 1, got {groups!r}")
    n, c, h, w = x_shape
    o, cg, kh, kw = weight_shape
    if c % groups or o % groups:
        raise argument_error(InvalidProblemError, op, "groups", f"{groups} does not divide the input's {c} and the "
                             f"output's {o} channels")
    if cg * groups != c:
        raise argument_error(InvalidProblemError, op, "weight_shape", f"{weight_shape} expects {cg * groups} input "
                             f"channels (groups {groups}); x has {c}")
    if min(kh, kw) < 1 or o < 1:
        raise argument_error(InvalidProblemError, op, "weight_shape", f"{weight_shape} has an empty filter")
    for axis, size, k in ((0, h, kh), (1, w, kw)):
        if size + 2 * padding[axis] < dilation[axis] * (k - 1) + 1:
            raise argument_error(InvalidProblemError, op, "x_shape", f"{x_shape}: the padded input "
                                 f"({size + 2 * padding[axis]}) is smaller than the dilated kernel "
                                 f"({dilation[axis] * (k - 1) + 1})")
    try:
        mask = tuple(bool(m) for m in mask)
    except TypeError:
        mask = ()
    if len(mask) != 3:
        raise argument_error(InvalidProblemError, op, "mask", f"must be three bools (input, weight, bias), got {mask!r}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic
    if heuristics is None:
        heuristics = heuristics_for(ConvHeuristics)
    elif not isinstance(heuristics, ConvHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics", f"must be a ConvHeuristics, got "
                             f"{type(heuristics).__name__}")
    check_heuristic_fields(op, heuristics, powers_of_two=("block_positions", "block_channels", "reduce_block",
                                                          "reduce_parts", "warps"),
                           at_least_one=("programs_per_sm",), optional=("block_positions", "block_channels"))
    if heuristics.warps > 32:
        raise argument_error(InvalidProblemError, op, "heuristics", f"warps must be <= 32, got {heuristics.warps}")
    if heuristics.pointwise_tile is not None:
        tile = heuristics.pointwise_tile
        ok = isinstance(tile, tuple) and len(tile) == 5 and all(isinstance(v, int) and v >= 1 for v in tile)
        if not ok or any(v < 16 or v & (v - 1) for v in tile[:3]) or tile[3] & (tile[3] - 1) or tile[3] > 32:
            raise argument_error(InvalidProblemError, op, "heuristics", "pointwise_tile must be (BLOCK_M, BLOCK_N, "
                                 "BLOCK_K, warps, stages): blocks powers of two >= 16, warps a power of two <= 32, "
                                 f"stages >= 1; got {tile!r}")
    return Conv2dProblem(op, x_shape, weight_shape, stride, padding, dilation, groups, dtype, device, bool(bias),
                         mask if op == BACKWARD_OP else (False, False, False), bool(channels_last),
                         bool(weight_channels_last), bool(deterministic), heuristics)


def _describer(op: str):
    def describe(x_shape, weight_shape, dtype, device="cuda", *, stride=1, padding=0, dilation=1, groups=1,
                 bias=False, mask=(True, True, False), channels_last=False, weight_channels_last=False,
                 deterministic=None, heuristics=None) -> Conv2dProblem:
        return _describe(op, x_shape, weight_shape, dtype, device, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, mask=mask, channels_last=channels_last,
                         weight_channels_last=weight_channels_last, deterministic=deterministic, heuristics=heuristics)
    describe.__doc__ = _describe.__doc__
    return describe


# Where the Triton depthwise kernels beat cuDNN, measured (benchmarks/probe_conv.py: MobileNet-V2,
# EfficientNet-B0 and ConvNeXt-T depthwise layers at batch 32, square kernels, padding k // 2, no
# dilation, strides 1 and 2; H200, torch 2.11, cuDNN 9.19, Triton 3.6; NOTES "Depthwise
# convolutions on the GPU"). Contiguous (NCHW) x in bf16 and float32 only: cuDNN is faster on
# channels-last x in nearly every row, and on contiguous float16 x in all rows but the stride-2
# ones. Kernels up to 5 x 5 (7 x 7 was not measured on contiguous x); batches from 32 (smaller
# ones were not measured). Forward: from 14 x 14 output positions at stride 1, 28 x 28 at stride 2
# (bf16 1.05-1.9x, float32 1.1-1.9x; 0.38-0.7x at 7 x 7). Input and weight gradients together:
# from 56 x 56 input positions with at most 3 x 3 taps (1.55-2.1x; below that, up to 1.4x slower,
# where the weight gradient dominates). The input gradient alone: from 14 x 14 input positions
# (1.15-3.5x). The weight gradient alone: cuDNN (our split sums lose at most shapes).
TRITON_MAX_TAPS = 25
TRITON_MIN_BATCH = 32
TRITON_FORWARD_MIN_POSITIONS = {1: 14 * 14, 2: 28 * 28}   # by stride
TRITON_BACKWARD_MIN_POSITIONS = 56 * 56
TRITON_BACKWARD_MAX_TAPS = 9
TRITON_INPUT_GRAD_MIN_POSITIONS = 14 * 14
TRITON_MEASURED_DTYPES = (torch.bfloat16, torch.float32)


def triton_beats_cudnn(problem: Conv2dProblem) -> bool:
    """Whether the measured table above puts this CUDA problem on the Triton depthwise kernels:
    only problems like the measured ones (square kernel, padding k // 2, no dilation, equal strides
    of 1 or 2, a batch of at least 32) and within the grid the kernels launch."""
    n, _, height, width = problem.x_shape
    _, _, kh, kw = problem.weight_shape
    stride = problem.stride[0]
    if not problem.depthwise or problem.channels_last or problem.dtype not in TRITON_MEASURED_DTYPES \
            or kh != kw or kh * kw > TRITON_MAX_TAPS or problem.padding != (kh // 2, kw // 2) \
            or problem.dilation != (1, 1) or problem.stride != (stride, stride) \
            or stride not in TRITON_FORWARD_MIN_POSITIONS or n < TRITON_MIN_BATCH \
            or _channel_blocks(problem) > MAX_GRID_Y:
        return False
    if not problem.backward:
        _, _, oh, ow = problem.out_shape
        return oh * ow >= TRITON_FORWARD_MIN_POSITIONS[stride]
    want_dx, want_dw, want_db = problem.mask
    if want_dw or want_db:
        return want_dx and height * width >= TRITON_BACKWARD_MIN_POSITIONS and kh * kw <= TRITON_BACKWARD_MAX_TAPS
    return height * width >= TRITON_INPUT_GRAD_MIN_POSITIONS


def choose_backend(problem: Conv2dProblem) -> str | None:
    """On CUDA: the Triton depthwise kernels where they were measured faster than cuDNN
    (``triton_beats_cudnn``), cuDNN elsewhere; None on other devices (the device type's default)."""
    if problem.device.type != "cuda":
        return None
    return "triton" if triton_available() and triton_beats_cudnn(problem) else "cudnn"


Conv2dDescriptor, Conv2dBackwardDescriptor = (register_op(op, _describer(op), choose_backend=choose_backend)
                                              for op in (FORWARD_OP, BACKWARD_OP))


# ----------------------------------------------------------------------------------------------
# torch's own kernels: the cudnn backend (CUDA) and the cpu backend
# ----------------------------------------------------------------------------------------------

_CUDNN_SWITCH = threading.Lock()   # held while a call turns cudnn.deterministic on for itself


def _torch_determinism() -> bool:
    return torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic


def _prepare_torch(problem: Conv2dProblem, deterministic: bool) -> Launch:
    """aten.convolution / aten.convolution_backward with autocast off (the plan's dtype), their
    outputs in the formats the problem declares (torch's own choice but for dweight of a contiguous
    weight with a channels-last x: then one copy of it), under cuDNN's deterministic
    switch for a deterministic plan on CUDA where torch's own switch is off."""
    stride, padding, dilation, groups = list(problem.stride), list(problem.padding), list(problem.dilation), problem.groups
    device_type = problem.device.type
    switch_cudnn = deterministic and device_type == "cuda"
    y_format = torch.channels_last if problem.channels_last else torch.contiguous_format
    w_format = torch.channels_last if problem.weight_channels_last else torch.contiguous_format

    def call_forward(x, weight, bias):
        y = torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, False, [0, 0], groups)
        return y.contiguous(memory_format=y_format)

    def call_backward(dy, x, weight):
        bias_sizes = [problem.weight_shape[0]] if problem.mask[2] else None
        dx, dw, db = torch.ops.aten.convolution_backward(dy, x, weight, bias_sizes, stride, padding, dilation, False,
                                                         [0, 0], groups, list(problem.mask))
        empty = torch.empty(0, dtype=problem.dtype, device=problem.device)
        return (empty if dx is None else dx.contiguous(memory_format=y_format),
                empty.clone() if dw is None else dw.contiguous(memory_format=w_format),
                empty.clone() if db is None else db)

    call = call_backward if problem.backward else call_forward

    def run(tensors, out):
        if torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return switched(tensors)
        return switched(tensors)

    def switched(tensors):
        if not switch_cudnn or _torch_determinism():
            return call(*tensors)
        with _CUDNN_SWITCH:
            torch.backends.cudnn.deterministic = True
            try:
                return call(*tensors)
            finally:
                torch.backends.cudnn.deterministic = False

    backend = "cudnn" if problem.device.type == "cuda" else "cpu"
    name = f"{problem.op}_{backend}{'' if deterministic or backend == 'cpu' else '_nondeterministic'}"
    return Launch(run, KernelChoice(name, backend, ()), problem.acc_dtype, allocates=True)


for _op in (FORWARD_OP, BACKWARD_OP):
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator="torch's (ATen / oneDNN)",
             name=f"{_op}_cpu")(lambda problem: _prepare_torch(problem, True))
    register(_op, backend="cudnn", dtypes=FLOATS, deterministic=True,
             accumulator="cuDNN's (float32 for half; TF32 for float32 while cudnn.allow_tf32)",
             name=f"{_op}_cudnn")(lambda problem: _prepare_torch(problem, True))
    register(_op, backend="cudnn", dtypes=FLOATS, deterministic=False,
             accumulator="cuDNN's (float32 for half; TF32 for float32 while cudnn.allow_tf32)",
             name=f"{_op}_cudnn_nondeterministic")(lambda problem: _prepare_torch(problem, False))


# ----------------------------------------------------------------------------------------------
# Triton kernels: depthwise convolutions
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from ._common import column_sum

    @triton.jit
    def _dw_forward(X, Wt, B, Y, C, H, W, OH, OW, P_BLOCKS, xs_n, xs_c, xs_h, xs_w, ys_n, ys_c, ys_h, ys_w,
                    ws_c, ws_h, ws_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                    KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
        """y[n, c, oh, ow] = bias[c] + sum over taps (i, j), in order, of x[n, c, oh s - p + i d,
        ow s - p + j d] * w[c, 0, i, j] (zeros outside x). Programs: (n x position block, channel
        block); n rides on the first grid axis (the others allow 65535 programs)."""
        pid = tl.program_id(0)
        n = (pid // P_BLOCKS).to(tl.int64)
        p = (pid % P_BLOCKS) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        oh, ow = p // OW, p % OW
        p_ok = p < OH * OW
        c_ok = c < C
        x_base = X + n * xs_n + c.to(tl.int64)[None, :] * xs_c
        acc = tl.zeros([BLOCK_P, BLOCK_C], ACC)
        for i in tl.static_range(KH):
            ih = oh * stride_h - pad_h + i * dil_h
            for j in tl.static_range(KW):
                iw = ow * stride_w - pad_w + j * dil_w
                ok = p_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                off = ih.to(tl.int64) * xs_h + iw.to(tl.int64) * xs_w
                xv = tl.load(x_base + off[:, None], mask=ok[:, None] & c_ok[None, :], other=0.0)
                wv = tl.load(Wt + c * ws_c + i * ws_h + j * ws_w, mask=c_ok, other=0.0)
                acc += xv.to(ACC) * wv.to(ACC)[None, :]
        if HAS_BIAS:
            acc += tl.load(B + c, mask=c_ok, other=0.0).to(ACC)[None, :]
        y_off = n * ys_n + c.to(tl.int64)[None, :] * ys_c + (oh.to(tl.int64) * ys_h + ow.to(tl.int64) * ys_w)[:, None]
        tl.store(Y + y_off, acc.to(Y.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _dw_input_grad(DY, Wt, DX, C, H, W, OH, OW, P_BLOCKS, ds_n, ds_c, ds_h, ds_w, xs_n, xs_c, xs_h, xs_w,
                       ws_c, ws_h, ws_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                       KH: tl.constexpr, KW: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                       ACC: tl.constexpr):
        """dx[n, c, h, w] = sum over taps (i, j), in order, of dy[n, c, oh, ow] * w[c, 0, i, j] for
        the outputs (oh, ow) that read (h, w) through that tap: oh s - p + i d = h. Programs:
        (n x input position block, channel block); each dx element is written once (no atomics)."""
        pid = tl.program_id(0)
        n = (pid // P_BLOCKS).to(tl.int64)
        q = (pid % P_BLOCKS) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        h, w = q // W, q % W
        q_ok = q < H * W
        c_ok = c < C
        dy_base = DY + n * ds_n + c.to(tl.int64)[None, :] * ds_c
        acc = tl.zeros([BLOCK_P, BLOCK_C], ACC)
        for i in tl.static_range(KH):
            th = h + pad_h - i * dil_h
            th_ok = th >= 0
            th = tl.where(th_ok, th, 0)
            oh = th // stride_h
            h_ok = th_ok & (oh * stride_h == th) & (oh < OH)
            for j in tl.static_range(KW):
                tw = w + pad_w - j * dil_w
                tw_ok = tw >= 0
                tw = tl.where(tw_ok, tw, 0)
                ow = tw // stride_w
                ok = q_ok & h_ok & tw_ok & (ow * stride_w == tw) & (ow < OW)
                off = oh.to(tl.int64) * ds_h + ow.to(tl.int64) * ds_w
                dyv = tl.load(dy_base + off[:, None], mask=ok[:, None] & c_ok[None, :], other=0.0)
                wv = tl.load(Wt + c * ws_c + i * ws_h + j * ws_w, mask=c_ok, other=0.0)
                acc += dyv.to(ACC) * wv.to(ACC)[None, :]
        dx_off = n * xs_n + c.to(tl.int64)[None, :] * xs_c + (h.to(tl.int64) * xs_h + w.to(tl.int64) * xs_w)[:, None]
        tl.store(DX + dx_off, acc.to(DX.dtype.element_ty), mask=q_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _dw_weight_grad(DY, X, PART, C, H, W, OH, OW, total, chunk, ds_n, ds_c, ds_h, ds_w, xs_n, xs_c, xs_h, xs_w,
                        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                        KH: tl.constexpr, KW: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
                        INDEX: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
        """PART[split, c, t] = sum over this program's chunk of the N x OH x OW output positions of
        dy[n, c, oh, ow] * x[n, c, oh s - p + i d, ow s - p + j d] for tap t = i KW + j, and of dy
        itself for t = KH KW (the bias gradient); a row not asked for (WEIGHT_GRAD, BIAS_GRAD) is 0,
        its positions not read. Programs: (channel block,
        split). One tap at a time: BLOCK_P positions a step added elementwise in order, then summed
        over the positions once (fixed order; the chunk's dy is read again for each tap, from cache).
        INDEX: the positions' integer type (int64 when they reach 2**31)."""
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        start = tl.program_id(1).to(INDEX) * chunk
        stop = tl.minimum(start + chunk, total)
        c_dy = c.to(tl.int64)[None, :] * ds_c
        c_x = c.to(tl.int64)[None, :] * xs_c
        row = PART + tl.program_id(1).to(tl.int64) * C * (KH * KW + 1) + c.to(tl.int64) * (KH * KW + 1)
        for t in tl.static_range(KH * KW + 1):
            acc = tl.zeros([BLOCK_P, BLOCK_C], ACC)
            if (t < KH * KW and WEIGHT_GRAD) or (t == KH * KW and BIAS_GRAD):
                for q0 in range(start, stop, BLOCK_P):
                    q = q0 + tl.arange(0, BLOCK_P)
                    q_ok = q < stop
                    n = (q // (OH * OW)).to(tl.int64)
                    p = (q % (OH * OW)).to(tl.int32)
                    oh, ow = p // OW, p % OW
                    dy_off = n * ds_n + oh.to(tl.int64) * ds_h + ow.to(tl.int64) * ds_w
                    dyv = tl.load(DY + dy_off[:, None] + c_dy, mask=q_ok[:, None] & c_ok[None, :], other=0.0).to(ACC)
                    if t < KH * KW:
                        ih = oh * stride_h - pad_h + (t // KW) * dil_h
                        iw = ow * stride_w - pad_w + (t % KW) * dil_w
                        ok = q_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                        x_off = n * xs_n + ih.to(tl.int64) * xs_h + iw.to(tl.int64) * xs_w
                        xv = tl.load(X + x_off[:, None] + c_x, mask=ok[:, None] & c_ok[None, :], other=0.0).to(ACC)
                        acc += dyv * xv
                    else:
                        acc += dyv
            tl.store(row + t, tl.sum(acc, 0), mask=c_ok)

    @triton.jit
    def _pw_matmul(A, B, BIAS, Y, M, K, P, total, a_sm, a_sk, b_sn, b_sk, b_sp, y_sn, y_sm, y_sp,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
        """Y[n, m, p] = bias[m] + sum over k of A[m, k] B[n, k, p]: a 1x1 convolution's forward (A the
        weight (O, C), B x) or input gradient (A the weight transposed, B dy). The columns are the N x P
        positions (n, p) flattened, so a tile may span two images; P positions an image, each operand's
        spatial axes one strided axis (dense x: contiguous or channels-last). Programs: (column block,
        row block); K walked in BLOCK_K steps by tl.dot, accumulated in ACC."""
        j = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        j_ok = j < total
        m_ok = m < M
        n = j // P
        p = j % P
        b_col = n * b_sn + p * b_sp
        acc = tl.zeros([BLOCK_M, BLOCK_N], ACC)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(A + m[:, None].to(tl.int64) * a_sm + k[None, :].to(tl.int64) * a_sk,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(B + k[:, None].to(tl.int64) * b_sk + b_col[None, :], mask=k_ok[:, None] & j_ok[None, :],
                        other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
        if HAS_BIAS:
            acc += tl.load(BIAS + m, mask=m_ok, other=0.0).to(ACC)[:, None]
        y_off = m[:, None].to(tl.int64) * y_sm + (n * y_sn + p * y_sp)[None, :]
        tl.store(Y + y_off, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & j_ok[None, :])

    @triton.jit
    def _pw_weight_grad(DY, X, PART, O, C, P, total, chunk, dy_sn, dy_so, dy_sp, x_sn, x_sc, x_sp,
                        WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                        ACC: tl.constexpr):
        """PART[split, o, c] = sum over this split's chunk of the N x P positions q = (n, p) of
        dy[n, o, p] x[n, c, p] (a 1x1 convolution's weight gradient: a matmul over the positions), and
        PART[split, o, C] = the chunk's sum of dy[n, o, p] (the bias gradient; written by the column
        block 0 programs). Programs: (column block, row block, split); each chunk a whole number of
        BLOCK_K steps, added by tl.dot in order: deterministic."""
        o = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        o_ok = o < O
        c_ok = c < C
        start = tl.program_id(2).to(tl.int64) * chunk
        stop = tl.minimum(start + chunk, total)
        acc = tl.zeros([BLOCK_M, BLOCK_N], ACC)
        row_sum = tl.zeros([BLOCK_M], ACC)
        for q0 in range(start, stop, BLOCK_K):
            q = q0 + tl.arange(0, BLOCK_K)
            q_ok = q < stop
            n = q // P
            p = q % P
            a = tl.load(DY + o[:, None].to(tl.int64) * dy_so + (n * dy_sn + p * dy_sp)[None, :],
                        mask=o_ok[:, None] & q_ok[None, :], other=0.0)
            if WEIGHT_GRAD:
                b = tl.load(X + (n * x_sn + p * x_sp)[:, None] + c[None, :].to(tl.int64) * x_sc,
                            mask=q_ok[:, None] & c_ok[None, :], other=0.0)
                if UPCAST:
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION, out_dtype=ACC)
                else:
                    acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
            if BIAS_GRAD:
                row_sum += tl.sum(a.to(ACC), 1)
        row = PART + tl.program_id(2).to(tl.int64) * O * (C + 1) + o[:, None].to(tl.int64) * (C + 1)
        if WEIGHT_GRAD:
            tl.store(row + c[None, :], acc, mask=o_ok[:, None] & c_ok[None, :])
        if BIAS_GRAD:
            if tl.program_id(0) == 0:
                tl.store(row + C, row_sum[:, None], mask=o_ok[:, None])


def _depthwise_tiles(problem: Conv2dProblem) -> tuple[int, int]:
    block_p, block_c = problem.heuristics.tile(problem.channels_last)
    return block_p, min(block_c, next_pow2(max(problem.x_shape[1], 1)))


def _channel_blocks(problem: Conv2dProblem) -> int:
    """Programs along the channels: the forward's and input gradient's second grid axis (at most
    MAX_GRID_Y), the weight gradient's first."""
    return -(-problem.x_shape[1] // _depthwise_tiles(problem)[1])


def _weight_grad_splits(problem: Conv2dProblem, block_p: int, block_c: int) -> tuple[int, int]:
    """(splits, chunk): the N x OH x OW positions split among programs in whole BLOCK_P steps so
    that channel blocks x splits reach ``programs_per_sm`` per SM."""
    n, o, oh, ow = problem.out_shape
    total = n * oh * ow
    c_blocks = -(-problem.x_shape[1] // block_c)
    wanted = max(1, sm_count(problem.device) * problem.heuristics.programs_per_sm // c_blocks)
    steps = -(-total // block_p)
    splits = max(1, min(wanted, steps, MAX_GRID_Y))
    chunk = -(-steps // splits) * block_p
    return (-(-total // chunk) if total else 1), chunk


def _gradients_run(mask, rows: int, cols: int, splits: int, total: int, acc: torch.dtype, input_grad, weight_grad,
                   finish):
    """``run(tensors, outputs)`` of a backward plan (tensors (dy, x, weight), outputs (dx, dw, db),
    each made only if ``mask`` asks): dx by ``input_grad(dy, x, weight, dx)`` (zeros when dy is
    empty); the weight and bias gradients from (rows, cols) sums in ``acc``, the bias's in the last
    column, which ``weight_grad(dy, x, weight, part)`` writes as (splits, rows, cols) partials and
    ``finish`` (a ``column_sum``) adds in a fixed order (zeros when the ``total`` summed positions
    are none)."""
    want_dx, want_dw, want_db = mask

    def run(tensors, outputs):
        dy, x, weight = tensors
        dx, dw, db = outputs
        if want_dx and dx.numel():
            if dy.numel() == 0:
                dx.zero_()
            else:
                input_grad(dy, x, weight, dx)
        if want_dw or want_db:
            sums = torch.empty((rows, cols), dtype=acc, device=dy.device)
            if total == 0:
                sums.zero_()
            else:
                part = torch.empty((splits, rows, cols), dtype=acc, device=dy.device)
                weight_grad(dy, x, weight, part)
                finish(part, sums)
            if want_dw:
                dw.copy_(sums[:, :cols - 1].reshape(dw.shape))
            if want_db:
                db.copy_(sums[:, cols - 1])
    return run


# The 1x1 kernels' tile, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): chosen, not tuned; of nine tiles
# timed at ResNet-50's 1x1 shapes each reached 0.30-0.39x cuDNN's speed (geometric mean over the
# rows; benchmarks/NOTES.md "1x1 convolutions"), so the registry does not choose these kernels.
POINTWISE_TILE = (64, 128, 64, 4, 3)


def _pointwise_tile(problem: Conv2dProblem) -> tuple[int, int, int, int, int]:
    return problem.heuristics.pointwise_tile or POINTWISE_TILE


def _pointwise_meta(dtype: torch.dtype) -> dict:
    """The 1x1 kernels' tl.dot options: float32 operands multiplied exactly (PRECISION "ieee"; torch's
    cuDNN runs them in TF32 only while ``torch.backends.cudnn.allow_tf32`` is on); under the
    interpreter bfloat16 operands cast to float32 first (UPCAST: Triton 3.9's interpreter returned
    garbage from a bfloat16 tl.dot; the products are exact either way)."""
    return dict(PRECISION="ieee" if dtype == torch.float32 else "tf32",
                UPCAST=dtype == torch.bfloat16 and triton_interpreting())


def _positions_walkable(t: Tensor) -> Tensor:
    """``t`` (N, C, H, W) itself when its H x W positions walk as one strided axis (H's stride W times
    W's, or either axis of size 1: any dense layout, an expanded H of one-column images), else a
    contiguous copy: the 1x1 kernels read one position stride (``_spatial_stride``). The autograd
    engine may hand dy over in any strides (the gradient of y.sum(2) is an expand, of a transpose
    a transpose)."""
    h, w = t.shape[2], t.shape[3]
    return t if h == 1 or w == 1 or t.stride(2) == w * t.stride(3) else t.contiguous()


def _spatial_stride(t: Tensor) -> int:
    """The stride of the H x W positions of ``t`` walked as one axis (``_positions_walkable``): W's,
    or H's where W is 1 (a size-1 axis's stride is free)."""
    return t.stride(3) if t.shape[3] > 1 else t.stride(2)


def _pointwise_splits(problem: Conv2dProblem, block_m: int, block_n: int, block_k: int) -> tuple[int, int]:
    """(splits, chunk) of the weight gradient's N x OH x OW positions: whole BLOCK_K steps, enough
    splits for (output tiles x splits) to reach ``programs_per_sm`` per SM (the bias gradient alone:
    one column block)."""
    n, o, oh, ow = problem.out_shape
    total = n * oh * ow
    column_blocks = -(-problem.x_shape[1] // block_n) if problem.mask[1] else 1
    tiles = max(1, -(-o // block_m) * column_blocks)
    wanted = max(1, sm_count(problem.device) * problem.heuristics.programs_per_sm // tiles)
    steps = -(-total // block_k)
    splits = max(1, min(wanted, steps, MAX_GRID_Y))
    chunk = -(-steps // splits) * block_k
    return (-(-total // chunk) if total else 1), chunk


def _prepare_pointwise(problem: Conv2dProblem) -> Launch:
    """1x1 convolutions (``Conv2dProblem.pointwise``): the forward and the input gradient as one
    matmul kernel over the flattened positions (``_pw_matmul``), the weight and bias gradients as a
    matmul over the positions split among programs, float32 partials added in a fixed order."""
    if problem.dtype == torch.float64:
        raise UnsupportedError(f"trainops.{problem.op}: the triton backend's 1x1 kernels (tl.dot) take float32, "
                               "float16 and bfloat16, not float64; use the cudnn or cpu backend")
    block_m, block_n, block_k, warps, stages = _pointwise_tile(problem)
    n, c, height, width = problem.x_shape
    o = problem.weight_shape[0]
    positions = height * width
    total = n * positions
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ACC=tl.float32, num_warps=warps,
                num_stages=stages, **_pointwise_meta(problem.dtype))
    params = (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_K", block_k), ("num_warps", warps),
              ("num_stages", stages))
    column_blocks = max(1, -(-total // block_n))

    def row_blocks(rows: int) -> int:
        blocks = -(-rows // block_m)
        if blocks > MAX_GRID_Y:
            raise UnsupportedError(f"trainops.{problem.op}: {rows} channels make {blocks} blocks of {block_m}, "
                                   f"more than the {MAX_GRID_Y} programs the Triton kernels' grid takes on that axis; "
                                   "use the cudnn backend or a larger BLOCK_M (ConvHeuristics.pointwise_tile)")
        return max(1, blocks)

    if not problem.backward:
        forward = launcher(_pw_matmul, (column_blocks, row_blocks(o)), HAS_BIAS=problem.bias, **meta)

        def run(tensors, y):
            x, weight, bias = tensors
            if y.numel() == 0:
                return
            x = _positions_walkable(x)
            forward(weight, x, bias if bias is not None else weight, y, o, c, positions, total, weight.stride(0),
                    weight.stride(1), x.stride(0), x.stride(1), _spatial_stride(x), y.stride(0), y.stride(1),
                    _spatial_stride(y))

        return Launch(run, KernelChoice("conv2d_pointwise_triton", "triton", params), torch.float32)

    _, want_dw, want_db = problem.mask
    input_grad = launcher(_pw_matmul, (column_blocks, row_blocks(c)), HAS_BIAS=False, **meta)
    splits, chunk = _pointwise_splits(problem, block_m, block_n, block_k)
    # the bias gradient alone needs one column block (its row sums)
    weight_grad = launcher(_pw_weight_grad, (max(1, -(-c // block_n)) if want_dw else 1, row_blocks(o), splits),
                           WEIGHT_GRAD=want_dw, BIAS_GRAD=want_db, **meta)
    h = problem.heuristics
    finish = column_sum(splits, o * (c + 1), h.reduce_block, h.reduce_parts)

    def run_input_grad(dy, x, weight, dx):
        dy = _positions_walkable(dy)
        input_grad(weight, dy, weight, dx, c, o, positions, total, weight.stride(1), weight.stride(0), dy.stride(0),
                   dy.stride(1), _spatial_stride(dy), dx.stride(0), dx.stride(1), _spatial_stride(dx))

    def run_weight_grad(dy, x, weight, part):
        dy, x = _positions_walkable(dy), _positions_walkable(x)
        weight_grad(dy, x, part, o, c, positions, total, chunk, dy.stride(0), dy.stride(1), _spatial_stride(dy),
                    x.stride(0), x.stride(1), _spatial_stride(x))

    run = _gradients_run(problem.mask, o, c + 1, splits, total, torch.float32, run_input_grad, run_weight_grad, finish)
    params = params + (("splits", splits),)
    workspace = (splits + 1) * o * (c + 1) * 4
    return Launch(run, KernelChoice("conv2d_backward_pointwise_triton", "triton", params), torch.float32,
                  workspace_bytes=workspace)


def _prepare_triton(problem: Conv2dProblem) -> Launch:
    """The Triton backend's plan: the 1x1 kernels for a pointwise problem (not depthwise), the
    depthwise kernels for a depthwise one, UnsupportedError for any other."""
    if problem.pointwise and not problem.depthwise:
        return _prepare_pointwise(problem)
    if not problem.depthwise:
        raise UnsupportedError(f"trainops.{problem.op}: the triton backend runs depthwise convolutions and 1x1 "
                               "convolutions (one group, stride 1, no padding) only; got weight "
                               f"{problem.weight_shape} with groups {problem.groups}, stride {problem.stride}, padding "
                               f"{problem.padding} on x {problem.x_shape}; use the cudnn or cpu backend")
    h = problem.heuristics
    n, c, height, width = problem.x_shape
    _, _, kh, kw = problem.weight_shape
    _, _, oh, ow = problem.out_shape
    block_p, block_c = _depthwise_tiles(problem)
    acc = problem.acc_dtype
    acc_tl = tl.float64 if acc == torch.float64 else tl.float32
    geometry = (problem.stride[0], problem.stride[1], problem.padding[0], problem.padding[1], problem.dilation[0],
                problem.dilation[1])
    meta = dict(KH=kh, KW=kw, BLOCK_P=block_p, BLOCK_C=block_c, ACC=acc_tl, num_warps=h.warps)
    c_blocks = _channel_blocks(problem)
    if c_blocks > MAX_GRID_Y:
        raise UnsupportedError(f"trainops.{problem.op}: {c} channels make {c_blocks} channel blocks of {block_c}, more than "
                               f"the {MAX_GRID_Y} programs the Triton kernels' grid takes on that axis; use the cudnn "
                               "backend or larger block_channels (ConvHeuristics)")
    params = (("BLOCK_P", block_p), ("BLOCK_C", block_c), ("num_warps", h.warps))

    if not problem.backward:
        p_blocks = max(1, -(-oh * ow // block_p))
        forward = launcher(_dw_forward, (p_blocks * max(n, 1), c_blocks), HAS_BIAS=problem.bias, **meta)

        def run(tensors, y):
            x, weight, bias = tensors
            if y.numel() == 0:
                return
            forward(x, weight, bias if bias is not None else weight, y, c, height, width, oh, ow, p_blocks, *x.stride(),
                    *y.stride(), weight.stride(0), weight.stride(2), weight.stride(3), *geometry)

        return Launch(run, KernelChoice("conv2d_depthwise_triton", "triton", params), acc)

    _, want_dw, want_db = problem.mask
    p_blocks = max(1, -(-height * width // block_p))
    input_grad = launcher(_dw_input_grad, (p_blocks * max(n, 1), c_blocks), **meta)
    splits, chunk = _weight_grad_splits(problem, block_p, block_c)
    taps = kh * kw
    total = n * oh * ow
    weight_grad = launcher(_dw_weight_grad, (c_blocks, splits), WEIGHT_GRAD=want_dw, BIAS_GRAD=want_db,
                           INDEX=tl.int64 if total + chunk >= 2 ** 31 else tl.int32, **meta)
    finish = column_sum(splits, c * (taps + 1), h.reduce_block, h.reduce_parts)

    def run_input_grad(dy, x, weight, dx):
        input_grad(dy, weight, dx, c, height, width, oh, ow, p_blocks, *dy.stride(), *dx.stride(), weight.stride(0),
                   weight.stride(2), weight.stride(3), *geometry)

    def run_weight_grad(dy, x, weight, part):
        weight_grad(dy, x, part, c, height, width, oh, ow, total, chunk, *dy.stride(), *x.stride(), *geometry)

    run = _gradients_run(problem.mask, c, taps + 1, splits, total, acc, run_input_grad, run_weight_grad, finish)
    params = params + (("splits", splits),)
    workspace = (splits + 1) * c * (taps + 1) * acc.itemsize
    return Launch(run, KernelChoice("conv2d_backward_depthwise_triton", "triton", params), acc, workspace_bytes=workspace)


if triton_available():
    for _op in (FORWARD_OP, BACKWARD_OP):
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True,
                 accumulator="float32 (float64 for float64); 1x1: no float64", name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.conv2d / conv2d_backward, with autograd
# ----------------------------------------------------------------------------------------------

def is_channels_last_tensor(t: Tensor) -> bool:
    """Whether torch's ``suggest_memory_format`` calls ``t`` channels-last (its strides ordered as
    channels-last's; a (C, 1, KH, KW) depthwise weight moved to channels-last is, although it is
    also contiguous): the test torch's convolution makes of its input and weight."""
    if t.dim() != 4:
        return False
    if 1 not in t.shape:   # the usual cases, decided by two cheap queries (torch's rule agrees there)
        contiguous, channels_last = t.is_contiguous(), t.is_contiguous(memory_format=torch.channels_last)
        if contiguous != channels_last:
            return channels_last
    from torch._prims_common import suggest_memory_format   # size-1 axes, or neither layout: torch's rule

    return suggest_memory_format(t) == torch.channels_last


def output_channels_last(x: Tensor, weight: Tensor) -> bool:
    """y's and dx's format, as torch's convolution picks it: channels-last when x or the weight is."""
    return is_channels_last_tensor(x) or is_channels_last_tensor(weight)


def _dense(x: Tensor) -> Tensor:
    """x itself when contiguous or channels-last, else a contiguous copy (a view of other strides:
    the Triton kernels read strides, torch's pick their own layout; one rule for both)."""
    if x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last):
        return x
    return x.contiguous()


def _descriptor(op: str, x: Tensor, weight: Tensor, stride, padding, dilation, groups, bias: bool,
                mask=(False, False, False)):
    descriptor_type = Conv2dBackwardDescriptor if op == BACKWARD_OP else Conv2dDescriptor
    return descriptor_type(tuple(x.shape), tuple(weight.shape), x.dtype, x.device, stride=tuple(stride),
                           padding=tuple(padding), dilation=tuple(dilation), groups=groups, bias=bias, mask=tuple(mask),
                           channels_last=output_channels_last(x, weight),
                           weight_channels_last=is_channels_last_tensor(weight),
                           deterministic=torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic,
                           heuristics=heuristics_for(ConvHeuristics))


def _conv2d_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: list[int], padding: list[int],
                 dilation: list[int], groups: int) -> Tensor:
    x = _dense(x)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    plan = cached_plan(_descriptor(FORWARD_OP, x, weight, stride, padding, dilation, groups, bias is not None))
    plan.problem.check((x, weight, bias), None)
    return plan.run_unchecked((x, weight, bias))


def _conv2d_fake(x, weight, bias, stride, padding, dilation, groups):
    problem = _describe(FORWARD_OP, x.shape, weight.shape, x.dtype, x.device, stride=stride, padding=padding,
                        dilation=dilation, groups=groups, bias=bias is not None,
                        channels_last=output_channels_last(_dense(x), weight))
    shape = problem.out_shape
    strides = channels_last_strides(shape) if problem.channels_last else contiguous_strides(shape)
    return torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)


def _conv2d_backward_impl(dy: Tensor, x: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                          dilation: list[int], groups: int, mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    x = _dense(x)
    plan = cached_plan(_descriptor(BACKWARD_OP, x, weight, stride, padding, dilation, groups, mask[2], mask))
    plan.problem.check((dy, x, weight), None)
    return plan.run_unchecked((dy, x, weight))


def _conv2d_backward_fake(dy, x, weight, stride, padding, dilation, groups, mask):
    channels_last = output_channels_last(_dense(x), weight)
    empty = x.new_empty(0)
    strides = channels_last_strides(x.shape) if channels_last else contiguous_strides(x.shape)
    dx = torch.empty_strided(tuple(x.shape), strides, dtype=x.dtype, device=x.device) if mask[0] else empty
    w_strides = channels_last_strides(weight.shape) if is_channels_last_tensor(weight) else \
        contiguous_strides(weight.shape)
    dw = torch.empty_strided(tuple(weight.shape), w_strides, dtype=weight.dtype, device=weight.device) if mask[1] \
        else x.new_empty(0)
    db = weight.new_empty((weight.shape[0],)) if mask[2] else x.new_empty(0)
    return dx, dw, db


def _save(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(inputs.x, inputs.weight)
    ctx.geometry = (list(inputs.stride), list(inputs.padding), list(inputs.dilation), inputs.groups)
    ctx.has_bias = inputs.bias is not None
    # autograd runs a CUDA backward on its own thread, where the forward's context (heuristics in
    # force, a pinned backend) is not: both are kept for it
    ctx.heuristics = heuristics_for(ConvHeuristics)
    ctx.backend = pinned_backend()


def _grad(ctx, dy) -> dict:
    if dy is None:
        return {}
    if torch.is_grad_enabled():   # create_graph=True: the backward op records no graph of its own
        raise UnsupportedError("trainops.conv2d: double backward (create_graph=True) is not supported")
    x, weight = ctx.saved_tensors
    mask = [ctx.needs_grad.x, ctx.needs_grad.weight, ctx.has_bias and ctx.needs_grad.bias]
    if not any(mask):
        return {}
    with heuristics(ctx.heuristics), (pin_backend(ctx.backend) if ctx.backend else contextlib.nullcontext()):
        dx, dw, db = conv2d_backward_op(dy, x, weight, *ctx.geometry, mask)
    names = ("x", "weight", "bias")
    return {name: g for name, g, wanted in zip(names, (dx, dw, db), mask) if wanted}


# the outputs' formats follow the inputs' (channels-last in, channels-last out): Inductor must pass
# the inputs in the strides it traced, not a layout of its choosing
conv2d_backward_op = custom_op(BACKWARD_OP, _conv2d_backward_impl, _conv2d_backward_fake,
                               tags=(torch.Tag.needs_exact_strides,))
conv2d_op = custom_op(FORWARD_OP, _conv2d_impl, _conv2d_fake, backward=_grad, save=_save,
                      tags=(torch.Tag.needs_exact_strides,))
