"""Broadcast gradients: ``sum_to_shape``, the reduction every broadcasting elementwise backward ends
with (ONNX Runtime's DivGrad / MulGrad / AddGrad ... reduce their output gradient this way): a
gradient of the broadcast result's shape summed down to the shape of an operand that was broadcast.

    sum_to_shape(grad, shape) -> out      out has ``shape``; out[k] = sum of grad over the axes
                                          ``shape`` broadcasts along

Semantics are torch's ``Tensor.sum_to_size``: ``shape`` must be expandable to ``grad.shape``
(right-aligned; each size 1 or grad's); grad's leading axes beyond ``shape``'s rank and the axes
where ``shape`` has 1 and grad more are summed. out is contiguous, in grad's dtype (float32, float16,
bfloat16, float64), accumulated in float32 (float64 for float64) and rounded once. Deterministic:
each output is summed in a fixed order set by the plan (bit-stable from run to run on one device
and plan; a plan of other tiles or another GPU's SM count may round differently). An empty
reduction writes zeros. The backward of out with respect to grad is ``dout.expand(grad.shape)``.

Layout: grad is read in place in any strides. Its axes (size-1 axes dropped) are grouped into runs:
the summed axes sorted by stride (the order they are added in is the plan's choice) and merged
where their strides make one walk, the kept axes in the output's order, merged likewise. The
Triton kernel walks up to four summed and four kept runs (the summed index and the output index
are independent), which covers every contiguous tensor of rank 8 or less and most permuted or
sliced ones. A grad of more runs is copied to a contiguous tensor first by the op (one more read and
write of it) and, if that still has more, the Triton backend raises UnsupportedError (the CPU
backend takes any).

Bytes (the fewest the op must move): grad read once, out written once. Triton plan
(``BroadcastSumHeuristics``, defaults from ``rule``, measured): a program owns a block of outputs
and walks a share of the summed elements in (summed, kept) tiles oriented so that the axis of
stride 1 runs along a warp's lanes (summed along the lanes, as (outer index, innermost summed run)
so that the loads are contiguous); when the outputs are too few to fill the GPU, the summed
elements are split among programs that write float32 partial sums, added in a fixed order by a
second kernel (``_common.column_sum``).
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
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics_for
from ..registry import (ACCUMULATOR, FLOATS, accumulator_dtype, normalize_device, pinned_backend, register,
                        register_op, sm_count, triton_available)
from ._common import MAX_GRID_Y, contiguous_strides, float_dtype

OP = "sum_to_shape"
SUMMED_RUNS, KEPT_RUNS = 4, 4   # the Triton kernel's slots: R0..R3 and K0..K3


# ----------------------------------------------------------------------------------------------
# Heuristics, problem, descriptor
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BroadcastSumHeuristics:
    """The sum_to_shape Triton kernels' tunables (trainops.heuristics(...) overrides them); a field
    left None takes the measured rule's value for the problem (``rule``).

    kept_block: the tile's extent along the lanes (the outputs when the kept axis has stride 1, else
    the summed elements), capped by that axis; tile: elements of one (summed, kept) tile a program
    adds per step (the lanes' block widens when the other axis is too short to fill it);
    programs_per_sm: programs wanted per SM before the summed elements are split among programs;
    warps: each program's warps; kept_run_walk: with the kept axis along the lanes, walk the
    outputs as (outer index, innermost kept run) rather than one flat index (``_sum_to_shape``);
    reduce_block / reduce_parts: the partial sums' adding kernel (``column_sum``).
    """

    tile: int | None = None
    kept_block: int | None = None
    programs_per_sm: int | None = None
    warps: int | None = None
    kept_run_walk: bool | None = None
    reduce_block: int = 128
    reduce_parts: int = 32


@dataclass(frozen=True)
class Walk:
    """grad's axes as the Triton kernel walks them: sizes and strides of the summed runs R0..R3 and
    the kept runs K0..K3, each kind outermost first (absent runs: size 1, stride 0)."""

    summed: tuple[tuple[int, int], ...]
    kept: tuple[tuple[int, int], ...]

    @property
    def summed_count(self) -> int:
        return math.prod(s for s, _ in self.summed)

    @property
    def kept_count(self) -> int:
        return math.prod(s for s, _ in self.kept)

    @property
    def inner(self) -> str | None:
        """Which run has the stride-1 axis innermost in the walk: the last kept run or the last
        summed run (the tile's orientation follows it)."""
        last_kept = [st for s, st in self.kept if s > 1]
        last_summed = [st for s, st in self.summed if s > 1]
        if last_kept and last_kept[-1] == 1:
            return "kept"
        if last_summed and last_summed[-1] == 1:
            return "summed"
        return None


def summed_axes(grad_shape: Sequence[int], shape: Sequence[int]) -> tuple[bool, ...]:
    """For each axis of grad: whether sum_to_shape sums it (grad's leading axes beyond ``shape``'s
    rank, and those where ``shape`` has 1 and grad more); ``shape`` is assumed expandable."""
    lead = len(grad_shape) - len(shape)
    return tuple(d < lead or (shape[d - lead] == 1 and grad_shape[d] != 1) for d in range(len(grad_shape)))


def _merged(axes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(size, stride) axes, outermost first, size-1 ones dropped, each merged into the previous one
    when the previous one's stride is its stride times its size (the two walk as one axis)."""
    out: list[list[int]] = []
    for size, stride in axes:
        if size == 1:
            continue
        if out and out[-1][1] == stride * size:
            out[-1][0] *= size
            out[-1][1] = stride
        else:
            out.append([size, stride])
    return [tuple(a) for a in out]


def runs(grad_shape: Sequence[int], strides: Sequence[int], summed: Sequence[bool]) -> list[tuple[bool, int, int]]:
    """grad's axes as (summed?, size, stride) runs: the summed runs first, their axes sorted by
    stride, largest first (any order sums the same terms; this one merges every pair that walks as
    one), then the kept runs in the output's order (which their index must follow)."""
    summed_list = sorted(((size, stride) for size, stride, s in zip(grad_shape, strides, summed) if s),
                          key=lambda axis: -axis[1])
    kept_axes = [(size, stride) for size, stride, s in zip(grad_shape, strides, summed) if not s]
    return [(True, *r) for r in _merged(summed_list)] + [(False, *r) for r in _merged(kept_axes)]


def walk_of(grad_runs: Sequence[tuple[bool, int, int]]) -> Walk | None:
    """The runs in the kernel's slots, summed runs in R0..R3 and kept runs in K0..K3, each kind in
    its order (outermost first; unused slots size 1), or None when a kind has more runs than slots."""
    summed = [(size, stride) for is_summed, size, stride in grad_runs if is_summed]
    kept = [(size, stride) for is_summed, size, stride in grad_runs if not is_summed]
    if len(summed) > SUMMED_RUNS or len(kept) > KEPT_RUNS:
        return None
    return Walk(tuple(summed + [(1, 0)] * (SUMMED_RUNS - len(summed))), tuple(kept + [(1, 0)] * (KEPT_RUNS - len(kept))))


@dataclass(frozen=True)
class SumToShapeProblem:
    """One sum_to_shape problem: grad of ``grad_shape`` / ``strides`` summed to ``shape``.
    Inputs (grad,) -> out (contiguous, ``shape``, grad's dtype)."""

    op: str
    grad_shape: tuple[int, ...]
    strides: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    heuristics: BroadcastSumHeuristics
    walk: Walk | None   # None: more runs than the Triton kernel's slots (the CPU backend needs none)
    index_dtype = None

    @property
    def acc_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    def check(self, tensors: Sequence, out) -> None:
        """Cheap checks of concrete arguments against the plan (shape, strides, dtype, device)."""
        if len(tensors) != 1:
            raise InvalidProblemError(f"trainops.{self.op}: expected 1 argument (grad), got {len(tensors)}")
        check_tensor(self.op, "grad", tensors[0], self.grad_shape, self.dtype, self.device, self.strides)
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its output)")

    def new_output(self) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


def check_expandable(op: str, grad_shape: Sequence[int], shape) -> tuple[int, ...]:
    """``shape`` as a tuple of ints when it expands to ``grad_shape`` (torch's rules, right-aligned),
    else InvalidProblemError naming ``shape``."""
    if torch.compiler.is_compiling():   # sizes may be symbols: index() would fix them to this call's values
        shape = tuple(shape)
    else:
        shape = checked_shape(op, "shape", shape)
    grad_shape = tuple(grad_shape)
    lead = len(grad_shape) - len(shape)
    # == (not "in"): sizes may be torch.compile's symbols, which a membership test cannot decide
    if lead < 0 or any(not (s == 1 or s == g) for s, g in zip(shape, grad_shape[lead:])):
        raise argument_error(InvalidProblemError, op, "shape", f"{shape} is not expandable to grad's shape {grad_shape}")
    return shape


def _describe(grad_shape, dtype, device="cuda", *, strides=None, shape=None, heuristics=None) -> SumToShapeProblem:
    """Validate a sum_to_shape descriptor.

    grad_shape: grad's sizes, any rank. dtype: grad's: float32, float16, bfloat16, float64. strides:
    None (contiguous) or grad's strides (any non-negative). shape: the output's sizes, expandable to
    grad_shape (None: grad_shape itself). heuristics: a BroadcastSumHeuristics.
    """
    grad_shape = checked_shape(OP, "grad_shape", grad_shape)
    dtype = float_dtype(OP, "grad", dtype)
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, OP, "device", f"is not a device: {e}") from None
    shape = grad_shape if shape is None else check_expandable(OP, grad_shape, shape)
    if strides is None:
        strides = contiguous_strides(grad_shape)
    try:
        strides = tuple(int(s) for s in strides)
    except TypeError:
        raise argument_error(InvalidProblemError, OP, "strides", f"must be a sequence of ints, got {strides!r}") from None
    if len(strides) != len(grad_shape) or any(s < 0 for s in strides):
        raise argument_error(InvalidProblemError, OP, "strides",
                             f"{strides} are not {len(grad_shape)} non-negative strides of grad's shape {grad_shape}")
    if heuristics is None:
        heuristics = heuristics_for(BroadcastSumHeuristics)
    elif not isinstance(heuristics, BroadcastSumHeuristics):
        raise argument_error(InvalidProblemError, OP, "heuristics",
                             f"must be a BroadcastSumHeuristics, got {type(heuristics).__name__}")
    powers = {name: getattr(heuristics, name) for name in ("tile", "kept_block", "warps", "reduce_block",
                                                           "reduce_parts")}
    given = {name: v for name, v in powers.items() if v is not None or name.startswith("reduce")}
    per_sm = heuristics.programs_per_sm
    if any(type(v) is not int or v < 1 or v & (v - 1) for v in given.values()) or given.get("warps", 1) > 32 \
            or given.get("kept_block", 1) > given.get("tile", 2 ** 62) \
            or (per_sm is not None and (type(per_sm) is not int or per_sm < 1)):
        raise argument_error(InvalidProblemError, OP, "heuristics",
                             f"{powers} must be powers of two or None (kept_block <= tile, warps <= 32), "
                             f"programs_per_sm an int >= 1 or None; got {heuristics}")
    if heuristics.kept_run_walk is not None and type(heuristics.kept_run_walk) is not bool:
        raise argument_error(InvalidProblemError, OP, "heuristics",
                             f"kept_run_walk must be None, True or False; got {heuristics.kept_run_walk!r}")
    walk = walk_of(runs(grad_shape, strides, summed_axes(grad_shape, shape)))
    return SumToShapeProblem(OP, grad_shape, strides, shape, dtype, device, heuristics, walk)


SumToShapeDescriptor = register_op(OP, _describe)


# ----------------------------------------------------------------------------------------------
# CPU path
# ----------------------------------------------------------------------------------------------

def _prepare_cpu(problem: SumToShapeProblem) -> Launch:
    dims = [d for d, s in enumerate(summed_axes(problem.grad_shape, problem.shape)) if s]
    acc = problem.acc_dtype

    def run(tensors, out):
        (grad,) = tensors
        total = grad.sum(dims, dtype=acc) if dims else grad.to(acc)
        out.copy_(total.reshape(problem.shape))

    return Launch(run, KernelChoice("sum_to_shape_cpu", "cpu", ()), acc)


register(OP, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
         name="sum_to_shape_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from ._common import column_sum

    @triton.jit
    def _offsets(i, N1, N2, N3, s0, s1, s2, s3):
        """Element offsets (int64) in grad of indices ``i`` over four runs of sizes (N0,) N1, N2, N3
        (numbered with the first run outermost) and strides s0..s3: the kept runs' outputs and the
        summed runs' elements alike."""
        i3 = i % N3
        t = i // N3
        i2 = t % N2
        t = t // N2
        return (t // N1).to(tl.int64) * s0 + (t % N1).to(tl.int64) * s1 + i2.to(tl.int64) * s2 \
            + i3.to(tl.int64) * s3

    @triton.jit
    def _sum_to_shape(G, OUT, K, R, chunk, chunk3, splits3, K0, K1, K2, K3, sk0, sk1, sk2, sk3,
                      R0, R1, R2, R3, sr0, sr1, sr2, sr3,
                      BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SUMMED_INNER: tl.constexpr,
                      KEPT_RUN_WALK: tl.constexpr, INDEX: tl.constexpr, ACC: tl.constexpr):
        """OUT[split, k] = sum over this program's share of the summed elements of grad at (r, k), in
        ACC; programs: axis 0 blocks of BLOCK_K outputs, axis 1 the splits of the summed elements.

        Kept along the lanes (their stride-1 axis): the summed index r is mapped to offsets by div
        / mod over the summed runs, and a split adds ``chunk`` consecutive summed elements (whole
        BLOCK_R steps); the outputs' index k by div / mod over the kept runs too, or with
        KEPT_RUN_WALK as (outer index, index in the innermost kept run K3), a program's lanes taking
        BLOCK_K consecutive indices of that run at one outer index, which the compiler sees as
        contiguous (Triton specialises a stride of 1). Summed along the lanes: the summed elements
        are walked as (outer index, index in the innermost summed run R3) likewise, the lanes taking
        BLOCK_R consecutive indices of that run; split = outer split * splits3 + inner split adds
        ``chunk`` outer indices times ``chunk3`` elements of the run. Which walk wins was measured
        (``rule``). Fixed order: steps added elementwise in order into the tile, then the tile
        reduced by tl.sum. INDEX: the indices' integer type (int64 when an index reaches 2**31)."""
        split = tl.program_id(1).to(INDEX)
        if SUMMED_INNER:
            k = tl.program_id(0).to(INDEX) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_off = _offsets(k, K1, K2, K3, sk0, sk1, sk2, sk3)[:, None]
            outer = split // splits3
            o_first = outer * chunk
            o_stop = tl.minimum(o_first + chunk, R // R3)
            r3_first = (split % splits3) * chunk3
            r3_stop = tl.minimum(r3_first + chunk3, R3)
            acc = tl.zeros([BLOCK_K, BLOCK_R], ACC)
            for o in range(o_first, o_stop):
                o_off = _offsets(o, R0, R1, R2, 0, sr0, sr1, sr2)
                for r0 in range(r3_first, r3_stop, BLOCK_R):
                    r3 = r0 + tl.arange(0, BLOCK_R)
                    mask = (k < K)[:, None] & (r3 < r3_stop)[None, :]
                    acc += tl.load(G + o_off + k_off + (r3.to(tl.int64) * sr3)[None, :], mask=mask,
                                   other=0.0).to(ACC)
            total = tl.sum(acc, 1)
            keep = k < K
        else:
            if KEPT_RUN_WALK:
                blocks3 = tl.cdiv(K3, BLOCK_K)
                outer = tl.program_id(0).to(INDEX) // blocks3
                k3 = (tl.program_id(0).to(INDEX) % blocks3) * BLOCK_K + tl.arange(0, BLOCK_K)
                k_off = (_offsets(outer, K0, K1, K2, 0, sk0, sk1, sk2) + k3.to(tl.int64) * sk3)[None, :]
                k = outer * K3 + k3
                keep = k3 < K3
            else:
                k = tl.program_id(0).to(INDEX) * BLOCK_K + tl.arange(0, BLOCK_K)
                k_off = _offsets(k, K1, K2, K3, sk0, sk1, sk2, sk3)[None, :]
                keep = k < K
            start = split * chunk
            stop = tl.minimum(start + chunk, R)
            acc = tl.zeros([BLOCK_R, BLOCK_K], ACC)
            for r0 in range(start, stop, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                mask = (r < stop)[:, None] & keep[None, :]
                r_off = _offsets(r, R1, R2, R3, sr0, sr1, sr2, sr3)[:, None]
                acc += tl.load(G + r_off + k_off, mask=mask, other=0.0).to(ACC)
            total = tl.sum(acc, 0)
        tl.store(OUT + split.to(tl.int64) * K + k.to(tl.int64), total.to(OUT.dtype.element_ty), mask=keep)


def _slots(walk_runs: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """A kind's runs (from a Walk: outermost first, padded with (1, 0) after) as the kernel's four
    slots with the innermost run last: the outer runs in slots 0-2, padded with (1, 0) before."""
    real = [r for r in walk_runs if r[0] > 1] or [(1, 0)]
    return tuple([(1, 0)] * (4 - len(real)) + real)


class Tiles(NamedTuple):
    """The Triton plan's launch shape (see ``tiles``)."""

    block_k: int        # outputs a program owns
    block_r: int        # summed elements a step adds per output
    summed_inner: bool  # the lanes walk the summed elements (their innermost run has stride 1)
    splits: int         # programs along grid axis 1: the summed elements' splits
    chunk: int          # kept along the lanes: summed elements a split adds; else outer summed indices
    splits3: int        # summed along the lanes: splits within the innermost summed run
    chunk3: int         # summed along the lanes: elements of that run a split adds
    warps: int
    kept_run_walk: bool  # kept along the lanes: outputs walked as (outer index, innermost kept run)


SUMMED_LANES_TILE = 2048   # the rule's tile when the summed elements take the lanes


def summed_lanes(problem: SumToShapeProblem) -> bool:
    """Whether the tile's lanes walk the summed elements: their innermost run has stride 1 and that
    run times the outputs fill a tile (the heuristics' ``tile``, else the rule's 2048 elements).
    Shorter (a few summed elements a row over a few outputs) would shrink the tile to a few
    elements a step, and the kept runs take the lanes instead (strided loads)."""
    w = problem.walk
    tile = problem.heuristics.tile or SUMMED_LANES_TILE
    return w.inner == "summed" and _slots(w.summed)[3][0] * w.kept_count >= tile


def rule(problem: SumToShapeProblem) -> tuple[int, int, int, int, bool]:
    """(kept_block, tile, programs_per_sm, warps, kept_run_walk) for a problem: a rule fitted to the
    winners of a sweep on the H200 (benchmarks/probe_sum_to_shape.py, 15 broadcast shapes x 64
    tilings, GPU time; NOTES, "sum_to_shape: every probe shape level or ahead"), not each shape's
    own winner (up to 12 % behind it on the summed-lane rows).

    Summed along the lanes (row sums, NCHW per-channel sums): 1024-wide lanes, 2048-element tiles,
    2 programs an SM, 8 warps. Kept along the lanes: rows of grad not 16-byte aligned (a vocabulary
    of 32001): 1024-wide lanes, 8 programs an SM, the outputs walked as (outer index, innermost
    run) (165 against 203 us flat); else the widest lanes (up to 1024) that still give two blocks of
    outputs per SM, 32 when none does: 32-wide lanes take 256-row tiles in 2-byte dtypes (8 warps)
    and 64-row ones, 8 programs an SM, in wider dtypes; 64-512-wide ones 8192-element tiles;
    1024-wide ones 2-row tiles; all of these with the flat walk (within 6 % of the other on most
    rows, 9 % ahead on one)."""
    w = problem.walk
    if summed_lanes(problem):
        return 1024, SUMMED_LANES_TILE, 2, 8, False
    itemsize = problem.dtype.itemsize
    # rows not 16-byte aligned; a short stride-1 summed run left off the lanes (summed_lanes) lands
    # here too (stride 1 x itemsize), its tiles not measured but full
    if any(stride * itemsize % 16 for size, stride in w.summed if size > 1):
        return 1024, 2048, 8, 4, True
    blocks_wanted = 2 * sm_count(problem.device)
    lanes = next((b for b in (1024, 512, 256, 128, 64) if -(-w.kept_count // b) >= blocks_wanted), 32)
    if lanes == 1024:
        return 1024, 2048, 2, 4, False
    if lanes > 32:
        return lanes, 8192, 2, 4, False
    return (32, 8192, 2, 8, False) if itemsize <= 2 else (32, 2048, 8, 4, False)


def tiles(problem: SumToShapeProblem) -> Tiles:
    """The Triton plan's tiles. The tile's orientation follows the stride-1 axis: the lanes walk
    it in blocks ``kept_block`` wide (capped by its extent: the innermost summed run when summed
    along the lanes), widened (up to ``tile`` elements) when the other axis is too short to fill
    the tile. When the output blocks make fewer than ``programs_per_sm`` programs per SM, the summed
    elements are split among programs, enough for that many: kept along the lanes, in chunks of
    whole BLOCK_R steps; summed along the lanes, first over the outer summed index (``chunk``
    indices a split), then, if that is not enough, within the innermost summed run (``splits3``
    splits of ``chunk3`` elements, whole BLOCK_R steps). Fields of the heuristics left None come
    from ``rule``."""
    h, w = problem.heuristics, problem.walk
    measured = rule(problem)
    kept_block, tile, per_sm, warps, run_walk = (
        given if given is not None else default for given, default in
        zip((h.kept_block, h.tile, h.programs_per_sm, h.warps, h.kept_run_walk), measured))
    K, R = w.kept_count, w.summed_count
    summed_inner = summed_lanes(problem)
    run_walk = run_walk and not summed_inner
    K3, R3 = _slots(w.kept)[3][0], _slots(w.summed)[3][0]
    lanes, other = (R3, K) if summed_inner else (K3 if run_walk else K, R)
    lane_block = min(kept_block, next_pow2(max(lanes, 1)))
    other_block = max(1, min(tile // lane_block, next_pow2(max(other, 1))))
    lane_block = max(lane_block, min(tile // other_block, next_pow2(max(lanes, 1))))
    block_r, block_k = (lane_block, other_block) if summed_inner else (other_block, lane_block)
    k_blocks = output_blocks(K, K3, block_k, run_walk)
    wanted = max(1, -(-sm_count(problem.device) * per_sm // max(k_blocks, 1)))
    if not summed_inner:
        steps = -(-R // block_r)
        splits = max(1, min(wanted, steps, MAX_GRID_Y))   # splits ride on the grid's second axis
        chunk = -(-steps // splits) * block_r
        splits = -(-R // chunk) if R else 1
        return Tiles(block_k, block_r, summed_inner, splits, chunk, 1, R3, warps, run_walk)
    outer = R // max(R3, 1)
    splits_o = max(1, min(wanted, outer, MAX_GRID_Y))
    chunk = -(-outer // splits_o)
    splits_o = -(-outer // chunk) if outer else 1
    steps3 = -(-R3 // block_r)
    splits3 = max(1, min(-(-wanted // splits_o), steps3, MAX_GRID_Y // splits_o))
    chunk3 = -(-steps3 // splits3) * block_r
    splits3 = -(-R3 // chunk3) if R3 else 1
    return Tiles(block_k, block_r, summed_inner, splits_o * splits3, chunk, splits3, chunk3, warps, False)


def output_blocks(K: int, K3: int, block_k: int, run_walk: bool) -> int:
    """Programs along grid axis 0: blocks of BLOCK_K of the K outputs, or with the kept run walk of
    each innermost kept run (K3 long, K // K3 of them)."""
    return (K // max(K3, 1)) * -(-K3 // block_k) if run_walk else -(-K // block_k)


def kernel_arguments(problem: SumToShapeProblem) -> tuple[Tiles, tuple[int, int], tuple, dict]:
    """(tiles, grid, the run-time arguments after grad and out, the constexprs and warps) of
    ``_sum_to_shape`` for a problem the Triton kernel walks."""
    w = problem.walk
    K, R = w.kept_count, w.summed_count
    t = tiles(problem)
    (R0, sr0), (R1, sr1), (R2, sr2), (R3, sr3) = _slots(w.summed)
    (K0, sk0), (K1, sk1), (K2, sk2), (K3, sk3) = _slots(w.kept)
    grid = (max(1, output_blocks(K, K3, t.block_k, t.kept_run_walk)), t.splits)
    index = tl.int64 if max(K + t.block_k, R + t.chunk + t.chunk3 + t.block_r) >= 2 ** 31 else tl.int32
    trailing = (K, R, t.chunk, t.chunk3, t.splits3, K0, K1, K2, K3, sk0, sk1, sk2, sk3, R0, R1, R2, R3,
                sr0, sr1, sr2, sr3)
    meta = dict(BLOCK_K=t.block_k, BLOCK_R=t.block_r, SUMMED_INNER=t.summed_inner, KEPT_RUN_WALK=t.kept_run_walk,
                INDEX=index, ACC=tl.float64 if problem.acc_dtype == torch.float64 else tl.float32,
                num_warps=t.warps)
    return t, grid, trailing, meta


def _prepare_triton(problem: SumToShapeProblem) -> Launch:
    h, w = problem.heuristics, problem.walk
    if w is None:
        raise UnsupportedError(f"trainops.{OP}: grad of shape {problem.grad_shape} and strides {problem.strides} has "
                               f"more than {SUMMED_RUNS} summed or {KEPT_RUNS} kept runs of axes, more than the Triton "
                               "kernel walks (trainops.sum_to_shape copies such a grad to a contiguous one first); the "
                               "cpu backend takes it")
    K, R = w.kept_count, w.summed_count
    t, grid, trailing, meta = kernel_arguments(problem)
    splits = t.splits
    acc = problem.acc_dtype
    main = launcher(_sum_to_shape, grid, trailing=trailing, **meta)
    finish = column_sum(splits, K, h.reduce_block, h.reduce_parts) if splits > 1 else None
    workspace = splits * K * acc.itemsize if finish else 0

    def run(tensors, out):
        (grad,) = tensors
        if K == 0:
            return
        if R == 0:
            out.zero_()
            return
        if finish is None:
            main(grad, out)
            return
        part = torch.empty((splits, K), dtype=acc, device=out.device)
        main(grad, part)
        finish(part, out)

    params = (("BLOCK_K", t.block_k), ("BLOCK_R", t.block_r), ("summed_inner", t.summed_inner), ("splits", splits),
              ("inner_splits", t.splits3), ("kept_run_walk", t.kept_run_walk), ("num_warps", t.warps))
    return Launch(run, KernelChoice("sum_to_shape_triton", "triton", params), acc, workspace_bytes=workspace)


if triton_available():
    register(OP, backend="triton", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
             name="sum_to_shape_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom op: torch.ops.trainops.sum_to_shape, with autograd
# ----------------------------------------------------------------------------------------------

def walkable(grad: Tensor, shape: Sequence[int]) -> Tensor:
    """``grad`` itself when the Triton kernel walks its strides (or the CPU backend runs it), else a
    contiguous copy (the one copy, said in the module docstring)."""
    if grad.device.type == "cpu" and (pinned_backend() or "cpu") == "cpu":
        return grad
    # contiguous, rank <= 8: kept and summed axes alternate in at most 8 runs, at most 4 of a kind,
    # so the walk fits without being worked out on every call
    if (grad.dim() <= SUMMED_RUNS + KEPT_RUNS and grad.is_contiguous()) \
            or walk_of(runs(grad.shape, grad.stride(), summed_axes(grad.shape, shape))) is not None:
        return grad
    return grad.contiguous()


def _impl(grad: Tensor, shape: list[int]) -> Tensor:
    grad = walkable(grad, shape)
    descriptor = SumToShapeDescriptor(grad.shape, grad.dtype, grad.device, strides=grad.stride(), shape=tuple(shape),
                                      heuristics=heuristics_for(BroadcastSumHeuristics))
    return cached_plan(descriptor).run_unchecked((grad,))


def _fake(grad, shape):
    return grad.new_empty(tuple(shape))


def _save(ctx, inputs, output) -> None:
    ctx.grad_shape = tuple(inputs.grad.shape)


def _grad(ctx, dout) -> dict:
    return {"grad": dout.expand(ctx.grad_shape)}


sum_to_shape_op = custom_op(OP, _impl, _fake, backward=_grad, save=_save, inline_triton=True)
