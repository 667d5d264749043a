"""The softmax of an explicit (non-flash) attention, with scale, additive bias, boolean mask, causal
mask and dropout fused, forward and backward in one pass each (ONNX Runtime's BiasSoftmax /
BiasSoftmaxDropout): Triton kernels, CPU path, registrations and custom ops.

For scores of shape (..., q_len, k_len) (``scores = q @ k^T``, usually (batch, heads, q_len, k_len)),
row by row over the last axis, in the accumulator dtype (float32; float64 for float64 scores):

    z   = scores * scale (+ bias)                    bias additive, broadcast to scores' shape
    z   = -inf where mask is False, or where k > q + causal_shift (causal), q / k the row / key index
    y   = exp(z - max z) / sum exp(z - max z)         (a row whose every z is -inf: y = 0, not NaN)
    out = y * keep * (1 / (1 - p))                    dropout_p = p > 0; else out = y

causal_shift 0 is torch SDPA's ``is_causal=True`` (the upper-left aligned triangle, also for q_len
!= k_len); k_len - q_len is the lower-right aligned one (torch's ``causal_lower_right``, flash
attention's). Fully masked rows give zeros as SDPA's fused kernels do (its math reference: NaN).

``keep`` is ops/dropout.py's mask of element i, its row-major index in scores' logical shape
(offset 0): lane i % 4 of Philox-4x32-10 block i // 4 (``tl.randint4x``) under the 63-bit ``seed``,
kept when ``tl.rand``'s uniform map of it is >= p: ``trainops.dropout`` of a tensor of scores' shape
with the same seed drops the same elements, and the CPU path (dropout.keep_mask) matches the
kernels bit for bit. The mask depends on the seed only (not on block sizes, strides or the
backend). ``out`` is computed from y rounded to scores' dtype: out = round(round(y) * s) where
kept, s = 1 / (1 - p) rounded to float32 (float64 for float64 scores), so a kept element is exactly
that of the y the backward reads. ``scale`` is likewise used as float32 (float64).

Backward, with g = d out * keep * (1 / (1 - p)) (g = d out without dropout):

    dz = y * (g - sum(g * y))       d scores = dz * scale       d bias = dz summed over bias's broadcast axes

Saved for the backward: y in scores' dtype and the seed (an int64 CPU tensor, or a device tensor
under torch.compile or a CUDA graph capture: ops.dropout.draw_seed); the dropout mask is
regenerated, never stored. Without dropout y is the output itself, which attention's ``P @ V``
saves anyway: no memory of its own. With dropout it is a second tensor of scores' size and a second
write in the forward (as ONNX Runtime's BiasSoftmaxDropout); saving scores instead and recomputing
y in the backward would spare that write at the same memory, at the cost of the mask and bias in
the backward and a third pass over long rows (not done). The backward needs neither mask nor bias:
masked positions have y = 0, so dz = 0. It takes causal_shift only to skip reading the keys the
causal mask hides (about half of d out and y); it still writes their zeros.

Shapes: scores of rank 1 to 8 (rank 2 at least with causal); mask (bool) and bias (any float dtype)
broadcastable to scores' shape, read through their broadcast strides (stride 0 on broadcast axes,
never expanded in memory). Any strides for scores and d out (read in place). Outputs contiguous, in
scores' dtype; d bias in bias's dtype and shape. Dtypes: float32, float16, bfloat16, float64.
Deterministic and bit-identical run to run: row sums in registers; the bias gradient is summed in a
fixed order (each program sums its share of the broadcast rows into its own partial row, then the
partials are summed by torch.sum over a fixed axis), no atomics.

Triton plans (``_choose_config``): rows of up to ``AttentionSoftmaxHeuristics.fused_max`` elements
are held in registers (forward: one read of scores, one write of y (and out); backward: one read of
d out and y, one write of d scores). Longer rows are looped in chunks of ``chunk`` elements:
forward an online max / sum pass then a second pass; backward a sum(g * y) pass then a second pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..layout import ReductionLayout, next_pow2, reduction_layout
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics, heuristics_for
from ..registry import (ACCUMULATOR, FLOATS, accumulator_dtype, normalize_device, register, register_op, sm_count,
                        triton_available)
from ._common import contiguous_strides, first_step, float_bits, float_dtype, math_value
from .dropout import SEED_BOUND, check_seed, keep_mask, keep_threshold, seed_args, seed_launchers

OP = "attention_softmax"
BACKWARD_OP = "attention_softmax_backward"
MAX_RANK = 8


# ----------------------------------------------------------------------------------------------
# Heuristics
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionSoftmaxHeuristics:
    """The attention softmax's tunables (trainops.heuristics(...) overrides them). Not yet measured
    on the GPU: the defaults are the normalization family's measured choices for rows held in
    registers (ops/normalization.py), which move the same bytes per row.

    fused_max: longest row (elements) held in registers; longer rows are looped in chunks of
        ``chunk`` elements, one row a program. forward_tile / backward_tile: elements one program
        holds per step (rows per program = tile // row block, at least 1).
    warps: (tile elements at most, warps) steps, the first that fits (fused rows).
    looped_warps: warps of the looped plan.
    bias_grad_programs_per_sm: with a bias gradient, the backward's programs per SM it aims at:
        each program sums the rows of its share of the bias's broadcast axes into a partial row.
    """

    fused_max: int = 16384
    chunk: int = 4096
    forward_tile: int = 4096
    backward_tile: int = 4096
    warps: tuple[tuple[int, int], ...] = ((1024, 4), (4096, 8), (1 << 62, 16))
    looped_warps: int = 8
    bias_grad_programs_per_sm: int = 4

    def num_warps(self, elements: int) -> int:
        return first_step(self.warps, elements)


# ----------------------------------------------------------------------------------------------
# Problem
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionSoftmaxProblem:
    """One attention-softmax problem over rows of ``shape[-1]`` elements.

    Forward inputs (scores, mask, bias, seed) -> (out, y); y is empty without dropout (out is then
    the softmax). Backward inputs (dout, y, seed) -> (dscores, dbias); dbias is empty when no bias
    gradient is asked. ``seed``: an int (Philox key) with dropout, else None.
    ``strides``: forward (scores,), backward (dout, y). ``mask_strides`` / ``bias_strides``: the
    broadcast strides (one per axis of scores, 0 on broadcast axes) of the mask and the bias
    (None: absent). ``bias_dtype``: forward the bias's, backward dbias's (None: absent).
    ``bias_shape``: backward, dbias's shape (bias's own). ``causal_shift``: None, or causal with
    key k masked in row q when k > q + causal_shift.
    """

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    strides: tuple[tuple[int, ...], ...]
    mask_strides: tuple[int, ...] | None
    bias_dtype: torch.dtype | None
    bias_strides: tuple[int, ...] | None
    bias_shape: tuple[int, ...] | None
    scale: float
    causal_shift: int | None
    dropout_p: float
    heuristics: AttentionSoftmaxHeuristics
    index_dtype = None

    @property
    def backward(self) -> bool:
        return self.op == BACKWARD_OP

    @property
    def n(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def q_len(self) -> int:
        return self.shape[-2] if len(self.shape) >= 2 else 1

    @property
    def acc_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0

    @property
    def aligned_bias_shape(self) -> tuple[int, ...]:
        """dbias's shape with leading 1s up to scores' rank (backward, with a bias gradient)."""
        return (1,) * (len(self.shape) - len(self.bias_shape)) + tuple(self.bias_shape)

    def check(self, tensors: Sequence, out) -> None:
        """Cheap checks of concrete tensors against the plan (shape, strides, dtype, device, seed)."""
        names = ("dout", "y", "seed") if self.backward else ("scores", "mask", "bias", "seed")
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(names)} arguments ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        given = dict(zip(names, tensors))
        for name, strides in zip(names, self.strides):
            check_tensor(self.op, name, given[name], self.shape, self.dtype, self.device, strides)
        if not self.backward:
            for name, strides, dtype in (("mask", self.mask_strides, torch.bool), ("bias", self.bias_strides,
                                                                                   self.bias_dtype)):
                t = given[name]
                if (t is None) != (strides is None):
                    raise argument_error(InvalidProblemError, self.op, name,
                                         "is missing; the plan has one" if t is None else "is given; the plan has none")
                if t is None:
                    continue
                if not isinstance(t, Tensor):
                    raise argument_error(InvalidProblemError, self.op, name,
                                         f"must be a torch.Tensor, got {type(t).__name__}")
                if t.dtype != dtype or t.device != self.device:
                    raise argument_error(InvalidProblemError, self.op, name,
                                         f"has dtype {t.dtype} on {t.device}; the plan is for {dtype} on {self.device}")
                if broadcast_strides(self.op, name, t, self.shape) != strides:
                    raise argument_error(InvalidProblemError, self.op, name,
                                         "has other broadcast strides than the plan's (make a plan for this layout)")
        seed = given["seed"]
        if self.dropout:
            check_seed(self.op, seed, self.device)
        elif seed is not None:
            raise argument_error(InvalidProblemError, self.op, "seed", "is given without dropout")
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    def new_output(self) -> tuple[Tensor, Tensor]:
        """Forward: (out, y); backward: (dscores, dbias). Absent outputs are empty tensors."""
        first = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if self.backward:
            second = (torch.empty(self.bias_shape, dtype=self.bias_dtype, device=self.device)
                      if self.bias_shape is not None else torch.empty(0, dtype=self.dtype, device=self.device))
        else:
            second = torch.empty(self.shape if self.dropout else 0, dtype=self.dtype, device=self.device)
        return first, second


def broadcast_strides(op: str, name: str, t: Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """``t``'s strides seen broadcast to ``shape`` (0 on broadcast and size-1 axes), or
    InvalidProblemError naming ``name`` when ``t`` does not broadcast to ``shape``."""
    t_shape, t_strides = t.shape, t.stride()
    lead = len(shape) - len(t_shape)
    if lead < 0:
        raise argument_error(InvalidProblemError, op, name, f"has shape {tuple(t_shape)}, which does not broadcast to "
                             f"scores' shape {tuple(shape)}")
    out = [0] * lead
    for size, stride, target in zip(t_shape, t_strides, shape[lead:]):
        if size == target and size != 1:
            out.append(stride)
        elif size == 1:
            out.append(0)
        else:
            raise argument_error(InvalidProblemError, op, name, f"has shape {tuple(t_shape)}, which does not "
                                 f"broadcast to scores' shape {tuple(shape)}")
    return tuple(out)


def _strides_arg(op: str, name: str, strides, rank: int) -> tuple[int, ...]:
    try:
        strides = tuple(int(v) for v in strides)
    except TypeError:
        raise argument_error(InvalidProblemError, op, name, f"must be a sequence of ints, got {strides!r}") from None
    if len(strides) != rank or any(v < 0 for v in strides):
        raise argument_error(InvalidProblemError, op, name, f"has strides {strides}; expected {rank} non-negative "
                             "strides")
    return strides


def _describe(op: str, shape, dtype, device, strides, mask_strides, bias_dtype, bias_strides, bias_shape, scale,
              causal_shift, dropout_p, heuristics) -> AttentionSoftmaxProblem:
    backward = op == BACKWARD_OP
    first = "dout" if backward else "scores"
    shape = checked_shape(op, "shape", shape)
    if not 1 <= len(shape) <= MAX_RANK:
        raise argument_error(UnsupportedError, op, first, f"has rank {len(shape)}; ranks 1 to {MAX_RANK} are supported")
    dtype = float_dtype(op, first, dtype)
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    names = ("dout", "y") if backward else ("scores",)
    contiguous = contiguous_strides(shape)
    if strides is None:
        strides = (contiguous,) * len(names)
    elif len(strides) > 0 and all(isinstance(v, int) for v in strides):  # one stride tuple for every input
        strides = (tuple(strides),) * len(names)
    if len(strides) != len(names):
        raise argument_error(InvalidProblemError, op, "strides",
                             f"needs one stride tuple per input ({', '.join(names)})")
    strides = tuple(_strides_arg(op, name, st, len(shape)) for name, st in zip(names, strides))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise argument_error(InvalidProblemError, op, "scale", f"must be a finite number, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise argument_error(InvalidProblemError, op, "dropout_p", f"must be a number in [0, 1), got {dropout_p!r}")
    if bias_dtype is not None:
        bias_dtype = float_dtype(op, "bias", bias_dtype)
    if causal_shift is not None:
        if isinstance(causal_shift, bool) or not isinstance(causal_shift, int):
            raise argument_error(InvalidProblemError, op, "causal", f"shift must be an int, got {causal_shift!r}")
        if len(shape) < 2:
            raise argument_error(InvalidProblemError, op, "causal", f"needs scores of rank 2 or more (q_len, "
                                 f"k_len), got shape {shape}")
    if backward:
        if mask_strides is not None or bias_strides is not None:
            raise argument_error(InvalidProblemError, op, "mask", "the backward takes no mask or bias")
        if (bias_shape is None) != (bias_dtype is None):
            raise argument_error(InvalidProblemError, op, "bias_shape", "and bias_dtype go together")
        if bias_shape is not None:
            bias_shape = checked_shape(op, "bias_shape", bias_shape)
            lead = len(shape) - len(bias_shape)
            if lead < 0 or any(b not in (1, s) for b, s in zip(bias_shape, shape[lead:])):
                raise argument_error(InvalidProblemError, op, "bias_shape", f"is {bias_shape}, which does not "
                                     f"broadcast to {shape}")
    else:
        if bias_shape is not None:
            raise argument_error(InvalidProblemError, op, "bias_shape", "is a backward argument")
        if mask_strides is not None:
            mask_strides = _strides_arg(op, "mask", mask_strides, len(shape))
        if (bias_strides is None) != (bias_dtype is None):
            raise argument_error(InvalidProblemError, op, "bias_strides", "and bias_dtype go together")
        if bias_strides is not None:
            bias_strides = _strides_arg(op, "bias", bias_strides, len(shape))
    if heuristics is None:
        heuristics = heuristics_for(AttentionSoftmaxHeuristics)
    elif not isinstance(heuristics, AttentionSoftmaxHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"must be an AttentionSoftmaxHeuristics, got {type(heuristics).__name__}")
    return AttentionSoftmaxProblem(op, shape, dtype, device, strides, mask_strides, bias_dtype, bias_strides,
                                   bias_shape, float(scale), causal_shift, float(dropout_p), heuristics)


def _describe_forward(shape, dtype, device="cuda", strides=None, mask_strides=None, bias_dtype=None, bias_strides=None,
                      scale=1.0, causal_shift=None, dropout_p=0.0, heuristics=None) -> AttentionSoftmaxProblem:
    """Validate an attention-softmax descriptor.

    shape: scores' sizes (rank 1..8). dtype: scores' dtype. strides: None (contiguous), scores'
    strides, or a 1-tuple holding them. mask_strides: None (no mask) or the bool mask's strides
    broadcast to shape (0 on broadcast axes: ``broadcast_strides``). bias_dtype / bias_strides:
    None (no bias) or the bias's dtype and broadcast strides. scale: finite. causal_shift: None
    (not causal) or k > q + causal_shift is masked (0: torch SDPA's is_causal, upper left;
    k_len - q_len: lower right). dropout_p: in [0, 1). heuristics: an AttentionSoftmaxHeuristics.
    """
    return _describe(OP, shape, dtype, device, strides, mask_strides, bias_dtype, bias_strides, None, scale,
                     causal_shift, dropout_p, heuristics)


def _describe_backward(shape, dtype, device="cuda", strides=None, bias_shape=None, bias_dtype=None, scale=1.0,
                       causal_shift=None, dropout_p=0.0, heuristics=None) -> AttentionSoftmaxProblem:
    """Validate an attention-softmax backward descriptor.

    shape / dtype: d out's and y's. strides: None (contiguous), one stride tuple for both, or
    (dout's, y's). bias_shape /
    bias_dtype: None (no bias gradient) or the bias's shape (broadcastable to shape) and dtype,
    which dbias takes. scale, causal_shift, dropout_p: the forward's (causal: the keys it hides
    are not read, y being 0 there). heuristics: an AttentionSoftmaxHeuristics.
    """
    return _describe(BACKWARD_OP, shape, dtype, device, strides, None, bias_dtype, None, bias_shape, scale,
                     causal_shift, dropout_p, heuristics)


ForwardDescriptor = register_op(OP, _describe_forward)
BackwardDescriptor = register_op(BACKWARD_OP, _describe_backward)


def _keep_scale(p: float) -> float:
    return 1.0 / (1.0 - p)


# ----------------------------------------------------------------------------------------------
# CPU path: torch's CPU ops in the accumulator dtype (the same formulas as the kernels)
# ----------------------------------------------------------------------------------------------

def _causal_keep(problem: AttentionSoftmaxProblem, device) -> Tensor:
    q = torch.arange(problem.q_len, device=device)[:, None]
    k = torch.arange(problem.n, device=device)[None, :]
    return k <= q + problem.causal_shift


def _cpu_forward(problem: AttentionSoftmaxProblem, tensors, outputs) -> None:
    scores, mask, bias, seed = tensors
    out, y = outputs
    acc = problem.acc_dtype
    z = scores.to(acc) * math_value(problem.scale, acc)
    if bias is not None:
        z = z + bias.to(acc)
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf"))
    if problem.causal_shift is not None:
        z = z.masked_fill(~_causal_keep(problem, z.device), float("-inf"))
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - torch.where(m == float("-inf"), 0.0, m))
    s = e.sum(-1, keepdim=True)
    probs = e * torch.where(s == 0, 0.0, 1.0 / s)
    if not problem.dropout:
        out.copy_(probs)
        return
    y.copy_(probs)
    keep = keep_mask(problem.numel, seed, 0, problem.dropout_p).view(problem.shape)
    out.copy_(torch.where(keep, y.to(acc) * math_value(_keep_scale(problem.dropout_p), acc), 0.0))


def _cpu_backward(problem: AttentionSoftmaxProblem, tensors, outputs) -> None:
    dout, y, seed = tensors
    ds, dbias = outputs
    acc = problem.acc_dtype
    g = dout.to(acc)
    if problem.dropout:
        keep = keep_mask(problem.numel, seed, 0, problem.dropout_p).view(problem.shape)
        g = torch.where(keep, g * math_value(_keep_scale(problem.dropout_p), acc), 0.0)
    yy = y.to(acc)
    dz = yy * (g - (g * yy).sum(-1, keepdim=True))
    ds.copy_(dz * math_value(problem.scale, acc))
    if problem.bias_shape is not None:
        aligned = problem.aligned_bias_shape
        dims = [d for d, (b, s) in enumerate(zip(aligned, problem.shape)) if b == 1 and s != 1]
        dbias.copy_((dz.sum(dims, keepdim=True) if dims else dz).reshape(problem.bias_shape))


def _prepare_cpu(problem: AttentionSoftmaxProblem) -> Launch:
    compute = _cpu_backward if problem.backward else _cpu_forward

    def run(tensors, outputs):
        if problem.numel:
            compute(problem, tensors, outputs)
        elif problem.backward and problem.bias_shape is not None:
            outputs[1].zero_()

    return Launch(run, KernelChoice(f"{problem.op}_cpu", "cpu", ()), problem.acc_dtype)


for _op in (OP, BACKWARD_OP):
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
             name=f"{_op}_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    # the shared row offset and the dropout family's mask decision (Philox-4x32 lane vs threshold),
    # each under its own name: Triton's interpreter looks a called jit function up by its __name__
    from ._common import _row_offset, from_bits
    from .dropout import _keep

    @triton.jit
    def _keep_tile(seed, first, c, lane, threshold, LANES: tl.constexpr):
        """Dropout's keep mask of a (rows, groups, lanes) tile: element i (row-major index first + c)
        draws lane i % 4 of Philox block i // 4 (ops/dropout.py's convention). LANES = 4 (k_len % 4
        == 0): a group's 4 lanes are one Philox block, one call per 4 elements; LANES = 1: one call
        per element."""
        if LANES == 4:
            return _keep(seed, (first[:, None, None] + (c - lane)) >> 2, lane, threshold)
        i = first[:, None, None] + c
        return _keep(seed, i >> 2, i & 3, threshold)

    @triton.jit
    def _logits(S, M, B, s_row, m_row, b_row, c, valid, q, s_n, m_n, b_n, shift, scale,
                HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr):
        """z = scores * scale (+ bias) of one (rows, groups, lanes) tile; -inf where masked or out of
        range (masked positions are not read)."""
        c64 = c.to(tl.int64)
        keep = valid
        if CAUSAL:
            keep = keep & (c <= (q + shift)[:, None, None])
        if HAS_MASK:
            keep = keep & (tl.load(M + m_row[:, None, None] + c64 * m_n, mask=keep, other=0) != 0)
        z = tl.load(S + s_row[:, None, None] + c64 * s_n, mask=keep, other=0.0).to(ACC) * scale
        if HAS_BIAS:
            z += tl.load(B + b_row[:, None, None] + c64 * b_n, mask=keep, other=0.0).to(ACC)
        return tl.where(keep, z, float("-inf"))

    @triton.jit
    def _store_probs(Y, O, first, c, lane, valid, y, seed, threshold, keep_scale,
                     DROPOUT: tl.constexpr, LANES: tl.constexpr, ACC: tl.constexpr):
        """Store y (rounded to Y's dtype) and, with dropout, out = round(y) * keep_scale where kept."""
        offsets = first[:, None, None] + c
        y = y.to(Y.dtype.element_ty)
        tl.store(Y + offsets, y, mask=valid)
        if DROPOUT:
            out = tl.where(_keep_tile(seed, first, c, lane, threshold, LANES), y.to(ACC) * keep_scale, 0.0)
            tl.store(O + offsets, out.to(O.dtype.element_ty), mask=valid)

    @triton.jit(do_not_specialize=["seed", "scale_bits", "threshold", "keep_bits"])
    def _attention_softmax_fwd(
        S, M, B, Y, O,                        # scores, mask, bias (None: absent); y (softmax), out (None without dropout)
        s_base, s_o0, s_o1, s_i, s_n,         # scores: base offset, outer0 / outer1 / inner / key-axis strides
        m_base, m_o0, m_o1, m_i, m_n,         # mask, likewise (broadcast strides: 0 on broadcast axes)
        b_base, b_o0, b_o1, b_i, b_n,         # bias, likewise
        out_base, rows, n, OUTER1, INNER,     # contiguous outputs: first row's offset; rows of this launch, k_len
        q_len, shift, scale_bits,             # rows per (batch, head); causal: k > q + shift masked; scale's bits
        threshold, keep_bits, SEED, seed,     # dropout: keep when the draw > threshold; 1 / (1 - p)'s bits; key
        HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
        ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr, LOOPED: tl.constexpr,
        SEED_ON_DEVICE: tl.constexpr,
    ):
        """BLOCK_M rows a program, each a (groups, LANES) tile of BLOCK_N positions: y (and out)
        written once; long rows (LOOPED) read twice. The key is ``seed``, or SEED[0] (SEED_ON_DEVICE)."""
        if SEED_ON_DEVICE:
            seed = tl.load(SEED)
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        r_mask = r < rows
        s_row = s_base + _row_offset(r, OUTER1, INNER, s_o0, s_o1, s_i)
        m_row = m_base + _row_offset(r, OUTER1, INNER, m_o0, m_o1, m_i)
        b_row = b_base + _row_offset(r, OUTER1, INNER, b_o0, b_o1, b_i)
        first = out_base + r.to(tl.int64) * n     # the row's first row-major index in scores' shape
        q = (first // n) % q_len
        lane = tl.arange(0, LANES)[None, None, :]
        cols = tl.arange(0, BLOCK_N // LANES)[None, :, None] * LANES + lane
        scale = from_bits(scale_bits, ACC)
        keep_scale = from_bits(keep_bits, ACC)
        if not LOOPED:
            valid = r_mask[:, None, None] & (cols < n)
            z = _logits(S, M, B, s_row, m_row, b_row, cols, valid, q, s_n, m_n, b_n, shift, scale,
                        HAS_MASK, HAS_BIAS, CAUSAL, ACC)
            m = tl.max(tl.max(z, 2), 1)
            e = tl.exp(z - tl.where(m == float("-inf"), 0.0, m)[:, None, None])
            s = tl.sum(tl.sum(e, 2), 1)
            y = e * tl.where(s == 0.0, 0.0, 1.0 / s)[:, None, None]   # every z -inf: s = 0, y = 0; NaN stays NaN
            _store_probs(Y, O, first, cols, lane, valid, y, seed, threshold, keep_scale, DROPOUT, LANES, ACC)
        else:
            m = tl.full([BLOCK_M], float("-inf"), ACC)
            s = tl.zeros([BLOCK_M], ACC)
            for start in range(0, n, BLOCK_N):
                c = start + cols
                valid = r_mask[:, None, None] & (c < n)
                z = _logits(S, M, B, s_row, m_row, b_row, c, valid, q, s_n, m_n, b_n, shift, scale,
                            HAS_MASK, HAS_BIAS, CAUSAL, ACC)
                m_new = tl.maximum(m, tl.max(tl.max(z, 2), 1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf prefix stays out of NaN
                s = s * tl.exp(m - m_ref) + tl.sum(tl.sum(tl.exp(z - m_ref[:, None, None]), 2), 1)
                m = m_new
            m_ref = tl.where(m == float("-inf"), 0.0, m)
            inv = tl.where(s == 0.0, 0.0, 1.0 / s)
            for start in range(0, n, BLOCK_N):
                c = start + cols
                valid = r_mask[:, None, None] & (c < n)
                z = _logits(S, M, B, s_row, m_row, b_row, c, valid, q, s_n, m_n, b_n, shift, scale,
                            HAS_MASK, HAS_BIAS, CAUSAL, ACC)
                y = tl.exp(z - m_ref[:, None, None]) * inv[:, None, None]
                _store_probs(Y, O, first, c, lane, valid, y, seed, threshold, keep_scale, DROPOUT, LANES, ACC)

    @triton.jit
    def _grad_tile(DO, Y, do_row, y_row, first, c, lane, valid, do_n, y_n, seed, threshold, keep_scale,
                   DROPOUT: tl.constexpr, LANES: tl.constexpr, ACC: tl.constexpr):
        """(g, y) of one tile: g = d out (* keep / (1 - p), the mask regenerated from the row-major index)."""
        c64 = c.to(tl.int64)
        g = tl.load(DO + do_row[:, None, None] + c64 * do_n, mask=valid, other=0.0).to(ACC)
        y = tl.load(Y + y_row[:, None, None] + c64 * y_n, mask=valid, other=0.0).to(ACC)
        if DROPOUT:
            g = tl.where(_keep_tile(seed, first, c, lane, threshold, LANES), g * keep_scale, 0.0)
        return g, y

    @triton.jit
    def _seen(valid, c, q, shift, CAUSAL: tl.constexpr):
        """``valid`` less the keys the causal mask hides (k > q + shift)."""
        if CAUSAL:
            return valid & (c <= (q + shift)[:, None, None])
        return valid

    @triton.jit
    def _bwd_rows(DO, Y, DS, DB, do_row, y_row, first, db_row, k_mask, cols, lane, acc, acc_row, n, do_n, y_n,
                  q_len, shift, scale, seed, threshold, keep_scale, DROPOUT: tl.constexpr, BIAS_GRAD: tl.constexpr,
                  ROWSUM: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, LANES: tl.constexpr, LOOPED: tl.constexpr):
        """d scores of BLOCK_M rows (``first``: their row-major index, also their offset in the
        contiguous d scores); their dz added to the bias-gradient sums (acc, acc_row; looped: the
        program's own partial rows at db_row). Keys the causal mask hides are not read (y = 0 there)."""
        q = (first // n) % q_len
        if not LOOPED:
            valid = k_mask[:, None, None] & (cols < n)
            g, y = _grad_tile(DO, Y, do_row, y_row, first, cols, lane, _seen(valid, cols, q, shift, CAUSAL), do_n, y_n,
                              seed, threshold, keep_scale, DROPOUT, LANES, ACC)
            dz = y * (g - tl.sum(tl.sum(g * y, 2), 1)[:, None, None])
            tl.store(DS + first[:, None, None] + cols, (dz * scale).to(DS.dtype.element_ty), mask=valid)
            if BIAS_GRAD:
                if ROWSUM:
                    acc_row += tl.sum(tl.sum(dz, 2), 1)
                else:
                    acc += dz
        else:
            gy = tl.zeros([BLOCK_M], ACC)
            for start in range(0, n, BLOCK_N):
                c = start + cols
                valid = k_mask[:, None, None] & (c < n)
                g, y = _grad_tile(DO, Y, do_row, y_row, first, c, lane, _seen(valid, c, q, shift, CAUSAL), do_n, y_n,
                                  seed, threshold, keep_scale, DROPOUT, LANES, ACC)
                gy += tl.sum(tl.sum(g * y, 2), 1)
            for start in range(0, n, BLOCK_N):
                c = start + cols
                valid = k_mask[:, None, None] & (c < n)
                g, y = _grad_tile(DO, Y, do_row, y_row, first, c, lane, _seen(valid, c, q, shift, CAUSAL), do_n, y_n,
                                  seed, threshold, keep_scale, DROPOUT, LANES, ACC)
                dz = y * (g - gy[:, None, None])
                tl.store(DS + first[:, None, None] + c, (dz * scale).to(DS.dtype.element_ty), mask=valid)
                if BIAS_GRAD:
                    if ROWSUM:
                        acc_row += tl.sum(tl.sum(dz, 2), 1)
                    else:  # the program's own partial rows (zeroed before launch): no other program touches them
                        ptr = db_row[:, None, None] + c
                        tl.store(ptr, tl.load(ptr, mask=valid, other=0.0) + dz, mask=valid)
        return acc, acc_row

    @triton.jit(do_not_specialize=["seed", "scale_bits", "threshold", "keep_bits"])
    def _attention_softmax_bwd(
        DO, Y, DS, DB,                                 # d out, saved y; outputs d scores, d bias (partials; or None)
        do_base, do_k0, do_k1, do_ki, do_b0, do_b1, do_bi, do_n,   # d out: base, kept-row strides, broadcast-row
        y_base, y_k0, y_k1, y_ki, y_b0, y_b1, y_bi, y_n,           # strides, key-axis stride; y likewise
        ds_base, ds_k0, ds_k1, ds_ki, ds_b0, ds_b1, ds_bi,         # d scores (contiguous: key stride 1)
        db_base, part_base, part_stride,               # d bias: kept row kr at db_base + kr * NB (+ part * part_stride)
        k_rows, K1, KI, b_rows, B1, BI, b_per_program, SPLITS,     # kept / broadcast rows and their layouts
        n, NB, q_len, shift, scale_bits, threshold, keep_bits, SEED, seed,  # k_len, d bias row length, ...
        DROPOUT: tl.constexpr, BIAS_GRAD: tl.constexpr, ROWSUM: tl.constexpr, CAUSAL: tl.constexpr,
        ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr, LOOPED: tl.constexpr,
        SEED_ON_DEVICE: tl.constexpr,
    ):
        """Rows are (kept row kr, broadcast row b): kr indexes the bias's own rows, b the rows the
        bias is broadcast over. A program owns BLOCK_M kept rows and, with a bias gradient,
        ``b_per_program`` broadcast rows (its split): it writes their d scores and sums their dz
        into its own partial row of d bias (fixed order). Without a bias gradient every row is a
        kept row (no broadcast rows, no loop)."""
        pid = tl.program_id(0)
        split = pid % SPLITS
        kr = (pid // SPLITS) * BLOCK_M + tl.arange(0, BLOCK_M)
        k_mask = kr < k_rows
        do_k = do_base + _row_offset(kr, K1, KI, do_k0, do_k1, do_ki)
        y_k = y_base + _row_offset(kr, K1, KI, y_k0, y_k1, y_ki)
        ds_k = ds_base + _row_offset(kr, K1, KI, ds_k0, ds_k1, ds_ki)
        if BIAS_GRAD:
            db_row = DB + (part_base + split).to(tl.int64) * part_stride + db_base + kr.to(tl.int64) * NB
        else:  # DB is None: no bias gradient
            db_row = kr
        lane = tl.arange(0, LANES)[None, None, :]
        cols = tl.arange(0, BLOCK_N // LANES)[None, :, None] * LANES + lane
        scale = from_bits(scale_bits, ACC)
        keep_scale = from_bits(keep_bits, ACC)
        if SEED_ON_DEVICE:
            seed = tl.load(SEED)
        acc = tl.zeros([BLOCK_M, BLOCK_N // LANES, LANES], ACC)
        acc_row = tl.zeros([BLOCK_M], ACC)
        if BIAS_GRAD:
            b_lo = split * b_per_program
            for b in range(b_lo, tl.minimum(b_lo + b_per_program, b_rows)):
                acc, acc_row = _bwd_rows(DO, Y, DS, DB, do_k + _row_offset(b, B1, BI, do_b0, do_b1, do_bi),
                                         y_k + _row_offset(b, B1, BI, y_b0, y_b1, y_bi),
                                         ds_k + _row_offset(b, B1, BI, ds_b0, ds_b1, ds_bi), db_row, k_mask, cols,
                                         lane, acc, acc_row, n, do_n, y_n, q_len, shift, scale, seed, threshold,
                                         keep_scale, DROPOUT, BIAS_GRAD, ROWSUM, CAUSAL, ACC, BLOCK_M, BLOCK_N, LANES,
                                         LOOPED)
            if ROWSUM:
                tl.store(db_row, acc_row.to(DB.dtype.element_ty), mask=k_mask)
            elif not LOOPED:
                tl.store(db_row[:, None, None] + cols, acc.to(DB.dtype.element_ty),
                         mask=k_mask[:, None, None] & (cols < n))
        else:
            _bwd_rows(DO, Y, DS, DB, do_k, y_k, ds_k, db_row, k_mask, cols, lane, acc, acc_row, n, do_n, y_n, q_len,
                      shift, scale, seed, threshold, keep_scale, DROPOUT, BIAS_GRAD, ROWSUM, CAUSAL, ACC, BLOCK_M,
                      BLOCK_N, LANES, LOOPED)


@dataclass(frozen=True)
class AttentionSoftmaxConfig:
    """A Triton plan: rows per program (block_m), row block (block_n) as groups of ``lanes``
    positions (with dropout 4 when k_len % 4 == 0: one Philox call per group, else 1; without,
    the whole block), warps, looped or fused."""

    block_m: int
    block_n: int
    lanes: int
    num_warps: int
    looped: bool


def _choose_config(problem: AttentionSoftmaxProblem, rows: int) -> AttentionSoftmaxConfig:
    """Fused rows up to ``fused_max`` elements (a program holds BLOCK_M rows, about ``*_tile``
    elements); longer rows looped in ``chunk``-element blocks, one row a program. ``rows``: the
    rows (forward) or kept rows (backward) of one launch."""
    h = problem.heuristics
    n = max(problem.n, 1)
    if n > h.fused_max:
        block_m, block_n, warps, looped = 1, next_pow2(min(h.chunk, n)), h.looped_warps, True
    else:
        block_n = next_pow2(n)
        tile = h.backward_tile if problem.backward else h.forward_tile
        block_m = max(1, min(tile // block_n, next_pow2(max(rows, 1))))
        warps, looped = h.num_warps(block_m * block_n), False
    if problem.dropout:  # a group of 4 lanes is one Philox block (k_len % 4 == 0: rows start at a block)
        lanes = 4 if n % 4 == 0 and block_n >= 4 else 1
    else:
        lanes = block_n  # one group: the row block as one contiguous axis
    return AttentionSoftmaxConfig(block_m, block_n, lanes, warps, looped)


def _operand_args(layout: ReductionLayout, bases, count: int) -> list[int]:
    args = []
    for k in range(count):
        args += [bases[k], layout.stride_outer0[k], layout.stride_outer1[k], layout.stride_inner[k], layout.stride_n[k]]
    return args


def _scalar_args(problem: AttentionSoftmaxProblem) -> tuple[int, int, int]:
    """(scale's bits, dropout's keep threshold, 1 / (1 - p)'s bits): the kernels' exact scalars."""
    acc = problem.acc_dtype
    p = problem.dropout_p
    return float_bits(problem.scale, acc), keep_threshold(p), float_bits(_keep_scale(p), acc)


def _meta(problem: AttentionSoftmaxProblem, config: AttentionSoftmaxConfig, **flags) -> dict:
    return dict(flags, DROPOUT=problem.dropout, ACC=tl.float64 if problem.acc_dtype == torch.float64 else tl.float32,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, LANES=config.lanes, LOOPED=config.looped,
                num_warps=config.num_warps)


def _params(config: AttentionSoftmaxConfig, **extra) -> tuple:
    return (("plan", "looped" if config.looped else "fused"), ("BLOCK_M", config.block_m), ("BLOCK_N", config.block_n),
            ("lanes", config.lanes), ("num_warps", config.num_warps)) + tuple(extra.items())


def _prepare_forward(problem: AttentionSoftmaxProblem) -> Launch:
    shape, n = problem.shape, problem.n
    rank = len(shape)
    zeros = (0,) * rank
    operands = [problem.strides[0], problem.mask_strides or zeros, problem.bias_strides or zeros,
                contiguous_strides(shape)]
    layout = reduction_layout(shape, rank - 1, operands)   # reference: the contiguous outputs
    config = _choose_config(problem, layout.rows)
    meta = _meta(problem, config, HAS_MASK=problem.mask_strides is not None,
                 HAS_BIAS=problem.bias_strides is not None, CAUSAL=problem.causal_shift is not None)
    shift = problem.causal_shift if problem.causal_shift is not None else 0
    # every scalar argument but the seed is fixed by the plan: built once here, not per call
    launches = [(*_operand_args(layout, bases, 3), bases[3], layout.rows, n, layout.outer1, layout.inner,
                 problem.q_len, shift, *_scalar_args(problem)) for bases in layout.host_bases]
    launch = seed_launchers(_attention_softmax_fwd, (triton.cdiv(layout.rows, config.block_m),), meta)
    dropout = problem.dropout

    def run(tensors, outputs):
        scores, mask, bias, seed = tensors
        out, y = outputs
        pointers = (scores, mask, bias, y if dropout else out, out if dropout else None)
        on_device, seed_ptr, seed = seed_args(seed if dropout else 0)
        for args in launches:
            launch[on_device](*pointers, *args, seed_ptr, seed)

    return Launch(run, KernelChoice("attention_softmax_fwd", "triton",
                                    _params(config, host_launches=len(layout.host_bases))), problem.acc_dtype)


def _backward_layouts(problem: AttentionSoftmaxProblem) -> tuple[ReductionLayout, ReductionLayout]:
    """Rows split into kept axes (the bias's own, or all without a bias gradient) and broadcast
    axes (the bias's size-1 axes); each group merged by layout.reduction_layout. Operands: d out,
    y, d scores, and (kept layout only) d bias, contiguous, the reference."""
    shape, n = problem.shape, problem.n
    lead = range(len(shape) - 1)
    ds_strides = contiguous_strides(shape)
    if problem.bias_shape is not None:
        aligned = problem.aligned_bias_shape
        kept = [d for d in lead if aligned[d] != 1]
        spread = [d for d in lead if aligned[d] == 1 and shape[d] != 1]
        db_strides = contiguous_strides(aligned)
    else:
        kept, spread, db_strides = list(lead), [], ds_strides
    operands = problem.strides + (ds_strides,)

    def restrict(strides, dims):
        return tuple(strides[d] for d in dims) + (strides[-1],)

    kept_layout = reduction_layout(tuple(shape[d] for d in kept) + (n,), len(kept),
                                   [restrict(st, kept) for st in operands + (db_strides,)])
    spread_layout = reduction_layout(tuple(shape[d] for d in spread) + (n,), len(spread),
                                     [restrict(st, spread) for st in operands])
    return kept_layout, spread_layout


def _prepare_backward(problem: AttentionSoftmaxProblem) -> Launch:
    kept, spread = _backward_layouts(problem)
    config = _choose_config(problem, kept.rows)
    acc = problem.acc_dtype
    n = problem.n
    bias_grad = problem.bias_shape is not None
    nb = problem.aligned_bias_shape[-1] if bias_grad else n
    rowsum = bias_grad and nb == 1 and n != 1
    k_blocks = triton.cdiv(kept.rows, config.block_m)
    if bias_grad:  # the broadcast rows cut into splits, enough programs for the device
        target = sm_count(problem.device) * problem.heuristics.bias_grad_programs_per_sm
        splits = max(1, min(spread.rows, triton.cdiv(target, max(k_blocks, 1))))
        per_program = triton.cdiv(spread.rows, splits)
        splits = triton.cdiv(spread.rows, per_program)
    else:
        splits, per_program = 1, 1
    parts = splits * len(spread.host_bases)
    bias_rows = math.prod(problem.aligned_bias_shape[:-1]) if bias_grad else 0
    # partial rows in the accumulator dtype, unless a single fused part writes d bias itself
    workspace = bias_grad and (parts > 1 or (config.looped and not rowsum))
    part_stride = bias_rows * nb if workspace else 0
    meta = _meta(problem, config, BIAS_GRAD=bias_grad, ROWSUM=rowsum, CAUSAL=problem.causal_shift is not None)
    shift = problem.causal_shift if problem.causal_shift is not None else 0

    def operand(k_bases, b_bases, i):
        return [k_bases[i] + b_bases[i], kept.stride_outer0[i], kept.stride_outer1[i], kept.stride_inner[i],
                spread.stride_outer0[i], spread.stride_outer1[i], spread.stride_inner[i], kept.stride_n[i]]

    launches = [(*operand(k_bases, b_bases, 0), *operand(k_bases, b_bases, 1), *operand(k_bases, b_bases, 2)[:7],
                 k_bases[3] if bias_grad else 0, index * splits, part_stride, kept.rows, kept.outer1, kept.inner,
                 spread.rows, spread.outer1, spread.inner, per_program, splits, n, nb, problem.q_len, shift,
                 *_scalar_args(problem))
                for k_bases in kept.host_bases for index, b_bases in enumerate(spread.host_bases)]
    launch = seed_launchers(_attention_softmax_bwd, (k_blocks * splits,), meta)
    dropout = problem.dropout
    make_workspace = torch.zeros if config.looped and not rowsum else torch.empty

    def run(tensors, outputs):
        dout, y, seed = tensors
        ds, dbias = outputs
        db = make_workspace((parts, bias_rows, nb), dtype=acc, device=ds.device) if workspace else dbias
        on_device, seed_ptr, seed = seed_args(seed if dropout else 0)
        for args in launches:
            launch[on_device](dout, y, ds, db if bias_grad else None, *args, seed_ptr, seed)
        if workspace:  # the partial rows summed over a fixed axis: deterministic
            dbias.view(bias_rows, nb).copy_(db.sum(0))

    params = _params(config, splits=splits, host_launches=len(launches))
    return Launch(run, KernelChoice("attention_softmax_bwd", "triton", params), acc,
                  workspace_bytes=parts * bias_rows * nb * acc.itemsize if workspace else 0)


def _prepare_empty(problem: AttentionSoftmaxProblem) -> Launch:
    """No element: nothing to launch; a bias gradient is zeros."""
    def run(tensors, outputs):
        if problem.backward and problem.bias_shape is not None:
            outputs[1].zero_()

    return Launch(run, KernelChoice(f"{problem.op}_empty", "triton", ()), problem.acc_dtype)


def _prepare_triton(problem: AttentionSoftmaxProblem) -> Launch:
    if problem.numel == 0:
        return _prepare_empty(problem)
    return _prepare_backward(problem) if problem.backward else _prepare_forward(problem)


if triton_available():
    for _op in (OP, BACKWARD_OP):
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
                 name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.attention_softmax and its backward, with autograd
# ----------------------------------------------------------------------------------------------

def _check_operand(name: str, t: Tensor, scores: Tensor) -> tuple[int, ...]:
    """The broadcast strides of mask / bias, after the checks the descriptor cannot make."""
    if t.device != scores.device:
        raise argument_error(InvalidProblemError, OP, name, f"is on {t.device} but scores is on {scores.device}")
    if name == "mask" and t.dtype != torch.bool:
        raise argument_error(InvalidProblemError, OP, name, f"has dtype {t.dtype}; it must be torch.bool (True = "
                             "keep); pass an additive float mask as bias")
    return broadcast_strides(OP, name, t, scores.shape)


def _seed_value(seed: Tensor | None, dropout_p: float, device: torch.device) -> int | Tensor | None:
    """The seed as the kernels take it: a host int (from a CPU seed), the one-element tensor itself
    (a seed on scores' CUDA device, drawn under torch.compile or a CUDA graph capture), None
    without dropout."""
    if dropout_p == 0:
        return None
    if not isinstance(seed, Tensor) or seed.numel() != 1 or seed.dtype != torch.int64 or not (
            seed.device.type == "cpu" or (seed.device == device and device.type == "cuda")):
        raise argument_error(InvalidProblemError, OP, "seed", "must be a one-element int64 tensor with dropout, on "
                             "the CPU (ops.dropout.draw_seed: a host value, reading it does not sync) or on scores' "
                             f"CUDA device, got {seed!r}")
    if seed.device.type != "cpu":
        return seed.reshape(())
    seed = int(seed)
    if not 0 <= seed < SEED_BOUND:
        raise argument_error(InvalidProblemError, OP, "seed", f"must be in [0, 2**63 - 1), got {seed}")
    return seed


def _attention_softmax_impl(scores: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], scale: float,
                            causal_shift: Optional[int], dropout_p: float,
                            seed: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    mask_strides = None if mask is None else _check_operand("mask", mask, scores)
    bias_strides = None if bias is None else _check_operand("bias", bias, scores)
    # positionally: (shape, dtype, device, strides, mask_strides, bias_dtype, bias_strides, scale, causal_shift,
    # dropout_p, heuristics), the hot path's cheapest build
    descriptor = ForwardDescriptor(scores.shape, scores.dtype, scores.device, (scores.stride(),), mask_strides,
                                   None if bias is None else bias.dtype, bias_strides, scale, causal_shift, dropout_p,
                                   heuristics_for(AttentionSoftmaxHeuristics))
    plan = cached_plan(descriptor)
    return plan.run_unchecked((scores, mask, bias, _seed_value(seed, dropout_p, scores.device)))


def _attention_softmax_fake(scores, mask, bias, scale, causal_shift, dropout_p, seed):
    y = scores.new_empty(scores.shape) if dropout_p > 0 else scores.new_empty(0)
    return scores.new_empty(scores.shape), y


def _save(ctx, inputs, outputs) -> None:
    out, y = outputs
    ctx.mark_non_differentiable(y)
    ctx.set_materialize_grads(False)
    dropout = inputs.dropout_p > 0
    ctx.save_for_backward(y if dropout else out, inputs.seed if dropout else None)
    ctx.scale, ctx.causal_shift, ctx.dropout_p = inputs.scale, inputs.causal_shift, inputs.dropout_p
    bias = inputs.bias
    ctx.bias_shape = None if bias is None else list(bias.shape)
    ctx.bias_dtype = None if bias is None else bias.dtype
    # the backward plans with the forward's heuristics: autograd may run it on another thread
    ctx.heuristics = heuristics_for(AttentionSoftmaxHeuristics)


def _grad(ctx, dout, dy) -> dict:
    if dout is None:
        return {}
    if torch.is_grad_enabled():  # create_graph=True: the backward op records no graph of its own
        raise UnsupportedError(f"trainops.{OP}: double backward (create_graph=True) is not supported")
    y, seed = ctx.saved_tensors
    bias_grad = ctx.bias_shape is not None and ctx.needs_grad.bias
    with heuristics(ctx.heuristics):
        dscores, dbias = attention_softmax_backward_op(dout, y, seed, ctx.scale, ctx.causal_shift, ctx.dropout_p,
                                                       ctx.bias_shape if bias_grad else None,
                                                       ctx.bias_dtype if bias_grad else None)
    grads = {"scores": dscores}
    if bias_grad:
        grads["bias"] = dbias
    return grads


def _backward_impl(dout: Tensor, y: Tensor, seed: Optional[Tensor], scale: float, causal_shift: Optional[int],
                   dropout_p: float, bias_shape: Optional[List[int]],
                   bias_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    if dout.dtype != y.dtype:
        dout = dout.to(y.dtype)
    if dout.shape != y.shape or dout.device != y.device:
        raise argument_error(InvalidProblemError, BACKWARD_OP, "dout", f"has shape {tuple(dout.shape)} on "
                             f"{dout.device}; y has {tuple(y.shape)} on {y.device}")
    descriptor = BackwardDescriptor(y.shape, y.dtype, y.device, (dout.stride(), y.stride()),
                                    None if bias_shape is None else tuple(bias_shape), bias_dtype, scale, causal_shift,
                                    dropout_p, heuristics_for(AttentionSoftmaxHeuristics))
    plan = cached_plan(descriptor)
    return plan.run_unchecked((dout, y, _seed_value(seed, dropout_p, dout.device)))


def _backward_fake(dout, y, seed, scale, causal_shift, dropout_p, bias_shape, bias_dtype):
    dbias = y.new_empty(bias_shape, dtype=bias_dtype) if bias_shape is not None else y.new_empty(0)
    return y.new_empty(y.shape), dbias


def _no_dropout(arguments) -> bool:
    return arguments.dropout_p == 0


# The backward op has no autograd of its own (double backward is not supported).
# Inlined under torch.compile on CUDA (library.custom_op's inline_triton) except with dropout (not
# tried: its seed, drawn on the device there, would go through Inductor's mutation analysis too).
attention_softmax_backward_op = custom_op(BACKWARD_OP, _backward_impl, _backward_fake, inline_triton=_no_dropout)
attention_softmax_op = custom_op(OP, _attention_softmax_impl, _attention_softmax_fake, backward=_grad, save=_save,
                                 inline_triton=_no_dropout)
