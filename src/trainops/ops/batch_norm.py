"""Batch normalization over the channel axis (axis 1), forward and backward: Triton kernels, CPU
path, registrations and custom ops (ONNX Runtime's BatchNormalization / BatchNormalizationGrad).

x has shape (N, C, d1, ..., dk), k >= 0 (BatchNorm1d, 2d, 3d). Each channel c is normalized over
the R = N * d1 * ... * dk elements of its slice:

    training   mean = sum(x) / R, var = sum((x - mean)^2) / R (biased), rstd = 1 / sqrt(var + eps)
               running_mean <- (1 - momentum) * running_mean + momentum * mean
               running_var  <- (1 - momentum) * running_var + momentum * var * R / (R - 1)
    eval       mean = running_mean, rstd = 1 / sqrt(running_var + eps)
    both       y = (x - mean) * rstd * weight + bias

Backward, with xh = (x - mean) * rstd and g = dy * weight (weight 1 when absent):

    dweight = sum(dy * xh), dbias = sum(dy)                           (per channel, over R)
    training   dx = rstd * (g - mean(g) - xh * mean(g * xh))  =  weight * rstd * (dy - dbias / R - xh * dweight / R)
    eval       dx = g * rstd

torch.nn.functional.batch_norm's semantics: running statistics are updated in place only in
training mode and only when given; eval needs them. Dtypes: x (and dy) float32 / float16 /
bfloat16 / float64; weight, bias, running_mean, running_var any of those (gradients and updated
statistics in their own dtype); y and dx in x's dtype. Statistics and sums in float32 (float64 for
float64 x). Layouts: channels-first (contiguous) and channels-last, and any x whose spatial axes
walk as one strided axis (other views are copied first); y and dx keep x's memory format.

Deterministic and bit-identical run to run: every per-channel sum is taken per program over a
fixed range of the channel's elements (means and squared deviations combined tile by tile,
Chan's formula, so a large mean costs no precision), then across programs in a fixed order by the
last program of the channel block to finish. The only atomic is that program's ticket (an int32
counter a channel block), which decides who combines, never the order of a sum.

Triton plan: x is walked as (N', C, S') with S' the spatial axes (and N folded into them when
they merge, as in channels-last): a program owns BLOCK_C channels and a range of (n, spatial
block) tiles. Forward in training: the statistics kernel reads x once and writes each program's
partials; the last program of each channel block to arrive (``_last_to_arrive``: a release /
acquire ticket) merges its channels' partials, updates
the running statistics and writes (mean, rstd), all in the same launch; the apply kernel reads x
again and writes y (3 passes over x's bytes: read, read, write; 2 launches, 3 before). Backward:
partial sums of dy and dy * xh (reads dy, x) and, by the last program, their fixed-order totals
(dweight, dbias) in one launch, then dx (reads dy, x, writes dx): 2 launches, 3 before. The
normalising passes stay separate launches: they need every program's statistics (a grid-wide
barrier). The tickets and partials are kept by the plan on the default stream (the last program
sets its ticket back to 0), made anew on other streams (``_workspace``: CUDA graph captures and
graph-tree warm-ups, whose memory pools must not keep them), the tickets then zeroed by a fill.

Fused ReLU (``relu=True`` on batch_norm and batch_norm_backward; trainops.batch_norm_relu): y =
max(batch norm, 0), NaN kept; the backward recomputes y from x (the forward's expression, rounded
to y's dtype) in both backward kernels and zeroes dy where y <= 0 (torch's threshold_backward),
so the ReLU costs no launch, no pass and no saved tensor.

Synchronised (``sync_batch_norm``, torch.nn.SyncBatchNorm's semantics): in training the statistics
are the process group's whole batch. Each rank computes its own count n_r (a host int: its R),
mean (relative to a shift s_r, and s_r) and biased variance (``batch_norm_local_stats``: the
statistics kernels above, writing the variance); one all_gather of [n_r, mean_r - s_r, s_r, n_r *
var_r] (3C + 1 float64 values a rank) lets every rank combine them in float64 with Chan's formula,
in rank order, the means taken relative to the first non-empty rank's shift (N = sum n_r, mean =
sum n_r mean_r / N, M2 = sum (n_r var_r + n_r (mean_r - mean)^2), var = M2 / N): the same bits on
every rank, a rank with no element adding nothing, a mean far from zero keeping its precision. The running statistics take mean and M2 / (N - 1). y as
above. Backward: ``batch_norm_backward_reduce`` (this rank's sum(dy) and sum(dy * xh), and from them
dweight and dbias: this rank's sums, as torch's; DDP then averages them), one all_reduce (SUM) of
the two sums in the accumulator dtype, then ``batch_norm_backward_elemt`` with the group's means
sum / N. No host synchronisation besides the two collectives.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import merge_dims, next_pow2
from ..library import PLAIN_TENSORS, custom_op
from ..plan import (KernelChoice, Launch, Plan, _tracked, cached_plan, check_tensor, checked_shape, heuristics,
                    heuristics_for, keeps_plans, record_use)
from ..registry import (ACCUMULATOR, FLOATS, accumulator_dtype, normalize_device, pinned_backend, register,
                        register_op, sm_count, triton_available)
from ._common import check_heuristic_fields, float_dtype

STATS_OP, FORWARD_OP, BACKWARD_OP = "batch_norm_stats", "batch_norm", "batch_norm_backward"
# the synchronised variant's pieces (torch's names): this rank's statistics, this rank's gradient
# sums, dx from the group's
LOCAL_STATS_OP, REDUCE_OP, ELEMT_OP = ("batch_norm_local_stats", "batch_norm_backward_reduce",
                                      "batch_norm_backward_elemt")
OPS = (STATS_OP, FORWARD_OP, BACKWARD_OP, LOCAL_STATS_OP, REDUCE_OP, ELEMT_OP)
BACKWARD_OPS = (BACKWARD_OP, REDUCE_OP, ELEMT_OP)
MAX_RANK = 8


# ----------------------------------------------------------------------------------------------
# Heuristics
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchNormHeuristics:
    """The batch-norm family's tunables (trainops.heuristics(...) overrides them); a field left None
    takes the measured rule's value for the problem (``rule``: by layout, channels and positions).

    tile: elements of one (spatial block, channel block) tile a program loads per step.
    channel_block: channels a program owns when channels are the contiguous axis (channels-last);
        with spatial elements contiguous (channels-first) the tile's channels are tile // spatial
        block, at least 1. spatial_block: the largest spatial block.
    programs_per_sm: programs of the two reduction kernels (statistics, gradient sums) per SM; each
        writes one partial row per channel. warps: warps of every kernel.
    """

    tile: int | None = None
    channel_block: int | None = None
    spatial_block: int | None = None
    programs_per_sm: int | None = None
    warps: int = 4


class BatchNormTiles(NamedTuple):
    tile: int
    channel_block: int
    spatial_block: int
    programs_per_sm: int


# The defaults, fitted to a sweep of 27 tilings over ResNet-50's 14 batch-norm rows (7 shapes x 2
# layouts, bf16, forward + backward, GPU time against torch's; benchmarks/probe_batch_norm.py, H200,
# benchmarks/NOTES.md "Batch norm's tiles"), the rule with the best worst-row ratio, then the best
# geometric mean:
# - channels-first: tiles of 2048, 8 reduction programs per SM from 14 x 14 positions, 2 below (the
#   spatial block 512-2048 made no difference): worst row 1.55x torch, geometric mean 2.75x; the
#   earlier 4096 / 64 / 1024 / 4 lost at 64x512x7x7 (0.87x);
# - channels-last: tiles of 8192, 128 channels a program from 256 channels and 14 x 14 positions, 32
#   below, 2 programs per SM: worst 1.28x, mean 1.63x; the earlier tiling lost at 32x128x28x28 (0.90x).
# Rows without spatial axes ((N, C), BatchNorm1d) were not swept: they keep the earlier values.
MANY_POSITIONS = 14 * 14
WIDE_CHANNELS = 256


def rule(layout: str, channels: int, positions: int) -> BatchNormTiles:
    """The measured default tiles of a problem: ``layout`` "channels_first", "channels_last" or
    "no_spatial"; ``channels`` C; ``positions`` the spatial elements per channel and sample."""
    if layout == "channels_first":
        return BatchNormTiles(2048, 64, 1024, 8 if positions >= MANY_POSITIONS else 2)
    if layout == "channels_last":
        wide = channels >= WIDE_CHANNELS and positions >= MANY_POSITIONS
        return BatchNormTiles(8192, 128 if wide else 32, 1024, 2)
    if layout == "no_spatial":
        return BatchNormTiles(4096, 64, 1024, 4)
    raise ValueError(f"batch_norm.rule: layout {layout!r} is not channels_first, channels_last or no_spatial")


def tiles(h: BatchNormHeuristics, layout: str, channels: int, positions: int) -> BatchNormTiles:
    """``h``'s fields, those left None from ``rule(layout, channels, positions)``."""
    measured = rule(layout, channels, positions)
    return BatchNormTiles(*(measured[i] if value is None else value
                            for i, value in enumerate((h.tile, h.channel_block, h.spatial_block, h.programs_per_sm))))


# ----------------------------------------------------------------------------------------------
# Problem
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchNormProblem:
    """One batch-norm problem over x of ``shape`` (N, C, spatial...), one of three ops:

    batch_norm_stats     (x, running_mean, running_var) -> (mean, rstd) of the batch (training), the
                         running statistics (when given) updated in place
    batch_norm           (x, weight, bias, mean, rstd) -> y
    batch_norm_backward  (dy, x, weight, mean, rstd) -> (dx, dweight, dbias)

or one of the synchronised variant's three:

    batch_norm_local_stats     (x,) -> (mean, var): this rank's mean as (2, C) rows (the mean
                               relative to a shift, and the shift: each channel's first element on
                               the CPU path, its first tile's mean in the Triton kernels) and its
                               biased variance (0s without an element); no running statistics
    batch_norm_backward_reduce (dy, x, weight, mean, rstd) -> (sums, dweight, dbias): sums (2, C)
                               = (sum(dy), sum(dy * xh)) in the accumulator dtype (weight: its
                               dtype only)
    batch_norm_backward_elemt  (dy, x, weight, mean, rstd, sums) -> dx of the training formula,
                               sums (2, C) being the group's (sum(dy) / N, sum(dy * xh) / N)

    Absent optional tensors are None; absent outputs are empty tensors. mean and rstd: (C,) in
    the accumulator dtype (the batch's in training, the running statistics' in eval).
    ``strides``: x's, or (dy's, x's) for the backward ops; each one's spatial axes walk as one
    strided axis.
    """

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    strides: tuple[tuple[int, ...], ...]
    weight_dtype: torch.dtype | None
    bias_dtype: torch.dtype | None
    stats_dtype: torch.dtype | None      # running statistics' dtype (forward; None: not given)
    training: bool
    momentum: float
    eps: float
    input_grad: bool
    weight_grad: bool
    bias_grad: bool
    heuristics: BatchNormHeuristics
    relu: bool = False                   # batch_norm / batch_norm_backward: a ReLU fused after y
    index_dtype = None

    @cached_property
    def backward(self) -> bool:
        return self.op in BACKWARD_OPS

    @cached_property
    def stats(self) -> bool:
        return self.op in (STATS_OP, LOCAL_STATS_OP)

    @cached_property
    def variance(self) -> bool:
        """batch_norm_local_stats: the statistics kernels write the biased variance, not rstd."""
        return self.op == LOCAL_STATS_OP

    @cached_property
    def channels(self) -> int:
        return self.shape[1]

    @cached_property
    def reduced(self) -> int:
        """R: elements per channel."""
        return self.shape[0] * math.prod(self.shape[2:])

    @cached_property
    def acc_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    @cached_property
    def strided_names(self) -> tuple[str, ...]:
        return ("dy", "x") if self.backward else ("x",)

    def check(self, tensors: Sequence[Tensor | None], out) -> None:
        """Cheap checks of concrete tensors against the plan (shape, strides, dtype, device)."""
        if self.variance:
            names, per_channel = ("x",), {}
        elif self.stats:
            names = ("x", "running_mean", "running_var")
            per_channel = {"running_mean": self.stats_dtype, "running_var": self.stats_dtype}
        else:
            names = ("dy", "x", "weight", "mean", "rstd") if self.backward else ("x", "weight", "bias", "mean", "rstd")
            if self.op == ELEMT_OP:
                names += ("sums",)
            per_channel = {"weight": self.weight_dtype, "mean": self.acc_dtype, "rstd": self.acc_dtype}
            if not self.backward:
                per_channel["bias"] = self.bias_dtype
            elif self.relu:   # the fused ReLU's backward recomputes y: bias last
                names += ("bias",)
                per_channel["bias"] = self.bias_dtype
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(names)} tensors ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        given = dict(zip(names, tensors))
        for name, dtype in per_channel.items():
            if (given[name] is None) != (dtype is None):
                raise argument_error(InvalidProblemError, self.op, name,
                                     "is missing; the plan has one" if dtype is not None else
                                     "is given; the plan has none")
            if given[name] is not None:
                check_tensor(self.op, name, given[name], (self.channels,), dtype, self.device)
                if not given[name].is_contiguous():
                    raise argument_error(InvalidProblemError, self.op, name, "must be contiguous")
        for name, strides in zip(self.strided_names, self.strides):
            check_tensor(self.op, name, given[name], self.shape, self.dtype, self.device, strides)
        if self.op == ELEMT_OP:
            check_tensor(self.op, "sums", given["sums"], (2, self.channels), self.acc_dtype, self.device)
            if not given["sums"].is_contiguous():
                raise argument_error(InvalidProblemError, self.op, "sums", "must be contiguous")
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    @cached_property
    def out_strides(self) -> tuple[int, ...]:
        """y's and dx's strides: x's memory format (``output_strides``)."""
        return output_strides(self.shape, self.strides[-1])

    def like_x(self) -> Tensor:
        """A new tensor of x's shape and dtype in x's memory format."""
        return torch.empty_strided(self.shape, self.out_strides, dtype=self.dtype, device=self.device)

    def new_output(self):
        """Statistics: (mean, rstd) ((mean, var): local statistics); forward: y; backward: (dx,
        dweight, dbias) ((sums, dweight, dbias): reduce; dx: elemt). Absent outputs are empty."""
        def empty():  # an absent output: its own empty tensor (outputs of a custom op may not alias)
            return torch.empty(0, dtype=self.dtype, device=self.device)
        c = (self.channels,)
        if self.op == ELEMT_OP:
            return self.like_x()
        if self.backward:
            if self.op == REDUCE_OP:   # the sums in dx's place
                dx = torch.empty((2, self.channels), dtype=self.acc_dtype, device=self.device)
            else:
                dx = self.like_x() if self.input_grad else empty()
            dw = torch.empty(c, dtype=self.weight_dtype, device=self.device) if self.weight_grad else empty()
            db = torch.empty(c, dtype=self.bias_dtype, device=self.device) if self.bias_grad else empty()
            return dx, dw, db
        if self.stats:   # the local statistics' mean as (relative mean, shift) rows: see the class docstring
            return (torch.empty((2, self.channels) if self.variance else c, dtype=self.acc_dtype, device=self.device),
                    torch.empty(c, dtype=self.acc_dtype, device=self.device))
        return self.like_x()


def _dense_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` whose axes are ordered as in ``strides`` (largest
    first; ties keep the axis order): x's memory format for y and dx (channels-last stays
    channels-last), as torch's empty_like of a dense tensor."""
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], d))
    dense, step = [0] * len(shape), 1
    for d in reversed(order):
        dense[d] = step
        step *= max(shape[d], 1)
    return tuple(dense)


def output_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Strides of y and dx for x of ``strides`` (as the op reads it): x's memory format when x is
    dense (its axes' order, so channels-last stays channels-last), else contiguous (a crop of a
    channels-last tensor too, where torch's empty_like would keep channels-last)."""
    dense = _dense_strides(shape, strides)
    if all(a == b for a, b, size in zip(strides, dense, shape) if size > 1):
        return dense
    return _dense_strides(shape, range(len(shape), 0, -1))


def _walks(shape: Sequence[int], strides: Sequence[Sequence[int]]):
    """(N', S', ((n stride, channel stride, spatial stride) per tensor)) of (N, C, spatial...)
    walked as (N', C, S') by every tensor of ``strides`` alike: the spatial axes merged into one,
    and N folded into them when it walks on in every tensor (channels-last: one axis of N * S
    elements; no spatial axis: N itself). None when a tensor's spatial axes do not walk as one
    strided axis."""
    per = []
    for st in strides:
        spatial = merge_dims(shape[2:], st[2:]) if len(shape) > 2 else (1, 0)
        if spatial is None:
            return None
        per.append((st[0], st[1], spatial[1]))
    n, s = shape[0], math.prod(shape[2:])
    if s == 1:
        return 1, n, tuple((0, sc, sn) for sn, sc, _ in per)
    if n > 1 and all(sn == ss * s for sn, _, ss in per):
        return 1, n * s, tuple((0, sc, ss) for _, sc, ss in per)
    return n, s, tuple(per)


def _describe(op: str, shape, dtype, device="cuda", *, strides=None, weight_dtype=None, bias_dtype=None,
              stats_dtype=None, training=True, momentum=0.1, eps=1e-5, input_grad=True, weight_grad=None,
              bias_grad=None, heuristics=None, relu=False) -> BatchNormProblem:
    """Validate a batch-norm descriptor.

    shape: x's sizes (N, C, spatial...), rank 2..8. dtype: x's (and dy's). strides: None
    (contiguous) or x's strides (forward), (dy's, x's) (backward); spatial axes must walk as one
    strided axis. weight_dtype / bias_dtype: None when absent. stats_dtype: batch_norm_stats, the
    running statistics' dtype (None: not given). training: the backward's formula (mean and rstd
    are the batch's, else the running ones); the statistics are always the batch's (eval takes
    the running ones without this op) and the forward ignores it. momentum: in [0, 1]. eps: >= 0.
    input_grad / weight_grad /
    bias_grad: backward, which gradients to compute (weight_grad / bias_grad default to "the
    tensor is present"). heuristics: a BatchNormHeuristics. The synchronised variant's ops:
    batch_norm_local_stats takes no running statistics and any R (one element, or none);
    batch_norm_backward_reduce computes no dx (input_grad is False), batch_norm_backward_elemt
    only dx (weight_grad and bias_grad False), both with training's formula. relu: batch_norm and
    batch_norm_backward only, a ReLU fused after y (the backward then takes the bias, when present,
    after rstd, and bias_dtype is its dtype; bias_grad says whether its gradient is wanted).
    """
    backward = op in BACKWARD_OPS
    if op == REDUCE_OP:
        input_grad, training = False, True
    elif op == ELEMT_OP:
        input_grad, weight_grad, bias_grad, training = True, False, False, True
    first = "dy" if backward else "x"
    shape = checked_shape(op, "shape", shape)
    if not 2 <= len(shape) <= MAX_RANK:
        raise argument_error(UnsupportedError if len(shape) > MAX_RANK else InvalidProblemError, op, first,
                             f"has rank {len(shape)}; batch norm takes (N, C, ...) of rank 2 to {MAX_RANK}")
    dtype = float_dtype(op, first, dtype)
    weight_dtype = float_dtype(op, "weight", weight_dtype, optional=True)
    bias_dtype = float_dtype(op, "bias", bias_dtype, optional=True)
    stats_dtype = float_dtype(op, "running_mean", stats_dtype, optional=True)
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0 or math.isinf(eps):
        raise argument_error(InvalidProblemError, op, "eps", f"must be a finite number >= 0, got {eps!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= momentum <= 1:
        raise argument_error(InvalidProblemError, op, "momentum", f"must be a number in [0, 1], got {momentum!r}")
    training = bool(training)
    reduced = shape[0] * math.prod(shape[2:])
    if op == STATS_OP:
        if reduced == 1 and shape[1]:
            raise argument_error(InvalidProblemError, op, first, f"has shape {shape}: training needs more than 1 "
                                 "value per channel (as torch)")
    names = ("dy", "x") if backward else ("x",)
    if strides is None:
        strides = (None,) * len(names)
    if not isinstance(strides, (tuple, list)) or len(strides) != len(names):
        raise argument_error(InvalidProblemError, op, "strides", f"needs one entry per input ({', '.join(names)})")
    checked = []
    for name, st in zip(names, strides):
        if st is None:
            st = tuple(_dense_strides(shape, range(len(shape), 0, -1)))
        try:
            st = tuple(int(v) for v in st)
        except TypeError:
            raise argument_error(InvalidProblemError, op, "strides", f"must be sequences of ints, got {st!r}") from None
        if len(st) != len(shape) or any(v < 0 for v in st):
            raise argument_error(InvalidProblemError, op, name, f"has strides {st}: one non-negative stride per axis "
                                 f"of {shape}")
        if _walks(shape, [st]) is None:
            raise argument_error(UnsupportedError, op, name, f"has strides {st}: its spatial axes do not walk as one "
                                 "strided axis (copy it first; the custom op does)")
        checked.append(st)
    if weight_grad is None:
        weight_grad = weight_dtype is not None
    if bias_grad is None:
        bias_grad = bias_dtype is not None
    if backward and weight_grad and weight_dtype is None:
        raise argument_error(InvalidProblemError, op, "weight_grad", "is True without a weight")
    if backward and bias_grad and bias_dtype is None:
        raise argument_error(InvalidProblemError, op, "bias_grad", "is True without a bias dtype")
    if not isinstance(relu, bool):
        raise argument_error(InvalidProblemError, op, "relu", f"must be a bool, got {relu!r}")
    if relu and op not in (FORWARD_OP, BACKWARD_OP):
        raise argument_error(InvalidProblemError, op, "relu", f"is only for {FORWARD_OP} and {BACKWARD_OP}")
    if heuristics is None:
        heuristics = heuristics_for(BatchNormHeuristics)
    elif not isinstance(heuristics, BatchNormHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"must be a BatchNormHeuristics, got {type(heuristics).__name__}")
    # block sizes and warps powers of two (the kernels' tile shapes); None: the measured rule's
    check_heuristic_fields(op, heuristics, powers_of_two=("tile", "channel_block", "spatial_block", "warps"),
                           at_least_one=("programs_per_sm",),
                           optional=("tile", "channel_block", "spatial_block", "programs_per_sm"))
    if op in (STATS_OP, LOCAL_STATS_OP):
        weight_dtype = bias_dtype = None
    return BatchNormProblem(op, shape, dtype, device, tuple(checked), weight_dtype, bias_dtype,
                            stats_dtype if op == STATS_OP else None, training, float(momentum), float(eps),
                            bool(input_grad) if backward else True, bool(weight_grad) if backward else False,
                            bool(bias_grad) if backward else False, heuristics, relu)


def _describer(op: str):
    def describe(shape, dtype, device="cuda", *, strides=None, weight_dtype=None, bias_dtype=None, stats_dtype=None,
                 training=True, momentum=0.1, eps=1e-5, input_grad=True, weight_grad=None, bias_grad=None,
                 heuristics=None, relu=False) -> BatchNormProblem:
        return _describe(op, shape, dtype, device, strides=strides, weight_dtype=weight_dtype, bias_dtype=bias_dtype,
                         stats_dtype=stats_dtype, training=training, momentum=momentum, eps=eps,
                         input_grad=input_grad, weight_grad=weight_grad, bias_grad=bias_grad, heuristics=heuristics,
                         relu=relu)
    describe.__doc__ = _describe.__doc__
    return describe


BatchNormStatsDescriptor = register_op(STATS_OP, _describer(STATS_OP))
BatchNormDescriptor = register_op(FORWARD_OP, _describer(FORWARD_OP))
BatchNormBackwardDescriptor = register_op(BACKWARD_OP, _describer(BACKWARD_OP))
BatchNormLocalStatsDescriptor = register_op(LOCAL_STATS_OP, _describer(LOCAL_STATS_OP))
BatchNormReduceDescriptor = register_op(REDUCE_OP, _describer(REDUCE_OP))
BatchNormElemtDescriptor = register_op(ELEMT_OP, _describer(ELEMT_OP))


# ----------------------------------------------------------------------------------------------
# CPU path: torch's CPU ops in the accumulator dtype (the same formulas as the kernels)
# ----------------------------------------------------------------------------------------------

def _per_channel(v: Tensor, rank: int) -> Tensor:
    return v.reshape((1, -1) + (1,) * (rank - 2))


def _cpu_stats(problem: BatchNormProblem, tensors, outputs) -> None:
    x, running_mean, running_var = tensors if not problem.variance else (tensors[0], None, None)
    mean, rstd = outputs   # (mean, var) for the local statistics
    acc, rank = problem.acc_dtype, len(problem.shape)
    xa = x.to(acc)
    dims = (0,) + tuple(range(2, rank))
    # summed after a shift (each channel's first element), as the kernels: a mean far from 0 keeps
    # its precision (torch's float32 mean alone was off by 1e-3 at 1e4)
    shift = xa.select(0, 0).reshape(problem.channels, -1)[:, 0]
    shifted = xa - _per_channel(shift, rank)
    relative = shifted.mean(dims)
    if problem.variance:   # the relative mean and the shift apart: the group's combine keeps them precise
        mean[0].copy_(relative)
        mean[1].copy_(shift)
        rstd.copy_((shifted - _per_channel(relative, rank)).square().mean(dims))
        return
    mean.copy_(shift + relative)
    var = (xa - _per_channel(mean, rank)).square().mean(dims)
    torch.rsqrt(var + problem.eps, out=rstd)
    if running_mean is not None:
        m, r = problem.momentum, problem.reduced
        running_mean.copy_((1 - m) * running_mean.to(acc) + m * mean)
        running_var.copy_((1 - m) * running_var.to(acc) + m * var * (r / (r - 1)))


def _cpu_forward(problem: BatchNormProblem, tensors, y) -> None:
    x, weight, bias, mean, rstd = tensors
    acc, rank = problem.acc_dtype, len(problem.shape)
    # the kernels' expression: (x - mean) * (rstd * weight) + bias (the fused ReLU's backward repeats it)
    out = (x.to(acc) - _per_channel(mean, rank)) * _per_channel(rstd * (weight.to(acc) if weight is not None else 1),
                                                                rank)
    if bias is not None:
        out = out + _per_channel(bias.to(acc), rank)
    y.copy_(out.clamp_min(0) if problem.relu else out)   # clamp_min keeps NaN, as torch.relu


def _cpu_backward(problem: BatchNormProblem, tensors, outputs) -> None:
    dy, x, weight, mean, rstd = tensors[:5]
    acc, rank = problem.acc_dtype, len(problem.shape)
    dims = (0,) + tuple(range(2, rank))
    dya = dy.to(acc)
    xh = (x.to(acc) - _per_channel(mean, rank)) * _per_channel(rstd, rank)
    scale = _per_channel(rstd * (weight.to(acc) if weight is not None else 1), rank)
    if problem.relu:   # the forward's y recomputed (its expression and dtype): dy where the ReLU passed it
        bias = tensors[5]
        y = (x.to(acc) - _per_channel(mean, rank)) * scale
        if bias is not None:
            y = y + _per_channel(bias.to(acc), rank)
        dya = dya.masked_fill(y.to(problem.dtype) <= 0, 0)
    if problem.op == ELEMT_OP:   # the group's means given
        mean_dy, mean_dy_xh = tensors[5]
        outputs.copy_(scale * (dya - _per_channel(mean_dy, rank) - xh * _per_channel(mean_dy_xh, rank)))
        return
    dx, dweight, dbias = outputs   # sums in place of dx: reduce
    sum_dy, sum_dy_xh = dya.sum(dims), (dya * xh).sum(dims)
    if problem.op == REDUCE_OP:
        dx[0].copy_(sum_dy)
        dx[1].copy_(sum_dy_xh)
    if problem.weight_grad:
        dweight.copy_(sum_dy_xh)
    if problem.bias_grad:
        dbias.copy_(sum_dy)
    if problem.input_grad:
        if problem.training:
            r = problem.reduced
            dx.copy_(scale * (dya - _per_channel(sum_dy / r, rank) - xh * _per_channel(sum_dy_xh / r, rank)))
        else:
            dx.copy_(scale * dya)


def _prepare_cpu(problem: BatchNormProblem) -> Launch:
    compute = _cpu_backward if problem.backward else _cpu_stats if problem.stats else _cpu_forward

    def run(tensors, outputs):
        if problem.channels == 0:
            return
        if problem.reduced == 0:
            _write_empty(problem, tensors, outputs)
            return
        compute(problem, tensors, outputs)

    return Launch(run, KernelChoice(f"{problem.op}_cpu", "cpu", ()), problem.acc_dtype)


def _write_empty(problem: BatchNormProblem, tensors, outputs) -> None:
    """No element in a channel (N = 0 or a zero-size spatial axis), as torch: the running
    statistics are left alone (the batch's mean and rstd are 0 and 1: nothing reads them; the
    local statistics' mean and variance 0 and 0: a rank that adds nothing to the group's).
    Backward: zero weight and bias gradients (and reduce's sums); elemt: dx has no element."""
    if problem.op == ELEMT_OP:
        return
    if problem.backward:
        for grad in outputs[1:] if problem.op != REDUCE_OP else outputs:
            grad.zero_()
    elif problem.stats:
        mean, rstd = outputs
        mean.zero_()
        rstd.fill_(0.0 if problem.variance else 1.0)


for _op in OPS:
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
             name=f"{_op}_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _tile(unit, S, S_BLOCKS, sn, ss, sc, c, BLOCK_S: tl.constexpr):
        """Offsets, spatial mask and element count of tile ``unit`` = (n, spatial block) for the
        channels ``c``: [BLOCK_S, BLOCK_C]."""
        n = unit // S_BLOCKS
        s = (unit - n * S_BLOCKS) * BLOCK_S + tl.arange(0, BLOCK_S)
        offsets = n.to(tl.int64) * sn + s.to(tl.int64)[:, None] * ss + c.to(tl.int64)[None, :] * sc
        return offsets, s < S, tl.minimum(S - (unit - n * S_BLOCKS) * BLOCK_S, BLOCK_S)

    @triton.jit
    def _bn_stats(X, PART, COUNTER, MEAN, RSTD, RUNNING_MEAN, RUNNING_VAR, C, S, S_BLOCKS, UNITS,
                  units_per_program, sn, sc, ss, R, momentum, eps,
                  HAS_RUNNING: tl.constexpr, VARIANCE: tl.constexpr, ACC: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
        """Partial statistics of BLOCK_C channels over this program's tiles (at least one):
        PART[0, p, c] the elements' count, [1] their mean minus [3], [2] their squared deviations,
        [3] the shift: the program's first tile's mean. Elements are summed after the shift (sums
        of x - shift and of its square, kept per tile slot in registers and reduced once after the
        loop), so that a mean far from 0 costs no precision: the squared deviations are
        sum((x - shift)^2) - count * (mean - shift)^2, which cancels only when the channel's mean
        lies many standard deviations from its first tile's."""
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < C
        p = tl.program_id(1)
        first = p * units_per_program
        last = tl.minimum(first + units_per_program, UNITS)
        offsets, s_mask, k = _tile(first, S, S_BLOCKS, sn, ss, sc, c, BLOCK_S)
        mask = s_mask[:, None] & c_mask[None, :]
        shift = tl.sum(tl.load(X + offsets, mask=mask, other=0.0).to(ACC), 0) / k.to(ACC)
        total = tl.zeros([BLOCK_S, BLOCK_C], ACC)
        squares = tl.zeros([BLOCK_S, BLOCK_C], ACC)
        count = tl.zeros([BLOCK_C], ACC)
        for unit in range(first, last):
            offsets, s_mask, k = _tile(unit, S, S_BLOCKS, sn, ss, sc, c, BLOCK_S)
            mask = s_mask[:, None] & c_mask[None, :]
            x = tl.where(mask, tl.load(X + offsets, mask=mask, other=0.0).to(ACC) - shift[None, :], 0.0)
            total += x
            squares += x * x
            count += k.to(ACC)
        mean = tl.sum(total, 0) / count
        m2 = tl.maximum(tl.sum(squares, 0) - count * mean * mean, 0.0)
        row = p.to(tl.int64) * C + c
        planes = tl.num_programs(1).to(tl.int64) * C
        tl.store(PART + row, count, mask=c_mask)
        tl.store(PART + planes + row, mean, mask=c_mask)
        tl.store(PART + 2 * planes + row, m2, mask=c_mask)
        tl.store(PART + 3 * planes + row, shift, mask=c_mask)
        if _last_to_arrive(COUNTER):
            _bn_stats_combine(PART, MEAN, RSTD, RUNNING_MEAN, RUNNING_VAR, tl.num_programs(1), C, R, momentum, eps,
                              c, c_mask, HAS_RUNNING, VARIANCE, ACC, BLOCK_P, BLOCK_C)

    @triton.jit
    def _partials(PART, planes, p0, P, C, c, c_mask, base, BLOCK_P: tl.constexpr):
        """Partials p0 .. p0 + BLOCK_P of the channels ``c``: (count, mean relative to ``base``,
        squared deviations), [BLOCK_P, BLOCK_C] each (zero past P)."""
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & c_mask[None, :]
        rows = p.to(tl.int64)[:, None] * C + c[None, :]
        k = tl.load(PART + rows, mask=mask, other=0.0, volatile=True)
        relative = tl.load(PART + planes + rows, mask=mask, other=0.0, volatile=True) + (
            tl.load(PART + 3 * planes + rows, mask=mask, other=0.0, volatile=True) - base[None, :])
        return k, relative, tl.load(PART + 2 * planes + rows, mask=mask, other=0.0, volatile=True)

    @triton.jit
    def _last_to_arrive(COUNTER):
        """Whether this program is the last of its channel block (axis 0) to reach this point: a
        ticket from the block's int32 counter (zeroed before the launch; set back to 0 by the last
        program). The barrier puts every
        thread's partial stores before the release of the ticket; the acquire side lets the last
        program read them (volatile loads)."""
        tl.debug_barrier()
        arrived = tl.atomic_add(COUNTER + tl.program_id(0), 1, sem="acq_rel")
        last = arrived == tl.num_programs(1) - 1
        if last:   # zeroed again for the plan's next launch (_workspace keeps the tickets)
            tl.store(COUNTER + tl.program_id(0), 0)
        return last

    @triton.jit
    def _bn_stats_combine(PART, MEAN, RSTD, RUNNING_MEAN, RUNNING_VAR, P, C, R, momentum, eps, c, c_mask,
                          HAS_RUNNING: tl.constexpr, VARIANCE: tl.constexpr, ACC: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """The P partials of each channel combined: mean, rstd (VARIANCE: the biased variance in
        its place); the running statistics updated in
        place (their own dtype; unbiased variance R / (R - 1)). Partial means are taken relative
        to the first partial's shift (base), then two passes over [BLOCK_P, BLOCK_C] tiles of
        partials: the mean (sum of count * relative mean / R), then the squared deviations (sum
        of each partial's plus count * (its mean - the mean)^2). Fixed tiles and reduction trees:
        the same bits every run, whichever program runs it."""
        planes = (P + tl.zeros([], tl.int64)) * C   # P may arrive as the int 1 (specialised)
        base = tl.load(PART + 3 * planes + c, mask=c_mask, other=0.0, volatile=True)
        weighted = tl.zeros([BLOCK_P, BLOCK_C], ACC)
        for p0 in range(0, P, BLOCK_P):
            k, relative, _ = _partials(PART, planes, p0, P, C, c, c_mask, base, BLOCK_P)
            weighted += k * relative
        mean = tl.sum(weighted, 0) / R   # relative to base
        spread = tl.zeros([BLOCK_P, BLOCK_C], ACC)
        for p0 in range(0, P, BLOCK_P):
            k, relative, m2 = _partials(PART, planes, p0, P, C, c, c_mask, base, BLOCK_P)
            d = relative - mean[None, :]
            spread += m2 + k * d * d
        m2 = tl.sum(spread, 0)
        var = m2 / R
        if VARIANCE:   # the local statistics: the mean relative to base, then base (rows of MEAN)
            tl.store(MEAN + c, mean, mask=c_mask)
            tl.store(MEAN + C + c, base, mask=c_mask)
            tl.store(RSTD + c, var, mask=c_mask)
        else:
            mean += base
            tl.store(MEAN + c, mean, mask=c_mask)
            tl.store(RSTD + c, 1.0 / tl.sqrt(var + eps), mask=c_mask)
        if HAS_RUNNING:
            rm = tl.load(RUNNING_MEAN + c, mask=c_mask, other=0.0).to(ACC)
            rv = tl.load(RUNNING_VAR + c, mask=c_mask, other=0.0).to(ACC)
            unbiased = m2 / (R - 1)
            tl.store(RUNNING_MEAN + c, ((1 - momentum) * rm + momentum * mean).to(RUNNING_MEAN.dtype.element_ty),
                     mask=c_mask)
            tl.store(RUNNING_VAR + c, ((1 - momentum) * rv + momentum * unbiased).to(RUNNING_VAR.dtype.element_ty),
                     mask=c_mask)

    @triton.jit
    def _bias(B, c, c_mask, HAS_B: tl.constexpr, ACC: tl.constexpr, BLOCK_C: tl.constexpr):
        """The channels' bias in ACC (zeros without one)."""
        bias = tl.zeros([BLOCK_C], ACC)
        if HAS_B:
            bias = tl.load(B + c, mask=c_mask, other=0.0).to(ACC)
        return bias

    @triton.jit
    def _normalized(x, mean, scale, bias, HAS_B: tl.constexpr):
        """(x - mean) * scale + bias of a [BLOCK_S, BLOCK_C] tile, the forward's expression: the
        backward of the fused ReLU recomputes it to find the elements the ReLU zeroed."""
        # x - mean first: x * scale - mean * scale would cancel in float32 when |mean| >> std
        y = (x - mean[None, :]) * scale[None, :]
        if HAS_B:
            y += bias[None, :]
        return y

    @triton.jit
    def _relu_masked(dy, x, mean, scale, bias, DT: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr):
        """dy where the fused ReLU passed its input (y, stored in DT, not <= 0), else 0: torch's
        threshold_backward on the forward's y, recomputed from x."""
        # y rounded to DT, compared in ACC (Triton's interpreter compares bfloat16 values as integers)
        y = _normalized(x, mean, scale, bias, HAS_B).to(DT).to(ACC)
        return tl.where(y <= 0, 0.0, dy)

    @triton.jit
    def _bn_apply(X, Y, W, B, MEAN, RSTD, C, S, S_BLOCKS, x_sn, x_sc, x_ss, y_sn, y_sc, y_ss,
                  HAS_W: tl.constexpr, HAS_B: tl.constexpr, RELU: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        """y = (x - mean) * rstd * weight + bias (RELU: then max(y, 0), NaN kept) over one tile a
        program (tiles on axis 0, channel blocks on axis 1)."""
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < C
        unit = tl.program_id(0)
        x_off, s_mask, _ = _tile(unit, S, S_BLOCKS, x_sn, x_ss, x_sc, c, BLOCK_S)
        y_off, _, _ = _tile(unit, S, S_BLOCKS, y_sn, y_ss, y_sc, c, BLOCK_S)
        mask = s_mask[:, None] & c_mask[None, :]
        scale = tl.load(RSTD + c, mask=c_mask, other=0.0)
        if HAS_W:
            scale = scale * tl.load(W + c, mask=c_mask, other=0.0).to(ACC)
        mean = tl.load(MEAN + c, mask=c_mask, other=0.0)
        x = tl.load(X + x_off, mask=mask, other=0.0).to(ACC)
        y = _normalized(x, mean, scale, _bias(B, c, c_mask, HAS_B, ACC, BLOCK_C), HAS_B)
        if RELU:
            y = tl.where(y < 0, 0.0, y)
        tl.store(Y + y_off, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bn_grad_sums(DY, X, W, B, MEAN, RSTD, PART, COUNTER, SUMS, DW, DB, C, S, S_BLOCKS, UNITS, units_per_program,
                      dy_sn, dy_sc, dy_ss, x_sn, x_sc, x_ss,
                      DW_WANTED: tl.constexpr, DB_WANTED: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                      RELU: tl.constexpr, ACC: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                      BLOCK_P: tl.constexpr):
        """Partial sums of dy (PART[0, p, c]) and dy * xh (PART[1, p, c]) over this program's tiles
        (RELU: dy zeroed where the fused ReLU zeroed y); the last program of the channel block to
        arrive sums the partials (``_bn_grad_combine``): one launch for the sums and their totals."""
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < C
        p = tl.program_id(1)
        first = p * units_per_program
        last = tl.minimum(first + units_per_program, UNITS)
        mean = tl.load(MEAN + c, mask=c_mask, other=0.0)
        rstd = tl.load(RSTD + c, mask=c_mask, other=0.0)
        scale = rstd
        if HAS_W:
            scale = scale * tl.load(W + c, mask=c_mask, other=0.0).to(ACC)
        bias = _bias(B, c, c_mask, HAS_B, ACC, BLOCK_C)   # HAS_B: with RELU only
        sum_dy = tl.zeros([BLOCK_S, BLOCK_C], ACC)
        sum_dy_xh = tl.zeros([BLOCK_S, BLOCK_C], ACC)
        for unit in range(first, last):
            dy_off, s_mask, _ = _tile(unit, S, S_BLOCKS, dy_sn, dy_ss, dy_sc, c, BLOCK_S)
            x_off, _, _ = _tile(unit, S, S_BLOCKS, x_sn, x_ss, x_sc, c, BLOCK_S)
            mask = s_mask[:, None] & c_mask[None, :]
            dy = tl.load(DY + dy_off, mask=mask, other=0.0).to(ACC)
            x = tl.load(X + x_off, mask=mask, other=0.0).to(ACC)
            if RELU:
                dy = _relu_masked(dy, x, mean, scale, bias, DY.dtype.element_ty, HAS_B, ACC)
            sum_dy += dy
            sum_dy_xh += dy * ((x - mean[None, :]) * rstd[None, :])
        row = p.to(tl.int64) * C + c
        tl.store(PART + row, tl.sum(sum_dy, 0), mask=c_mask)
        tl.store(PART + tl.num_programs(1).to(tl.int64) * C + row, tl.sum(sum_dy_xh, 0), mask=c_mask)
        if _last_to_arrive(COUNTER):
            _bn_grad_combine(PART, SUMS, DW, DB, tl.num_programs(1), C, c, c_mask, DW_WANTED, DB_WANTED, ACC,
                             BLOCK_P, BLOCK_C)

    @triton.jit
    def _bn_grad_combine(PART, SUMS, DW, DB, P, C, c, c_mask, DW_WANTED: tl.constexpr, DB_WANTED: tl.constexpr,
                         ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """The P partials of the channels ``c`` summed over [BLOCK_P, BLOCK_C] tiles (fixed tiles and
        reduction tree: the same bits every run, whichever program runs it): SUMS[0] = sum(dy)
        (= dbias), SUMS[1] = sum(dy * xh) (= dweight), both also written in the parameters' dtypes
        when wanted."""
        planes = (P + tl.zeros([], tl.int64)) * C   # P may arrive as the int 1 (specialised)
        tile_dy = tl.zeros([BLOCK_P, BLOCK_C], ACC)
        tile_dy_xh = tl.zeros([BLOCK_P, BLOCK_C], ACC)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            mask = (p < P)[:, None] & c_mask[None, :]
            rows = p.to(tl.int64)[:, None] * C + c[None, :]
            tile_dy += tl.load(PART + rows, mask=mask, other=0.0, volatile=True)
            tile_dy_xh += tl.load(PART + planes + rows, mask=mask, other=0.0, volatile=True)
        sum_dy = tl.sum(tile_dy, 0)
        sum_dy_xh = tl.sum(tile_dy_xh, 0)
        tl.store(SUMS + c, sum_dy, mask=c_mask)
        tl.store(SUMS + C + c, sum_dy_xh, mask=c_mask)
        if DW_WANTED:
            tl.store(DW + c, sum_dy_xh.to(DW.dtype.element_ty), mask=c_mask)
        if DB_WANTED:
            tl.store(DB + c, sum_dy.to(DB.dtype.element_ty), mask=c_mask)

    @triton.jit
    def _bn_grad_input(DY, X, DX, W, B, MEAN, RSTD, SUMS, C, S, S_BLOCKS, R,
                       dy_sn, dy_sc, dy_ss, x_sn, x_sc, x_ss, dx_sn, dx_sc, dx_ss,
                       TRAINING: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, RELU: tl.constexpr,
                       ACC: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        """dx over one tile a program: training, weight * rstd * (dy - sum(dy) / R - xh * sum(dy * xh) / R);
        eval, dy * weight * rstd (tiles on axis 0, channel blocks on axis 1); RELU: dy zeroed first
        where the fused ReLU zeroed y."""
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < C
        unit = tl.program_id(0)
        dy_off, s_mask, _ = _tile(unit, S, S_BLOCKS, dy_sn, dy_ss, dy_sc, c, BLOCK_S)
        dx_off, _, _ = _tile(unit, S, S_BLOCKS, dx_sn, dx_ss, dx_sc, c, BLOCK_S)
        mask = s_mask[:, None] & c_mask[None, :]
        rstd = tl.load(RSTD + c, mask=c_mask, other=0.0)
        scale = rstd
        if HAS_W:
            scale = scale * tl.load(W + c, mask=c_mask, other=0.0).to(ACC)
        dy = tl.load(DY + dy_off, mask=mask, other=0.0).to(ACC)
        if TRAINING or RELU:
            x_off, _, _ = _tile(unit, S, S_BLOCKS, x_sn, x_ss, x_sc, c, BLOCK_S)
            x = tl.load(X + x_off, mask=mask, other=0.0).to(ACC)
            mean = tl.load(MEAN + c, mask=c_mask, other=0.0)
        if RELU:
            dy = _relu_masked(dy, x, mean, scale, _bias(B, c, c_mask, HAS_B, ACC, BLOCK_C), DY.dtype.element_ty,
                              HAS_B, ACC)
        if TRAINING:
            mean_dy = tl.load(SUMS + c, mask=c_mask, other=0.0) / R
            mean_dy_xh = tl.load(SUMS + C + c, mask=c_mask, other=0.0) / R
            xh = (x - mean[None, :]) * rstd[None, :]
            dx = scale[None, :] * (dy - mean_dy[None, :] - xh * mean_dy_xh[None, :])
        else:
            dx = dy * scale[None, :]
        tl.store(DX + dx_off, dx.to(DX.dtype.element_ty), mask=mask)


COMBINE_TILE = 4096   # elements of the last program's [BLOCK_P, BLOCK_C] tile of partials (unmeasured)


def _workspace(kept: dict, tickets: int, elements: int, dtype: torch.dtype, t: Tensor) -> tuple[Tensor, Tensor]:
    """(int32 tickets, zeroed, one per channel block; ``elements`` partials in ``dtype``) for one
    launch on ``t``'s device.

    On a CUDA device's default stream (and on the CPU) they are made once and kept in ``kept`` (the
    plan's), the kernels' last programs setting the tickets back to 0: no allocation and no fill a
    call, and the launches of one plan on one stream follow one another. Elsewhere (a side stream:
    a CUDA graph capture, capture_step's warm-up, a CUDA graph tree's warm-up and recording) they are
    new each call, the tickets zeroed by a fill: a tensor kept from there would sit in the graph's
    memory pool, which torch.compile's reduce-overhead checks for strays."""
    device = t.get_device()
    if device < 0 or torch._C._cuda_getCurrentRawStream(device) == 0:
        found = kept.get(device)
        if found is None:
            found = kept[device] = (torch.zeros(tickets, dtype=torch.int32, device=t.device),
                                    torch.empty(elements, dtype=dtype, device=t.device))
        return found
    return (torch.zeros(tickets, dtype=torch.int32, device=t.device),
            torch.empty(elements, dtype=dtype, device=t.device))


@dataclass(frozen=True)
class BatchNormConfig:
    """A Triton plan: the tile (spatial block x channel block), warps, reduction programs."""

    block_s: int
    block_c: int
    num_warps: int
    programs: int            # reduction programs along the tiles (per channel block)
    units_per_program: int


def _problem_walks(problem: BatchNormProblem):
    """``_walks`` of the inputs (x; dy, x) and the output (y; dx) together, so that a tile is the
    same elements in each: (N', S', (strides of each, the output's last))."""
    return _walks(problem.shape, problem.strides + (problem.out_strides,))


def _config(problem: BatchNormProblem) -> BatchNormConfig:
    """Channels contiguous (channels-last, or (N, C)): BLOCK_C up to ``channel_block`` and the
    spatial block filling the tile; otherwise the spatial block first (up to ``spatial_block``),
    channels filling the tile. Reduction programs: about ``programs_per_sm`` per SM over all
    channel blocks, each a whole number of tiles."""
    n_prime, s, per = _problem_walks(problem)
    _, sc, ss = per[-2]   # x's
    c = problem.channels
    channels_inner = sc == 1 and ss != 1
    layout = "no_spatial" if len(problem.shape) == 2 else "channels_last" if channels_inner else "channels_first"
    t = tiles(problem.heuristics, layout, c, math.prod(problem.shape[2:]))
    if channels_inner:
        block_c = min(next_pow2(c), t.channel_block)
        block_s = max(1, min(next_pow2(s), t.tile // block_c))
    else:
        block_s = min(next_pow2(s), t.spatial_block)
        block_c = max(1, min(next_pow2(c), t.tile // block_s))
    n_units = -(-s // block_s) * n_prime
    c_blocks = -(-c // block_c)
    wanted = max(1, (sm_count(problem.device) * t.programs_per_sm) // max(c_blocks, 1))
    units_per_program = max(1, -(-n_units // wanted))
    programs = max(1, -(-n_units // units_per_program))
    return BatchNormConfig(block_s, block_c, problem.heuristics.warps, programs, units_per_program)


def _prepare_triton(problem: BatchNormProblem, config: BatchNormConfig | None = None) -> Launch:
    config = config or _config(problem)
    acc = problem.acc_dtype
    acc_tl = tl.float64 if acc == torch.float64 else tl.float32
    c, r = problem.channels, problem.reduced
    n_prime, s, walks = _problem_walks(problem)
    s_blocks = -(-s // config.block_s)
    units = n_prime * s_blocks
    c_blocks = -(-c // config.block_c)
    tile = dict(ACC=acc_tl, BLOCK_S=config.block_s, BLOCK_C=config.block_c, num_warps=config.num_warps)
    x_sn, x_sc, x_ss = walks[-2]
    o_sn, o_sc, o_ss = walks[-1]
    # the last program's combine: [BLOCK_P, BLOCK_C] tiles of partials, at most COMBINE_TILE elements
    combine_rows = max(1, min(next_pow2(config.programs), COMBINE_TILE // config.block_c))
    relu, has_b = problem.relu, problem.bias_dtype is not None
    kept: dict = {}   # _workspace's, by device
    params = (("BLOCK_S", config.block_s), ("BLOCK_C", config.block_c), ("num_warps", config.num_warps),
              ("programs", config.programs), ("units_per_program", config.units_per_program))

    if problem.stats:
        stats = launcher(_bn_stats, (c_blocks, config.programs),
                         trailing=(c, s, s_blocks, units, config.units_per_program, x_sn, x_sc, x_ss, r,
                                   problem.momentum, problem.eps),
                         HAS_RUNNING=problem.stats_dtype is not None, VARIANCE=problem.variance, BLOCK_P=combine_rows,
                         **tile)

        def run(tensors, outputs):
            x, running_mean, running_var = tensors if not problem.variance else (tensors[0], None, None)
            mean, rstd = outputs   # (mean, var) for the local statistics
            if c == 0:
                return
            if r == 0:
                _write_empty(problem, tensors, outputs)
                return
            tickets, part = _workspace(kept, c_blocks, 4 * config.programs * c, acc, x)
            stats(x, part, tickets, mean, rstd, running_mean, running_var)

        return Launch(run, KernelChoice("bn_stats", "triton", params), acc,
                      workspace_bytes=4 * config.programs * c * acc.itemsize)

    if not problem.backward:
        apply = launcher(_bn_apply, (units, c_blocks), trailing=(c, s, s_blocks, x_sn, x_sc, x_ss, o_sn, o_sc, o_ss),
                         HAS_W=problem.weight_dtype is not None, HAS_B=has_b, RELU=relu, **tile)

        def run(tensors, y):
            if c and r:
                x, weight, bias, mean, rstd = tensors
                apply(x, y, weight, bias, mean, rstd)

        return Launch(run, KernelChoice("bn_apply_relu" if relu else "bn_apply", "triton", params), acc)

    dy_sn, dy_sc, dy_ss = walks[0]
    elemt, reduce = problem.op == ELEMT_OP, problem.op == REDUCE_OP
    sums_needed = not elemt and (reduce or problem.weight_grad or problem.bias_grad or
                                 (problem.input_grad and problem.training))
    has_w = problem.weight_dtype is not None
    has_b = relu and has_b   # the backward takes the bias (to recompute y) only with the fused ReLU
    grad_sums = launcher(_bn_grad_sums, (c_blocks, config.programs),
                         trailing=(c, s, s_blocks, units, config.units_per_program, dy_sn, dy_sc, dy_ss,
                                   x_sn, x_sc, x_ss),
                         DW_WANTED=problem.weight_grad, DB_WANTED=problem.bias_grad, HAS_W=has_w, HAS_B=has_b,
                         RELU=relu, BLOCK_P=combine_rows, **tile)
    # elemt's sums are the group's means already: divided by 1
    grad_input = launcher(_bn_grad_input, (units, c_blocks),
                          trailing=(c, s, s_blocks, 1 if elemt else r, dy_sn, dy_sc, dy_ss, x_sn, x_sc, x_ss,
                                    o_sn, o_sc, o_ss),
                          TRAINING=problem.training, HAS_W=has_w, HAS_B=has_b, RELU=relu, **tile)

    def run(tensors, outputs):
        dy, x, weight, mean, rstd = tensors[:5]
        bias = tensors[5] if relu else None
        if c == 0:
            return
        if r == 0:
            _write_empty(problem, tensors, outputs)
            return
        if elemt:
            grad_input(dy, x, outputs, weight, None, mean, rstd, tensors[5])
            return
        dx, dweight, dbias = outputs   # reduce: sums in place of dx
        sums = None
        if sums_needed:
            # the partials, then the sums (read by grad_input below)
            tickets, part = _workspace(kept, c_blocks, 2 * config.programs * c + (0 if reduce else 2 * c), acc, dy)
            sums = dx if reduce else part[2 * config.programs * c:]
            grad_sums(dy, x, weight, bias, mean, rstd, part, tickets, sums,
                      dweight if problem.weight_grad else None, dbias if problem.bias_grad else None)
        if problem.input_grad:
            grad_input(dy, x, dx, weight, bias, mean, rstd, sums)

    name = (("bn_grad_input" if elemt else "bn_grad_sums" if reduce else "bn_grad_sums+input")
            + ("_relu" if relu else ""))
    return Launch(run, KernelChoice(name, "triton", params), acc,
                  workspace_bytes=(2 * config.programs * c + 2 * c) * acc.itemsize)


if triton_available():
    for _op in OPS:
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
                 name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.batch_norm / batch_norm_backward, with autograd
# ----------------------------------------------------------------------------------------------

def _walkable(t: Tensor) -> Tensor:
    """``t``, or a contiguous copy when its spatial axes do not walk as one strided axis (rare views)."""
    if (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last) or t.dim() < 2
            or _walks(t.shape, [t.stride()]) is not None):
        return t
    return t.contiguous()


def _per_channel_tensor(op: str, name: str, t: Tensor | None, channels: int, device) -> Tensor | None:
    if t is None:
        return None
    if t.shape != (channels,) or t.device != device:
        raise argument_error(InvalidProblemError, op, name, f"has shape {tuple(t.shape)} on {t.device}; expected "
                             f"({channels},) on {device}, one value per channel")
    return t if t.is_contiguous() else t.contiguous()


def check_running(op: str, running_mean: Tensor | None, running_var: Tensor | None, channels: int, device) -> None:
    for name, t in (("running_mean", running_mean), ("running_var", running_var)):
        if t is not None and (t.shape != (channels,) or t.device != device or not t.is_contiguous()):
            raise argument_error(InvalidProblemError, op, name, f"has shape {tuple(t.shape)} on {t.device}; expected "
                                 f"a contiguous ({channels},) on {device} (updated in place)")
    if (running_mean is None) != (running_var is None) or (
            running_mean is not None and running_mean.dtype != running_var.dtype):
        raise argument_error(InvalidProblemError, op, "running_var", "must be given with running_mean, in its dtype")


def _batch_norm_stats_impl(x: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                           momentum: float, eps: float) -> tuple[Tensor, Tensor]:
    op = STATS_OP
    x = _walkable(x)
    check_running(op, running_mean, running_var, x.shape[1] if x.dim() >= 2 else 0, x.device)
    descriptor = BatchNormStatsDescriptor(x.shape, x.dtype, x.device, strides=(x.stride(),),
                                          stats_dtype=None if running_mean is None else running_mean.dtype,
                                          momentum=momentum, eps=eps, heuristics=heuristics_for(BatchNormHeuristics))
    return cached_plan(descriptor).run_unchecked((x, running_mean, running_var))


def _batch_norm_stats_fake(x, running_mean, running_var, momentum, eps):
    acc = accumulator_dtype(x.dtype)
    return x.new_empty((x.shape[1],), dtype=acc), x.new_empty((x.shape[1],), dtype=acc)


def _batch_norm_impl(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, rstd: Tensor,
                     training: bool, relu: bool = False) -> Tensor:
    op = FORWARD_OP
    x = _walkable(x)
    channels = x.shape[1] if x.dim() >= 2 else 0
    weight, bias = (_per_channel_tensor(op, n, t, channels, x.device) for n, t in (("weight", weight), ("bias", bias)))
    descriptor = BatchNormDescriptor(x.shape, x.dtype, x.device, strides=(x.stride(),),
                                     weight_dtype=None if weight is None else weight.dtype,
                                     bias_dtype=None if bias is None else bias.dtype, training=training,
                                     heuristics=heuristics_for(BatchNormHeuristics), relu=relu)
    plan = cached_plan(descriptor)
    acc = plan.problem.acc_dtype
    if any(t.shape != (channels,) or t.dtype != acc or t.device != x.device or not t.is_contiguous()
           for t in (mean, rstd)):
        plan.problem.check((x, weight, bias, mean, rstd), None)   # names the argument
    return plan.run_unchecked((x, weight, bias, mean, rstd))


def _like_read(x: Tensor) -> Tensor:
    """A new tensor with the strides the op gives y (or dx) for this x: ``output_strides`` of x as
    ``_walkable`` leaves it (the fakes must report the real strides: Inductor relies on them)."""
    if x.dim() < 2:
        return torch.empty_like(x)
    strides = x.stride() if _walks(x.shape, [x.stride()]) is not None else \
        _dense_strides(x.shape, range(x.dim(), 0, -1))
    return x.new_empty_strided(x.shape, output_strides(x.shape, strides))


def _batch_norm_fake(x, weight, bias, mean, rstd, training, relu=False):
    return _like_read(x)


def _batch_norm_backward_impl(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                              training: bool, input_grad: bool, weight_grad: bool,
                              bias_dtype: Optional[torch.dtype], bias: Optional[Tensor] = None,
                              relu: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    # relu: the bias (when the forward had one) joins the tensors; bias_dtype still says whether
    # (and in which dtype) dbias is wanted
    if relu and bias is not None:
        bias = _per_channel_tensor(BACKWARD_OP, "bias", bias, x.shape[1] if x.dim() >= 2 else 0, x.device)
        return _run_backward(BACKWARD_OP, dy, x, weight, mean, rstd, bias, training=training, input_grad=input_grad,
                             weight_grad=weight_grad, bias_dtype=bias.dtype, bias_grad=bias_dtype is not None,
                             relu=True)
    return _run_backward(BACKWARD_OP, dy, x, weight, mean, rstd, None if relu else (), training=training,
                         input_grad=input_grad, weight_grad=weight_grad, bias_dtype=bias_dtype, relu=relu)


def _run_backward(op: str, dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor,
                  sums=(), *, training: bool = True, input_grad: bool = True,
                  weight_grad: bool = False, bias_dtype: torch.dtype | None = None, bias_grad: bool | None = None,
                  relu: bool = False):
    """One of the backward ops (batch_norm_backward, batch_norm_backward_reduce, batch_norm_backward_elemt
    with the group's ``sums``) on these tensors: dy and x walkable (rare views copied), a dense weight.
    ``sums``: elemt's sums; batch_norm_backward with ``relu``: the bias (or None); () otherwise."""
    dy, x = _walkable(dy), _walkable(x)
    if weight is not None and not weight.is_contiguous():  # a strided weight: dense first, as the forward
        weight = weight.contiguous()
    if dy.shape != x.shape or dy.dtype != x.dtype or dy.device != x.device:
        raise argument_error(InvalidProblemError, op, "dy", f"has shape {tuple(dy.shape)}, {dy.dtype} on {dy.device}; "
                             f"expected x's {tuple(x.shape)}, {x.dtype} on {x.device}")
    descriptor = _BACKWARD_DESCRIPTORS[op](x.shape, x.dtype, x.device, strides=(dy.stride(), x.stride()),
                                           weight_dtype=None if weight is None else weight.dtype,
                                           bias_dtype=bias_dtype, training=training, input_grad=input_grad,
                                           weight_grad=weight_grad,
                                           bias_grad=bias_dtype is not None if bias_grad is None else bias_grad,
                                           heuristics=heuristics_for(BatchNormHeuristics), relu=relu)
    plan = cached_plan(descriptor)
    acc, c = plan.problem.acc_dtype, (x.shape[1],)
    tensors = (dy, x, weight, mean, rstd) + (() if isinstance(sums, tuple) else (sums,))
    elemt_sums = sums if op == ELEMT_OP else None
    if any(t.shape != c or t.dtype != acc or t.device != x.device or not t.is_contiguous() for t in (mean, rstd)) or (
            weight is not None and (weight.shape != c or weight.device != x.device or not weight.is_contiguous())) or (
            elemt_sums is not None and (elemt_sums.shape != (2,) + c or elemt_sums.dtype != acc
                                        or elemt_sums.device != x.device or not elemt_sums.is_contiguous())):
        plan.problem.check(tensors, None)   # names the argument
    return plan.run_unchecked(tensors)


_BACKWARD_DESCRIPTORS = {BACKWARD_OP: BatchNormBackwardDescriptor, REDUCE_OP: BatchNormReduceDescriptor,
                         ELEMT_OP: BatchNormElemtDescriptor}


def _batch_norm_backward_fake(dy, x, weight, mean, rstd, training, input_grad, weight_grad, bias_dtype, bias=None,
                              relu=False):
    c = (x.shape[1],)
    dx = _like_read(x) if input_grad else x.new_empty(0)
    dw = x.new_empty(c, dtype=weight.dtype) if weight_grad else x.new_empty(0)
    db = x.new_empty(c, dtype=bias_dtype) if bias_dtype is not None else x.new_empty(0)
    return dx, dw, db


def _save(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    ctx.relu = inputs.relu
    # the fused ReLU's backward recomputes y from x: it needs the bias too
    ctx.save_for_backward(inputs.x, inputs.weight, inputs.mean, inputs.rstd, inputs.bias if inputs.relu else None)
    ctx.training = inputs.training
    ctx.bias_dtype = None if inputs.bias is None else inputs.bias.dtype
    # the backward plans with the forward's heuristics (autograd may run it on another thread)
    ctx.heuristics = heuristics_for(BatchNormHeuristics)
    ctx.backward_plan = _eager_backward_plan(ctx, inputs, output)


def _eager_backward_plan(ctx, inputs, y):
    """In plain eager mode, the backward's plan for a dy with y's strides, made in the forward:
    the backward, which autograd runs on its device thread (where Python is slowest), then only
    launches. None under torch.compile, for tensor subclasses, or where x, the weight or the bias
    would be copied first."""
    x = inputs.x
    if (type(x) not in PLAIN_TENSORS or type(y) not in PLAIN_TENSORS or torch.compiler.is_compiling()
            or _walkable(x) is not x
            or any(t is not None and not t.is_contiguous() for t in (inputs.weight, inputs.bias))):
        return None   # (a strided weight or bias: the backward op makes it dense first)
    needs = ctx.needs_input_grad   # (x, weight, bias, ...): the op's argument order
    weight_grad = inputs.weight is not None and needs[1]
    bias_grad = inputs.bias is not None and needs[2]
    if not (needs[0] or weight_grad or bias_grad):
        return None
    relu = inputs.relu
    descriptor = BatchNormBackwardDescriptor(
        x.shape, x.dtype, x.device, strides=(y.stride(), x.stride()),
        weight_dtype=None if inputs.weight is None else inputs.weight.dtype,
        bias_dtype=None if inputs.bias is None or not (bias_grad or relu) else inputs.bias.dtype,
        training=inputs.training, input_grad=needs[0], weight_grad=weight_grad, bias_grad=bias_grad,
        heuristics=ctx.heuristics, relu=relu)
    return cached_plan(descriptor)


def _per_channel_as_planned(t: Tensor, dtype: torch.dtype, channels: tuple, device) -> bool:
    return (type(t) in PLAIN_TENSORS and t.dtype == dtype and t.shape == channels and t.device == device
            and t.is_contiguous())


def _as_planned(problem: BatchNormProblem, dy: Tensor, x: Tensor, weight, mean, rstd, bias) -> bool:
    """Whether the backward's tensors (dy as given, the rest as the saved-tensor hooks hand them
    back: save_on_cpu returns a channels-last x contiguous) are those ``problem``, the forward-made
    backward plan, was made for: else the backward op, which plans for them or names the argument
    it refuses. ``bias``: the fused ReLU's (the plan reads it), else None."""
    device = problem.device
    if not (type(dy) in PLAIN_TENSORS and type(x) in PLAIN_TENSORS and dy.dtype == x.dtype == problem.dtype
            and dy.device == x.device == device and dy.shape == x.shape == problem.shape
            and dy.stride() == problem.strides[0] and x.stride() == problem.strides[1]):
        return False
    channels, acc = (problem.shape[1],), problem.acc_dtype
    if not (_per_channel_as_planned(mean, acc, channels, device) and _per_channel_as_planned(rstd, acc, channels, device)):
        return False
    if (weight is None) != (problem.weight_dtype is None) or (
            weight is not None and not _per_channel_as_planned(weight, problem.weight_dtype, channels, device)):
        return False
    return bias is None or (problem.relu and _per_channel_as_planned(bias, problem.bias_dtype, channels, device))


def _grad(ctx, dy) -> dict:
    if dy is None:
        return {}
    if torch.is_grad_enabled():  # create_graph=True: the backward op records no graph of its own
        raise UnsupportedError("trainops.batch_norm: double backward (create_graph=True) is not supported")
    x, weight, mean, rstd, bias = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_grad.weight
    bias_grad = ctx.bias_dtype is not None and ctx.needs_grad.bias
    input_grad = ctx.needs_grad.x
    if not (input_grad or weight_grad or bias_grad):
        return {}
    plan = getattr(ctx, "backward_plan", None)
    if plan is not None and _as_planned(plan.problem, dy, x, weight, mean, rstd, bias if ctx.relu else None):
        # the forward's plan (eager, dy laid out as y): launches only, no op dispatch or planning
        dx, dweight, dbias = plan.run_unchecked((dy, x, weight, mean, rstd, bias) if ctx.relu else
                                                (dy, x, weight, mean, rstd))
    else:
        with heuristics(ctx.heuristics):
            dx, dweight, dbias = batch_norm_backward_op(dy, x, weight, mean, rstd, ctx.training, input_grad,
                                                        weight_grad, ctx.bias_dtype if bias_grad else None, bias,
                                                        ctx.relu)
    grads = {}
    if input_grad:
        grads["x"] = dx
    if weight_grad:
        grads["weight"] = dweight
    if bias_grad:
        grads["bias"] = dbias
    return grads


# The statistics op has no autograd (mean and rstd carry none: the forward op's backward is the
# whole batch-norm gradient, their dependence on x included, in training); neither has the backward
# op (double backward raises UnsupportedError). torch.library allows no autograd formula on an op
# that writes its inputs, hence two forward ops.
batch_norm_stats_op = custom_op(STATS_OP, _batch_norm_stats_impl, _batch_norm_stats_fake,
                                mutates_args=("running_mean", "running_var"))
batch_norm_backward_op = custom_op(BACKWARD_OP, _batch_norm_backward_impl, _batch_norm_backward_fake)
batch_norm_op = custom_op(FORWARD_OP, _batch_norm_impl, _batch_norm_fake, backward=_grad, save=_save)


# ----------------------------------------------------------------------------------------------
# Eager training forward: statistics and normalisation in one call
# ----------------------------------------------------------------------------------------------

class _EagerPlans(NamedTuple):
    """The plans of one eager training call (``eager_training``): the statistics', the forward's
    and, when a gradient is wanted, the backward's for a dy laid out as y (None otherwise, or where
    ``_eager_backward_plan`` declines)."""

    heuristics: BatchNormHeuristics
    stats: Plan
    forward: Plan
    backward: Plan | None
    bias_dtype: torch.dtype | None
    relu: bool


_NO_EAGER_PATH = object()   # a key whose calls take the op path (x would be copied first)
# (x's shape, strides, dtype, device, the per-channel tensors' dtypes, momentum, eps, relu, the
# gradients wanted, id(heuristics), pinned backend) -> _EagerPlans or _NO_EAGER_PATH
_EAGER_PLANS: dict = keeps_plans({})
_EAGER_CACHE_SIZE = 1024
_Needs = NamedTuple("_Needs", [("x", bool), ("weight", bool), ("bias", bool)])


def eager_training(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None,
                   bias: Tensor | None, momentum: float, eps: float, relu: bool) -> Tensor | None:
    """Training's batch norm (relu: + ReLU) of checked arguments in one eager call: the statistics'
    and the forward's plans run back to back, under one autograd node whose backward has its plan
    made already (the custom ops' ``_grad``, unchanged). None where the op path must run instead:
    under torch.compile or a functorch transform, with tensor subclasses or a __torch_function__
    mode, for an x that would be copied first (``_walkable``), a strided weight, bias or running
    statistic. The plans are those the op path's ``cached_plan`` calls hand out for the same call,
    so the outputs, the running statistics and the gradients are the same bits; the running
    statistics' versions are bumped as by the statistics op. The (x layout, dtypes, options)
    key -> plans cache saves the three descriptor builds and plan look-ups a call."""
    if (type(x) not in PLAIN_TENSORS or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._is_torch_function_mode_enabled()):
        return None
    for t in (weight, bias, running_mean, running_var):
        if t is not None and (type(t) not in PLAIN_TENSORS or not t.is_contiguous()):
            return None
    # (plain tensors and no __torch_function__ mode: has_torch_function would say no, 1.5 us dearer)
    grad = torch.is_grad_enabled()
    needs_x = grad and x.requires_grad
    needs_w = needs_b = False
    if weight is not None:
        needs_w = grad and weight.requires_grad
    if bias is not None:
        needs_b = grad and bias.requires_grad
    h = heuristics_for(BatchNormHeuristics)
    key = (x.shape, x.stride(), x.dtype, x.device, None if weight is None else weight.dtype,
           None if bias is None else bias.dtype, None if running_mean is None else running_mean.dtype,
           None if running_var is None else running_var.dtype, momentum, eps, relu, needs_x, needs_w, needs_b, id(h),
           pinned_backend())
    plans = _EAGER_PLANS.get(key)
    if plans is None or (plans is not _NO_EAGER_PATH and plans.heuristics is not h):
        plans = _eager_plans(x, running_mean, running_var, weight, bias, momentum, eps, relu, h,
                             (needs_x, needs_w, needs_b))
        if len(_EAGER_PLANS) >= _EAGER_CACHE_SIZE:
            _EAGER_PLANS.clear()
        _EAGER_PLANS[key] = plans
    if plans is _NO_EAGER_PATH:
        return None
    if _tracked:   # as the op path's cached_plan calls count them (the backward's in the forward's _save)
        record_use(plans.stats)
        record_use(plans.forward)
        if plans.backward is not None:
            record_use(plans.backward)
    if needs_x or needs_w or needs_b:
        return _EagerTraining.apply(x, weight, bias, plans, (running_mean, running_var))
    return _eager_run(plans, x, weight, bias, running_mean, running_var)[0]


def _eager_plans(x, running_mean, running_var, weight, bias, momentum, eps, relu, h, needs):
    """The _EagerPlans of a call (the op path's descriptors), or _NO_EAGER_PATH."""
    if _walkable(x) is not x or (running_mean is None) != (running_var is None) or (
            running_mean is not None and running_mean.dtype != running_var.dtype):
        return _NO_EAGER_PATH   # (running statistics the statistics op refuses: its error, from the op path)
    if any(t is not None and (t.shape != (x.shape[1],) or t.device != x.device)
           for t in (running_mean, running_var, weight, bias)):
        return _NO_EAGER_PATH
    stats = cached_plan(BatchNormStatsDescriptor(x.shape, x.dtype, x.device, strides=(x.stride(),),
                                                 stats_dtype=None if running_mean is None else running_mean.dtype,
                                                 momentum=momentum, eps=eps, heuristics=h),
                        count=False)   # (track_kernels counts the runs: record_use)
    bias_dtype = None if bias is None else bias.dtype
    forward = cached_plan(BatchNormDescriptor(x.shape, x.dtype, x.device, strides=(x.stride(),),
                                              weight_dtype=None if weight is None else weight.dtype,
                                              bias_dtype=bias_dtype, training=True, heuristics=h, relu=relu),
                          count=False)
    backward = None
    needs_x, needs_w, needs_b = needs
    if needs_x or needs_w or needs_b:   # _eager_backward_plan's descriptor, for y's strides
        backward = cached_plan(BatchNormBackwardDescriptor(
            x.shape, x.dtype, x.device, strides=(forward.problem.out_strides, x.stride()),
            weight_dtype=None if weight is None else weight.dtype,
            bias_dtype=None if bias is None or not (needs_b or relu) else bias.dtype,
            training=True, input_grad=needs_x, weight_grad=needs_w, bias_grad=needs_b, heuristics=h, relu=relu),
            count=False)
    return _EagerPlans(h, stats, forward, backward, bias_dtype, relu)


def _eager_run(plans: _EagerPlans, x, weight, bias, running_mean, running_var):
    """(y, mean, rstd): the statistics (the running ones updated, their versions bumped as by the
    statistics op), then y."""
    mean, rstd = plans.stats.run_unchecked((x, running_mean, running_var))
    if running_mean is not None:
        torch.autograd.graph.increment_version(running_mean)
        torch.autograd.graph.increment_version(running_var)
    return plans.forward.run_unchecked((x, weight, bias, mean, rstd)), mean, rstd


class _EagerTraining(torch.autograd.Function):
    """``eager_training``'s autograd node: the forward op's ``_save`` and ``_grad``, with the plans
    made once per key. The running statistics come in a tuple: autograd does not see them."""

    @staticmethod
    def forward(ctx, x, weight, bias, plans, running):
        y, mean, rstd = _eager_run(plans, x, weight, bias, *running)
        ctx.set_materialize_grads(False)
        ctx.relu = plans.relu
        ctx.save_for_backward(x, weight, mean, rstd, bias if plans.relu else None)
        ctx.training = True
        ctx.bias_dtype = plans.bias_dtype
        ctx.heuristics = plans.heuristics
        ctx.backward_plan = plans.backward
        return y

    @staticmethod
    def backward(ctx, dy):
        ctx.needs_grad = _Needs(*ctx.needs_input_grad[:3])
        grads = _grad(ctx, dy)
        return grads.get("x"), grads.get("weight"), grads.get("bias"), None, None


# ----------------------------------------------------------------------------------------------
# Synchronised batch norm over torch.distributed (torch.nn.SyncBatchNorm's semantics)
# ----------------------------------------------------------------------------------------------

def _all_gather(packed: Tensor, group, world_size: int) -> Tensor:
    """(world_size, len(packed)): every rank's ``packed``, in rank order. One collective: the
    list all_gather on CPU tensors and gloo (which took no single output tensor in torch's
    SyncBatchNorm), else all_gather_single (all_gather_into_tensor where torch has no such name)."""
    import torch.distributed as dist

    if packed.device.type == "cpu" or dist.get_backend(group) == "gloo":
        parts = [torch.empty_like(packed) for _ in range(world_size)]
        dist.all_gather(parts, packed, group=group)
        return torch.stack(parts)
    gathered = packed.new_empty((world_size * packed.numel(),))
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, packed, group=group)
    return gathered.view(world_size, -1)


def _group_statistics(x: Tensor, group, world_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The group's (mean, M2, N) per channel, float64 on x's device: this rank's mean (relative to
    its shift) and variance (``batch_norm_local_stats``), one all_gather of [n, relative mean,
    shift, n * var] (3C + 1 float64 values), combined in rank order with Chan's formula relative to
    the first rank's shift, so that a mean far from zero keeps its precision (the same bits on
    every rank; a rank without an element adds 0 to every sum). N is (1,); a group without an
    element gives mean 0, M2 0."""
    c = x.shape[1]
    count = x.shape[0] * math.prod(x.shape[2:])   # this rank's R: a host int, no synchronisation
    descriptor = BatchNormLocalStatsDescriptor(x.shape, x.dtype, x.device, strides=(x.stride(),),
                                               heuristics=heuristics_for(BatchNormHeuristics))
    mean, var = cached_plan(descriptor).run_unchecked((x,))
    packed = torch.empty(3 * c + 1, dtype=torch.float64, device=x.device)
    packed[:1].fill_(count)
    packed[1:2 * c + 1].copy_(mean.reshape(-1))   # relative means, then shifts
    packed[2 * c + 1:].copy_(var).mul_(count)
    gathered = _all_gather(packed, group, world_size)
    counts, relative, shifts, m2s = (gathered[:, :1], gathered[:, 1:c + 1], gathered[:, c + 1:2 * c + 1],
                                     gathered[:, 2 * c + 1:])
    # the first rank with elements' shift is the common one (a rank without any has shift 0)
    first = (counts[:, 0] > 0).to(torch.int64).argmax()
    shift = shifts.index_select(0, first.reshape(1))
    means = (shifts - shift) + relative   # each rank's mean relative to the common shift
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total.clamp_min(1)
    m2 = (m2s + counts * (means - mean).square()).sum(0)
    return shift[0] + mean, m2, total


class _SyncBatchNorm(torch.autograd.Function):
    """Training's batch norm over the group's batch (see ``sync_batch_norm``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group, world_size):
        walked = _walkable(x)
        acc = accumulator_dtype(x.dtype)
        mean64, m2, total = _group_statistics(walked, group, world_size)
        mean = mean64.to(acc)
        rstd = torch.rsqrt(m2 / total.clamp_min(1) + eps).to(acc)
        if running_mean is not None:
            # torch's update: momentum towards the mean and the unbiased variance M2 / (N - 1) (a
            # group of one element gives NaN, as torch's); a group without an element leaves them
            seen = total > 0
            old_mean, old_var = running_mean.to(acc), running_var.to(acc)
            new_mean = (1 - momentum) * old_mean + momentum * mean
            new_var = (1 - momentum) * old_var + momentum * (m2 / (total - 1)).to(acc)
            running_mean.copy_(torch.where(seen, new_mean, old_mean))
            running_var.copy_(torch.where(seen, new_var, old_var))
        y = _batch_norm_impl(walked, weight, bias, mean, rstd, True)
        ctx.save_for_backward(x, weight, mean, rstd, total)
        ctx.group = group
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.heuristics = heuristics_for(BatchNormHeuristics)
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph=True
            raise UnsupportedError("trainops.sync_batch_norm: double backward (create_graph=True) is not supported")
        x, weight, mean, rstd, total = ctx.saved_tensors
        input_grad, weight_grad, bias_grad = ctx.needs_input_grad[:3]
        weight_grad = weight_grad and weight is not None
        bias_dtype = ctx.bias_dtype if bias_grad else None
        dx = None
        with heuristics(ctx.heuristics):
            sums, dweight, dbias = _run_backward(REDUCE_OP, dy, x, weight, mean, rstd, weight_grad=weight_grad,
                                                 bias_dtype=bias_dtype)
            if input_grad:   # the group's sums, as torch: only for dx (every rank must want it)
                import torch.distributed as dist

                dist.all_reduce(sums, group=ctx.group)
                sums.div_(total.clamp_min(1).to(sums.dtype))
                dx = _run_backward(ELEMT_OP, dy, x, weight, mean, rstd, sums)
        return (dx, dweight if weight_grad else None, dbias if bias_dtype is not None else None,
                None, None, None, None, None, None)


@torch.compiler.disable
def sync_batch_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                    running_var: Tensor | None, momentum: float, eps: float, group, world_size: int) -> Tensor:
    """Training's batch norm of x over the whole batch of ``group``'s ``world_size`` ranks, with
    autograd (the module docstring gives the math; trainops.functional.sync_batch_norm checks the
    arguments first). Collectives: one all_gather of 3C + 1 float64 values in the forward, one
    all_reduce of 2C accumulator-dtype values in the backward when x needs its gradient; every rank
    of the group must make the same calls. torch.compile does not trace it (its collectives and
    plans run eagerly)."""
    return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, group, world_size)


__all__ = ["BatchNormHeuristics", "BatchNormProblem", "batch_norm_op", "batch_norm_backward_op", "batch_norm_stats_op",
           "eager_training", "output_strides", "sync_batch_norm"]
