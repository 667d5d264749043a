"""RMSNorm and LayerNorm over the trailing axes, forward and backward, with the pre-norm block's
fused residual add: Triton kernels, CPU path, registrations and custom ops.

Each row holds the N elements of the last ``normalized_ndim`` axes. With h = x (+ residual, when
given: the op then also returns h, the block's new residual stream), w_eff = weight + weight_offset:

    rms_norm     rstd = 1 / sqrt(mean(h^2) + eps)                    y = h * rstd * w_eff
    layer_norm   mu = mean(h), rstd = 1 / sqrt(mean((h - mu)^2) + eps)  y = (h - mu) * rstd * w + b

Backward, with hh = the normalized h ((h - mu) * rstd, mu = 0 for RMSNorm) and g = dy * w_eff:

    rms_norm     dh = rstd * (g - hh * mean(g * hh))                 dw = sum over rows of dy * hh
    layer_norm   dh = rstd * (g - mean(g) - hh * mean(g * hh))       dw as above, db = sum over rows of dy
    dx = d residual = dh + (the gradient of the returned h)

Shapes: x of any shape whose trailing ``normalized_ndim`` axes are weight's (and bias's) shape;
residual x's shape. Strides: any for x, residual, dy and the gradient of h (read in place when the
normalized axes of each walk as one strided axis, the case of every view users make; otherwise that
tensor is copied first). Outputs are contiguous. Dtypes: x and residual float32 / float16 /
bfloat16 / float64, one dtype; weight and bias any of those (their gradients in their own dtype);
h in x's dtype; y in ``out_dtype`` (any of the four; default x's): the float32 (float64) y rounded
once to it, so a bf16 y of a float32 x holds exactly ``y_float32.to(torch.bfloat16)`` (the cast
torch's autocast makes before a matmul: trainops.hf's pre-norms under autocast). The backward
takes dy in y's dtype and gives dx in x's. Statistics (mean, rstd) and every sum in float32
(float64 for float64 x). h is rounded to x's dtype before it is normalized, as ``x + residual`` in
torch, so the stored h and the normalized one agree.

Deterministic and bit-identical run to run: the weight and bias gradients are summed per program
over a fixed block of rows into a float32 workspace, then across programs in a fixed order by a
second kernel (no atomics). The number of programs depends on the device's SM count.

Triton plans (``_choose_config``): rows of up to ``NormHeuristics.fused_max`` elements are held
in registers (forward: one read of x (and residual), one write of y (and h); backward: one read
of dy and h, one write of dx). Longer rows are looped in chunks: statistics first (Chan's
combination of per-chunk means and squared deviations), then a second read. Backwards over wide
rows (LayerNorm's longer than 8192 elements, RMSNorm's longer than 16384, up to SMs chunks of
4096 elements) take the exchange plan (``exchange.py``): a row is cut into chunks held in
registers by programs that run together and
trade their partial sums, so dy and h are read once, and each program keeps the weight and bias
gradients of its chunk's columns in registers over all its rows. Its programs spin on one
another: ``TRAINOPS_ROW_EXCHANGE=0`` (or ``NormHeuristics(row_exchange=False)``) turns it off
where something else limits the SMs a process may use (exchange.py says more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..compiled import Decomposition
from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher, on_device
from ..layout import ReductionLayout, merge_dims, next_pow2, reduction_layout
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics_for, keep_heuristics
from ..registry import (ACCUMULATOR, FLOATS, accumulator_dtype, normalize_device, register, register_op, sm_count,
                        triton_available)
from ._common import (check_heuristic_fields, checked_strides, contiguous_strides, first_step, float_dtype,
                      raise_mismatch)
from .exchange import ExchangeGrid, ExchangeHeuristics, balanced_groups, exchange_phases, launch_exchange

FORWARD_OPS = ("rms_norm", "layer_norm")
BACKWARD_OPS = ("rms_norm_backward", "layer_norm_backward")
MAX_RANK = 8


# ----------------------------------------------------------------------------------------------
# Heuristics
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NormHeuristics(ExchangeHeuristics):
    """The normalization family's tunables (trainops.heuristics(...) overrides them).

    Sizes in *units* count 2-byte elements (bf16 / fp16 elements; a float32 element is 2 units, a
    float64 one 4), so that a step moves the same bytes whatever x's dtype.

    fused_max: longest row (elements) held in registers; longer rows are looped in chunks of
        ``chunk`` elements, forward ``looped_rows`` rows a program with ``looped_warps`` warps,
        backward ``looped_backward_rows`` rows a step with ``looped_backward_warps``.
    exchange_above / rms_exchange_above: LayerNorm / RMSNorm backwards over rows longer than this
        many elements take the exchange plan (when on, and when a row needs at most SMs chunks):
        chunks of ``exchange_tile`` elements, ``exchange_warps`` warps,
        ``exchange_programs_per_sm`` programs per SM asked for (the kernel's occupancy may allow
        fewer; sms and row_exchange: ExchangeHeuristics).
    forward_tile: units one forward program holds (rows per program = tile // row block);
        forward_rows: at least this many rows a forward program for 2-byte dtypes (the weight and
        bias read once for them; 1 for wider dtypes). warps: (row block units at most, warps)
        steps of the forward, the first that fits.
    backward_tile: units a backward program holds per step of its loop over rows;
        backward_programs_per_sm: programs of the backward per SM (each sums its rows' weight
        gradient into one workspace row); backward_warps and backward_stages: (row block units at
        most, value) steps of its warps and software-pipelining stages, fewer stages when stages x
        the bytes a step loads (dy, h, grad_h tiles) would pass pipeline_bytes (the staging lives
        in shared memory: 3 stages of two 8192-element float32 tiles needed 262 KB with the
        reductions' scratch, over the H100's 227 KB; one program a SM with 2 x 64 KB ran on the
        H200). Row blocks of at most small_rows elements instead take small_rows_tile elements a
        step, small_rows_warps warps and small_rows_programs_per_sm programs per SM.
        step_sums: fused backwards over row blocks of at most this many elements sum each step's rows
        of dweight / dbias into one accumulator row (0: never); wider ones keep an accumulator per
        (row slot, column) and sum it once after their loop. bf16 LayerNorm at rows of 768: 245 -> 176
        registers a thread, backward 66.7 -> 64.9 us on the H100, forward + backward 95.5 -> 91.5 us on
        the H200; at rows of 2048 the per-step sums were 2 % slower on the H200 (float32 and float64
        rows not measured).
        reduce_block: columns one program of the partial-sum reduction owns.
    Defaults measured on the H200 (benchmarks/NOTES.md, "Normalization's tiles and odd widths",
    GPU time; probe_normalization.py). Backward: one program a SM, 16 KB of x a step (8192 bf16
    elements), 8 warps and 3 stages beat the H100 era's 4096-element tiles and 2 programs a SM at
    bf16 rows of 2048-8192 (LayerNorm 8192 x 4096 62.2 us against 66.3; RMSNorm 1-3 %; rows of
    5120 / 8192 1.2-1.4x with the forward) and at float32 rows of 2048 and 4096 (RMSNorm 105.1 us
    against about 110); rows of 16384 bf16 want 32 warps and one stage (LayerNorm 165 us against
    466 with 16 warps: registers spilled). Row blocks of 1024 and less keep the earlier backward
    (bf16 RMSNorm / LayerNorm 32768 x 768 50.4 / 60.2 us against 51.5 / 60.9 for the new one;
    float32 LayerNorm 118 us a backward with the new one, about 89 with the earlier).
    Forward: 2 rows a program with 4 warps at bf16 rows of 5120-8192 (LayerNorm 4096 x 5120 40 us
    against 54.5); float32 forwards were within 2 % across the tiles and warps tried.
    Wide rows (NOTES "Wide rows: the exchange backward"; H200, bf16, backward alone): the exchange
    with 4096-element chunks, 4 warps and 2 programs a SM against the plans before it, LayerNorm
    2048 x 16384 102.7 us against 163.3 (fused, 32 warps), 1024 x 20000 69.1 against 95.3 (looped),
    1024 x 32768 104.3 against 150.2; RMSNorm 1024 x 20000 61 against 71, 1024 x 32768 95 against
    115; but RMSNorm 2048 x 16384 93 against the fused 87.5 (hence its own threshold), and rows of
    8192 (bf16 and float32) 1.25-1.6x slower than fused; 2048- and 8192-element chunks were slower
    for LayerNorm; float32 LayerNorm 2048 x 16384 152 us against 244 fused with the same 4096-element
    chunks (sizes here count elements, not units). An exchange forward was
    slower than the fused and looped ones at every width tried (RMSNorm 2048 x 16384 54 against 43
    us) and was dropped. Looped rows: 2 rows a forward program (8 warps), 4 a backward step (16
    warps), 1024 x 32768 LayerNorm backward 150 us against 316 for one row a step at 8 warps.
    """

    fused_max: int = 16384
    chunk: int = 4096
    looped_rows: int = 2
    looped_backward_rows: int = 4
    looped_backward_warps: int = 16
    exchange_above: int = 8192
    rms_exchange_above: int = 16384
    exchange_tile: int = 4096
    exchange_warps: int = 4
    exchange_programs_per_sm: int = 2
    forward_tile: int = 8192
    forward_rows: int = 2
    warps: tuple[tuple[int, int], ...] = ((2048, 4), (4096, 8), (8192, 4), (1 << 62, 8))
    backward_tile: int = 8192
    backward_programs_per_sm: int = 1
    backward_warps: tuple[tuple[int, int], ...] = ((8192, 8), (1 << 62, 32))
    backward_stages: tuple[tuple[int, int], ...] = ((8192, 3), (1 << 62, 1))
    small_rows: int = 1024
    small_rows_tile: int = 4096
    small_rows_warps: int = 4
    small_rows_programs_per_sm: int = 2
    step_sums: int = 1024
    pipeline_bytes: int = 147456
    reduce_block: int = 64
    looped_warps: int = 8

    def __hash__(self) -> int:
        # every call's descriptor (the plan cache's key) hashes this: 1.1 us over the 26 fields on the
        # CPU host, so computed once (the fields are frozen); equality stays the fields'
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", found)
        return found


# ----------------------------------------------------------------------------------------------
# Problem
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NormProblem:
    """One normalization problem over rows of ``n`` elements (the last ``normalized_ndim`` axes).

    Forward inputs (x, weight, bias, residual) -> (y, h, stats); backward inputs
    (dy, h, weight, stats, grad_h) -> (dx, dweight, dbias). Absent optional tensors are None;
    absent outputs are empty tensors. ``dtype``: x's, residual's and h's (forward), h's, grad_h's
    and dx's (backward); ``out_dtype``: y's (forward), dy's (backward). ``stats`` is float32
    (float64 for float64 x) of shape (k, rows): RMSNorm's rstd (k = 1), LayerNorm's mean and rstd
    (k = 2).
    ``strides``: the strided inputs' strides in the order of ``strided_names`` (None when absent).
    """

    op: str
    shape: tuple[int, ...]
    normalized_ndim: int
    dtype: torch.dtype
    device: torch.device
    weight_dtype: torch.dtype | None
    bias_dtype: torch.dtype | None
    has_residual: bool
    strides: tuple[tuple[int, ...] | None, ...]
    eps: float
    weight_offset: float
    weight_grad: bool
    heuristics: NormHeuristics
    out_dtype: torch.dtype
    index_dtype = None

    @cached_property
    def backward(self) -> bool:
        return self.op in BACKWARD_OPS

    @cached_property
    def rms(self) -> bool:
        return self.op.startswith("rms")

    @cached_property
    def n(self) -> int:
        return math.prod(self.shape[len(self.shape) - self.normalized_ndim:])

    @cached_property
    def rows(self) -> int:
        return math.prod(self.shape[:len(self.shape) - self.normalized_ndim])

    @cached_property
    def compiled_size(self) -> int | None:
        """The size CompiledChoices key a forward on (a row's elements); None for a backward, which
        runs under torch.compile whenever its forward op does (trainops.compiled)."""
        return None if self.backward else self.n

    @cached_property
    def weight_grad_wanted(self) -> bool:
        """Backward: whether dweight is computed (a weight whose gradient is asked for)."""
        return self.weight_dtype is not None and self.weight_grad

    @cached_property
    def normalized_shape(self) -> tuple[int, ...]:
        return self.shape[len(self.shape) - self.normalized_ndim:]

    @cached_property
    def stats_rows(self) -> int:
        return 1 if self.rms else 2

    @cached_property
    def units_per_element(self) -> int:
        """The 2-byte units one element of x is worth (NormHeuristics' sizes): bf16 1, float32 2."""
        return max(1, self.dtype.itemsize // 2)

    @cached_property
    def acc_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    @cached_property
    def strided_names(self) -> tuple[str, ...]:
        return ("dy", "h", "grad_h") if self.backward else ("x", "residual")

    def check(self, tensors: Sequence[Tensor | None], out) -> None:
        """Cheap checks of concrete tensors against the plan (shape, strides, dtype, device)."""
        names = ("dy", "h", "weight", "stats", "grad_h") if self.backward else ("x", "weight", "bias", "residual")
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(names)} tensors ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        given = dict(zip(names, tensors))
        expected = {"weight": self.weight_dtype, "residual" if not self.backward else "grad_h":
                    self.dtype if self.has_residual else None}
        if not self.backward:
            expected["bias"] = self.bias_dtype
        for name, dtype in expected.items():
            if (given[name] is None) != (dtype is None):
                raise argument_error(InvalidProblemError, self.op, name,
                                     "is missing; the plan has one" if dtype is not None else
                                     "is given; the plan has none")
        for name, strides in zip(self.strided_names, self.strides):
            if given[name] is not None:
                check_tensor(self.op, name, given[name], self.shape, self.out_dtype if name == "dy" else self.dtype,
                             self.device, strides)
        for name in ("weight", "bias"):
            if given.get(name) is not None:
                check_tensor(self.op, name, given[name], self.normalized_shape, expected[name], self.device)
        if self.backward:
            check_tensor(self.op, "stats", given["stats"], (self.stats_rows, self.rows), self.acc_dtype, self.device)
            if not given["stats"].is_contiguous():
                raise argument_error(InvalidProblemError, self.op, "stats", "must be contiguous (the forward's)")
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    def new_output(self) -> tuple[Tensor, Tensor, Tensor]:
        """Forward: (y, h, stats); backward: (dx, dweight, dbias). Absent outputs are empty."""
        def empty():  # an absent output: its own empty tensor (outputs of a custom op may not alias)
            return torch.empty(0, dtype=self.dtype, device=self.device)
        if self.backward:
            dw = (torch.empty(self.normalized_shape, dtype=self.weight_dtype, device=self.device)
                  if self.weight_dtype is not None and self.weight_grad else empty())
            db = (torch.empty(self.normalized_shape, dtype=self.bias_dtype, device=self.device)
                  if self.bias_dtype is not None else empty())
            return torch.empty(self.shape, dtype=self.dtype, device=self.device), dw, db
        y = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        h = torch.empty(self.shape, dtype=self.dtype, device=self.device) if self.has_residual else empty()
        stats = torch.empty((self.stats_rows, self.rows), dtype=self.acc_dtype, device=self.device)
        return y, h, stats


def _describe(op: str, shape, dtype, device="cuda", *, normalized_ndim=1, weight_dtype=None, bias_dtype=None,
              has_residual=False, strides=None, eps=None, weight_offset=0.0, weight_grad=True,
              heuristics=None, out_dtype=None) -> NormProblem:
    """Validate a normalization descriptor.

    shape: x's sizes (rank 1..8). normalized_ndim: how many trailing axes form a row (1..rank).
    dtype: x's (and residual's, h's, dx's) dtype. out_dtype: y's (forward) or dy's (backward),
    default dtype. weight_dtype / bias_dtype: None when absent.
    has_residual: forward, a residual is added; backward, a gradient of h is added.
    strides: None (contiguous) or one entry per strided input (forward x, residual; backward dy, h,
    grad_h), None for an absent one; each input's normalized axes must walk as one strided axis.
    eps: >= 0 (default: RMSNorm torch.finfo(dtype).eps, LayerNorm 1e-5). weight_offset: RMSNorm's
    w_eff = weight + weight_offset (Gemma: 1.0); needs a weight. weight_grad: backward, whether to
    compute the weight's gradient (False for a frozen weight: the backward then reads the weight but
    sums no partials; the bias gradient is left out by giving no bias_dtype). heuristics: a
    NormHeuristics.
    """
    backward = op in BACKWARD_OPS
    first = "dy" if backward else "x"
    shape = checked_shape(op, "shape", shape)
    if not 1 <= len(shape) <= MAX_RANK:
        raise argument_error(UnsupportedError, op, first, f"has rank {len(shape)}; ranks 1 to {MAX_RANK} are supported")
    if not isinstance(normalized_ndim, int) or isinstance(normalized_ndim, bool) \
            or not 1 <= normalized_ndim <= len(shape):
        raise argument_error(InvalidProblemError, op, "normalized_shape",
                             f"must name 1 to {len(shape)} trailing axes of a rank-{len(shape)} input, "
                             f"got {normalized_ndim!r}")
    dtype = float_dtype(op, "h" if backward else first, dtype)
    out_dtype = float_dtype(op, first if backward else "out_dtype", dtype if out_dtype is None else out_dtype)
    weight_dtype = float_dtype(op, "weight", weight_dtype, optional=True)
    bias_dtype = float_dtype(op, "bias", bias_dtype, optional=True)
    if bias_dtype is not None and op.startswith("rms"):
        raise argument_error(InvalidProblemError, op, "bias", "is not an argument of RMSNorm")
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    if eps is None:
        eps = torch.finfo(dtype).eps if op.startswith("rms") else 1e-5
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or math.isinf(eps):
        raise argument_error(InvalidProblemError, op, "eps", f"must be a finite number >= 0, got {eps!r}")
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)) \
            or not math.isfinite(weight_offset):
        raise argument_error(InvalidProblemError, op, "weight_offset", f"must be a finite number, got {weight_offset!r}")
    if weight_offset != 0 and weight_dtype is None:
        raise argument_error(InvalidProblemError, op, "weight_offset",
                             f"is {weight_offset}, but there is no weight to offset")
    names = ("dy", "h", "grad_h") if backward else ("x", "residual")
    present = (True, True, bool(has_residual)) if backward else (True, bool(has_residual))
    strides = checked_strides(op, names, present, strides, (shape,) * len(names))
    for name, st in zip(names, strides):
        if st is not None and merge_dims(shape[len(shape) - normalized_ndim:], st[len(shape) - normalized_ndim:]) is None:
            raise argument_error(UnsupportedError, op, name,
                                 f"has strides {st}: its last {normalized_ndim} axes do not walk as one strided axis")
    if heuristics is None:
        heuristics = heuristics_for(NormHeuristics)
    elif not isinstance(heuristics, NormHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"must be a NormHeuristics, got {type(heuristics).__name__}")
    return NormProblem(op, shape, normalized_ndim, dtype, device, weight_dtype, bias_dtype, bool(has_residual),
                       strides, float(eps), float(weight_offset), bool(weight_grad), heuristics, out_dtype)


def _describer(op: str):
    def describe(shape, dtype, device="cuda", *, normalized_ndim=1, weight_dtype=None, bias_dtype=None,
                 has_residual=False, strides=None, eps=None, weight_offset=0.0, weight_grad=True,
                 heuristics=None, out_dtype=None) -> NormProblem:
        return _describe(op, shape, dtype, device, normalized_ndim=normalized_ndim, weight_dtype=weight_dtype,
                         bias_dtype=bias_dtype, has_residual=has_residual, strides=strides, eps=eps,
                         weight_offset=weight_offset, weight_grad=weight_grad, heuristics=heuristics,
                         out_dtype=out_dtype)
    describe.__doc__ = _describe.__doc__
    return describe


DESCRIPTORS = {op: register_op(op, _describer(op)) for op in FORWARD_OPS + BACKWARD_OPS}


def _dtype_of(t: Tensor | None):
    return None if t is None else t.dtype


def _strides_of(t: Tensor | None):
    return None if t is None else t.stride()


# ----------------------------------------------------------------------------------------------
# CPU path: torch's CPU ops in the accumulator dtype (the same formulas as the kernels)
# ----------------------------------------------------------------------------------------------

def _rows_view(t: Tensor, problem: NormProblem) -> Tensor:
    return t.reshape(problem.rows, problem.n)


def _cpu_forward(problem: NormProblem, tensors, outputs) -> None:
    x, weight, bias, residual = tensors
    y, h_out, stats = outputs
    acc = problem.acc_dtype
    h = x
    if residual is not None:
        h_out.copy_(x + residual)
        h = h_out
    h = _rows_view(h, problem).to(acc)
    if problem.rms:
        rstd = torch.rsqrt(h.square().mean(1) + problem.eps)
        normed = h * rstd[:, None]
        stats[0].copy_(rstd)
    else:
        mean = h.mean(1)
        centered = h - mean[:, None]
        rstd = torch.rsqrt(centered.square().mean(1) + problem.eps)
        normed = centered * rstd[:, None]
        stats[0].copy_(mean)
        stats[1].copy_(rstd)
    if weight is not None:
        normed = normed * (weight.reshape(-1).to(acc) + problem.weight_offset)
    if bias is not None:
        normed = normed + bias.reshape(-1).to(acc)
    y.copy_(normed.reshape(problem.shape))


def _cpu_backward(problem: NormProblem, tensors, outputs) -> None:
    dy, h, weight, stats, grad_h = tensors
    dx, dweight, dbias = outputs
    acc = problem.acc_dtype
    dy = _rows_view(dy, problem).to(acc)
    h = _rows_view(h, problem).to(acc)
    rstd = stats[-1][:, None]
    normed = h * rstd if problem.rms else (h - stats[0][:, None]) * rstd
    g = dy * (weight.reshape(-1).to(acc) + problem.weight_offset) if weight is not None else dy
    dh = g - normed * (g * normed).mean(1, keepdim=True)
    if not problem.rms:
        dh = dh - g.mean(1, keepdim=True)
    dh = dh * rstd
    if grad_h is not None:
        dh = dh + _rows_view(grad_h, problem).to(acc)
    dx.copy_(dh.reshape(problem.shape))
    if weight is not None and problem.weight_grad:
        dweight.copy_((dy * normed).sum(0).reshape(dweight.shape))
    if dbias.numel() or problem.bias_dtype is not None:
        dbias.copy_(dy.sum(0).reshape(dbias.shape))


def _prepare_cpu(problem: NormProblem) -> Launch:
    compute = _cpu_backward if problem.backward else _cpu_forward

    def run(tensors, outputs):
        if problem.rows and problem.n:
            compute(problem, tensors, outputs)
        else:
            _write_empty(problem, outputs)

    return Launch(run, KernelChoice(f"{problem.op}_cpu", "cpu", ()), problem.acc_dtype)


def _gradient_workspaces(problem: NormProblem, outputs, parts: int, acc: torch.dtype, make=torch.empty):
    """A backward run's start, shared by its plans: ``(dweight partials, dbias partials)``, each a
    (parts, n) workspace in ``acc`` made by ``make`` (None where that gradient is not computed), or
    None when there is nothing to reduce (no row, or rows of length 0): the outputs are then written
    here. One workspace a gradient, not views of a shared one: each view is one more host call."""
    if problem.rows == 0 or problem.n == 0:
        _write_empty(problem, outputs)
        return None
    device = outputs[0].device
    dw_part = make((parts, problem.n), dtype=acc, device=device) if problem.weight_grad_wanted else None
    db_part = make((parts, problem.n), dtype=acc, device=device) if problem.bias_dtype is not None else None
    return dw_part, db_part


def _write_empty(problem: NormProblem, outputs) -> None:
    """No element to normalize. Forward: rows of length 0 have mean 0 and rstd NaN (1 / sqrt(0 / 0
    + eps)); backward: the weight and bias gradients are zero."""
    if problem.backward:
        for grad in outputs[1:]:
            grad.zero_()
    elif problem.rows:
        stats = outputs[2]
        stats[-1].fill_(float("nan"))
        if not problem.rms:
            stats[0].zero_()


for _op in FORWARD_OPS + BACKWARD_OPS:
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
             name=f"{_op}_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from ._common import _row_offset, column_sum
    from .exchange import arrive, place_in_group, wait_for

    @triton.jit
    def _load_h(X, R, H, x_row, r_row, out_row, cols, mask, x_sn, r_sn,
                HAS_R: tl.constexpr, STORE_H: tl.constexpr, ACC: tl.constexpr):
        """h = x (+ residual, rounded to x's dtype; stored to H when STORE_H) as ACC."""
        x = tl.load(X + x_row[:, None] + cols[None, :].to(tl.int64) * x_sn, mask=mask, other=0.0)
        if HAS_R:
            r = tl.load(R + r_row[:, None] + cols[None, :].to(tl.int64) * r_sn, mask=mask, other=0.0)
            h = (x.to(ACC) + r.to(ACC)).to(X.dtype.element_ty)
            if STORE_H:
                tl.store(H + out_row[:, None] + cols[None, :], h, mask=mask)
            return h.to(ACC)
        return x.to(ACC)

    @triton.jit
    def _weight_eff(W, c, n, w_offset, HAS_W: tl.constexpr, ACC: tl.constexpr):
        """w_eff = weight + weight_offset over columns ``c`` as ACC (1 without a weight). The cast
        keeps ACC where Inductor, launching an inlined kernel, passes the float scalars as fp64."""
        if HAS_W:
            return (tl.load(W + c, mask=c < n, other=0.0).to(ACC) + w_offset).to(ACC)
        return tl.full(c.shape, 1.0, ACC)

    @triton.jit
    def _norm_fwd(
        X, R, Y, H, W, B, STATS,                  # inputs x, residual; outputs y, h; weight, bias; stats (k, rows)
        x_base, x_s0, x_s1, x_si, x_sn,           # x: base offset, outer0 / outer1 / inner / row-axis strides
        r_base, r_s0, r_s1, r_si, r_sn,           # residual, likewise
        out_base, rows_total,                     # contiguous outputs: first row's offset; rows of the whole problem
        rows, n_units, OUTER1, INNER, eps, w_offset,  # rows of this launch, row length / ALIGN, batch sizes, eps, w_eff - w
        RMS: tl.constexpr, HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr,
        ALIGN: tl.constexpr,
    ):
        """BLOCK_M rows a program: statistics, then y (and h) written once. ALIGN: a power of two
        that divides n and every row's offset in every tensor (the plan's guarantee): rows of
        1000 bf16 elements then load as 16-byte vectors, not element by element. The row length
        comes as n_units = n / ALIGN: a hint on a scalar argument does not reach the compiler."""
        n = n_units * ALIGN
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        r_mask = r < rows
        x_row = tl.multiple_of(x_base + _row_offset(r, OUTER1, INNER, x_s0, x_s1, x_si), ALIGN)
        r_row = tl.multiple_of(r_base + _row_offset(r, OUTER1, INNER, r_s0, r_s1, r_si), ALIGN)
        out_row = tl.multiple_of(out_base + r.to(tl.int64) * n, ALIGN)
        cols = tl.arange(0, BLOCK_N)
        if not LOOPED:
            mask = r_mask[:, None] & (cols < n)[None, :]
            h = _load_h(X, R, H, x_row, r_row, out_row, cols, mask, x_sn, r_sn, HAS_R, True, ACC)
            if RMS:
                mean = tl.zeros([BLOCK_M], ACC)
                centered = h
            else:
                mean = tl.sum(h, 1) / n
                centered = tl.where(mask, h - mean[:, None], 0.0)
            rstd = (1.0 / tl.sqrt(tl.sum(centered * centered, 1) / n + eps)).to(ACC)  # eps: fp64 under Inductor
            y = centered * rstd[:, None]
            if HAS_W:
                y = y * _weight_eff(W, cols, n, w_offset, HAS_W, ACC)[None, :]
            if HAS_B:
                y = y + tl.load(B + cols, mask=cols < n, other=0.0).to(ACC)[None, :]
            tl.store(Y + out_row[:, None] + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        else:
            # Chan's combination of per-chunk (count, mean, squared deviations): stable for any mean
            count = tl.zeros([BLOCK_M], ACC)
            mean = tl.zeros([BLOCK_M], ACC)
            m2 = tl.zeros([BLOCK_M], ACC)
            for start in range(0, n, BLOCK_N):
                c = start + cols
                mask = r_mask[:, None] & (c < n)[None, :]
                h = _load_h(X, R, H, x_row, r_row, out_row, c, mask, x_sn, r_sn, HAS_R, False, ACC)
                k = tl.minimum(n - start, BLOCK_N).to(ACC)
                if RMS:
                    m2 += tl.sum(h * h, 1)
                else:
                    chunk_mean = tl.sum(h, 1) / k
                    d = tl.where(mask, h - chunk_mean[:, None], 0.0)
                    delta = chunk_mean - mean
                    total = count + k
                    mean += delta * (k / total)
                    m2 += tl.sum(d * d, 1) + delta * delta * (count * k / total)
                    count = total
            rstd = (1.0 / tl.sqrt(m2 / n + eps)).to(ACC)
            for start in range(0, n, BLOCK_N):
                c = start + cols
                mask = r_mask[:, None] & (c < n)[None, :]
                h = _load_h(X, R, H, x_row, r_row, out_row, c, mask, x_sn, r_sn, HAS_R, True, ACC)
                y = (h - mean[:, None]) * rstd[:, None]
                if HAS_W:
                    y = y * _weight_eff(W, c, n, w_offset, HAS_W, ACC)[None, :]
                if HAS_B:
                    y = y + tl.load(B + c, mask=c < n, other=0.0).to(ACC)[None, :]
                tl.store(Y + out_row[:, None] + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
        stats_row = out_base // n + r
        if RMS:
            tl.store(STATS + stats_row, rstd, mask=r_mask)
        else:
            tl.store(STATS + stats_row, mean, mask=r_mask)
            tl.store(STATS + rows_total + stats_row, rstd, mask=r_mask)

    @triton.jit
    def _norm_bwd_tile(DY, HX, w_eff, dy_row, h_row, c, mask, mean, rstd, dy_sn, h_sn,
                       HAS_W: tl.constexpr, ACC: tl.constexpr):
        """(dy, hh, g) of one tile: the row gradient's ingredients (w_eff: the tile's columns')."""
        dy = tl.load(DY + dy_row[:, None] + c[None, :].to(tl.int64) * dy_sn, mask=mask, other=0.0).to(ACC)
        h = tl.load(HX + h_row[:, None] + c[None, :].to(tl.int64) * h_sn, mask=mask, other=0.0).to(ACC)
        hh = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            g = dy * w_eff[None, :]
        else:
            g = dy
        return dy, hh, g

    @triton.jit
    def _norm_bwd(
        DY, HX, W, STATS, DS, DX, DW_PART, DB_PART,   # dy, h, weight, stats, grad of h; dx; per-program partials
        dy_base, dy_s0, dy_s1, dy_si, dy_sn,
        h_base, h_s0, h_s1, h_si, h_sn,
        s_base, s_s0, s_s1, s_si, s_sn,
        out_base, rows_total, part_base,              # first row's offset in dx; rows in all; first partial row
        rows, n_units, OUTER1, INNER, rows_per_program, w_offset,  # n_units: the row length / ALIGN
        RMS: tl.constexpr, HAS_W: tl.constexpr, DW: tl.constexpr, HAS_B: tl.constexpr, HAS_DS: tl.constexpr,
        ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr,
        STAGES: tl.constexpr, ALIGN: tl.constexpr, STEP_SUMS: tl.constexpr = False,
    ):
        """dx of ``rows_per_program`` rows, BLOCK_M at a time; their dweight / dbias summed in registers
        (or in the program's own workspace row, looped) and written as one partial row. STEP_SUMS
        (fused): each step's rows summed into one accumulator row, else kept per (row slot, column)
        and summed once after the loop."""
        n = n_units * ALIGN  # as the forward's ALIGN and n_units
        pid = tl.program_id(0)
        first = pid * rows_per_program
        last = tl.minimum(first + rows_per_program, rows)
        cols = tl.arange(0, BLOCK_N)
        part = (part_base + pid).to(tl.int64) * n
        # fused: the weight and bias gradients of the program's rows, per (row slot, column) or, with
        # STEP_SUMS, summed over each step's rows (fewer registers: see NormHeuristics.step_sums)
        dw = tl.zeros([BLOCK_N] if STEP_SUMS else [BLOCK_M, BLOCK_N], ACC)
        db = tl.zeros([BLOCK_N] if STEP_SUMS else [BLOCK_M, BLOCK_N], ACC)
        # fused: the weight read once a program, not once a step (inside the loop its loads were
        # pipelined through shared memory beside dy and h, a third of each step's staging)
        w_fused = _weight_eff(W, cols, n, w_offset, HAS_W and not LOOPED, ACC)
        for start in tl.range(first, last, BLOCK_M, num_stages=STAGES):
            r = start + tl.arange(0, BLOCK_M)
            r_mask = r < last
            dy_row = tl.multiple_of(dy_base + _row_offset(r, OUTER1, INNER, dy_s0, dy_s1, dy_si), ALIGN)
            h_row = tl.multiple_of(h_base + _row_offset(r, OUTER1, INNER, h_s0, h_s1, h_si), ALIGN)
            s_row = tl.multiple_of(s_base + _row_offset(r, OUTER1, INNER, s_s0, s_s1, s_si), ALIGN)
            out_row = tl.multiple_of(out_base + r.to(tl.int64) * n, ALIGN)
            stats_row = out_base // n + r
            rstd = tl.load(STATS + (rows_total if not RMS else 0) + stats_row, mask=r_mask, other=0.0)
            if RMS:
                mean = tl.zeros([BLOCK_M], ACC)
            else:
                mean = tl.load(STATS + stats_row, mask=r_mask, other=0.0)
            if not LOOPED:
                mask = r_mask[:, None] & (cols < n)[None, :]
                dy, hh, g = _norm_bwd_tile(DY, HX, w_fused, dy_row, h_row, cols, mask, mean, rstd, dy_sn, h_sn,
                                           HAS_W, ACC)
                c2 = tl.sum(g * hh, 1) / n
                dh = g - hh * c2[:, None]
                if not RMS:
                    dh -= (tl.sum(g, 1) / n)[:, None]
                dh = dh * rstd[:, None]
                if HAS_DS:
                    dh += tl.load(DS + s_row[:, None] + cols[None, :].to(tl.int64) * s_sn, mask=mask,
                                  other=0.0).to(ACC)
                tl.store(DX + out_row[:, None] + cols[None, :], dh.to(DX.dtype.element_ty), mask=mask)
                if DW:
                    dw += tl.sum(dy * hh, 0) if STEP_SUMS else dy * hh
                if HAS_B:
                    db += tl.sum(dy, 0) if STEP_SUMS else dy
            else:
                c1 = tl.zeros([BLOCK_M], ACC)
                c2 = tl.zeros([BLOCK_M], ACC)
                for cs in range(0, n, BLOCK_N):
                    c = cs + cols
                    mask = r_mask[:, None] & (c < n)[None, :]
                    dy, hh, g = _norm_bwd_tile(DY, HX, _weight_eff(W, c, n, w_offset, HAS_W, ACC), dy_row, h_row,
                                               c, mask, mean, rstd, dy_sn, h_sn, HAS_W, ACC)
                    c1 += tl.sum(g, 1)
                    c2 += tl.sum(g * hh, 1)
                c1, c2 = c1 / n, c2 / n
                for cs in range(0, n, BLOCK_N):
                    c = cs + cols
                    mask = r_mask[:, None] & (c < n)[None, :]
                    dy, hh, g = _norm_bwd_tile(DY, HX, _weight_eff(W, c, n, w_offset, HAS_W, ACC), dy_row, h_row,
                                               c, mask, mean, rstd, dy_sn, h_sn, HAS_W, ACC)
                    dh = g - hh * c2[:, None]
                    if not RMS:
                        dh -= c1[:, None]
                    dh = dh * rstd[:, None]
                    if HAS_DS:
                        dh += tl.load(DS + s_row[:, None] + c[None, :].to(tl.int64) * s_sn, mask=mask,
                                      other=0.0).to(ACC)
                    tl.store(DX + out_row[:, None] + c[None, :], dh.to(DX.dtype.element_ty), mask=mask)
                    # the program's own workspace row (zeroed before launch): no other program touches it
                    if DW:
                        p = DW_PART + part + c
                        tl.store(p, tl.load(p, mask=c < n, other=0.0) + tl.sum(dy * hh, 0), mask=c < n)
                    if HAS_B:
                        p = DB_PART + part + c
                        tl.store(p, tl.load(p, mask=c < n, other=0.0) + tl.sum(dy, 0), mask=c < n)
        if not LOOPED:
            if DW:
                tl.store(DW_PART + part + cols, dw if STEP_SUMS else tl.sum(dw, 0), mask=cols < n)
            if HAS_B:
                tl.store(DB_PART + part + cols, db if STEP_SUMS else tl.sum(db, 0), mask=cols < n)


    # ------------------------------------------------------------------------------------------
    # Exchange plan of the backward: wide rows cut into SPLITS chunks held by programs that trade
    # partial sums (exchange.py): dy and h read once, no second pass over the row, and each
    # program's weight-gradient columns summed in registers over all its rows
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _chunk_load(P, base, r, rows, OUTER1, INNER, s0, s1, si, sn, c, c_mask, ALIGN: tl.constexpr):
        """The [1, BLOCK_N] chunk ``c`` of row r of a strided operand, raw (all masked once r >= rows)."""
        row = tl.multiple_of(base + _row_offset(r, OUTER1, INNER, s0, s1, si), ALIGN)
        mask = (r < rows)[:, None] & c_mask[None, :]
        return tl.load(P + row[:, None] + c[None, :].to(tl.int64) * sn, mask=mask, other=0.0)

    @triton.jit
    def _norm_bwd_exchange(
        DY, HX, W, STATS, DS, DX, DW_PART, DB_PART, WS, COUNT,   # as _norm_bwd; WS [k, rows, SPLITS]; COUNT zeroed
        dy_base, dy_s0, dy_s1, dy_si, dy_sn,
        h_base, h_s0, h_s1, h_si, h_sn,
        s_base, s_s0, s_s1, s_si, s_sn,
        out_base, rows_total, rows, n_units, OUTER1, INNER, w_offset,
        RMS: tl.constexpr, HAS_W: tl.constexpr, DW: tl.constexpr, HAS_B: tl.constexpr, HAS_DS: tl.constexpr,
        ACC: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
        SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, PHASE: tl.constexpr,
    ):
        """dx of rows cut into SPLITS chunks of BLOCK_N, chunk k held by program k of a group
        (exchange.py, counter): each chunk publishes sum(g * hh) (LayerNorm also sum(g)), and after
        the group's wait every program merges the SPLITS partials in chunk order and writes its dx
        from registers. The weight and bias gradients of a program's chunk columns are summed in
        registers over all its rows and written once, as row ``group`` of DW_PART / DB_PART."""
        n = n_units * ALIGN
        split, group, groups = place_in_group(SPLITS)
        c = split * BLOCK_N + tl.arange(0, BLOCK_N)
        c_mask = c < n
        mask = c_mask[None, :]
        r1 = tl.arange(0, 1)
        w = _weight_eff(W, c, n, w_offset, HAS_W, ACC)[None, :]
        dw = tl.zeros([1, BLOCK_N], ACC)
        db = tl.zeros([1, BLOCK_N], ACC)
        if PHASE == 0:
            dy_next = _chunk_load(DY, dy_base, group + r1, rows, OUTER1, INNER, dy_s0, dy_s1, dy_si, dy_sn, c, c_mask,
                                  ALIGN)
            h_next = _chunk_load(HX, h_base, group + r1, rows, OUTER1, INNER, h_s0, h_s1, h_si, h_sn, c, c_mask, ALIGN)
        for row in range(group, rows, groups):
            r = row + r1
            if PHASE == 0:
                dy_raw, h_raw = dy_next, h_next
            else:
                dy_raw = _chunk_load(DY, dy_base, r, rows, OUTER1, INNER, dy_s0, dy_s1, dy_si, dy_sn, c, c_mask, ALIGN)
                h_raw = _chunk_load(HX, h_base, r, rows, OUTER1, INNER, h_s0, h_s1, h_si, h_sn, c, c_mask, ALIGN)
            stats_row = out_base // n + r
            rstd = tl.load(STATS + (rows_total if not RMS else 0) + stats_row)
            if RMS:
                mean = tl.zeros([1], ACC)
            else:
                mean = tl.load(STATS + stats_row)
            dy = dy_raw.to(ACC)
            hh = tl.where(mask, (h_raw.to(ACC) - mean[:, None]) * rstd[:, None], 0.0)
            if HAS_W:
                g = dy * w
            else:
                g = dy
            if PHASE != 2:
                tl.store(WS + r * SPLITS + split, tl.sum(g * hh, 1))
                if not RMS:
                    tl.store(WS + (rows + r) * SPLITS + split, tl.sum(g, 1))
                arrive(COUNT + row)
            if PHASE == 0:
                dy_next = _chunk_load(DY, dy_base, r + groups, rows, OUTER1, INNER, dy_s0, dy_s1, dy_si, dy_sn, c,
                                      c_mask, ALIGN)
                h_next = _chunk_load(HX, h_base, r + groups, rows, OUTER1, INNER, h_s0, h_s1, h_si, h_sn, c, c_mask,
                                     ALIGN)
            if PHASE != 1:
                wait_for(COUNT + row, SPLITS)
                k = tl.arange(0, SPLITS_P2)
                k_mask = k < SPLITS
                c2 = tl.sum(tl.load(WS + row * SPLITS + k, mask=k_mask, other=0.0, cache_modifier=".cg"), 0) / n
                dh = g - hh * c2
                if not RMS:
                    c1 = tl.sum(tl.load(WS + (rows + row) * SPLITS + k, mask=k_mask, other=0.0,
                                        cache_modifier=".cg"), 0) / n
                    dh -= c1
                dh = dh * rstd[:, None]
                if HAS_DS:
                    dh += _chunk_load(DS, s_base, r, rows, OUTER1, INNER, s_s0, s_s1, s_si, s_sn, c, c_mask,
                                      ALIGN).to(ACC)
                out_row = tl.multiple_of(out_base + r.to(tl.int64) * n, ALIGN)
                tl.store(DX + out_row[:, None] + c[None, :], dh.to(DX.dtype.element_ty), mask=mask)
                if DW:
                    dw += dy * hh
                if HAS_B:
                    db += dy
        if PHASE != 1:
            part = group.to(tl.int64) * n
            if DW:
                tl.store(DW_PART + part + c[None, :], dw, mask=mask)
            if HAS_B:
                tl.store(DB_PART + part + c[None, :], db, mask=mask)


@dataclass(frozen=True)
class NormConfig:
    """A Triton plan: rows per program or step (block_m), row block (block_n), warps, looped or
    fused, and for the backward its programs per SM and pipeline stages (before the staging cap)."""

    block_m: int
    block_n: int
    num_warps: int
    looped: bool
    programs_per_sm: int = 1
    stages: int = 1
    exchange: bool = False


def _choose_config(problem: NormProblem) -> NormConfig:
    """Backwards over rows longer than ``exchange_above`` (RMSNorm: ``rms_exchange_above``) elements
    that need at most SMs chunks: the exchange plan. Otherwise fused rows up to ``fused_max``
    elements: a program (a backward step) holds BLOCK_M rows, its tile's worth, at least
    ``forward_rows`` in a 2-byte forward; longer rows looped in ``chunk``-element blocks,
    ``looped_rows`` rows a forward program, ``looped_backward_rows`` a backward step.
    NormHeuristics says what the sizes count."""
    h = problem.heuristics
    n = max(problem.n, 1)
    rows = next_pow2(max(problem.rows, 1))
    per_unit = problem.units_per_element
    if problem.backward and _exchange_splits(problem.op, n, problem.device, h):
        return NormConfig(1, h.exchange_tile, h.exchange_warps, False, h.exchange_programs_per_sm, exchange=True)
    if n > h.fused_max:
        block_n = next_pow2(min(h.chunk, n))
        block_m = min(h.looped_backward_rows if problem.backward else h.looped_rows, rows)
        return NormConfig(block_m, block_n, h.looped_backward_warps if problem.backward else h.looped_warps, True,
                          h.backward_programs_per_sm, first_step(h.backward_stages, block_n * per_unit))
    block_n = next_pow2(n)
    units = block_n * per_unit
    if not problem.backward:
        least = h.forward_rows if per_unit == 1 else 1
        block_m = min(max(least, h.forward_tile // units), rows)
        return NormConfig(max(1, block_m), block_n, first_step(h.warps, units), False)
    stages = first_step(h.backward_stages, units)
    if block_n <= h.small_rows:
        return NormConfig(max(1, min(h.small_rows_tile // block_n, rows)), block_n, h.small_rows_warps, False,
                          h.small_rows_programs_per_sm, stages)
    return NormConfig(max(1, min(h.backward_tile // units, rows)), block_n, first_step(h.backward_warps, units), False,
                      h.backward_programs_per_sm, stages)


def _exchange_splits(op: str, n: int, device: torch.device, h: NormHeuristics) -> int:
    """The chunks a row of a backward's exchange plan is cut into (``exchange_tile`` elements each),
    or 0 where the backward takes another plan: rows longer than ``exchange_above`` elements
    (RMSNorm: ``rms_exchange_above``), at most SMs chunks, with the exchange on
    (ExchangeHeuristics)."""
    above = h.rms_exchange_above if op.startswith("rms") else h.exchange_above
    if n <= above or not h.exchange_on():
        return 0
    splits = -(-n // max(1, h.exchange_tile))
    return splits if 2 <= splits <= h.sm_count(device) else 0


def _layout(problem: NormProblem) -> ReductionLayout:
    """The strided inputs' and the contiguous output's rows as one reduction over a merged row axis."""
    k = problem.normalized_ndim
    lead = problem.shape[:len(problem.shape) - k]
    operands = []
    for st in problem.strides:
        if st is None:
            operands.append((0,) * (len(lead) + 1))
            continue
        _, s_n = merge_dims(problem.shape[len(problem.shape) - k:], st[len(st) - k:])
        operands.append(tuple(st[:len(lead)]) + (s_n,))
    operands.append(contiguous_strides(lead + (problem.n,)))
    return reduction_layout(lead + (problem.n,), len(lead), operands)


def _row_alignment(problem: NormProblem, layout: ReductionLayout) -> int:
    """The largest power of two of elements, up to 16 bytes' worth, that divides the row length and
    every row's offset in every tensor (strides and launch bases); 1 where a row's elements are not
    adjacent. The kernels pass it to the compiler (``tl.multiple_of``): Triton itself only knows
    the values it specialises (multiples of 16), so rows of 1000 bf16 elements (2000 bytes, every
    row 16-byte aligned) were loaded one element at a time. The 16 bytes are x's (h's); a y or dy
    of another dtype (out_dtype) is a contiguous or strided tensor of the same element offsets, so
    the count divides its offsets too (its vectors are then narrower or wider than 16 bytes)."""
    if any(s not in (0, 1) for s in layout.stride_n):
        return 1
    values = [problem.n, *layout.stride_outer0, *layout.stride_outer1, *layout.stride_inner,
              *(b for bases in layout.host_bases for b in bases)]
    align = 16 // problem.dtype.itemsize
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


def _check_heuristics(problem: NormProblem) -> None:
    """InvalidProblemError naming ``heuristics`` for a block size that is not a power of two, a
    count below 1, or a steps table that is not ((limit, value), ...) of ints >= 1 reaching the
    widest row block a plan makes. Checked when a plan is made, not per call."""
    h = problem.heuristics
    check_heuristic_fields(problem.op, h, powers_of_two=("chunk", "forward_tile", "forward_rows", "backward_tile",
                                                         "small_rows_tile", "small_rows_warps", "reduce_block",
                                                         "looped_warps", "looped_rows", "looped_backward_rows",
                                                         "looped_backward_warps", "exchange_tile", "exchange_warps"),
                           at_least_one=("fused_max", "backward_programs_per_sm", "small_rows",
                                         "small_rows_programs_per_sm", "pipeline_bytes", "exchange_above",
                                         "rms_exchange_above", "exchange_programs_per_sm"))
    if isinstance(h.step_sums, bool) or not isinstance(h.step_sums, int) or h.step_sums < 0:
        raise argument_error(InvalidProblemError, problem.op, "heuristics",
                             f"step_sums must be an int >= 0, got {h.step_sums!r}")
    for name in ("looped_warps", "looped_backward_warps", "small_rows_warps", "exchange_warps"):
        if getattr(h, name) > 32:
            raise argument_error(InvalidProblemError, problem.op, "heuristics",
                                 f"{name} must be a power of two up to 32, got {getattr(h, name)!r}")
    # the widest row block this problem's plans look a table up for, in units
    per_unit = problem.units_per_element
    fused, looped = per_unit * next_pow2(h.fused_max), per_unit * h.chunk
    for name, widest, powers in (("warps", fused, True), ("backward_warps", fused, True),
                                 ("backward_stages", max(fused, looped), False)):
        table = getattr(h, name)
        ok = isinstance(table, tuple) and len(table) > 0 and all(
            isinstance(step, tuple) and len(step) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in step) for step in table)
        ok = ok and table[-1][0] >= widest and all(not powers or (v & (v - 1) == 0 and v <= 32) for _, v in table)
        if not ok:
            raise argument_error(InvalidProblemError, problem.op, "heuristics",
                                 f"{name} must be a tuple of (row block units at most, "
                                 f"{'warps, a power of two up to 32' if powers else 'stages'}) int pairs >= 1 "
                                 f"whose last limit reaches {widest}, got {table!r}")


def _prepare_exchange(problem: NormProblem, config: NormConfig, layout: ReductionLayout, meta: dict,
                      operand_args) -> Launch:
    """The backward's exchange plan (``_norm_bwd_exchange``): one launch per host base, in stream
    order over one partials workspace and one row counter (zeroed before each). Its programs sum
    the weight and bias gradients of their chunk columns over their rows: one workspace row per
    group, as many groups as the launch's grid holds (the compiled kernel's occupancy decides,
    exchange.py), then the column sum over the rows the launches wrote."""
    n, rows_total = problem.n, problem.rows
    per_launch = layout.outer0 * layout.outer1 * layout.inner
    splits = -(-n // config.block_n)
    meta = {k: v for k, v in meta.items() if k not in ("BLOCK_M", "LOOPED")}
    dw_wanted, has_bias = problem.weight_grad_wanted, problem.bias_dtype is not None
    meta.update(SPLITS=splits, SPLITS_P2=next_pow2(splits), DW=dw_wanted, HAS_B=has_bias, HAS_DS=problem.has_residual)
    sms = problem.heuristics.sm_count(problem.device)
    # a grid per host launch: each binds its own bases, which Triton may specialise differently
    grids = [ExchangeGrid(_norm_bwd_exchange, per_launch, splits, config.programs_per_sm, sms)
             for _ in layout.host_bases]
    acc = problem.acc_dtype
    ws_elems = per_launch * splits * problem.stats_rows
    trailing = [(*operand_args(bases), bases[-1], rows_total, per_launch, n // meta["ALIGN"], layout.outer1,
                 layout.inner, problem.weight_offset) for bases in layout.host_bases]
    # the groups of one launch at most (the occupancy can only lower the programs a SM asked for)
    parts_most = balanced_groups(max(per_launch, 1), splits, sms * config.programs_per_sm) * len(layout.host_bases)
    sums = {}  # the column sum's launcher by the workspace rows written (one entry in practice)
    direct = {}  # a GPU launch's direct launcher by (host launch, grid): no JIT binding per call
    phase = exchange_phases()[0]

    def sum_columns(parts):
        if parts not in sums:
            sums[parts] = column_sum(parts, n, problem.heuristics.reduce_block, 64)
        return sums[parts]

    def launch(index, tensors, device) -> int:
        """One host launch; returns the groups its grid held (workspace rows written)."""
        call, grid = (*tensors, *trailing[index]), grids[index]
        if phase != 0:  # the interpreter: two launches, publish then merge (exchange.py)
            launch_exchange(_norm_bwd_exchange, grid, call, meta, device)
            return grid(call, dict(meta, PHASE=phase), device)[0] // splits
        with on_device(device):  # the occupancy's grid, per alignment (exchange.py), compiled on the tensors' device
            size = grid(call, dict(meta, PHASE=0), device)
        run_direct = direct.get((index, size))
        if run_direct is None:
            run_direct = direct[(index, size)] = launcher(_norm_bwd_exchange, size, trailing=trailing[index],
                                                          PHASE=0, **meta)
        run_direct(*tensors)
        return size[0] // splits

    def run(tensors, outputs):
        workspaces = _gradient_workspaces(problem, outputs, parts_most, acc)
        if workspaces is None:
            return
        dy, h, weight, stats, grad_h = tensors
        dx, dweight, dbias = outputs
        dw_part, db_part = workspaces
        written = 0
        ws = torch.empty(ws_elems, dtype=acc, device=dx.device)  # reused by the launches, in stream order
        count = torch.zeros(per_launch, dtype=torch.int32, device=dx.device)
        for index in range(len(trailing)):
            if index:
                count.zero_()
            written += launch(index, (dy, h, weight, stats, grad_h, dx,
                                      None if dw_part is None else dw_part[written:] if written else dw_part,
                                      None if db_part is None else db_part[written:] if written else db_part,
                                      ws, count), dx.device)
        if dw_wanted:
            sum_columns(written)(dw_part, dweight)
        if has_bias:
            sum_columns(written)(db_part, dbias)

    params = (("plan", "exchange"), ("BLOCK_N", config.block_n), ("num_warps", config.num_warps),
              ("splits", splits), ("per_sm", config.programs_per_sm), ("host_launches", len(layout.host_bases)),
              ("align", meta["ALIGN"]))
    workspace = (ws_elems + parts_most * n * (dw_wanted + has_bias)) * acc.itemsize + per_launch * 4
    return Launch(run, KernelChoice("norm_bwd_exchange", "triton", params), acc, workspace_bytes=workspace)


def _prepare_triton(problem: NormProblem, config: NormConfig | None = None) -> Launch:
    _check_heuristics(problem)
    config = config or _choose_config(problem)
    layout = _layout(problem)
    acc = problem.acc_dtype
    n, rows_total = problem.n, problem.rows
    meta = dict(RMS=problem.rms, HAS_W=problem.weight_dtype is not None, ACC=tl.float64 if acc == torch.float64
                else tl.float32, BLOCK_M=config.block_m, BLOCK_N=config.block_n, LOOPED=config.looped,
                ALIGN=_row_alignment(problem, layout), num_warps=config.num_warps)
    per_launch = layout.outer0 * layout.outer1 * layout.inner
    sizes = [layout.outer1, layout.inner]

    def operand_args(bases):
        args = []
        for k in range(len(problem.strides)):
            args += [bases[k], layout.stride_outer0[k], layout.stride_outer1[k], layout.stride_inner[k],
                     layout.stride_n[k]]
        return args

    if config.exchange:  # backward plans only (_choose_config)
        return _prepare_exchange(problem, config, layout, meta, operand_args)
    if not problem.backward:
        grid = (triton.cdiv(per_launch, config.block_m),)
        meta.update(HAS_R=problem.has_residual, HAS_B=problem.bias_dtype is not None)

        # every scalar argument is fixed by the plan: built once here, not per call
        launches = [launcher(_norm_fwd, grid, trailing=(*operand_args(bases), bases[-1], rows_total, per_launch,
                                                        n // meta["ALIGN"], *sizes, problem.eps, problem.weight_offset),
                             **meta)
                    for bases in layout.host_bases]

        def run(tensors, outputs):
            x, weight, bias, residual = tensors
            y, h, stats = outputs
            if rows_total == 0:
                return
            if n == 0:
                _write_empty(problem, outputs)
                return
            # absent inputs and outputs: None (the kernel never touches them; no tensor twice)
            pointers = (x, residual, y, None if residual is None else h, weight, bias, stats)
            for launch in launches:
                launch(*pointers)

        kernel = "norm_fwd"
        workspace = 0
    else:
        programs_cap = sm_count(problem.device) * config.programs_per_sm
        rows_per_program = max(config.block_m, triton.cdiv(per_launch, max(1, programs_cap)))
        rows_per_program = triton.cdiv(rows_per_program, config.block_m) * config.block_m
        programs = max(1, triton.cdiv(per_launch, rows_per_program))
        parts = programs * len(layout.host_bases)
        dw_wanted, has_bias = problem.weight_grad_wanted, problem.bias_dtype is not None
        workspace = parts * n * (dw_wanted + has_bias) * acc.itemsize
        step_bytes = config.block_m * config.block_n * problem.dtype.itemsize * (3 if problem.has_residual else 2)
        stages = max(1, min(config.stages, problem.heuristics.pipeline_bytes // step_bytes))
        meta.update(DW=dw_wanted, HAS_B=has_bias, HAS_DS=problem.has_residual, STAGES=stages,
                    STEP_SUMS=not config.looped and config.block_n <= problem.heuristics.step_sums)

        launches = [launcher(_norm_bwd, (programs,), trailing=(*operand_args(bases), bases[-1], rows_total,
                                                               index * programs, per_launch, n // meta["ALIGN"], *sizes,
                                                               rows_per_program, problem.weight_offset), **meta)
                    for index, bases in enumerate(layout.host_bases)]
        sum_columns = column_sum(parts, n, problem.heuristics.reduce_block, 64)
        make_workspace = torch.zeros if config.looped else torch.empty

        def run(tensors, outputs):
            workspaces = _gradient_workspaces(problem, outputs, parts, acc, make_workspace)
            if workspaces is None:
                return
            dx, dweight, dbias = outputs
            dw_part, db_part = workspaces
            pointers = (*tensors, dx, dw_part, db_part)  # absent ones None, as forward
            for launch in launches:
                launch(*pointers)
            if dw_wanted:
                sum_columns(dw_part, dweight)
            if has_bias:
                sum_columns(db_part, dbias)

        kernel = "norm_bwd"
    params = (("plan", "looped" if config.looped else "fused"), ("BLOCK_M", config.block_m),
              ("BLOCK_N", config.block_n), ("num_warps", config.num_warps),
              ("host_launches", len(layout.host_bases)), ("align", meta["ALIGN"])) + \
        ((("stages", meta["STAGES"]), ("programs", programs), ("step_sums", meta["STEP_SUMS"]))
         if problem.backward else ())
    return Launch(run, KernelChoice(kernel, "triton", params), acc, workspace_bytes=workspace)


if triton_available():
    for _op in FORWARD_OPS + BACKWARD_OPS:
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
                 name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.rms_norm / layer_norm and their backward, with autograd
# ----------------------------------------------------------------------------------------------

def _normalized_axes_walk(t: Tensor, k: int) -> bool:
    return merge_dims(t.shape[t.dim() - k:], t.stride()[t.dim() - k:]) is not None


def _walkable(t: Tensor | None, k: int) -> Tensor | None:
    """``t``, or a contiguous copy when its normalized axes do not walk as one strided axis (rare views)."""
    if t is None or _normalized_axes_walk(t, k):
        return t
    return t.contiguous()


def _forward(op: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None,
             normalized_ndim: int, eps: float, weight_offset: float,
             out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
    if not x.is_contiguous():
        x = _walkable(x, normalized_ndim)
    if residual is not None:
        residual = _walkable(residual, normalized_ndim)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise_mismatch(op, "residual", residual, x.shape, x.dtype, x.device)
    descriptor = DESCRIPTORS[op](x.shape, x.dtype, x.device, normalized_ndim, _dtype_of(weight), _dtype_of(bias),
                                 residual is not None, (x.stride(), _strides_of(residual)), eps, weight_offset,
                                 True, heuristics_for(NormHeuristics),
                                 None if out_dtype == x.dtype else out_dtype)  # x's: the default's plan
    plan = cached_plan(descriptor)
    normalized_shape = x.shape[x.dim() - normalized_ndim:]
    # the kernels read weight and bias as dense rows: a strided one (a view, rare) is copied
    weight = weight if weight is None or weight.is_contiguous() else weight.contiguous()
    bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != normalized_shape or t.device != x.device):
            raise_mismatch(op, name, t, normalized_shape, t.dtype, x.device)
    return plan.run_unchecked((x, weight, bias, residual))


def _backward(op: str, dy: Tensor, h: Tensor, weight: Tensor | None, stats: Tensor, grad_h: Tensor | None,
              normalized_ndim: int, has_bias: bool, bias_dtype, weight_offset: float,
              weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    dy, h, grad_h = (t if t is None or t.is_contiguous() else _walkable(t, normalized_ndim) for t in (dy, h, grad_h))
    # dy in y's dtype (the forward's out_dtype), h, grad_h and dx in x's
    descriptor = DESCRIPTORS[op](dy.shape, h.dtype, dy.device, normalized_ndim, _dtype_of(weight),
                                 bias_dtype if has_bias else None, grad_h is not None,
                                 (dy.stride(), h.stride(), _strides_of(grad_h)), 0.0, weight_offset,
                                 weight_grad, heuristics_for(NormHeuristics), None if dy.dtype == h.dtype else dy.dtype)
    plan = cached_plan(descriptor)
    problem = plan.problem
    weight = weight if weight is None or weight.is_contiguous() else weight.contiguous()
    for name, t in (("h", h), ("grad_h", grad_h)):
        if t is not None and (t.shape != dy.shape or t.dtype != h.dtype or t.device != dy.device):
            raise_mismatch(op, name, t, dy.shape, h.dtype, dy.device)
    if weight is not None and (weight.shape != problem.normalized_shape or weight.device != dy.device):
        raise_mismatch(op, "weight", weight, problem.normalized_shape, weight.dtype, dy.device)
    if stats.shape != (problem.stats_rows, problem.rows) or stats.dtype != problem.acc_dtype \
            or stats.device != dy.device or not stats.is_contiguous():
        problem.check((dy, h, weight, stats, grad_h), None)
    return plan.run_unchecked((dy, h, weight, stats, grad_h))


def _rms_norm_impl(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], normalized_ndim: int,
                   eps: Optional[float], weight_offset: float,
                   out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _forward("rms_norm", x, weight, None, residual, normalized_ndim, eps, weight_offset, out_dtype)


def _layer_norm_impl(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                     normalized_ndim: int, eps: Optional[float],
                     out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _forward("layer_norm", x, weight, bias, residual, normalized_ndim, eps, 0.0, out_dtype)


def _forward_fake(x: Tensor, weight, residual, normalized_ndim: int, stats_rows: int, out_dtype):
    rows = math.prod(x.shape[:x.dim() - normalized_ndim])
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    y = x.new_empty(x.shape, dtype=x.dtype if out_dtype is None else out_dtype)
    return y, h, x.new_empty((stats_rows, rows), dtype=accumulator_dtype(x.dtype))


def _rms_norm_fake(x, weight, residual, normalized_ndim, eps, weight_offset, out_dtype=None):
    return _forward_fake(x, weight, residual, normalized_ndim, 1, out_dtype)


def _layer_norm_fake(x, weight, bias, residual, normalized_ndim, eps, out_dtype=None):
    return _forward_fake(x, weight, residual, normalized_ndim, 2, out_dtype)


def _save_forward(ctx, inputs, outputs) -> None:
    y, h, stats = outputs
    # stats (and h without a residual) carry no gradient; an output nobody used gets None, not zeros
    ctx.mark_non_differentiable(*((stats, h) if inputs.residual is None else (stats,)))
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h if inputs.residual is not None else inputs.x, inputs.weight, stats)
    ctx.normalized_ndim = inputs.normalized_ndim
    ctx.has_residual = inputs.residual is not None
    bias = getattr(inputs, "bias", None)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.weight_offset = getattr(inputs, "weight_offset", 0.0)
    # the backward plans with the forward's heuristics: autograd may run it on another thread (CUDA
    # devices have their own), where the caller's trainops.heuristics(...) block is not in force
    ctx.heuristics = heuristics_for(NormHeuristics)


def _forward_grad(backward_op):
    def grad(ctx, dy, dh, dstats) -> dict:
        if torch.is_grad_enabled():  # create_graph=True: the backward ops record no graph of their own
            raise UnsupportedError(f"trainops.{backward_op.name.removesuffix('_backward')}: double backward "
                                   "(create_graph=True) is not supported")
        h, weight, stats = ctx.saved_tensors
        grad_h = dh if ctx.has_residual and dh is not None else None
        if dy is None:
            if grad_h is None:  # neither output was used
                return {}
            dy = torch.zeros_like(h)
        weight_grad = weight is not None and ctx.needs_grad.weight
        bias_grad = ctx.bias_dtype is not None and ctx.needs_grad.bias  # a frozen bias: no dbias computed
        with keep_heuristics(ctx.heuristics):
            if backward_op is rms_norm_backward_op:
                dx, dweight, dbias = backward_op(dy, h, weight, stats, grad_h, ctx.normalized_ndim,
                                                 ctx.weight_offset, weight_grad)
            else:
                dx, dweight, dbias = backward_op(dy, h, weight, stats, grad_h, ctx.normalized_ndim, bias_grad,
                                                 ctx.bias_dtype, weight_grad)
        grads = {"x": dx, "residual": dx if ctx.has_residual else None}
        if weight_grad:
            grads["weight"] = dweight
        if bias_grad:
            grads["bias"] = dbias
        return grads
    return grad


def _rms_norm_backward_impl(dy: Tensor, h: Tensor, weight: Optional[Tensor], stats: Tensor, grad_h: Optional[Tensor],
                            normalized_ndim: int, weight_offset: float,
                            weight_grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    return _backward("rms_norm_backward", dy, h, weight, stats, grad_h, normalized_ndim, False, None, weight_offset,
                     weight_grad)


def _layer_norm_backward_impl(dy: Tensor, h: Tensor, weight: Optional[Tensor], stats: Tensor,
                              grad_h: Optional[Tensor], normalized_ndim: int, has_bias: bool,
                              bias_dtype: Optional[torch.dtype],
                              weight_grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    return _backward("layer_norm_backward", dy, h, weight, stats, grad_h, normalized_ndim, has_bias, bias_dtype, 0.0,
                     weight_grad)


def _layer_norm_backward_fake(dy, h, weight, stats, grad_h, normalized_ndim, has_bias, bias_dtype, weight_grad=True):
    normalized_shape = dy.shape[dy.dim() - normalized_ndim:]
    dw = h.new_empty(normalized_shape, dtype=weight.dtype) if weight is not None and weight_grad \
        else h.new_empty(0)
    db = h.new_empty(normalized_shape, dtype=bias_dtype) if has_bias else h.new_empty(0)
    return h.new_empty(dy.shape), dw, db   # dx in x's (h's) dtype, whatever dy's


def _rms_norm_backward_fake(dy, h, weight, stats, grad_h, normalized_ndim, weight_offset, weight_grad=True):
    return _layer_norm_backward_fake(dy, h, weight, stats, grad_h, normalized_ndim, False, None, weight_grad)


def _decomposed(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                normalized_ndim: int, eps: Optional[float], weight_offset: float, rms: bool,
                out_dtype: Optional[torch.dtype]):
    """(y, h, stats) of the forward in torch ops, for Inductor (trainops.compiled): the module
    docstring's formulas with its roundings (h in x's dtype; statistics and y's products in float32,
    float64 for float64; y rounded once to out_dtype, default x's dtype)."""
    h = x if residual is None else x + residual
    acc = accumulator_dtype(x.dtype)
    if eps is None:
        eps = torch.finfo(x.dtype).eps if rms else 1e-5
    dims = tuple(range(x.dim() - normalized_ndim, x.dim()))
    hf = h.to(acc)
    if rms:
        rstd = torch.rsqrt(hf.square().mean(dims, keepdim=True) + eps)
        y = hf * rstd
        stats = rstd.reshape(1, -1)
    else:
        mean = hf.mean(dims, keepdim=True)
        centred = hf - mean
        rstd = torch.rsqrt(centred.square().mean(dims, keepdim=True) + eps)
        y = centred * rstd
        stats = torch.stack((mean.reshape(-1), rstd.reshape(-1)))
    if weight is not None:
        y = y * (weight.to(acc) + weight_offset if weight_offset else weight.to(acc))
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype if out_dtype is None else out_dtype), (h if residual is not None else x.new_empty(0)), stats


def _normalized_size(arguments) -> int:
    return math.prod(arguments.x.shape[arguments.x.dim() - arguments.normalized_ndim:])


def _input_dtype(arguments) -> torch.dtype:
    return arguments.x.dtype


RMS_NORM_DECOMPOSITION = Decomposition(
    lambda x, weight, residual, normalized_ndim, eps, weight_offset, out_dtype=None: _decomposed(
        x, weight, None, residual, normalized_ndim, eps, weight_offset, True, out_dtype), _normalized_size,
    _input_dtype)
LAYER_NORM_DECOMPOSITION = Decomposition(
    lambda x, weight, bias, residual, normalized_ndim, eps, out_dtype=None: _decomposed(
        x, weight, bias, residual, normalized_ndim, eps, 0.0, False, out_dtype), _normalized_size, _input_dtype)


def _inlinable(op: str):
    """The inline_triton predicate (library.custom_op) of ``op``'s backward: its kernels may be
    launched by Inductor, except the exchange plan's, whose grid follows the compiled kernel's
    occupancy (the op then stays whole)."""
    def inlinable(arguments) -> bool:
        dy = arguments.dy
        n = math.prod(dy.shape[dy.dim() - arguments.normalized_ndim:])
        return not _exchange_splits(op, n, dy.device, heuristics_for(NormHeuristics))
    return inlinable


# The backward ops have no autograd of their own (double backward through a norm is not supported).
rms_norm_backward_op = custom_op("rms_norm_backward", _rms_norm_backward_impl, _rms_norm_backward_fake,
                                 inline_triton=_inlinable("rms_norm"))
layer_norm_backward_op = custom_op("layer_norm_backward", _layer_norm_backward_impl, _layer_norm_backward_fake,
                                   inline_triton=_inlinable("layer_norm"))
rms_norm_op = custom_op("rms_norm", _rms_norm_impl, _rms_norm_fake, backward=_forward_grad(rms_norm_backward_op),
                        save=_save_forward, inline_triton=True, decomposition=RMS_NORM_DECOMPOSITION)
layer_norm_op = custom_op("layer_norm", _layer_norm_impl, _layer_norm_fake,
                          backward=_forward_grad(layer_norm_backward_op), save=_save_forward, inline_triton=True,
                          decomposition=LAYER_NORM_DECOMPOSITION)
