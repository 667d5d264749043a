"""Gather and its gradient (GatherGrad, embedding backward): Triton kernels, CPU path, registration.

Each problem is viewed as ORT does, for any ``dim``: ``x`` of shape ``pre + (S,) + post`` becomes
(B, S, I) with B = prod(pre) and I = prod(post); the index (any rank, N elements) is flattened.

    gather            out[b, n, i] = x[b, index[n], i]                      out: (B, N, I)
    gather_backward   dx[b, s, i]  = scale(s) * sum_{n : index[n] = s} dy[b, n, i]    dx: (B, S, I)

with scale(s) = 0 for the padding row, 1 / count(s) under ``scale_grad_by_freq``, else 1.
Negative indices count from the end (ONNX) where the problem allows them (gather); embedding
indices must lie in [0, S) as in torch.

Dtypes: float32, float16, bfloat16, float64 values; int32 and int64 indices. Sums accumulate in
float32 (float64 for float64).

Index checks (``check_index=True``, the default): on the CPU, and in "immediate" mode everywhere,
the launcher reads the index's min and max before anything is written and raises
``IndexOutOfRangeError`` (an IndexError; on the GPU one small reduction and one host
synchronisation per call). Calls on the GPU, eager or inside a compiled graph, instead check on the
device without waiting (``defer_index_check``, the ops' ``deferred_check``: a later call raises)
and run the launch unchecked; inside a CUDA graph capture both become device-side asserts.
Unchecked out-of-range indices are never dereferenced: gather writes zeros for them and the
gradient drops them. Every CUDA call first raises an error an earlier call flagged, if the GPU
has set it by now (also inside a compiled graph; the replays of a captured graph run no Python).

Triton kernels:
    _gather_rows              tiles of [BLOCK_N index positions, BLOCK_I inner elements].
    gather_backward, deterministic (the default): stable-sort the indices, find each row's run
        of equal indices (searchsorted), then one program per tile of (b, BLOCK_V rows, inner
        block) sums each row's run in sorted order and writes the tile once (zeros for rows no
        index names): dy is read once and dx written once, with no memset. Runs longer than
        CHUNK positions (hot rows) are first cut at fixed CHUNK boundaries of the sorted order and
        summed chunk by chunk in parallel (_gather_grad_hot_chunks, float partials in a workspace),
        so a skewed index stream does not serialise. Fixed order everywhere: bit-identical run to run.
    gather_backward, atomic (``deterministic=False``): zero dx, then add each dy tile with float
        atomics. Half types add into a float32 workspace of B*S*I elements, then cast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import merge_dims, next_pow2
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics_for
from ..registry import (ACCUMULATOR, FLOATS, INDEX_DTYPES, accumulator_dtype, normalize_device, register,
                        register_op, triton_available)
from ._common import assert_on_device, capturing, error_word, message_code, note_device, note_flag, raise_flagged

MAX_RANK = 8


def three_axis_strides(shape: Sequence[int], strides: Sequence[int], lo: int, hi: int):
    """Strides of ``shape`` seen as (shape[:lo], shape[lo:hi], shape[hi:]), or None if a group does not merge."""
    groups = [merge_dims(shape[a:b], strides[a:b]) for a, b in ((0, lo), (lo, hi), (hi, len(shape)))]
    return None if None in groups else tuple(g[1] for g in groups)


# ----------------------------------------------------------------------------------------------
# Heuristics: the tile sizes the launchers plan with (trainops.heuristics(...) overrides them)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class GatherHeuristics:
    """The gather family's tunables; the defaults are the choices measured on the H100
    (benchmarks/NOTES.md).

    row_block: inner elements one program covers (per row of x or dx): whole rows up to here.
    tile: elements of a gather tile (BLOCK_N rows of BLOCK_I); row_tile: of a gradient tile.
    4096-element gradient tiles, one 8 KiB bf16 row each, beat 2 to 8 rows per tile and 1024- or
    2048-element row blocks by 5-10%. chunk: sorted positions per chunk; runs longer than a chunk
    are hot and summed per chunk into float partials (hot_tile elements per program), then
    hot_step partials a step; shorter runs are summed by their row's program. 64 beat 16 and 32
    on a Zipf stream (0.71 vs 0.79-1.0 ms). Compared by identity (a plan's cache key holds the
    object it was made with).
    """

    row_block: int = 4096
    tile: int = 4096
    row_tile: int = 4096
    chunk: int = 64
    hot_tile: int = 8192
    hot_step: int = 16


def _heuristics(op: str, heuristics) -> GatherHeuristics:
    if heuristics is None:
        return heuristics_for(GatherHeuristics)
    if not isinstance(heuristics, GatherHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics", f"must be a GatherHeuristics, got "
                             f"{type(heuristics).__name__}")
    return heuristics


# ----------------------------------------------------------------------------------------------
# Problems: validation shared by every backend
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _GatherShapes:
    """The fields and (B, S, I) view both gather problems share; ``x_shape`` is x's (and dx's) shape."""

    op: str
    x_shape: tuple[int, ...]
    dim: int
    index_shape: tuple[int, ...]
    dtype: torch.dtype
    index_dtype: torch.dtype
    device: torch.device

    @property
    def batch(self) -> int:
        return math.prod(self.x_shape[:self.dim])

    @property
    def size(self) -> int:
        return self.x_shape[self.dim]

    @property
    def inner(self) -> int:
        return math.prod(self.x_shape[self.dim + 1:])

    @property
    def gathered(self) -> int:
        return math.prod(self.index_shape)

    @property
    def gathered_shape(self) -> tuple[int, ...]:
        """x_shape[:dim] + index_shape + x_shape[dim+1:]: gather's output, gather_backward's dy."""
        return self.x_shape[:self.dim] + self.index_shape + self.x_shape[self.dim + 1:]

    def _check(self, tensors, out, name, shape, strides, out_shape) -> None:
        """``tensors`` = (name: shape, strides, dtype; index); ``out`` contiguous of ``out_shape``."""
        if len(tensors) != 2:
            raise InvalidProblemError(f"trainops.{self.op}: expected 2 tensors ({name}, index), got {len(tensors)}")
        check_tensor(self.op, name, tensors[0], shape, self.dtype, self.device, strides)
        check_tensor(self.op, "index", tensors[1], self.index_shape, self.index_dtype, self.device)
        if out is not None:
            check_tensor(self.op, "out", out, out_shape, self.dtype, self.device,
                         torch.empty(out_shape, device="meta").stride())


@dataclass(frozen=True)
class GatherProblem(_GatherShapes):
    """``gather`` of ``x`` (x_shape, x_strides) along ``dim`` by an index of ``index_shape``."""

    x_strides: tuple[int, ...]
    negative_indices: bool
    check_index: bool
    heuristics: GatherHeuristics

    def check(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None) -> None:
        self._check(tensors, out, "x", self.x_shape, self.x_strides, self.gathered_shape)

    def new_output(self) -> torch.Tensor:
        return torch.empty(self.gathered_shape, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class GatherBackwardProblem(_GatherShapes):
    """``gather_backward``: dy (x_shape[:dim] + index_shape + x_shape[dim+1:]) into dx of ``x_shape``."""

    dy_strides: tuple[int, ...]
    deterministic: bool
    padding_idx: int | None
    scale_grad_by_freq: bool
    negative_indices: bool
    check_index: bool
    heuristics: GatherHeuristics

    def check(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None) -> None:
        self._check(tensors, out, "dy", self.gathered_shape, self.dy_strides, self.x_shape)

    def new_output(self) -> torch.Tensor:
        return torch.empty(self.x_shape, dtype=self.dtype, device=self.device)


def _common(op, x_name, x_shape, dim, index_shape, dtype, index_dtype, device):
    """Validation shared by gather and gather_backward; returns normalized (x_shape, dim, index_shape, device)."""
    x_shape = checked_shape(op, "input_shape" if op == "gather_backward" else "x_shape", x_shape)
    index_shape = checked_shape(op, "index_shape", index_shape)
    rank = len(x_shape)
    if rank == 0:
        raise argument_error(InvalidProblemError, op, x_name, "must have at least one dimension to gather along")
    if rank + len(index_shape) - 1 > MAX_RANK or rank > MAX_RANK:
        raise argument_error(UnsupportedError, op, x_name, f"and index give an output of rank "
                             f"{rank + len(index_shape) - 1}; ranks up to {MAX_RANK} are supported")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise argument_error(InvalidProblemError, op, "dim", f"must be an int, got {dim!r}")
    if not -rank <= dim < rank:
        raise argument_error(InvalidProblemError, op, "dim",
                             f"is {dim}, out of range [{-rank}, {rank - 1}] for a tensor of rank {rank}")
    if not isinstance(dtype, torch.dtype) or dtype not in FLOATS:
        raise argument_error(UnsupportedError, op, x_name,
                             f"has dtype {dtype}; supported: float32, float16, bfloat16, float64")
    if not isinstance(index_dtype, torch.dtype) or index_dtype.is_floating_point or index_dtype.is_complex \
            or index_dtype == torch.bool:
        raise argument_error(InvalidProblemError, op, "index", f"has dtype {index_dtype}; indices must be integers "
                             "(int32 or int64)")
    if index_dtype not in INDEX_DTYPES:
        raise argument_error(UnsupportedError, op, "index", f"has dtype {index_dtype}; supported: int32, int64")
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    return x_shape, dim % rank, index_shape, device


def _describe_gather(x_shape, dim, index_shape, dtype, index_dtype, device="cuda", *, x_strides=None,
                     negative_indices=True, check_index=True, heuristics=None) -> GatherProblem:
    """Validate a gather descriptor.

    x_shape: the gathered tensor's sizes (rank >= 1); dim: its gathered axis (negative counts from
    the end); index_shape: any rank (flattened); dtype / index_dtype: of x / of the index.
    x_strides: None (contiguous) or x's strides; the dims before and after ``dim`` must each merge
    into one strided axis (every dense layout and its transposes of rank <= 3 do).
    negative_indices: True counts negative indices from the end (ONNX); False rejects them (embedding).
    check_index: validate index values on every run (a host synchronisation on the GPU).
    heuristics: a GatherHeuristics (default: the one in force, trainops.heuristics).
    """
    op = "gather"
    x_shape, dim, index_shape, device = _common(op, "x", x_shape, dim, index_shape, dtype, index_dtype, device)
    x_strides = torch.empty(x_shape, device="meta").stride() if x_strides is None else tuple(int(s) for s in x_strides)
    if len(x_strides) != len(x_shape) or any(s < 0 for s in x_strides):
        raise argument_error(InvalidProblemError, op, "x_strides", f"{x_strides} do not fit shape {x_shape}")
    if three_axis_strides(x_shape, x_strides, dim, dim + 1) is None:
        raise argument_error(UnsupportedError, op, "x",
                             f"has strides {x_strides} whose dims before or after dim={dim} do not merge; "
                             "pass x.contiguous()")
    return GatherProblem(op, x_shape, dim, index_shape, dtype, index_dtype, device, x_strides,
                         bool(negative_indices), bool(check_index), _heuristics(op, heuristics))


def _describe_gather_backward(input_shape, dim, index_shape, dtype, index_dtype, device="cuda", *,
                              dy_shape=None, dy_strides=None, deterministic=True, padding_idx=None, scale_grad_by_freq=False,
                              negative_indices=True, check_index=True, heuristics=None) -> GatherBackwardProblem:
    """Validate a gather_backward descriptor.

    input_shape: the shape of x (and of dx); dim, index_shape, dtype, index_dtype as for gather.
    dy_shape: checked against input_shape[:dim] + index_shape + input_shape[dim+1:] when given.
    dy_strides: None (contiguous) or the strides of dy (shape input_shape[:dim] + index_shape +
    input_shape[dim+1:]); each of the three groups must merge into one strided axis.
    deterministic: True selects the sorted kernel (bit-identical run to run), False the atomic one.
    padding_idx: a row of dx that receives no gradient (negative counts from the end), or None.
    scale_grad_by_freq: divide each row's gradient by how often its index occurs (torch's embedding).
    heuristics: a GatherHeuristics (default: the one in force, trainops.heuristics).
    """
    op = "gather_backward"
    input_shape, dim, index_shape, device = _common(op, "dy", input_shape, dim, index_shape, dtype,
                                                    index_dtype, device)
    expected = input_shape[:dim] + index_shape + input_shape[dim + 1:]
    if dy_shape is not None and tuple(dy_shape) != expected:
        raise argument_error(InvalidProblemError, op, "dy", f"has shape {tuple(dy_shape)}; input_shape "
                             f"{input_shape}, dim {dim} and index shape {index_shape} need {expected}")
    dy_shape = expected
    dy_strides = torch.empty(dy_shape, device="meta").stride() if dy_strides is None else tuple(int(s) for s in dy_strides)
    if len(dy_strides) != len(dy_shape) or any(s < 0 for s in dy_strides):
        raise argument_error(InvalidProblemError, op, "dy_strides", f"{dy_strides} do not fit dy's shape {dy_shape}")
    if three_axis_strides(dy_shape, dy_strides, dim, dim + len(index_shape)) is None:
        raise argument_error(UnsupportedError, op, "dy", f"has strides {dy_strides} whose batch, index or inner "
                             "dims do not merge; pass dy.contiguous()")
    size = input_shape[dim]
    if padding_idx is not None:
        if not isinstance(padding_idx, int) or isinstance(padding_idx, bool) or not -size <= padding_idx < size:
            raise argument_error(InvalidProblemError, op, "padding_idx",
                                 f"is {padding_idx!r}; expected an int in [{-size}, {size - 1}] or None")
        padding_idx %= size
    return GatherBackwardProblem(op, input_shape, dim, index_shape, dtype, index_dtype, device, dy_strides,
                                 bool(deterministic), padding_idx, bool(scale_grad_by_freq),
                                 bool(negative_indices), bool(check_index), _heuristics(op, heuristics))


GatherDescriptor = register_op("gather", _describe_gather)
GatherBackwardDescriptor = register_op("gather_backward", _describe_gather_backward)


def check_index_range(op: str, index: torch.Tensor, size: int, negative_indices: bool, name: str = "index") -> None:
    """Raise IndexOutOfRangeError (naming ``op`` and its argument ``name``) unless every index lies in
    [-size, size) (negatives allowed) or [0, size).

    One min/max reduction; on the GPU its two scalars come back with one synchronisation. While a
    CUDA graph is being captured, a device-side assert instead (``assert_on_device``).
    """
    if index.numel() == 0:
        return
    low, high = (-size if negative_indices else 0), size
    if capturing(index.device):
        assert_on_device(((index >= low) & (index < high)).all())
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(index)).tolist())
    if lo < low or hi >= high:
        bad = lo if lo < low else hi
        raise IndexOutOfRangeError(
            f"trainops.{op}: argument '{name}' holds {bad}, out of range [{low}, {high - 1}] for an axis of "
            f"size {size} (index min {lo}, max {hi}); nothing was written")


def _flat_index(problem, index: torch.Tensor) -> torch.Tensor:
    """The index as a contiguous 1-D tensor, range-checked when the problem asks for it."""
    if problem.check_index:
        check_index_range(problem.op, index, problem.size, problem.negative_indices)
    return index.reshape(-1)


# ----------------------------------------------------------------------------------------------
# CPU path: ATen's index_select / index_add_ (sequential, so deterministic), same semantics
# ----------------------------------------------------------------------------------------------

def _valid_rows(problem, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows with negatives resolved and out-of-range ones set to 0, mask of the in-range ones)."""
    rows = index.to(torch.int64)
    size = problem.size
    if problem.negative_indices:
        rows = torch.where(rows < 0, rows + size, rows)
    valid = (rows >= 0) & (rows < size)
    return torch.where(valid, rows, 0), valid


def _prepare_gather_cpu(problem: GatherProblem) -> Launch:
    b, s, i, n = problem.batch, problem.size, problem.inner, problem.gathered

    def run(tensors, out):
        x, index = tensors
        rows, valid = _valid_rows(problem, _flat_index(problem, index))
        if out.numel() == 0:
            return
        picked = x.reshape(b, s, i).index_select(1, rows).masked_fill_(~valid.view(1, n, 1), 0)
        out.view(b, n, i).copy_(picked)

    return Launch(run, KernelChoice("gather_index_select_cpu", "cpu"), problem.dtype)


def _prepare_gather_backward_cpu(problem: GatherBackwardProblem) -> Launch:
    b, s, i, n = problem.batch, problem.size, problem.inner, problem.gathered
    acc = accumulator_dtype(problem.dtype)

    def run(tensors, out):
        dy, index = tensors
        rows, valid = _valid_rows(problem, _flat_index(problem, index))
        if out.numel() == 0:
            return
        total = torch.zeros(b, s, i, dtype=acc)
        total.index_add_(1, rows, dy.reshape(b, n, i).to(acc).masked_fill(~valid.view(1, n, 1), 0))
        if problem.scale_grad_by_freq:
            counts = torch.zeros(s, dtype=acc).index_add_(0, rows, valid.to(acc))
            total /= counts.clamp(min=1).view(1, s, 1)
        if problem.padding_idx is not None:
            total[:, problem.padding_idx] = 0
        out.view(b, s, i).copy_(total)

    return Launch(run, KernelChoice("gather_backward_index_add_cpu", "cpu"), acc)


register("gather", backend="cpu", dtypes=FLOATS, index_dtypes=INDEX_DTYPES, deterministic=True,
         accumulator="none (a copy)", name="gather_cpu")(_prepare_gather_cpu)
register("gather_backward", backend="cpu", dtypes=FLOATS, index_dtypes=INDEX_DTYPES, deterministic=True,
         accumulator=ACCUMULATOR, name="gather_backward_cpu")(_prepare_gather_backward_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_rows(x_ptr, index_ptr, out_ptr, S, N, I, N_BLOCKS, x_sb, x_ss, x_si,
                     NEGATIVE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
        """out[b, n, i] = x[b, index[n], i] for a [BLOCK_N, BLOCK_I] tile; zeros where index is out of range."""
        pid = tl.program_id(0)
        b = (pid // N_BLOCKS).to(tl.int64)
        n = (pid % N_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        n_mask = n < N
        i_mask = i < I
        rows = tl.load(index_ptr + n, mask=n_mask, other=0).to(tl.int64)
        if NEGATIVE:
            rows = tl.where(rows < 0, rows + S, rows)
        valid = n_mask & (rows >= 0) & (rows < S)
        src = x_ptr + b * x_sb + rows[:, None] * x_ss + i[None, :].to(tl.int64) * x_si
        tile = tl.load(src, mask=valid[:, None] & i_mask[None, :], other=0.0)
        dst = out_ptr + (b * N + n[:, None]) * I + i[None, :]
        tl.store(dst, tile, mask=n_mask[:, None] & i_mask[None, :])

    @triton.jit
    def _flag_out_of_range(index_ptr, flag_ptr, N, LOW, HIGH, PROGRAMS, CODE, TO_WORD: tl.constexpr,
                           BLOCK: tl.constexpr):
        """Whether some index[n] lies outside [LOW, HIGH). TO_WORD: a program that finds one stores
        CODE into the error word ``flag_ptr`` (ops/_common.py; nothing is written otherwise). Else
        every program writes its verdict into flag[pid] (no memset, no atomics)."""
        pid = tl.program_id(0)
        bad = tl.zeros([BLOCK], tl.int32)
        for start in range(pid * BLOCK, N, PROGRAMS * BLOCK):
            n = start + tl.arange(0, BLOCK)
            rows = tl.load(index_ptr + n, mask=n < N, other=LOW).to(tl.int64)
            bad = bad | ((rows < LOW) | (rows >= HIGH)).to(tl.int32)
        if TO_WORD:
            tl.store(flag_ptr, CODE, mask=tl.max(bad, 0) != 0)
        else:
            tl.store(flag_ptr + pid, tl.max(bad, 0))

    @triton.jit
    def _gather_grad_hot_chunks(dy_ptr, sorted_ptr, perm_ptr, starts_ptr, partial_ptr, S, N, I, CHUNKS,
                                dy_sb, dy_sn, dy_si,
                                ACC: tl.constexpr, CHUNK: tl.constexpr, BLOCK_I: tl.constexpr):
        """Per CHUNK of sorted positions: partial sums of the (at most two) hot runs it touches.

        A hot run has more than CHUNK positions. Slot 0 of chunk c holds the part of the run that
        covers the chunk's first position, slot 1 the part of the run that covers its last one
        (when that is another hot run). partial: (B, CHUNKS, 2, I) in ACC.
        """
        pid = tl.program_id(0)
        b = (pid // CHUNKS).to(tl.int64)
        c = pid % CHUNKS
        first = c * CHUNK
        last = tl.minimum(first + CHUNK, N) - 1
        head = tl.load(sorted_ptr + first).to(tl.int64)
        tail = tl.load(sorted_ptr + last).to(tl.int64)
        head_in = (head >= 0) & (head < S)
        tail_in = (tail >= 0) & (tail < S) & (tail != head)
        head_count = tl.load(starts_ptr + head + 1, mask=head_in, other=0) - tl.load(starts_ptr + head, mask=head_in, other=0)
        tail_count = tl.load(starts_ptr + tail + 1, mask=tail_in, other=0) - tl.load(starts_ptr + tail, mask=tail_in, other=0)
        head_hot = head_count > CHUNK
        tail_hot = tail_count > CHUNK
        if head_hot | tail_hot:
            p = first + tl.arange(0, CHUNK)
            p_mask = p <= last
            keys = tl.load(sorted_ptr + p, mask=p_mask, other=-1).to(tl.int64)
            src = tl.load(perm_ptr + p, mask=p_mask, other=0).to(tl.int64)
            # `where(c, True, False)`, not `c`: Triton 3.9's interpreter broadcasts a scalar comparison
            # as int32 data, which its masked loads refuse; the compiler folds the select away.
            in_head = p_mask & (keys == head) & tl.where(head_hot, True, False)
            in_tail = p_mask & (keys == tail) & tl.where(tail_hot, True, False)
            i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
            i_mask = i < I
            tile = tl.load(dy_ptr + b * dy_sb + src[:, None] * dy_sn + i[None, :].to(tl.int64) * dy_si,
                           mask=(in_head | in_tail)[:, None] & i_mask[None, :], other=0.0).to(ACC)
            slot = partial_ptr + (b * CHUNKS + c) * 2 * I + i
            if head_hot:
                tl.store(slot, tl.sum(tl.where(in_head[:, None], tile, 0.0), axis=0), mask=i_mask)
            if tail_hot:
                tl.store(slot + I, tl.sum(tl.where(in_tail[:, None], tile, 0.0), axis=0), mask=i_mask)

    @triton.jit
    def _gather_grad_rows(dy_ptr, perm_ptr, starts_ptr, out_ptr, S, I, V_BLOCKS,
                          dy_sb, dy_sn, dy_si, padding_idx,
                          HAS_PADDING: tl.constexpr, SCALE_BY_FREQ: tl.constexpr, ACC: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_I: tl.constexpr):
        """dx[b, v, i] for a [BLOCK_V rows, BLOCK_I] tile, each row the sum of its run of sorted positions.

        Runs of at most CHUNK positions are summed here, one position per step for all rows of the
        tile at once, in sorted order; rows no index names get zeros. Rows of hot runs are left to
        _gather_grad_hot_rows. Together they write every row of dx exactly once.
        """
        pid = tl.program_id(0)
        b = (pid // V_BLOCKS).to(tl.int64)
        rows = (pid % V_BLOCKS) * BLOCK_V + tl.arange(0, BLOCK_V)
        v_mask = rows < S
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_mask = i < I
        start = tl.load(starts_ptr + rows, mask=v_mask, other=0)
        end = tl.load(starts_ptr + rows + 1, mask=v_mask, other=0)
        count = end - start
        if HAS_PADDING:
            end = tl.where(rows == padding_idx, start, end)
        hot = end - start > CHUNK
        light = tl.where(hot, 0, end - start)
        dy_ptr += b * dy_sb + i[None, :].to(tl.int64) * dy_si
        acc = tl.zeros([BLOCK_V, BLOCK_I], ACC)
        for k in range(0, tl.max(light, axis=0)):
            live = k < light
            src = tl.load(perm_ptr + start + k, mask=live, other=0).to(tl.int64)
            acc += tl.load(dy_ptr + src[:, None] * dy_sn, mask=live[:, None] & i_mask[None, :], other=0.0).to(ACC)
        if SCALE_BY_FREQ:
            acc = acc / tl.maximum(count, 1).to(ACC)[:, None]
        out = out_ptr + (b * S + rows[:, None]) * I + i[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(v_mask & ~hot)[:, None] & i_mask[None, :])

    @triton.jit
    def _gather_grad_hot_rows(keys_ptr, starts_ptr, partial_ptr, out_ptr, S, N, I, CHUNKS, padding_idx,
                              HAS_PADDING: tl.constexpr, SCALE_BY_FREQ: tl.constexpr, ACC: tl.constexpr,
                              CHUNK: tl.constexpr, STEP: tl.constexpr, BLOCK_I: tl.constexpr):
        """Rows of hot runs: the chunk where a hot run starts sums its chunk partials and writes the row.

        A hot run starts in chunk c either at its first position (the head) or later (then it
        covers the chunk's last position: the tail), so each hot row has exactly one writer.
        """
        pid = tl.program_id(0)
        b = (pid // CHUNKS).to(tl.int64)
        c = pid % CHUNKS
        first = c * CHUNK
        last = tl.minimum(first + CHUNK, N) - 1
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_mask = i < I
        for which in tl.static_range(2):
            if which == 0:
                key = tl.load(keys_ptr + first).to(tl.int64)
            else:
                key = tl.load(keys_ptr + last).to(tl.int64)
            valid = (key >= 0) & (key < S)
            if HAS_PADDING:
                valid = valid & (key != padding_idx)
            start = tl.load(starts_ptr + key, mask=valid, other=0)
            end = tl.load(starts_ptr + key + 1, mask=valid, other=0)
            if which == 0:
                starts_here = start == first
            else:
                starts_here = start > first
            if valid & (end - start > CHUNK) & starts_here:
                c_end = (end - 1) // CHUNK + 1
                acc = tl.zeros([BLOCK_I], ACC)
                for c0 in range(c, c_end, STEP):
                    cs = c0 + tl.arange(0, STEP)
                    slot = tl.where(cs * CHUNK >= start, 0, 1)
                    ptrs = partial_ptr + ((b * CHUNKS + cs) * 2 + slot)[:, None] * I + i[None, :]
                    acc += tl.sum(tl.load(ptrs, mask=(cs < c_end)[:, None] & i_mask[None, :], other=0.0), axis=0)
                if SCALE_BY_FREQ:
                    acc = acc / (end - start).to(ACC)
                tl.store(out_ptr + (b * S + key) * I + i, acc.to(out_ptr.dtype.element_ty), mask=i_mask)

    @triton.jit
    def _gather_grad_atomic(dy_ptr, index_ptr, counts_ptr, acc_ptr, S, N, I, N_BLOCKS, dy_sb, dy_sn, dy_si,
                            padding_idx, NEGATIVE: tl.constexpr, HAS_PADDING: tl.constexpr,
                            SCALE_BY_FREQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
        """acc[b, index[n], i] += dy[b, n, i] (/ count) with float atomics, for a [BLOCK_N, BLOCK_I] tile."""
        pid = tl.program_id(0)
        b = (pid // N_BLOCKS).to(tl.int64)
        n = (pid % N_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        n_mask = n < N
        i_mask = i < I
        rows = tl.load(index_ptr + n, mask=n_mask, other=0).to(tl.int64)
        if NEGATIVE:
            rows = tl.where(rows < 0, rows + S, rows)
        valid = n_mask & (rows >= 0) & (rows < S)
        if HAS_PADDING:
            valid = valid & (rows != padding_idx)
        mask = valid[:, None] & i_mask[None, :]
        tile = tl.load(dy_ptr + b * dy_sb + n[:, None].to(tl.int64) * dy_sn + i[None, :].to(tl.int64) * dy_si,
                       mask=mask, other=0.0).to(acc_ptr.dtype.element_ty)
        if SCALE_BY_FREQ:
            counts = tl.load(counts_ptr + rows, mask=valid, other=1)
            tile = tile / counts[:, None].to(acc_ptr.dtype.element_ty)
        tl.atomic_add(acc_ptr + (b * S + rows[:, None]) * I + i[None, :], tile, mask=mask, sem="relaxed")


# ----------------------------------------------------------------------------------------------
# Launchers: heuristic, layout, launch
# ----------------------------------------------------------------------------------------------

def _tile_shape(h: GatherHeuristics, n: int, inner: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_I, num_warps) of a [index positions x inner elements] tile."""
    block_i = min(next_pow2(inner), h.row_block)
    block_n = max(1, min(next_pow2(n), h.tile // block_i))
    return block_n, block_i, 4 if block_n * block_i <= 2048 else 8


def _acc_tl(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _prepare_gather_triton(problem: GatherProblem) -> Launch:
    b, s, i, n = problem.batch, problem.size, problem.inner, problem.gathered
    x_sb, x_ss, x_si = three_axis_strides(problem.x_shape, problem.x_strides, problem.dim, problem.dim + 1)
    block_n, block_i, warps = _tile_shape(problem.heuristics, n, i)
    n_blocks = -(-n // block_n)
    grid = (b * n_blocks, -(-i // block_i))
    # launched as every other family's plan (the plan's scalars bound once); it did not change an
    # eager 64-row embedding's host time (38.6 -> 38.0 us on the H100 host, benchmarks/NOTES.md)
    launch = launcher(_gather_rows, grid, trailing=(s, n, i, n_blocks, x_sb, x_ss, x_si),
                      NEGATIVE=problem.negative_indices, BLOCK_N=block_n, BLOCK_I=block_i, num_warps=warps)

    def run(tensors, out):
        x, index = tensors
        index = _flat_index(problem, index)
        if out.numel() == 0:
            return
        launch(x, index, out)

    params = (("BLOCK_N", block_n), ("BLOCK_I", block_i), ("num_warps", warps), ("grid", grid))
    return Launch(run, KernelChoice("gather_rows", "triton", params), problem.dtype)


def _prepare_gather_backward_sorted(problem: GatherBackwardProblem) -> Launch:
    b, s, i, n = problem.batch, problem.size, problem.inner, problem.gathered
    dy_sb, dy_sn, dy_si = three_axis_strides(problem.gathered_shape, problem.dy_strides, problem.dim,
                                             problem.dim + len(problem.index_shape))
    acc = accumulator_dtype(problem.dtype)
    h = problem.heuristics
    chunks = -(-n // h.chunk)
    block_i = min(next_pow2(i), h.row_block)
    block_v = max(1, min(next_pow2(s), h.row_tile // block_i))
    warps = 4 if block_v * block_i <= 2048 else 8
    hot_block = min(next_pow2(i), max(1, h.hot_tile // h.chunk))
    v_blocks = -(-s // block_v)
    row_grid = (b * v_blocks, -(-i // block_i))
    hot_grid = (b * chunks, -(-i // hot_block))
    workspace = b * chunks * 2 * i
    meta = dict(ACC=_acc_tl(problem.dtype), CHUNK=h.chunk)
    padding = -1 if problem.padding_idx is None else problem.padding_idx
    flags = dict(HAS_PADDING=problem.padding_idx is not None, SCALE_BY_FREQ=problem.scale_grad_by_freq)
    # the plan's scalars bound once (trailing): a call passes the tensors alone
    hot_chunks = launcher(_gather_grad_hot_chunks, hot_grid, trailing=(s, n, i, chunks, dy_sb, dy_sn, dy_si),
                          BLOCK_I=hot_block, num_warps=8, **meta)
    hot_rows = launcher(_gather_grad_hot_rows, hot_grid, trailing=(s, n, i, chunks, padding), STEP=h.hot_step,
                        BLOCK_I=hot_block, num_warps=4, **flags, **meta)
    row_sums = launcher(_gather_grad_rows, row_grid, trailing=(s, i, v_blocks, dy_sb, dy_sn, dy_si, padding),
                        BLOCK_V=block_v, BLOCK_I=block_i, num_warps=warps, **flags, **meta)

    def run(tensors, out):
        dy, index = tensors
        index = _flat_index(problem, index)
        if out.numel() == 0:
            return
        if problem.negative_indices:
            index = torch.where(index < 0, index + s, index)
        keys, perm = torch.sort(index, stable=True)
        # the row ids 0..S, made per call: a tensor kept by the plan would stay in the memory pool
        # current at its first call (a CUDA graph's, which must free everything it does not return)
        boundaries = torch.arange(s + 1, dtype=keys.dtype, device=out.device)
        starts = torch.searchsorted(keys, boundaries, out_int32=n < 2**31 - 1)
        partial = torch.empty(max(workspace, 1), dtype=acc, device=out.device)
        if n:
            hot_chunks(dy, keys, perm, starts, partial)
            hot_rows(keys, starts, partial, out)
        row_sums(dy, perm, starts, out)

    params = (("CHUNK", h.chunk), ("HOT_STEP", h.hot_step), ("BLOCK_V", block_v), ("BLOCK_I", block_i),
              ("HOT_BLOCK_I", hot_block), ("num_warps", warps), ("row_grid", row_grid), ("hot_grid", hot_grid))
    ws_bytes = workspace * acc.itemsize + n * 16 + (s + 1) * 8  # partials, sorted keys + permutation, run starts
    return Launch(run, KernelChoice("gather_grad_sorted", "triton", params), acc, workspace_bytes=ws_bytes)


def _prepare_gather_backward_atomic(problem: GatherBackwardProblem) -> Launch:
    b, s, i, n = problem.batch, problem.size, problem.inner, problem.gathered
    dy_sb, dy_sn, dy_si = three_axis_strides(problem.gathered_shape, problem.dy_strides, problem.dim,
                                             problem.dim + len(problem.index_shape))
    acc = accumulator_dtype(problem.dtype)
    separate_acc = acc != problem.dtype  # half types add into a float32 buffer, then cast
    block_n, block_i, warps = _tile_shape(problem.heuristics, n, i)
    n_blocks = -(-n // block_n)
    grid = (b * n_blocks, -(-i // block_i))
    padding = -1 if problem.padding_idx is None else problem.padding_idx
    add_rows = launcher(_gather_grad_atomic, grid, trailing=(s, n, i, n_blocks, dy_sb, dy_sn, dy_si, padding),
                        NEGATIVE=problem.negative_indices, HAS_PADDING=problem.padding_idx is not None,
                        SCALE_BY_FREQ=problem.scale_grad_by_freq, BLOCK_N=block_n, BLOCK_I=block_i, num_warps=warps)

    def run(tensors, out):
        dy, index = tensors
        index = _flat_index(problem, index)
        if out.numel() == 0:
            return
        target = torch.zeros(out.shape, dtype=acc, device=out.device) if separate_acc else out.zero_()
        counts = target  # unused unless scaling
        if problem.scale_grad_by_freq:
            rows = torch.where(index < 0, index + s, index) if problem.negative_indices else index
            rows = torch.where((rows >= 0) & (rows < s), rows, s).to(torch.int64)
            counts = torch.zeros(s + 1, dtype=torch.int32, device=out.device)
            counts.index_put_((rows,), torch.ones_like(rows, dtype=torch.int32), accumulate=True)
        if n:
            add_rows(dy, index, counts, target)
        if separate_acc:
            out.copy_(target)

    params = (("BLOCK_N", block_n), ("BLOCK_I", block_i), ("num_warps", warps), ("grid", grid))
    return Launch(run, KernelChoice("gather_grad_atomic", "triton", params), acc,
                  workspace_bytes=b * s * i * acc.itemsize if separate_acc else 0, bitwise_reproducible=False)


_FLAG_BLOCK = 1024
_FLAG_LAUNCHERS: dict = {}


def _flag_launch(n: int, to_word: bool):
    """(the check kernel's launcher, its programs) for ``n`` indices: up to 32 programs of 1024."""
    programs = max(1, min(-(-n // _FLAG_BLOCK), 32))
    launch = _FLAG_LAUNCHERS.get((programs, to_word))
    if launch is None:
        launch = _FLAG_LAUNCHERS[programs, to_word] = launcher(_flag_out_of_range, (programs,), TO_WORD=to_word,
                                                                BLOCK=_FLAG_BLOCK, num_warps=4)
    return launch, programs


def out_of_range_flag(index: Tensor, low: int, high: int) -> Tensor:
    """A one-element int32 tensor on index's device: 1 if some value of ``index`` lies outside
    [low, high), else 0, computed on the device (no host sync): one launch of a few programs, each
    writing its verdict, then their maximum (a second tiny reduction only when there are several).
    For the device-side assert of a CUDA graph capture; eager calls use report_out_of_range."""
    n = index.numel()
    launch, programs = _flag_launch(n, False)
    flags = torch.empty(programs, dtype=torch.int32, device=index.device)
    launch(index.reshape(-1), flags, n, low, high, programs, 0)
    return flags if programs == 1 else flags.amax(0, keepdim=True)


def report_out_of_range(index: Tensor, low: int, high: int, message: str) -> None:
    """One launch that stores ``message``'s code into the error word (ops/_common.py) if some value
    of ``index`` lies outside [low, high): nothing allocated, nothing waited for. Notes the device
    for check_pending."""
    n = index.numel()
    if index.is_cuda:
        note_device(index.device)
    launch, programs = _flag_launch(n, True)
    launch(index.reshape(-1), error_word(), n, low, high, programs, message_code(message))


if triton_available():
    register("gather", backend="triton", dtypes=FLOATS, index_dtypes=INDEX_DTYPES, deterministic=True,
             accumulator="none (a copy)", name="gather_triton")(_prepare_gather_triton)
    register("gather_backward", backend="triton", dtypes=FLOATS, index_dtypes=INDEX_DTYPES, deterministic=True,
             accumulator=ACCUMULATOR, name="gather_backward_sorted_triton")(_prepare_gather_backward_sorted)
    register("gather_backward", backend="triton", dtypes=FLOATS, index_dtypes=INDEX_DTYPES, deterministic=False,
             accumulator=ACCUMULATOR, name="gather_backward_atomic_triton")(_prepare_gather_backward_atomic)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.gather, gather_backward and embedding, with autograd
# ----------------------------------------------------------------------------------------------

def _same_device(op: str, x_name: str, x: Tensor, index: Tensor, index_name: str = "index") -> None:
    if index.device != x.device:
        raise argument_error(InvalidProblemError, op, index_name, f"is on {index.device} but {x_name} is on "
                             f"{x.device}")


def defer_index_check(op: str, name: str, index: Tensor, low: int, high: int) -> None:
    """The deferred check of a CUDA call's indices, run by the op itself (eager mode or inside a
    compiled graph): an earlier call's flagged error is raised first, then ``index`` is compared
    with [low, high) on the device without waiting for it (ops/_common.py's deferred flags; while a
    CUDA graph is being captured, a device-side assert). The op then runs unchecked: such indices
    read nothing (zeros) and get no gradient."""
    in_capture = capturing(index.device)
    raise_flagged(in_capture)
    if not index.numel():
        return
    message = (f"trainops.{op}: argument '{name}' held an index out of range [{low}, {high - 1}] (found by a "
               "check on the GPU that did not wait for it, reported at a later call; the outputs of such "
               "indices were zeros and they got no gradient)")
    if in_capture:
        note_flag(out_of_range_flag(index, low, high), message, in_capture)
    else:
        report_out_of_range(index, low, high, message)


def _start(deferred_check: bool, index: Tensor) -> bool:
    """Whether a call checks its indices on the device (CUDA only; elsewhere before the launch). A
    CUDA call that does not (unchecked, immediate) raises an earlier call's flagged error here; one
    that does raises it in defer_index_check."""
    if deferred_check and index.device.type == "cuda":
        return True
    if index.device.type == "cuda":
        raise_flagged()
    return False


def _run_gather(x: Tensor, index: Tensor, dim: int, negative_indices: bool, check_index: bool,
                deferred_check: bool = False, start: bool = True) -> Tensor:
    """``start=False``: the caller (embedding) has checked the index and raised pending errors already."""
    _same_device("gather", "x", x, index)
    if x.dim() and not x.is_contiguous() and three_axis_strides(x.shape, x.stride(), dim % x.dim(),
                                                                dim % x.dim() + 1) is None:
        x = x.contiguous()  # rare layouts whose dims around ``dim`` do not merge: one copy of x
    deferred = _start(deferred_check and check_index, index) if start else False
    descriptor = GatherDescriptor(x.shape, dim, index.shape, x.dtype, index.dtype, x.device, x_strides=x.stride(),
                                  negative_indices=negative_indices, check_index=check_index and not deferred,
                                  heuristics=heuristics_for(GatherHeuristics))
    plan = cached_plan(descriptor)
    if deferred:
        size = x.shape[dim]
        defer_index_check("gather", "index", index, -size if negative_indices else 0, size)
    return plan.run_unchecked((x, index))


def _gather_shape(x_shape: Sequence[int], index: Tensor, dim: int) -> list[int]:
    dim %= len(x_shape)
    return [*x_shape[:dim], *index.shape, *x_shape[dim + 1:]]


def _gather_impl(x: Tensor, index: Tensor, dim: int, negative_indices: bool = True,
                 check_index: bool = True, deferred_check: bool = False) -> Tensor:
    return _run_gather(x, index, dim, negative_indices, check_index, deferred_check)


def _gather_fake(x: Tensor, index: Tensor, dim: int, negative_indices: bool = True,
                 check_index: bool = True, deferred_check: bool = False) -> Tensor:
    return x.new_empty(_gather_shape(x.shape, index, dim))


def _save_gather(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs.index)
    ctx.dim, ctx.input_shape, ctx.negative_indices = inputs.dim, list(inputs.x.shape), inputs.negative_indices


def _gather_grad(ctx, dy: Tensor) -> dict:
    (index,) = ctx.saved_tensors
    return {"x": gather_backward_op(dy, index, ctx.dim, ctx.input_shape, True, None, False, ctx.negative_indices,
                                    False)}


def _gather_backward_impl(dy: Tensor, index: Tensor, dim: int, input_shape: Sequence[int],
                          deterministic: bool = True, padding_idx: Optional[int] = None,
                          scale_grad_by_freq: bool = False, negative_indices: bool = True,
                          check_index: bool = True, deferred_check: bool = False) -> Tensor:
    _same_device("gather_backward", "dy", dy, index)
    input_shape, rank = tuple(input_shape), len(input_shape)
    if rank and -rank <= dim < rank and not dy.is_contiguous() and three_axis_strides(
            dy.shape, dy.stride(), dim % rank, dim % rank + index.dim()) is None:
        dy = dy.contiguous()  # rare layouts whose batch / index / inner dims do not merge: one copy of dy
    deferred = _start(deferred_check and check_index, index)
    descriptor = GatherBackwardDescriptor(
        input_shape, dim, index.shape, dy.dtype, index.dtype, dy.device, dy_shape=dy.shape, dy_strides=dy.stride(),
        deterministic=deterministic, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq,
        negative_indices=negative_indices, check_index=check_index and not deferred,
        heuristics=heuristics_for(GatherHeuristics))
    plan = cached_plan(descriptor)
    if deferred:
        size = input_shape[dim]
        defer_index_check("gather_backward", "index", index, -size if negative_indices else 0, size)
    return plan.run_unchecked((dy, index))


def _gather_backward_fake(dy: Tensor, index: Tensor, dim: int, input_shape: Sequence[int],
                          deterministic: bool = True, padding_idx: Optional[int] = None,
                          scale_grad_by_freq: bool = False, negative_indices: bool = True,
                          check_index: bool = True, deferred_check: bool = False) -> Tensor:
    return dy.new_empty(input_shape)


def _save_gather_backward(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs.index)
    ctx.dim, ctx.size = inputs.dim, inputs.input_shape[inputs.dim]
    ctx.padding_idx, ctx.scale_grad_by_freq = inputs.padding_idx, inputs.scale_grad_by_freq
    ctx.negative_indices = inputs.negative_indices


def _gather_backward_grad(ctx, g: Tensor) -> dict:
    # dx[s] = f(s) * sum_{index[n] = s} dy[n]  =>  d/d dy[n] = f(index[n]) * g[index[n]]
    (index,) = ctx.saved_tensors
    dim = ctx.dim % g.dim()
    if ctx.padding_idx is not None or ctx.scale_grad_by_freq:
        rows = index.reshape(-1).long()
        rows = torch.where(rows < 0, rows + ctx.size, rows)
        factor = torch.ones(ctx.size, dtype=g.dtype, device=g.device)
        if ctx.scale_grad_by_freq:
            counts = torch.zeros(ctx.size, dtype=g.dtype, device=g.device)
            counts.index_add_(0, rows.clamp(0, ctx.size - 1), ((rows >= 0) & (rows < ctx.size)).to(g.dtype))
            factor = factor / counts.clamp(min=1)
        if ctx.padding_idx is not None:
            factor[ctx.padding_idx % ctx.size] = 0
        g = g * factor.view([-1 if d == dim else 1 for d in range(g.dim())])
    return {"dy": gather_op(g, index, ctx.dim, ctx.negative_indices, False)}


def _embedding_impl(index: Tensor, weight: Tensor, padding_idx: Optional[int] = None,
                    scale_grad_by_freq: bool = False, check_index: bool = True,
                    deferred_check: bool = False) -> Tensor:
    _same_device("embedding", "weight", weight, index, "input")
    deferred = _start(deferred_check and check_index, index)
    if check_index:   # here rather than in the gather plan, so that the error names embedding's argument
        if deferred:
            defer_index_check("embedding", "input", index, 0, weight.shape[0])
        else:
            check_index_range("embedding", index, weight.shape[0], False, name="input")
    return _run_gather(weight, index, 0, False, False, start=False)


def _embedding_fake(index: Tensor, weight: Tensor, padding_idx: Optional[int] = None,
                    scale_grad_by_freq: bool = False, check_index: bool = True,
                    deferred_check: bool = False) -> Tensor:
    return weight.new_empty([*index.shape, *weight.shape[1:]])


def _save_embedding(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs.index)
    ctx.weight_shape = list(inputs.weight.shape)
    ctx.padding_idx, ctx.scale_grad_by_freq = inputs.padding_idx, inputs.scale_grad_by_freq


def _embedding_grad(ctx, dy: Tensor) -> dict:
    (index,) = ctx.saved_tensors
    return {"weight": gather_backward_op(dy, index, 0, ctx.weight_shape, True, ctx.padding_idx,
                                         ctx.scale_grad_by_freq, False, False)}


gather_op = custom_op("gather", _gather_impl, _gather_fake, backward=_gather_grad, save=_save_gather)
gather_backward_op = custom_op("gather_backward", _gather_backward_impl, _gather_backward_fake,
                               backward=_gather_backward_grad, save=_save_gather_backward)
embedding_op = custom_op("embedding", _embedding_impl, _embedding_fake, backward=_embedding_grad,
                         save=_save_embedding)
