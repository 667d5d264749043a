"""Softmax and log-softmax along one axis, forward and backward: Triton kernels, CPU path, registration.

Along the reduced axis of each row (m = max x, s = sum exp(x - m)):

    softmax               y  = exp(x - m) / s
    log_softmax           y  = (x - m) - log s
    softmax_backward      dx = y * (dy - sum(y * dy))
    log_softmax_backward  dx = dy - exp(y) * sum(dy)

Shapes: any rank 0..8, any ``dim``, any strides (transposed, sliced, expanded). The reduced axis
is read in place through its stride; nothing is transposed or copied (see layout.py).
Dtypes: float32, float16, bfloat16, float64 inputs; ``out_dtype`` as torch's ``dtype=`` (the input
is cast to it first). Accumulation in float32, or float64 when the computing dtype is float64.
Numerics as torch: max-subtracted; an all -inf row gives NaN; NaN propagates along its row.
Deterministic and bit-identical run to run: fixed reduction order, no atomics on values (the
exchange plan's counters only order its programs). The exchange plan's aligned windows (rows off a
multiple of 16 elements) group a row's sums by its offset from a 16-byte boundary, and run only
on 16-byte aligned pointers: the same row values can round differently (a few ulp) at another
position in the batch or another address, as between any two plans.

Triton plans (chosen in ``_choose_config``):
    fused    the whole row (or a tile of rows / columns) in registers: one read, one write.
    exchange a long row cut into chunks held in registers by programs that run together and
             trade partial sums (exchange.py): one read, one write. Also few rows that one
             program a row would leave SMs idle with, in smaller chunks (exchange.fill_tile).
    looped   one program streams a long row twice: online max/sum, then a second pass
             newest-chunk-first so its reads hit L2.
    split    few long rows: two launches, per-chunk partial stats into a workspace, then each
             chunk combines its row's partials (fixed order) and writes its part.

The quack backend (the optional extra ``trainops[quack]``: quack-kernels' CuTe DSL kernels) runs
softmax and its backward on long contiguous rows, and is registered only when ``quack.softmax``
imports. ``import trainops`` does not import quack (seconds: its CUDA DSL): where a ``quack``
package is on the path, the registry imports it at the first listing (``trainops.kernels()``), the
first look-up of the quack backend, or the first problem ``quack_beats_triton`` would put on it.
With no backend pinned, ``choose_backend`` puts a problem on it only where it was measured faster
than the Triton plans (``quack_beats_triton``); everything else stays on Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import REGISTER_TILE, ReductionLayout, next_pow2, reduction_layout
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics_for
from ..registry import (ACCUMULATOR, FLOATS, accumulator_dtype, normalize_device, note_backend, register,
                        register_loader, register_op, triton_available)
from .exchange import ExchangeGrid, ExchangeHeuristics, fill_tile, launch_exchange

MAX_RANK = 8
FORWARD_OPS = ("softmax", "log_softmax")
BACKWARD_OPS = ("softmax_backward", "log_softmax_backward")

# The quack backend: the ops it runs, the dtypes its kernels take, and where it is chosen (quack_beats_triton).
QUACK_OPS = ("softmax", "softmax_backward")
QUACK_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
# Chosen for bf16 (measured) and fp16 (the same bytes an element, so the same memory-bound traffic;
# the sweep in benchmarks/notes/quack-backend.md checks it); float32 was not measured: Triton.
QUACK_CHOSEN_DTYPES = frozenset({torch.bfloat16, torch.float16})
# Per op, the ranges of (fewest, most) columns of a row put on quack: benchmarks/probe_quack_softmax.py on the
# H200, 2026-11-30 (torch 2.11, Triton 3.6, quack-kernels 0.6.5; bf16, rows = 2^27 / N, both through trainops
# with the backend pinned; benchmarks/results/probe-quack-softmax-bf16-h200-20261130-s8.{json,log}), ms Triton / quack:
#   N         8192   16384  24576  32760  32768  49152  65536  131072 151936 262144 524288
#   forward   .1348  .1446  .2109  .1916  .1772  .2015  .1913  .1886  .2046  .1868  .2547   (Triton)
#             .1354  .1349  .1350  .1348  .1342  .1346  .1330  .1351  .1499  .1412  .2264   (quack)
# quack is faster forward from 16384 columns up to 524288, the longest measured (not assumed beyond: quack
# keeps a row in its cluster's shared memory).
# The backward again after the Triton backward's 16-warp row tiles (the ninth session's probe,
# benchmarks/results/probe-quack-bwd-h200-20261130-s9.{json,log}), ms Triton / quack:
#   N         24576  32000  32768  40960  50264  65536  100352 128256 151936 152064 256000
#             .1982  .1960  .1955  .2608  .2821  .2553  .2702  .2693  .2750  .2745  .2720   (Triton)
#             .1908  .2153  .2135  .1939  .1932  .2324  .1947  .2428  .2248  .2250  .2677   (quack)
# Triton's one-tile backward (rows up to 32768) now beats quack's from 30720 to 32768; quack wins at 24576
# (Triton's tile is a quarter empty there) and on every length past the tile. The split probe of the same
# session (benchmarks/results/probe-quack-bwd-split-h200-20261130-s9.log: 24576 .1989/.1904, 26624
# .1972/.1912, 28672 .1963/.1910, 30720 .1955/.2210) puts the lower range's end at 28672
# (BACKWARD_TILE_SPLIT); the upper one starts at 32776, the first length past the tile (32768) whose rows
# quack's 16-byte vectors load in bf16 / fp16.
# quack's FORWARD returned NaN at 151936 columns (the eighth session's probe at 883x151936 bf16 and its bench
# --sweep at 2048x151936) and at 152064 (the ninth session's, benchmarks/results/probe-quack-fwd-odd-...),
# and was right at 32000, 50264 and 128256; its backward was right at every length measured (the fourteen
# above, 1.7e-3 to 1.8e-3). The cause, read in quack-kernels 0.6.5's source (softmax.py, reduce.py) and
# consistent with all seventeen lengths measured: quack_forward_fills_every_warp. A forward row goes to
# quack only where that says so AND its length is a multiple of 8192 (QUACK_COLUMN_MULTIPLE, the eighth
# session's guard: every multiple of 8192 measured was right; the model, not yet checked on a GPU, says
# multiples such as 139264 are not). The backward has no such condition (1): no exp of a -inf maximum,
# quack's 16-byte vectors (QUACK_ALIGN) its only limit.
BACKWARD_TILE_SPLIT = 28672
# quack-kernels 0.6.5's softmax forward tiling on sm_90 for 16-bit dtypes (Softmax._threads_per_row,
# Softmax._set_cluster_n): threads a row by the row's length, and the cluster of CTAs a row is cut across.
QUACK_FORWARD_THREADS = ((64, 8), (128, 16), (3072, 32), (6144, 64), (16384, 128))   # (most columns, threads); else 256
QUACK_FORWARD_CLUSTER = ((16384, 1), (32768, 2), (65536, 4), (131072, 8))            # (most columns, CTAs); else 16
QUACK_COLUMNS: Mapping[str, tuple[tuple[int, int], ...]] = {
    "softmax": ((16384, 524288),),
    "softmax_backward": ((24576, BACKWARD_TILE_SPLIT), (32776, 524288)),
}
QUACK_COLUMN_MULTIPLE: Mapping[str, int] = {"softmax": 8192, "softmax_backward": 1}
# The measurements' GPU: the H200 (sm_90, as the H100). quack picks its cluster size by architecture
# (none before sm_90, at most 8 on sm_12x), so elsewhere the table says nothing: Triton.
QUACK_MEASURED_CAPABILITIES = frozenset({(9, 0)})
# quack-kernels 0.6.5 loads rows in 16-byte vectors: its ReductionBase._get_tiled_copy asserts N % (16 bytes /
# element size) == 0, and Softmax.compile declares every operand 16-byte aligned (assumed_align) when it compiles.
QUACK_ALIGN = 16


# ----------------------------------------------------------------------------------------------
# Heuristics: the tables _choose_config plans with (trainops.heuristics(...) overrides them)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class SoftmaxHeuristics(ExchangeHeuristics):
    """The softmax family's tunables; the defaults are the choices measured on the H100
    (benchmarks/NOTES.md). Tables keyed by element size in bytes are per tensor.

    register_tile: elements of a row one program keeps in registers (a fused plan up to here:
        layout.REGISTER_TILE). stream_tile: elements one program loads per loop step when
        streaming a long row (32 KiB per tensor). column_block: contiguous positions a column tile
        spans forward (64 B of bf16, 128 B of fp32 were best); column_bytes_backward: bytes of
        them backward (bf16 dim=1 of 32x512x4096: 64 positions, 146 us, against 198 us for 32,
        log-softmax backward). split_programs_per_sm: the programs per SM split plans aim at;
        column_backward_split_per_sm: the same for the backward of a column layout (dim=0 of a
        matrix): 2, fewer and longer chunks (H200, dim=0 backward, benchmarks/probe_softmax_classes.py,
        2026-11-30, at 16 / 4 / 2: bf16 4096x4096 0.0740 / 0.0628 / 0.0571 ms, 32000x512 0.0751 /
        0.0616 / 0.0553, 8192x1024 0.0399 (16 and 4) / 0.0343; float32 4096x4096 0.1028 / 0.0987 /
        0.1013). fused_backward_warps: the most warps of a fused backward whose row-major tile is
        over 16384 elements (one warp per 256 tile elements, at least 4; at most 8 for smaller tiles,
        where more was slower on the H100, and for column tiles, not measured at more): 16 (same
        probe, bf16 rows of 32000: 4096 rows 0.2043 ms at 8 warps, 0.1904 at 16, 0.2038 at 32; 8192
        rows 0.4112 / 0.3713 / 0.3975).
        exchange_tile, exchange_warps (by op), exchange_per_sm (by backward): the exchange plan's
        chunk elements per program, warps and programs per SM; best of 12 settings on bf16
        128x262144 and 1024x131072: softmax forward at 16 warps (40 registers a thread once rows
        along one axis skip the row decomposition: 3 programs per SM) beat 8 warps (74-78
        registers) by 9% / 4%; log-softmax forward needs 53 registers at 16 warps (2 per SM, 9%
        slower) and stays at 8; the backward is best at 8 warps, 2 per SM (118 registers).
        fill_per_sm, fill_min_bytes, fill_min_row_bytes: few long rows (row-major, at least
        fill_min_row_bytes) whose usual plan (one row, or one exchange_tile chunk, a program) gives
        fewer programs than SMs are cut into chunks of a power of two of at least fill_min_bytes
        (exchange.fill_tile) so that about fill_per_sm
        programs an SM share them: the exchange plan at those chunks (warps: one per 512 chunk
        elements, 4 to the op's exchange_warps), or the split plan with the exchange off. 0 (the
        default) turns it off. On the H200 (bf16 kernel time, benchmarks/probe_split_rows.py,
        2026-11-29) 4 gave no net gain: forward / forward + backward 1.10x / 1.11x at 1x262144,
        0.98x at 4x131072, 0.92x / 0.91x at 16x65536, 0.90x / 0.84x at 64x32768, 1.00x at
        8x1048576 and 32x151936 (benchmarks/NOTES.md).
        sms and row_exchange: ExchangeHeuristics.
        quack_columns: per op (softmax, softmax_backward), the ranges of (fewest, most) columns of a
        row that choose_backend puts on the quack backend (where it is registered; QUACK_COLUMNS: the
        H200 probes of 2026-11-30). An op left out, or no range, stays on Triton; a pinned backend
        ignores it.
        quack_column_multiple: per op, choose_backend puts a row on quack only where its length is a
        multiple of this too (QUACK_COLUMN_MULTIPLE: forward 8192, since quack's forward returned NaN
        at 151936 columns on the H200 and every measured multiple of 8192 was correct; backward 1, no
        condition). An op left out takes QUACK_COLUMN_MULTIPLE's; 1 is no condition; a pinned backend
        ignores it. The forward also needs quack_forward_fills_every_warp, whatever this says.
        Each new row length quack runs compiles its kernel once (a few seconds; jit_cache).
    Compared by identity (a plan's cache key holds the object it was made with).
    """

    register_tile: Mapping[int, int] = field(default_factory=lambda: dict(REGISTER_TILE))
    stream_tile: Mapping[int, int] = field(default_factory=lambda: {1: 16384, 2: 16384, 4: 8192, 8: 4096})
    column_block: int = 32
    column_bytes_backward: int = 128
    split_programs_per_sm: int = 16
    column_backward_split_per_sm: int = 2
    fused_backward_warps: int = 16
    exchange_tile: Mapping[int, int] = field(default_factory=lambda: {1: 8192, 2: 8192, 4: 8192, 8: 4096})
    exchange_warps: Mapping[str, int] = field(default_factory=lambda: {
        "softmax": 16, "log_softmax": 8, "softmax_backward": 8, "log_softmax_backward": 8})
    exchange_per_sm: Mapping[bool, int] = field(default_factory=lambda: {False: 3, True: 2})
    fill_per_sm: int = 0
    fill_min_bytes: int = 4096
    fill_min_row_bytes: int = 16384
    quack_columns: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=lambda: dict(QUACK_COLUMNS))
    quack_column_multiple: Mapping[str, int] = field(default_factory=lambda: dict(QUACK_COLUMN_MULTIPLE))

    def __post_init__(self):
        """The fields added with the quack backend and the backward's H200 defaults, checked here (a
        wrong one would otherwise fail inside a rule or a kernel launch without naming itself)."""
        def whole(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        value = self.quack_column_multiple
        if not isinstance(value, Mapping) or not set(value) <= set(QUACK_OPS) or not all(
                whole(m) and m >= 1 for m in value.values()):
            raise argument_error(InvalidProblemError, "SoftmaxHeuristics", "quack_column_multiple",
                                 f"must map {' / '.join(QUACK_OPS)} to ints >= 1 (1: any length), got {value!r}")
        value = self.column_backward_split_per_sm
        if not whole(value) or value < 1:
            raise argument_error(InvalidProblemError, "SoftmaxHeuristics", "column_backward_split_per_sm",
                                 f"must be an int >= 1, got {value!r}")
        value = self.fused_backward_warps
        if not whole(value) or value not in (4, 8, 16, 32):
            raise argument_error(InvalidProblemError, "SoftmaxHeuristics", "fused_backward_warps",
                                 f"must be 4, 8, 16 or 32 (a warp count), got {value!r}")
        columns = self.quack_columns
        if not isinstance(columns, Mapping) or not set(columns) <= set(QUACK_OPS) or not all(
                isinstance(ranges, (tuple, list)) and all(
                    isinstance(bounds, (tuple, list)) and len(bounds) == 2 and all(whole(b) for b in bounds)
                    for bounds in ranges)
                for ranges in columns.values()):
            raise argument_error(InvalidProblemError, "SoftmaxHeuristics", "quack_columns",
                                 f"must map {' / '.join(QUACK_OPS)} to tuples of (fewest, most) int pairs, "
                                 f"got {columns!r}")


# ----------------------------------------------------------------------------------------------
# Problem: validation shared by every backend
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SoftmaxProblem:
    """One softmax-family problem: ``op`` over ``dim`` of tensors of ``shape``.

    Inputs: ``x`` (forward) or ``dy, y`` (backward), all of ``dtype`` with the given ``strides``.
    The output has ``out_dtype`` and ``out_strides`` (torch.empty_like of x, or of y backward).
    """

    op: str
    shape: tuple[int, ...]
    dim: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    device: torch.device
    strides: tuple[tuple[int, ...], ...]
    out_strides: tuple[int, ...]
    heuristics: SoftmaxHeuristics
    align: int = QUACK_ALIGN
    index_dtype = None

    @property
    def names(self) -> tuple[str, ...]:
        return ("x",) if self.op in FORWARD_OPS else ("dy", "y")

    @property
    def backward(self) -> bool:
        return self.op in BACKWARD_OPS

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the math is done in before accumulation: the output's forward, y's backward."""
        return self.dtype if self.backward else self.out_dtype

    def check(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None) -> None:
        """Cheap checks of concrete tensors against the plan (shape, strides, dtype, device)."""
        if len(tensors) != len(self.names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(self.names)} tensors "
                                      f"({', '.join(self.names)}), got {len(tensors)}")
        for name, t, strides in zip(self.names, tensors, self.strides):
            check_tensor(self.op, name, t, self.shape, self.dtype, self.device, strides)
        if out is not None:
            check_tensor(self.op, "out", out, self.shape, self.out_dtype, self.device, self.out_strides)

    def new_output(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.out_strides, dtype=self.out_dtype, device=self.device)


def _describe(op: str, shape, dim, dtype, device="cuda", *, out_dtype=None, strides=None,
              heuristics=None, align=QUACK_ALIGN) -> SoftmaxProblem:
    """Validate a softmax-family descriptor.

    shape: sizes (rank 0..8). dim: the reduced axis, negative counts from the end.
    dtype: the inputs' dtype. out_dtype: the output's (default: dtype). device: where it runs.
    strides: None (contiguous), one stride tuple for every input, or one tuple per input.
    heuristics: a SoftmaxHeuristics (default: the one in force, trainops.heuristics).
    align: the largest power of two, up to 16, that divides every input's data pointer in bytes
    (default 16, as a fresh allocation; ``descriptor_of`` measures it). Only the choice of backend
    reads it: quack's kernels assume 16-byte aligned operands (a view at an odd storage offset runs
    on Triton, and its plan says so).
    """
    names = ("x",) if op in FORWARD_OPS else ("dy", "y")
    shape = checked_shape(op, "shape", shape)
    rank = len(shape)
    if rank > MAX_RANK:
        raise argument_error(UnsupportedError, op, names[0], f"has rank {rank}; ranks 0 to {MAX_RANK} are supported")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise argument_error(InvalidProblemError, op, "dim", f"must be an int, got {dim!r}")
    low, high = (-1, 0) if rank == 0 else (-rank, rank - 1)
    if not low <= dim <= high:
        raise argument_error(InvalidProblemError, op, "dim",
                             f"is {dim}, out of range [{low}, {high}] for a tensor of rank {rank}")
    dim = dim % max(rank, 1)
    if not isinstance(dtype, torch.dtype) or dtype not in FLOATS:
        raise argument_error(UnsupportedError, op, names[0],
                             f"has dtype {dtype}; supported: float32, float16, bfloat16, float64")
    out_dtype = dtype if out_dtype is None else out_dtype
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in FLOATS:
        raise argument_error(UnsupportedError, op, "dtype",
                             f"is {out_dtype}; supported: float32, float16, bfloat16, float64")
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    contiguous = torch.empty(shape, device="meta").stride()
    if strides is None:
        strides = (contiguous,) * len(names)
    elif len(strides) > 0 and all(isinstance(s, int) for s in strides):
        strides = (tuple(strides),) * len(names)
    strides = tuple(tuple(int(v) for v in s) for s in strides)
    if len(strides) != len(names):
        raise argument_error(InvalidProblemError, op, "strides", f"needs one stride tuple per input ({', '.join(names)})")
    for name, st in zip(names, strides):
        if len(st) != rank or any(v < 0 for v in st):
            raise argument_error(InvalidProblemError, op, name,
                                 f"has strides {st}; expected {rank} non-negative strides for shape {shape}")
    reference = torch.empty_strided(shape, strides[-1], device="meta")
    out_strides = tuple(torch.empty_like(reference).stride())
    if heuristics is None:
        heuristics = heuristics_for(SoftmaxHeuristics)
    elif not isinstance(heuristics, SoftmaxHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics", f"must be a SoftmaxHeuristics, got "
                             f"{type(heuristics).__name__}")
    if isinstance(align, bool) or not isinstance(align, int) or align not in (1, 2, 4, 8, 16):
        raise argument_error(InvalidProblemError, op, "align", f"must be 1, 2, 4, 8 or 16 (bytes), got {align!r}")
    return SoftmaxProblem(op, shape, dim, dtype, out_dtype, device, strides, out_strides, heuristics, align)


def _describer(op: str):
    def describe(shape, dim, dtype, device="cuda", *, out_dtype=None, strides=None,
                 heuristics=None, align=QUACK_ALIGN) -> SoftmaxProblem:
        return _describe(op, shape, dim, dtype, device, out_dtype=out_dtype, strides=strides, heuristics=heuristics,
                         align=align)
    describe.__doc__ = _describe.__doc__
    return describe


def quack_unsupported(problem: SoftmaxProblem) -> tuple[str, str] | None:
    """Why quack's kernels cannot run this problem, as (argument, reason), or None when they can:
    plain softmax or its backward on CUDA, float32 / float16 / bfloat16, the output in the input's
    dtype, along the last axis of tensors that are contiguous (any rank, viewed as (rows, N)), rows
    of a whole number of 16-byte vectors (N a multiple of 8 in fp16 / bf16, of 4 in float32), every
    input starting on a 16-byte boundary (``problem.align``)."""
    first = problem.names[0]
    if problem.op not in QUACK_OPS:
        return "op", f"is {problem.op}; quack's kernels run {' and '.join(QUACK_OPS)}"
    if problem.device.type != "cuda":
        return first, f"is on device {problem.device}; quack's kernels run on CUDA"
    if problem.dtype not in QUACK_DTYPES:
        return first, f"has dtype {problem.dtype}; quack's kernels take float32, float16 and bfloat16"
    if problem.out_dtype != problem.dtype:
        return "dtype", f"is {problem.out_dtype}; quack's kernels write the input's dtype ({problem.dtype})"
    rank = len(problem.shape)
    if rank == 0 or problem.dim != rank - 1:
        return "dim", f"is {problem.dim}; quack's kernels reduce the last axis (of a tensor of rank >= 1)"
    for name, strides in zip(problem.names, problem.strides):
        if not _contiguous(problem.shape, strides):
            return name, (f"has strides {strides}; quack's kernels take contiguous tensors (viewed as (rows, "
                          f"{problem.shape[-1]}))")
    vector = QUACK_ALIGN // problem.dtype.itemsize
    if problem.shape[-1] % vector:
        return "shape", (f"is {problem.shape}: rows of {problem.shape[-1]} elements; quack's kernels load rows in "
                         f"16-byte vectors, so N must be a multiple of {vector} in {problem.dtype}")
    if problem.align < QUACK_ALIGN:
        return "align", (f"is {problem.align}: an input starts off a 16-byte boundary (a view at an odd storage "
                         "offset); quack's kernels assume 16-byte aligned operands")
    return None


def pointer_align(tensors: Sequence[torch.Tensor]) -> int:
    """The largest power of two, up to 16, that divides every tensor's data pointer (bytes)."""
    align = QUACK_ALIGN
    for t in tensors:
        ptr = t.data_ptr()
        if ptr % align:
            align = min(align, ptr & -ptr)
    return align


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Row-major contiguous, as torch.Tensor.is_contiguous (the strides of size-1 axes do not matter)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``, None without CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def quack_forward_fills_every_warp(n: int, itemsize: int) -> bool:
    """Whether quack-kernels 0.6.5's softmax forward (sm_90, 16-bit dtypes) gives every warp of a row at
    least one column of a row of ``n`` columns. Its kernel cuts a row across ``cluster`` CTAs of
    ``threads`` threads (QUACK_FORWARD_CLUSTER, QUACK_FORWARD_THREADS), each CTA a tile of ``blocks``
    x ``threads`` 16-byte vectors (blocks = ceil(vectors / (threads x cluster))), vector b x threads +
    t of a CTA to thread t; the last CTA holds the vectors left, ``r``. A warp whose columns all lie past
    the row has a maximum of -inf, and its online-softmax partial sum exp(-inf - -inf) is NaN, which the
    cross-CTA merge (NaN x 0) spreads to the whole row. Warp w's first vector in the last CTA is its
    32 w-th, so every warp has a column iff r > threads - 32. Consistent with the forward's H200
    results: NaN at 151936 and 152064 (r < 0), right at 32000, 32760, 50264, 128256, 163840 and every
    multiple of 8192 measured (8192-131072, 262144, 524288)."""
    vectors = n * itemsize // QUACK_ALIGN
    threads = next((t for most, t in QUACK_FORWARD_THREADS if n <= most), 256)
    cluster = next((c for most, c in QUACK_FORWARD_CLUSTER if n <= most), 16)
    blocks = -(-vectors // (threads * cluster))
    left = vectors - (cluster - 1) * blocks * threads
    return left > threads - 32


def quack_beats_triton(problem: SoftmaxProblem) -> bool:
    """Whether the H200 measurements (QUACK_COLUMNS) put this problem on quack's kernels: the quack backend is
    registered, the op is softmax or its backward, quack can run it (``quack_unsupported``: CUDA,
    contiguous rows, last axis, output in the input's dtype, N a multiple of 16 bytes, 16-byte
    aligned inputs), the dtype is bfloat16 or float16, the
    GPU is the measured architecture (sm_90), a row has as many columns as
    one of the ranges ``heuristics.quack_columns[op]`` allows (QUACK_COLUMNS by default: softmax 16384
    to 524288, softmax_backward 24576 to 28672 and 32776 to 524288) and a multiple of
    ``heuristics.quack_column_multiple[op]`` (QUACK_COLUMN_MULTIPLE: softmax 8192, as quack's forward
    returned NaN at 151936 columns; softmax_backward 1; an op the mapping leaves out takes
    QUACK_COLUMN_MULTIPLE's) and, forward, where ``quack_forward_fills_every_warp`` (quack's forward
    is NaN elsewhere). A pinned quack (``trainops.backend("quack")``) does not ask this rule."""
    if problem.op not in QUACK_OPS or problem.dtype not in QUACK_CHOSEN_DTYPES:
        return False
    heuristics = problem.heuristics
    n = problem.shape[-1]
    if (quack_unsupported(problem) is not None
            or not any(low <= n <= high for low, high in heuristics.quack_columns.get(problem.op, ()))
            or n % heuristics.quack_column_multiple.get(problem.op, QUACK_COLUMN_MULTIPLE[problem.op])
            or problem.op == "softmax" and not quack_forward_fills_every_warp(n, problem.dtype.itemsize)):
        return False
    # no import tried (and no "a quack package is on the path" note) where there is no quack package at all
    return _capability(problem.device) in QUACK_MEASURED_CAPABILITIES and (
        _quack is not None or (_quack_findable() and register_quack()))


def choose_backend(problem: SoftmaxProblem) -> str | None:
    """quack's kernels on bf16 / fp16 CUDA (sm_90) softmax and its backward, last axis of contiguous
    16-byte aligned rows of 16384 to 524288 columns forward (a multiple of 8192, and where
    quack_forward_fills_every_warp: quack's forward returned NaN at 151936), 24576 to 28672 and 32776
    to 524288 backward (QUACK_COLUMNS, QUACK_COLUMN_MULTIPLE: the H200 probes of 2026-11-30), where
    quack-kernels imports; else the device type's default (Triton on CUDA)."""
    return "quack" if quack_beats_triton(problem) else None


DESCRIPTORS = {op: register_op(op, _describer(op), choose_backend=choose_backend if op in QUACK_OPS else None)
               for op in FORWARD_OPS + BACKWARD_OPS}


def _raise_mismatch(op: str, dy: torch.Tensor, y: torch.Tensor):
    if dy.shape != y.shape:
        raise argument_error(InvalidProblemError, op, "dy", f"has shape {tuple(dy.shape)} but y has {tuple(y.shape)}")
    if dy.dtype != y.dtype:
        raise argument_error(InvalidProblemError, op, "dy", f"has dtype {dy.dtype} but y has {y.dtype}")
    raise argument_error(InvalidProblemError, op, "dy", f"is on {dy.device} but y is on {y.device}")


def descriptor_of(op: str, tensors: Sequence[torch.Tensor], dim: int, out_dtype=None) -> tuple:
    """The descriptor (and plan-cache key) of a call on concrete tensors; backward inputs must agree
    in shape, dtype and device. It holds the inputs' pointer alignment (``pointer_align``): the
    backend chosen can depend on it (quack: 16-byte aligned inputs only)."""
    ref = tensors[-1]
    if len(tensors) == 2:
        dy = tensors[0]
        if dy.shape != ref.shape or dy.dtype != ref.dtype or dy.device != ref.device:
            _raise_mismatch(op, dy, ref)
    # positionally: (shape, dim, dtype, device, out_dtype, strides, heuristics, align), the hot path's cheapest build
    return DESCRIPTORS[op](ref.shape, dim, ref.dtype, ref.device, out_dtype, tuple(t.stride() for t in tensors),
                           heuristics_for(SoftmaxHeuristics), pointer_align(tensors))


# ----------------------------------------------------------------------------------------------
# CPU path: ATen's CPU kernels, accumulating as the Triton kernels do
# ----------------------------------------------------------------------------------------------

def _cpu_math(problem: SoftmaxProblem, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """ATen's vectorized CPU kernels on inputs cast to the accumulator dtype (the same formulas)."""
    acc = accumulator_dtype(problem.compute_dtype)
    dim = problem.dim
    if problem.op in FORWARD_OPS:
        x = tensors[0].to(problem.out_dtype).to(acc)
        return torch._softmax(x, dim, False) if problem.op == "softmax" else torch._log_softmax(x, dim, False)
    dy, y = (t.to(acc) for t in tensors)
    if problem.op == "softmax_backward":
        return torch._softmax_backward_data(dy, y, dim, acc)
    return torch._log_softmax_backward_data(dy, y, dim, acc)


def _prepare_cpu(problem: SoftmaxProblem) -> Launch:
    def run(tensors, out):
        if problem.numel:
            out.copy_(_cpu_math(problem, tensors).reshape(problem.shape))

    return Launch(run, KernelChoice("softmax_aten_cpu", "cpu", (("op", problem.op),)),
                  accumulator_dtype(problem.compute_dtype))


for _op in FORWARD_OPS + BACKWARD_OPS:
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
             name=f"{_op}_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from .exchange import arrive, load_window, merge_max_sum, place_in_group, store_window, wait_for, window

    @triton.jit
    def _coords(pid, I_BLOCKS, OUTER1):
        """Program id -> (outer0, outer1, inner block)."""
        ib = pid % I_BLOCKS
        rest = pid // I_BLOCKS
        return rest // OUTER1, rest % OUTER1, ib

    @triton.jit
    def _row(o0, o1, i0, base, s_o0, s_o1, s_i):
        """64-bit element offset of a block's first row: pointers move by it before the tile offsets."""
        return base + o0.to(tl.int64) * s_o0 + o1.to(tl.int64) * s_o1 + i0.to(tl.int64) * s_i

    @triton.jit
    def _tile(i, n, s_i, s_n, WIDE: tl.constexpr):
        """Offsets inside a [BLOCK_I, BLOCK_N] tile (block-local rows i, positions n); 64-bit when WIDE."""
        # one return after if / else: the compiler also generates code after an `if WIDE: return`,
        # and int64 and int32 returns fail to compile (tests/test_compile_for_gpu.py)
        if WIDE:
            offsets = i.to(tl.int64)[:, None] * s_i + n.to(tl.int64)[None, :] * s_n
        else:
            offsets = i[:, None] * s_i + n[None, :] * s_n
        return offsets

    @triton.jit
    def _softmax_fwd_fused(
        x_ptr, y_ptr,
        x_base, x_so0, x_so1, x_si, x_sn,
        y_base, y_so0, y_so1, y_si, y_sn,
        N, INNER, OUTER1, I_BLOCKS,
        LOG: tl.constexpr, ACC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        """Whole rows in registers: one read of x, one write of y."""
        o0, o1, ib = _coords(tl.program_id(0), I_BLOCKS, OUTER1)
        i0 = ib * BLOCK_I
        i = tl.arange(0, BLOCK_I)
        n = tl.arange(0, BLOCK_N)
        mask = (i0 + i < INNER)[:, None] & (n < N)[None, :]
        x_ptr += _row(o0, o1, i0, x_base, x_so0, x_so1, x_si)
        y_ptr += _row(o0, o1, i0, y_base, y_so0, y_so1, y_si)
        x = tl.load(x_ptr + _tile(i, n, x_si, x_sn, WIDE), mask=mask, other=float("-inf"))
        x = x.to(y_ptr.dtype.element_ty).to(ACC)
        z = x - tl.max(x, axis=1)[:, None]
        e = tl.exp(z)
        s = tl.sum(e, axis=1)
        if LOG:
            y = z - tl.log(s)[:, None]
        else:
            y = e * (1.0 / s)[:, None]
        tl.store(y_ptr + _tile(i, n, y_si, y_sn, WIDE), y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fwd_partial_stats(x_ptr, i, i_mask, x_si, x_sn, n_lo, n_hi, OUT_T: tl.constexpr, ACC: tl.constexpr,
                           BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr):
        """Online (max, sum exp(x - max)) over positions [n_lo, n_hi) of rows i."""
        m = tl.full([BLOCK_I], float("-inf"), ACC)
        s = tl.zeros([BLOCK_I], ACC)
        for start in range(n_lo, n_hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            mask = i_mask[:, None] & (n < n_hi)[None, :]
            x = tl.load(x_ptr + _tile(i, n, x_si, x_sn, WIDE), mask=mask, other=float("-inf"))
            x = x.to(OUT_T).to(ACC)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # keeps an all -inf prefix out of NaN
            s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref[:, None]), axis=1)
            m = m_new
        return m, s

    @triton.jit
    def _combine_stats(ws_ptr, rows, TOTAL, SPLITS: tl.constexpr, ACC: tl.constexpr):
        """Merge the SPLITS partial (max, sum) of each row in a fixed order."""
        k = tl.arange(0, SPLITS)
        idx = rows[:, None] * SPLITS + k[None, :]
        m_k = tl.load(ws_ptr + idx)
        s_k = tl.load(ws_ptr + TOTAL + idx)
        m = tl.max(m_k, axis=1)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(s_k * tl.exp(m_k - m_ref[:, None]), axis=1)
        return m.to(ACC), s.to(ACC)

    @triton.jit
    def _softmax_fwd_chunked(
        x_ptr, y_ptr, ws_ptr,
        x_base, x_so0, x_so1, x_si, x_sn,
        y_base, y_so0, y_so1, y_si, y_sn,
        N, INNER, OUTER1, I_BLOCKS, CHUNK, TOTAL,
        LOG: tl.constexpr, ACC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr,
        WIDE: tl.constexpr, SPLITS: tl.constexpr, PHASE: tl.constexpr,
    ):
        """Rows too long for registers, in chunks of CHUNK positions (SPLITS chunks per row).

        PHASE 0 (looped, SPLITS == 1): stats then apply, in one program.
        PHASE 1 (split): partial stats of one chunk into the workspace.
        PHASE 2 (split): combine the row's partials, apply to one chunk; programs run in reverse
        order so the chunks PHASE 1 read last (still in L2) are read first.
        """
        pid = tl.program_id(0)
        if PHASE == 2:
            pid = tl.num_programs(0) - 1 - pid
        split = pid % SPLITS
        o0, o1, ib = _coords(pid // SPLITS, I_BLOCKS, OUTER1)
        i0 = ib * BLOCK_I
        i = tl.arange(0, BLOCK_I)
        i_mask = i0 + i < INNER
        n_lo = split * CHUNK
        n_hi = tl.minimum(n_lo + CHUNK, N)
        rows = (o0 * OUTER1 + o1) * (I_BLOCKS * BLOCK_I) + i0 + i  # workspace row index
        x_ptr += _row(o0, o1, i0, x_base, x_so0, x_so1, x_si)
        OUT_T: tl.constexpr = y_ptr.dtype.element_ty
        if PHASE == 1:
            m, s = _fwd_partial_stats(x_ptr, i, i_mask, x_si, x_sn, n_lo, n_hi, OUT_T, ACC, BLOCK_I, BLOCK_N, WIDE)
            tl.store(ws_ptr + rows * SPLITS + split, m)
            tl.store(ws_ptr + TOTAL + rows * SPLITS + split, s)
        else:
            if PHASE == 0:
                m, s = _fwd_partial_stats(x_ptr, i, i_mask, x_si, x_sn, n_lo, n_hi, OUT_T, ACC,
                                          BLOCK_I, BLOCK_N, WIDE)
            else:
                m, s = _combine_stats(ws_ptr, rows, TOTAL, SPLITS, ACC)
            y_ptr += _row(o0, o1, i0, y_base, y_so0, y_so1, y_si)
            log_s = tl.log(s)
            inv_s = 1.0 / s
            n_chunks = tl.cdiv(n_hi - n_lo, BLOCK_N)
            for k in range(n_chunks):
                n = n_lo + (n_chunks - 1 - k) * BLOCK_N + tl.arange(0, BLOCK_N)  # newest first: L2 hits
                mask = i_mask[:, None] & (n < n_hi)[None, :]
                x = tl.load(x_ptr + _tile(i, n, x_si, x_sn, WIDE), mask=mask, other=0.0)
                z = x.to(OUT_T).to(ACC) - m[:, None]
                if LOG:
                    y = z - log_s[:, None]
                else:
                    y = tl.exp(z) * inv_s[:, None]
                tl.store(y_ptr + _tile(i, n, y_si, y_sn, WIDE), y.to(OUT_T), mask=mask)

    @triton.jit
    def _softmax_bwd_fused(
        dy_ptr, y_ptr, dx_ptr,
        dy_base, dy_so0, dy_so1, dy_si, dy_sn,
        y_base, y_so0, y_so1, y_si, y_sn,
        dx_base, dx_so0, dx_so1, dx_si, dx_sn,
        N, INNER, OUTER1, I_BLOCKS,
        LOG: tl.constexpr, ACC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        """Whole rows in registers: one read of dy and y, one write of dx."""
        o0, o1, ib = _coords(tl.program_id(0), I_BLOCKS, OUTER1)
        i0 = ib * BLOCK_I
        i = tl.arange(0, BLOCK_I)
        n = tl.arange(0, BLOCK_N)
        mask = (i0 + i < INNER)[:, None] & (n < N)[None, :]
        dy_ptr += _row(o0, o1, i0, dy_base, dy_so0, dy_so1, dy_si)
        y_ptr += _row(o0, o1, i0, y_base, y_so0, y_so1, y_si)
        dx_ptr += _row(o0, o1, i0, dx_base, dx_so0, dx_so1, dx_si)
        dy = tl.load(dy_ptr + _tile(i, n, dy_si, dy_sn, WIDE), mask=mask, other=0.0).to(ACC)
        y = tl.load(y_ptr + _tile(i, n, y_si, y_sn, WIDE), mask=mask, other=0.0).to(ACC)
        if LOG:
            dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]
        else:
            dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
        tl.store(dx_ptr + _tile(i, n, dx_si, dx_sn, WIDE), dx.to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_partial_sum(dy_ptr, y_ptr, i, i_mask, dy_si, dy_sn, y_si, y_sn, n_lo, n_hi, LOG: tl.constexpr,
                         ACC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr):
        """sum(dy) (log-softmax: y is not read) or sum(y * dy) over positions [n_lo, n_hi) of rows i."""
        acc = tl.zeros([BLOCK_I, BLOCK_N], ACC)
        for start in range(n_lo, n_hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            mask = i_mask[:, None] & (n < n_hi)[None, :]
            dy = tl.load(dy_ptr + _tile(i, n, dy_si, dy_sn, WIDE), mask=mask, other=0.0).to(ACC)
            if LOG:
                acc += dy
            else:
                acc += tl.load(y_ptr + _tile(i, n, y_si, y_sn, WIDE), mask=mask, other=0.0).to(ACC) * dy
        return tl.sum(acc, axis=1)

    @triton.jit
    def _softmax_bwd_chunked(
        dy_ptr, y_ptr, dx_ptr, ws_ptr,
        dy_base, dy_so0, dy_so1, dy_si, dy_sn,
        y_base, y_so0, y_so1, y_si, y_sn,
        dx_base, dx_so0, dx_so1, dx_si, dx_sn,
        N, INNER, OUTER1, I_BLOCKS, CHUNK, TOTAL,
        LOG: tl.constexpr, ACC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr,
        WIDE: tl.constexpr, SPLITS: tl.constexpr, PHASE: tl.constexpr,
    ):
        """Backward of rows too long for registers; PHASE as in _softmax_fwd_chunked."""
        pid = tl.program_id(0)
        if PHASE == 2:
            pid = tl.num_programs(0) - 1 - pid
        split = pid % SPLITS
        o0, o1, ib = _coords(pid // SPLITS, I_BLOCKS, OUTER1)
        i0 = ib * BLOCK_I
        i = tl.arange(0, BLOCK_I)
        i_mask = i0 + i < INNER
        n_lo = split * CHUNK
        n_hi = tl.minimum(n_lo + CHUNK, N)
        rows = (o0 * OUTER1 + o1) * (I_BLOCKS * BLOCK_I) + i0 + i
        dy_ptr += _row(o0, o1, i0, dy_base, dy_so0, dy_so1, dy_si)
        y_ptr += _row(o0, o1, i0, y_base, y_so0, y_so1, y_si)
        if PHASE == 1:
            s = _bwd_partial_sum(dy_ptr, y_ptr, i, i_mask, dy_si, dy_sn, y_si, y_sn, n_lo, n_hi, LOG, ACC,
                                 BLOCK_I, BLOCK_N, WIDE)
            tl.store(ws_ptr + rows * SPLITS + split, s)
        else:
            if PHASE == 0:
                s = _bwd_partial_sum(dy_ptr, y_ptr, i, i_mask, dy_si, dy_sn, y_si, y_sn, n_lo, n_hi, LOG, ACC,
                                     BLOCK_I, BLOCK_N, WIDE)
            else:
                s = tl.sum(tl.load(ws_ptr + rows[:, None] * SPLITS + tl.arange(0, SPLITS)[None, :]), axis=1)
            dx_ptr += _row(o0, o1, i0, dx_base, dx_so0, dx_so1, dx_si)
            n_chunks = tl.cdiv(n_hi - n_lo, BLOCK_N)
            for k in range(n_chunks):
                n = n_lo + (n_chunks - 1 - k) * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = i_mask[:, None] & (n < n_hi)[None, :]
                dy = tl.load(dy_ptr + _tile(i, n, dy_si, dy_sn, WIDE), mask=mask, other=0.0).to(ACC)
                y = tl.load(y_ptr + _tile(i, n, y_si, y_sn, WIDE), mask=mask, other=0.0).to(ACC)
                if LOG:
                    dx = dy - tl.exp(y) * s[:, None]
                else:
                    dx = y * (dy - s[:, None])
                tl.store(dx_ptr + _tile(i, n, dx_si, dx_sn, WIDE), dx.to(dx_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _chunk(ptr, r, base, s_o0, s_o1, s_i, s_n, n, mask, INNER, OUTER1, ROWS, OTHER: tl.constexpr,
               WIDE: tl.constexpr):
        """Positions n of row r (all masked when r >= ROWS): the chunk one exchange program holds."""
        o0, o1, i = _coords(r, INNER, OUTER1)
        offsets = n.to(tl.int64) * s_n if WIDE else n * s_n
        # `where(c, True, False)`, not `c`: Triton 3.9's interpreter broadcasts a scalar comparison as
        # int32 data, which its masked loads refuse; the compiler folds the select away (same code as `c`).
        row_mask = mask & tl.where(r < ROWS, True, False)
        return tl.load(ptr + _row(o0, o1, i, base, s_o0, s_o1, s_i) + offsets, mask=row_mask, other=OTHER)

    @triton.jit
    def _window(r, base, s_o0, s_o1, s_i, split, N, INNER, OUTER1, ROWS, BLOCK_N: tl.constexpr,
                SPLITS: tl.constexpr, VEC: tl.constexpr):
        """Chunk ``split`` of row r in its aligned window (exchange.window): (w0, j, body, v, first, t, last)."""
        o0, o1, i = _coords(r, INNER, OUTER1)
        valid = tl.where(r < ROWS, True, False)  # `where`: see _chunk
        return window(_row(o0, o1, i, base, s_o0, s_o1, s_i), split, N, valid, BLOCK_N, SPLITS, VEC)

    @triton.jit
    def _window_parts(ptr, r, base, s_o0, s_o1, s_i, split, N, INNER, OUTER1, ROWS, OTHER: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, VEC: tl.constexpr):
        """The three parts of chunk ``split`` of row r in its window (``_window``): body, first and last vector."""
        w0, j, body, v, first, t, last = _window(r, base, s_o0, s_o1, s_i, split, N, INNER, OUTER1, ROWS, BLOCK_N,
                                                 SPLITS, VEC)
        return load_window(ptr, w0, j, body, v, first, t, last, OTHER)

    @triton.jit
    def _store_window(ptr, r, base, s_o0, s_o1, s_i, split, N, INNER, OUTER1, ROWS, body_values, first_values,
                      last_values, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, VEC: tl.constexpr):
        """Store the three parts of chunk ``split`` of row r in its window (``_window``)."""
        w0, j, body, v, first, t, last = _window(r, base, s_o0, s_o1, s_i, split, N, INNER, OUTER1, ROWS, BLOCK_N,
                                                 SPLITS, VEC)
        out_t: tl.constexpr = ptr.dtype.element_ty
        store_window(ptr, w0, j, body, v, first, t, last, body_values.to(out_t), first_values.to(out_t),
                     last_values.to(out_t), "")

    @triton.jit
    def _softmax_fwd_row_window(
        x_ptr, y_ptr,
        x_base, x_so0, x_so1, x_si, x_sn,
        y_base, y_so0, y_so1, y_si, y_sn,
        N, INNER, OUTER1, I_BLOCKS,
        LOG: tl.constexpr, ACC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr,
        WIDE: tl.constexpr, VEC: tl.constexpr,
    ):
        """The fused plan's one row a program (BLOCK_I == 1) through the row's aligned window
        (``_window``, one chunk of BLOCK_N >= N + VEC - 1): one read, one write, as _softmax_fwd_fused."""
        r = tl.program_id(0)
        rows = tl.num_programs(0)
        OUT_T: tl.constexpr = y_ptr.dtype.element_ty
        x, x_first, x_last = _window_parts(x_ptr, r, x_base, x_so0, x_so1, x_si, 0, N, INNER, OUTER1, rows,
                                           float("-inf"), BLOCK_N, 1, VEC)
        x = x.to(OUT_T).to(ACC)
        x_first = x_first.to(OUT_T).to(ACC)
        x_last = x_last.to(OUT_T).to(ACC)
        m = tl.maximum(tl.max(x, axis=0), tl.maximum(tl.max(x_first, axis=0), tl.max(x_last, axis=0)))
        z, z_first, z_last = x - m, x_first - m, x_last - m
        e, e_first, e_last = tl.exp(z), tl.exp(z_first), tl.exp(z_last)
        s = tl.sum(e, axis=0) + tl.sum(e_first, axis=0) + tl.sum(e_last, axis=0)
        if LOG:
            log_s = tl.log(s)
            _store_window(y_ptr, r, y_base, y_so0, y_so1, y_si, 0, N, INNER, OUTER1, rows, z - log_s, z_first - log_s,
                          z_last - log_s, BLOCK_N, 1, VEC)
        else:
            inv_s = 1.0 / s
            _store_window(y_ptr, r, y_base, y_so0, y_so1, y_si, 0, N, INNER, OUTER1, rows, e * inv_s, e_first * inv_s,
                          e_last * inv_s, BLOCK_N, 1, VEC)

    @triton.jit
    def _softmax_fwd_exchange(
        x_ptr, y_ptr, ws_ptr, count_ptr,
        x_base, x_so0, x_so1, x_si, x_sn,
        y_base, y_so0, y_so1, y_si, y_sn,
        N, INNER, OUTER1, ROWS,
        LOG: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr,
        SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, PHASE: tl.constexpr, VEC: tl.constexpr = 0,
    ):
        """Rows cut into SPLITS chunks of BLOCK_N, one per program of a group; chunks trade (max, sum)
        through ws [2, ROWS, SPLITS] and count [ROWS] (exchange.py: counter). One read, one write.
        Softmax keeps e = exp(x - m_chunk) from its partial sum and writes e * exp(m_chunk - m) / s,
        so that no exponential is left between the wait and the store (log-softmax: x - m - log s).

        VEC > 0 (rows of unit stride whose x and y starts share their offset from a 16-byte boundary,
        VEC elements being 16 bytes): chunks of the rows' aligned windows (``_window``), so that a
        row length off a multiple of 16 elements, or a row start off a 16-byte boundary, keeps the
        accesses vectorised (a mask against a length the compiler cannot divide makes them scalar:
        benchmarks/NOTES.md, "Odd row lengths of softmax")."""
        split, group, groups = place_in_group(SPLITS)
        OUT_T: tl.constexpr = y_ptr.dtype.element_ty
        if VEC == 0:
            n = split * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = n < N
            if PHASE == 0:
                x_next = _chunk(x_ptr, group, x_base, x_so0, x_so1, x_si, x_sn, n, mask, INNER, OUTER1, ROWS,
                                float("-inf"), WIDE)
        else:
            if PHASE == 0:
                x_next, first_next, last_next = _window_parts(x_ptr, group, x_base, x_so0, x_so1, x_si, split, N,
                                                              INNER, OUTER1, ROWS, float("-inf"), BLOCK_N, SPLITS, VEC)
        for r in range(group, ROWS, groups):
            if VEC == 0:
                if PHASE == 0:
                    x_raw = x_next
                else:
                    x_raw = _chunk(x_ptr, r, x_base, x_so0, x_so1, x_si, x_sn, n, mask, INNER, OUTER1, ROWS,
                                   float("-inf"), WIDE)
                x = x_raw.to(OUT_T).to(ACC)
                m_chunk = tl.max(x, axis=0)
            else:
                if PHASE == 0:
                    x_raw, first_raw, last_raw = x_next, first_next, last_next
                else:
                    x_raw, first_raw, last_raw = _window_parts(x_ptr, r, x_base, x_so0, x_so1, x_si, split, N, INNER,
                                                               OUTER1, ROWS, float("-inf"), BLOCK_N, SPLITS, VEC)
                x = x_raw.to(OUT_T).to(ACC)
                x_first = first_raw.to(OUT_T).to(ACC)
                x_last = last_raw.to(OUT_T).to(ACC)
                m_chunk = tl.maximum(tl.max(x, axis=0), tl.maximum(tl.max(x_first, axis=0), tl.max(x_last, axis=0)))
            m_safe = tl.where(m_chunk == float("-inf"), 0.0, m_chunk)
            e = tl.exp(x - m_safe)
            if VEC != 0:
                e_first = tl.exp(x_first - m_safe)
                e_last = tl.exp(x_last - m_safe)
            if PHASE != 2:
                # the chunk's sum taken here, between the two stores: summed before them, Triton 3.6
                # gave the plain kernel 46 registers a thread instead of 40 (16 chunks a row, 16 warps:
                # 2 programs an SM instead of 3; softmax 1024x131072 bf16 0.255 ms against 0.225, H100)
                tl.store(ws_ptr + r * SPLITS + split, m_chunk)
                if VEC == 0:
                    tl.store(ws_ptr + (ROWS + r) * SPLITS + split, tl.sum(e, axis=0))
                else:
                    tl.store(ws_ptr + (ROWS + r) * SPLITS + split,
                             tl.sum(e, axis=0) + (tl.sum(e_first, axis=0) + tl.sum(e_last, axis=0)))
                arrive(count_ptr + r)
            if PHASE == 0:  # the next row's chunk loads while this one waits
                if VEC == 0:
                    x_next = _chunk(x_ptr, r + groups, x_base, x_so0, x_so1, x_si, x_sn, n, mask, INNER, OUTER1,
                                    ROWS, float("-inf"), WIDE)
                else:
                    x_next, first_next, last_next = _window_parts(x_ptr, r + groups, x_base, x_so0, x_so1, x_si, split,
                                                                  N, INNER, OUTER1, ROWS, float("-inf"), BLOCK_N,
                                                                  SPLITS, VEC)
            if PHASE != 1:
                wait_for(count_ptr + r, SPLITS)
                k = tl.arange(0, SPLITS_P2)
                m_ref, s = merge_max_sum(
                    tl.load(ws_ptr + r * SPLITS + k, mask=k < SPLITS, other=float("-inf"), cache_modifier=".cg"),
                    tl.load(ws_ptr + (ROWS + r) * SPLITS + k, mask=k < SPLITS, other=0.0, cache_modifier=".cg"))
                if LOG:
                    y = x - (m_ref + tl.log(s))
                else:  # a chunk of -inf only: exp(-inf - m) = 0
                    scale = tl.exp(m_chunk - m_ref) / s
                    y = e * scale
                if VEC == 0:
                    o0, o1, i = _coords(r, INNER, OUTER1)
                    offsets = n.to(tl.int64) * y_sn if WIDE else n * y_sn
                    tl.store(y_ptr + _row(o0, o1, i, y_base, y_so0, y_so1, y_si) + offsets, y.to(OUT_T), mask=mask)
                else:
                    if LOG:
                        y_first = x_first - (m_ref + tl.log(s))
                        y_last = x_last - (m_ref + tl.log(s))
                    else:
                        y_first = e_first * scale
                        y_last = e_last * scale
                    _store_window(y_ptr, r, y_base, y_so0, y_so1, y_si, split, N, INNER, OUTER1, ROWS, y, y_first, y_last,
                                  BLOCK_N, SPLITS, VEC)

    @triton.jit
    def _softmax_bwd_exchange(
        dy_ptr, y_ptr, dx_ptr, ws_ptr, count_ptr,
        dy_base, dy_so0, dy_so1, dy_si, dy_sn,
        y_base, y_so0, y_so1, y_si, y_sn,
        dx_base, dx_so0, dx_so1, dx_si, dx_sn,
        N, INNER, OUTER1, ROWS,
        LOG: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr,
        SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, PHASE: tl.constexpr, VEC: tl.constexpr = 0,
    ):
        """Backward of _softmax_fwd_exchange's rows: chunks trade sum(y * dy) (log: sum(dy)) through ws [ROWS, SPLITS].
        VEC > 0: the rows' aligned windows, as the forward's (dy, y and dx rows at one offset from a 16-byte
        boundary)."""
        split, group, groups = place_in_group(SPLITS)
        n = split * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = n < N
        if PHASE == 0:
            if VEC == 0:
                dy_next = _chunk(dy_ptr, group, dy_base, dy_so0, dy_so1, dy_si, dy_sn, n, mask, INNER, OUTER1, ROWS,
                                 0.0, WIDE)
                y_next = _chunk(y_ptr, group, y_base, y_so0, y_so1, y_si, y_sn, n, mask, INNER, OUTER1, ROWS, 0.0,
                                WIDE)
            else:
                dy_next, dy_first_next, dy_last_next = _window_parts(dy_ptr, group, dy_base, dy_so0, dy_so1, dy_si,
                                                                     split, N, INNER, OUTER1, ROWS, 0.0, BLOCK_N,
                                                                     SPLITS, VEC)
                y_next, y_first_next, y_last_next = _window_parts(y_ptr, group, y_base, y_so0, y_so1, y_si, split, N,
                                                                  INNER, OUTER1, ROWS, 0.0, BLOCK_N, SPLITS, VEC)
        for r in range(group, ROWS, groups):
            if PHASE == 0:
                dy_raw = dy_next
                y_raw = y_next
                if VEC != 0:
                    dy_first, dy_last, y_first, y_last = dy_first_next, dy_last_next, y_first_next, y_last_next
            elif VEC == 0:
                dy_raw = _chunk(dy_ptr, r, dy_base, dy_so0, dy_so1, dy_si, dy_sn, n, mask, INNER, OUTER1, ROWS,
                                0.0, WIDE)
                y_raw = _chunk(y_ptr, r, y_base, y_so0, y_so1, y_si, y_sn, n, mask, INNER, OUTER1, ROWS, 0.0, WIDE)
            else:
                dy_raw, dy_first, dy_last = _window_parts(dy_ptr, r, dy_base, dy_so0, dy_so1, dy_si, split, N, INNER,
                                                          OUTER1, ROWS, 0.0, BLOCK_N, SPLITS, VEC)
                y_raw, y_first, y_last = _window_parts(y_ptr, r, y_base, y_so0, y_so1, y_si, split, N, INNER, OUTER1,
                                                       ROWS, 0.0, BLOCK_N, SPLITS, VEC)
            if PHASE != 2:
                if LOG:
                    part = tl.sum(dy_raw.to(ACC), axis=0)
                    if VEC != 0:
                        part += tl.sum(dy_first.to(ACC), axis=0) + tl.sum(dy_last.to(ACC), axis=0)
                else:
                    part = tl.sum(y_raw.to(ACC) * dy_raw.to(ACC), axis=0)
                    if VEC != 0:
                        part += (tl.sum(y_first.to(ACC) * dy_first.to(ACC), axis=0)
                                 + tl.sum(y_last.to(ACC) * dy_last.to(ACC), axis=0))
                tl.store(ws_ptr + r * SPLITS + split, part)
                arrive(count_ptr + r)
            if PHASE == 0:
                if VEC == 0:
                    dy_next = _chunk(dy_ptr, r + groups, dy_base, dy_so0, dy_so1, dy_si, dy_sn, n, mask, INNER,
                                     OUTER1, ROWS, 0.0, WIDE)
                    y_next = _chunk(y_ptr, r + groups, y_base, y_so0, y_so1, y_si, y_sn, n, mask, INNER, OUTER1,
                                    ROWS, 0.0, WIDE)
                else:
                    dy_next, dy_first_next, dy_last_next = _window_parts(
                        dy_ptr, r + groups, dy_base, dy_so0, dy_so1, dy_si, split, N, INNER, OUTER1, ROWS, 0.0,
                        BLOCK_N, SPLITS, VEC)
                    y_next, y_first_next, y_last_next = _window_parts(
                        y_ptr, r + groups, y_base, y_so0, y_so1, y_si, split, N, INNER, OUTER1, ROWS, 0.0, BLOCK_N,
                        SPLITS, VEC)
            if PHASE != 1:
                wait_for(count_ptr + r, SPLITS)
                k = tl.arange(0, SPLITS_P2)
                total = tl.sum(tl.load(ws_ptr + r * SPLITS + k, mask=k < SPLITS, other=0.0, cache_modifier=".cg"), axis=0)
                dy = dy_raw.to(ACC)
                y = y_raw.to(ACC)
                if LOG:
                    dx = dy - tl.exp(y) * total
                else:
                    dx = y * (dy - total)
                if VEC == 0:
                    o0, o1, i = _coords(r, INNER, OUTER1)
                    offsets = n.to(tl.int64) * dx_sn if WIDE else n * dx_sn
                    tl.store(dx_ptr + _row(o0, o1, i, dx_base, dx_so0, dx_so1, dx_si) + offsets,
                             dx.to(dx_ptr.dtype.element_ty), mask=mask)
                else:
                    if LOG:
                        dx_first = dy_first.to(ACC) - tl.exp(y_first.to(ACC)) * total
                        dx_last = dy_last.to(ACC) - tl.exp(y_last.to(ACC)) * total
                    else:
                        dx_first = y_first.to(ACC) * (dy_first.to(ACC) - total)
                        dx_last = y_last.to(ACC) * (dy_last.to(ACC) - total)
                    _store_window(dx_ptr, r, dx_base, dx_so0, dx_so1, dx_si, split, N, INNER, OUTER1, ROWS, dx,
                                  dx_first, dx_last, BLOCK_N, SPLITS, VEC)

    # The kernel of a fused / chunked (looped or split) plan, by (backward, fused).
    _KERNELS = {(False, True): _softmax_fwd_fused, (True, True): _softmax_bwd_fused,
                (False, False): _softmax_fwd_chunked, (True, False): _softmax_bwd_chunked}


# ----------------------------------------------------------------------------------------------
# Launcher: heuristic, layout, launch
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TritonConfig:
    """Block sizes of one launch. kind: "fused" | "exchange" | "looped" | "split" (see the module docstring)."""

    kind: str
    block_i: int
    block_n: int
    num_warps: int
    splits: int = 1
    chunk: int = 0  # positions per split (multiple of block_n); 0 for fused
    per_sm: int = 0  # exchange: programs per SM wanted (capped by the kernel's occupancy)




def _choose_config(problem: SoftmaxProblem, layout: ReductionLayout) -> TritonConfig:
    """Pick the plan, block sizes and warps from the problem's SoftmaxHeuristics (h).

    Row-major (the reduced axis is the most contiguous): a row of up to h.register_tile elements
    is fused, several short rows to a program so that each moves at least 1/8 of a register tile.
    Longer rows of at most SMs x h.exchange_tile elements are cut into chunks of h.exchange_tile
    held by programs that trade partial sums ("exchange", exchange.py). Longer still (or with
    the exchange off) rows stream h.stream_tile elements a step, one row to a program ("looped");
    with fewer than 2 programs per SM the rows are cut into chunks of half a stream tile
    ("split"), aiming at h.split_programs_per_sm programs per SM (h.column_backward_split_per_sm for a
    column layout's backward).
    Few long rows (row-major) whose plan above gives fewer programs than SMs: rows longer than a
    chunk of exchange.fill_tile (about h.fill_per_sm programs an SM, h.fill_min_bytes at least)
    take the exchange plan at that chunk, short of a register tile or not; with the exchange off,
    the split plan at chunks of at most it.
    Column-major (a batch axis is more contiguous, e.g. softmax over dim=1 of [B, C, HW]): tiles
    of h.column_block contiguous positions (backward: h.column_bytes_backward bytes of them) by
    BLOCK_N reduced positions; the reduced axis is walked through its stride, never transposed.
    Warps: forward one per 1024 tile elements (4 to 32); backward one per 256, 4 to 8 (to
    h.fused_backward_warps for row-major tiles over 16384 elements);
    exchange h.exchange_warps; streaming 16 forward, 32 backward; split 8 forward, 16 backward.
    """
    h = problem.heuristics
    itemsize = max(problem.dtype.itemsize, problem.out_dtype.itemsize)
    reg_tile, stream_tile = h.register_tile[itemsize], h.stream_tile[itemsize]
    n, inner = layout.n, layout.inner
    block_n_full = next_pow2(n)
    backward = problem.backward

    column = inner > 1 and layout.stride_inner[-1] < layout.stride_n[-1]

    def fused(block_i: int) -> TritonConfig:
        tile = block_i * block_n_full
        # fused_backward_warps was measured on row-major tiles (rows of 32000) only; column tiles keep 8
        most = h.fused_backward_warps if tile > 16384 and not column else 8
        warps = min(most, max(4, tile // 256)) if backward else min(32, max(4, tile // 1024))
        return TritonConfig("fused", block_i, block_n_full, warps)

    sms = h.sm_count(problem.device)
    # fewer rows than SMs: chunks that give every SM programs (0: one row, or exchange_tile, a program)
    largest = h.exchange_tile[itemsize] if h.exchange_on() else stream_tile // 2
    fill = 0 if column else fill_tile(layout.rows, n, itemsize, sms, h.fill_per_sm, h.fill_min_bytes, largest,
                                      n if block_n_full <= reg_tile else largest, h.fill_min_row_bytes)
    if column:
        positions = max(h.column_block, h.column_bytes_backward // itemsize) if backward else h.column_block
        block_i = min(next_pow2(inner), positions)
        fitting = reg_tile // block_n_full
        if fitting >= min(block_i, h.column_block // 2):
            return fused(min(block_i, fitting))
    elif block_n_full <= reg_tile and not fill:
        return fused(min(next_pow2(inner), max(1, reg_tile // 8 // block_n_full)))
    else:
        block_i = 1
        tile = fill or h.exchange_tile[itemsize]
        splits = -(-n // tile)
        windowed = -(-(n + max(0, _window_vec(problem, layout) - 1)) // tile)   # a window starts up to VEC - 1 early
        if windowed <= sms:
            splits = windowed   # else the windows are left out (_prepare_exchange), not the exchange
        if h.exchange_on() and splits <= sms:
            warps, per_sm = h.exchange_warps[problem.op], h.exchange_per_sm[backward]
            if tile < h.exchange_tile[itemsize]:
                warps, per_sm = min(warps, max(4, tile // 512)), max(per_sm, h.fill_per_sm)
            return TritonConfig("exchange", 1, tile, warps, splits, tile, per_sm)
    programs = -(-layout.rows // block_i)
    if programs >= 2 * sms and not fill:
        block_n = max(1, stream_tile // block_i)
        return TritonConfig("looped", block_i, block_n, 32 if backward else 16, 1, block_n_full)
    block_n = max(1, stream_tile // 2 // block_i)
    if fill:
        block_n = min(block_n, fill)
    per_sm = h.column_backward_split_per_sm if column and backward else h.split_programs_per_sm
    splits = min(next_pow2(-(-per_sm * sms // programs)), next_pow2(-(-n // block_n)), 256)
    chunk = -(-n // (splits * block_n)) * block_n
    return TritonConfig("split", block_i, block_n, 16 if backward else 8, next_pow2(-(-n // chunk)), chunk)


def _window_vec(problem: SoftmaxProblem, layout: ReductionLayout) -> int:
    """VEC, the elements in 16 bytes, when the exchange plan (forward and backward) or the fused plan's
    one row a program (forward, rows of 2049 to 32768 elements or a single row) reads and writes its
    rows through aligned windows (``_window``), else 0. ``plan.kernel["window"]`` reports it: a call
    whose pointers are not 16-byte aligned runs the plain kernel of the same plan. Windows need rows of unit stride in every operand (x and y; dy, y
    and dx), one element size, and each row of every operand starting as far past a 16-byte boundary
    as the same row of the output (strides and bases congruent modulo VEC; the pointers themselves
    are checked at each launch). They are used only where the plain chunks would lose vectorised
    access: a row length or a row stride that is no multiple of 16 elements (benchmarks/NOTES.md,
    "Odd row lengths of softmax")."""
    if problem.dtype.itemsize != problem.out_dtype.itemsize or set(layout.stride_n) != {1}:
        return 0
    vec = 16 // problem.dtype.itemsize
    # per operand: the element offsets its rows start at are combinations of these
    offsets = [(layout.stride_outer0[k], layout.stride_outer1[k], layout.stride_inner[k],
                *(bases[k] for bases in layout.host_bases)) for k in range(len(layout.stride_n))]
    if layout.n % 16 == 0 and all(o % 16 == 0 for operand in offsets for o in operand):
        return 0
    out = offsets[-1]
    return vec if all(a % vec == b % vec for operand in offsets[:-1] for a, b in zip(operand, out)) else 0


def _operand_args(layout: ReductionLayout, bases) -> list[int]:
    """Per operand: base offset, then its outer0, outer1, inner and reduced strides."""
    args = []
    for k, base in enumerate(bases):
        args += [base, layout.stride_outer0[k], layout.stride_outer1[k], layout.stride_inner[k], layout.stride_n[k]]
    return args


def _prepare_exchange(problem: SoftmaxProblem, layout: ReductionLayout, config: TritonConfig, meta: dict) -> Launch:
    """One launch per host base (usually one): workspace of partials and a zeroed count per row.

    Rows along one batch axis (outer0 = outer1 = 1, e.g. any contiguous input) are passed as
    outer0 with INNER = OUTER1 = 1, which Triton compiles as constants: the kernels' row -> (outer0,
    outer1, inner) division then folds away, and with it 15-18 registers a thread (forward, 8192
    elements at 16 warps: 58 -> 40, which lets 3 programs share an SM instead of 2)."""
    if layout.outer0 == layout.outer1 == 1:
        layout = replace(layout, outer0=layout.inner, stride_outer0=layout.stride_inner, inner=1,
                         stride_inner=(0,) * len(layout.stride_inner))
    fn = _softmax_bwd_exchange if problem.backward else _softmax_fwd_exchange
    acc = accumulator_dtype(problem.compute_dtype)
    rows, splits = layout.rows, config.splits
    meta = dict(meta, SPLITS=splits, SPLITS_P2=next_pow2(splits))
    del meta["BLOCK_I"]
    vec = _window_vec(problem, layout)
    if splits * config.block_n < layout.n + vec - 1:   # no room for a window's extra split (see _choose_config)
        vec = 0
    window_meta = dict(meta, VEC=vec)
    grids = [ExchangeGrid(fn, rows, splits, config.per_sm, problem.heuristics.sm_count(problem.device))
             for _ in layout.host_bases]   # one a host launch (exchange.py)
    ws_elems = rows * splits * (1 if problem.backward else 2)
    sizes = [layout.n, layout.inner, layout.outer1, rows]
    host_args = [_operand_args(layout, bases) + sizes for bases in layout.host_bases]

    def run(tensors, out):
        if problem.numel == 0:
            return
        # windows start at 16-byte boundaries of the rows' offsets: the pointers must be 16-byte aligned too
        aligned = vec and all(t.data_ptr() % 16 == 0 for t in (*tensors, out))
        for args, grid in zip(host_args, grids):
            ws = torch.empty(ws_elems, dtype=acc, device=out.device)
            count = torch.zeros(rows, dtype=torch.int32, device=out.device)
            launch_exchange(fn, grid, (*tensors, out, ws, count, *args), window_meta if aligned else meta,
                            out.device)

    params = (("plan", "exchange"), ("BLOCK_N", config.block_n), ("num_warps", config.num_warps),
              ("splits", splits), ("per_sm", config.per_sm), ("host_launches", len(layout.host_bases)),
              ("window", vec))
    return Launch(run, KernelChoice(fn.__name__.lstrip("_"), "triton", params), acc,
                  workspace_bytes=ws_elems * acc.itemsize + rows * 4)


def _prepare_triton(problem: SoftmaxProblem, config: TritonConfig | None = None) -> Launch:
    strides = problem.strides + (problem.out_strides,)
    layout = reduction_layout(problem.shape, problem.dim, strides)
    config = config or _choose_config(problem, layout)
    acc = accumulator_dtype(problem.compute_dtype)
    log = problem.op.startswith("log_")
    i_blocks = -(-layout.inner // config.block_i)
    row_programs = layout.outer0 * layout.outer1 * i_blocks
    ws_rows = row_programs * config.block_i
    ws_elems = ws_rows * config.splits * (1 if problem.backward else 2) if config.kind == "split" else 0
    tile_extent = max((config.block_i - 1) * si + (max(layout.n, config.block_n) - 1) * sn
                      for si, sn in zip(layout.stride_inner, layout.stride_n))
    meta = dict(LOG=log, ACC=tl.float64 if acc == torch.float64 else tl.float32, BLOCK_I=config.block_i,
                BLOCK_N=config.block_n, WIDE=tile_extent >= 2**31 - 1, num_warps=config.num_warps)
    if config.kind == "exchange":
        return _prepare_exchange(problem, layout, config, meta)
    sizes = [layout.n, layout.inner, layout.outer1, i_blocks]
    if config.kind != "fused":
        sizes += [config.chunk, ws_rows * config.splits]
    fn = _KERNELS[problem.backward, config.kind == "fused"]
    kernel = fn.__name__
    phases = {"fused": ({},), "looped": (dict(SPLITS=1, PHASE=0),),
              "split": (dict(SPLITS=config.splits, PHASE=1), dict(SPLITS=config.splits, PHASE=2))}[config.kind]
    grid = (row_programs * config.splits,)
    calls = [launcher(fn, grid, trailing=_operand_args(layout, bases) + sizes, **meta, **phase)
             for bases in layout.host_bases for phase in phases]
    # One row a program, forward: through aligned windows (_window) where the plain tile would lose vectorised
    # access and the window (up to VEC - 1 more positions) fits the same tile; on 16-byte aligned pointers.
    vec = _window_vec(problem, layout) if config.kind == "fused" and config.block_i == 1 and not problem.backward else 0
    window_calls = None
    if vec and next_pow2(layout.n + vec - 1) == config.block_n:
        window_calls = [launcher(_softmax_fwd_row_window, grid, trailing=_operand_args(layout, bases) + sizes, **meta,
                                 VEC=vec) for bases in layout.host_bases]
        kernel = f"{kernel}+{_softmax_fwd_row_window.__name__.lstrip('_')}"

    def run(tensors, out):
        if problem.numel == 0:
            return
        pointers = (*tensors, out)
        if config.kind != "fused":
            pointers += (torch.empty(max(ws_elems, 1), dtype=acc, device=out.device),)
        aligned = window_calls is not None and all(t.data_ptr() % 16 == 0 for t in pointers)
        for launch in window_calls if aligned else calls:
            launch(*pointers)

    params = (("plan", config.kind), ("BLOCK_I", config.block_i), ("BLOCK_N", config.block_n),
              ("num_warps", config.num_warps), ("splits", config.splits), ("chunk", config.chunk),
              ("programs", grid[0]), ("host_launches", len(layout.host_bases)),
              ("window", vec if window_calls is not None else 0))
    return Launch(run, KernelChoice(kernel.lstrip("_"), "triton", params), acc,
                  workspace_bytes=ws_elems * acc.itemsize)


if triton_available():
    for _op in FORWARD_OPS + BACKWARD_OPS:
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
                 name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# quack backend: quack-kernels' softmax and its backward (the optional extra trainops[quack])
# ----------------------------------------------------------------------------------------------

_quack = None                               # quack.softmax, once register_quack has registered it
quack_import_error: str | None = None       # why it did not, when it was tried and failed


def _prepare_quack(problem: SoftmaxProblem) -> Launch:
    """quack's ``_softmax_fwd(x, out)`` / ``_softmax_backward(dy, y, dx)`` on the (rows, N) views
    of the contiguous operands. quack compiles its kernels for 16-byte aligned operands (rows of a
    whole number of 16-byte vectors, ``quack_unsupported``); the plan is made for aligned inputs
    (``problem.align``: the choice sends a view at an odd storage offset to Triton, and a pinned
    quack refuses it), and its launch refuses operands off a 16-byte boundary (``Plan.run`` on other
    tensors than planned, or a misaligned ``out``) rather than run another kernel in its name.
    Errors of quack's own are raised, never retried."""
    why = quack_unsupported(problem)
    if why is not None:
        raise argument_error(UnsupportedError, problem.op, *why)
    n = problem.shape[-1]
    rows = problem.numel // n if n else 0
    function = _quack._softmax_backward if problem.backward else _quack._softmax_fwd
    names = problem.names + ("out",)

    def run(tensors, out):
        if problem.numel == 0:
            return
        operands = (*tensors, out)
        for name, t in zip(names, operands):
            if t.data_ptr() % QUACK_ALIGN:
                raise argument_error(InvalidProblemError, problem.op, name,
                                     f"starts off a {QUACK_ALIGN}-byte boundary; the plan (quack's kernels) is for "
                                     f"aligned operands (make a plan with align={pointer_align((t,))}: Triton)")
        function(*(t.view(rows, n) for t in operands))

    params = (("rows", rows), ("N", n), ("align_bytes", QUACK_ALIGN))
    name = "quack_softmax_backward" if problem.backward else "quack_softmax_fwd"
    return Launch(run, KernelChoice(name, "quack", params), torch.float32)


def register_quack() -> bool:
    """Register the quack kernels of softmax and its backward when ``quack.softmax`` imports (with
    ``_softmax_fwd`` and ``_softmax_backward``, quack-kernels 0.6.5's); True when they are
    registered. Deferred (``registry.register_loader``; quack_beats_triton calls it too): the import
    is tried once; a failure registers nothing, raises nothing, and leaves its reason in
    ``quack_import_error`` and ``registry.backend_notes()`` (printed by ``python -m trainops kernels``
    and ``env``): with no quack kernels, the rule puts every problem on Triton."""
    global _quack, quack_import_error
    if _quack is not None:
        return True
    if quack_import_error is not None:
        return False
    try:
        module = importlib.import_module("quack.softmax")
        module._softmax_fwd, module._softmax_backward  # noqa: B018 (the API this backend calls)
    except Exception as e:   # not installed, or its CUDA libraries / DSL did not load: no quack backend
        quack_import_error = f"{type(e).__name__}: {e}"
        note_backend("quack", f"not registered: a quack package is on the path but quack.softmax (quack-kernels "
                              f"0.6.5's _softmax_fwd / _softmax_backward) did not import ({quack_import_error}); "
                              "softmax runs on Triton")
        return False
    _quack, quack_import_error = module, None
    for op in QUACK_OPS:
        register(op, backend="quack", dtypes=QUACK_DTYPES, deterministic=True,
                 accumulator="float32 (quack's)", name=f"{op}_quack")(_prepare_quack)
    return True


def _quack_findable() -> bool:
    """Whether there is a ``quack`` package to import: a look at the import path, no import."""
    if "quack" in sys.modules:
        return sys.modules["quack"] is not None
    return importlib.util.find_spec("quack") is not None


if _quack_findable():
    register_loader("quack", register_quack)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.softmax, log_softmax and their backward, with autograd
# ----------------------------------------------------------------------------------------------

def _run(op: str, tensors: tuple[Tensor, ...], dim: int, out_dtype) -> Tensor:
    return cached_plan(descriptor_of(op, tensors, dim, out_dtype)).run_unchecked(tensors)


def _softmax_impl(x: Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    return _run("softmax", (x,), dim, dtype)


def _log_softmax_impl(x: Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    return _run("log_softmax", (x,), dim, dtype)


def _forward_fake(x: Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty_like(x, dtype=dtype or x.dtype)


def _save_output(ctx, inputs, y) -> None:
    ctx.save_for_backward(y)
    ctx.dim, ctx.x_dtype = inputs.dim, inputs.x.dtype


def _softmax_grad(ctx, dy: Tensor) -> dict:
    (y,) = ctx.saved_tensors
    return {"x": softmax_backward_op(dy, y, ctx.dim, ctx.x_dtype)}


def _log_softmax_grad(ctx, dy: Tensor) -> dict:
    (y,) = ctx.saved_tensors
    return {"x": log_softmax_backward_op(dy, y, ctx.dim, ctx.x_dtype)}


def _softmax_backward_impl(dy: Tensor, y: Tensor, dim: int, input_dtype: Optional[torch.dtype] = None) -> Tensor:
    return _run("softmax_backward", (dy, y), dim, input_dtype)


def _log_softmax_backward_impl(dy: Tensor, y: Tensor, dim: int,
                               input_dtype: Optional[torch.dtype] = None) -> Tensor:
    return _run("log_softmax_backward", (dy, y), dim, input_dtype)


def _backward_fake(dy: Tensor, y: Tensor, dim: int, input_dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty_like(y, dtype=input_dtype or y.dtype)


def _save_backward_inputs(ctx, inputs, dx) -> None:
    ctx.save_for_backward(inputs.dy, inputs.y)
    ctx.dim = inputs.dim


def _softmax_backward_grad(ctx, g: Tensor) -> dict:
    # dx = y * (dy - sum(y*dy)):  d/d dy = softmax_backward(g, y);  d/dy = g*(dy - sum(y*dy)) - dy*sum(g*y)
    dy, y = ctx.saved_tensors
    g = g.to(y.dtype)
    grads = {}
    if ctx.needs_grad.dy:
        grads["dy"] = softmax_backward_op(g, y, ctx.dim)
    if ctx.needs_grad.y:
        grads["y"] = g * (dy - (y * dy).sum(ctx.dim, keepdim=True)) - dy * (g * y).sum(ctx.dim, keepdim=True)
    return grads


def _log_softmax_backward_grad(ctx, g: Tensor) -> dict:
    # dx = dy - exp(y) * sum(dy):  d/d dy = g - sum(g*exp(y));  d/dy = -g * exp(y) * sum(dy)
    dy, y = ctx.saved_tensors
    g = g.to(y.dtype)
    p = y.exp()
    grads = {}
    if ctx.needs_grad.dy:
        grads["dy"] = g - (g * p).sum(ctx.dim, keepdim=True)
    if ctx.needs_grad.y:
        grads["y"] = -g * p * dy.sum(ctx.dim, keepdim=True)
    return grads


softmax_op = custom_op("softmax", _softmax_impl, _forward_fake, backward=_softmax_grad, save=_save_output)
log_softmax_op = custom_op("log_softmax", _log_softmax_impl, _forward_fake, backward=_log_softmax_grad,
                           save=_save_output)
softmax_backward_op = custom_op("softmax_backward", _softmax_backward_impl, _backward_fake,
                                backward=_softmax_backward_grad, save=_save_backward_inputs)
log_softmax_backward_op = custom_op("log_softmax_backward", _log_softmax_backward_impl, _backward_fake,
                                    backward=_log_softmax_backward_grad, save=_save_backward_inputs)
