"""Multi-tensor launches: one kernel over many tensors (optimizer steps, finite checks, accumulation).

The tensors of a bucket (same device, same dtype per column) are cut into blocks of ``block``
elements, one Triton program per block. A kernel receives

    addresses    int64 [n_columns, n_tensors]  data pointers, one row per column (param, grad, ...)
    block_tensor int32 [n_blocks]               which tensor a block belongs to
    first_block  int32 [n_tensors]              the first block of each tensor
    numels       int64 [n_tensors]

and turns an address into a typed pointer with ``.to(tl.pointer_type(dtype))``. The block tables
depend only on the sizes and are cached by them; the address table is rebuilt (and copied to the
device without a host synchronisation) only when some address changed, e.g. when gradients were
set to None and re-allocated. A steady training step therefore launches its kernels and copies
nothing, and a CUDA-graph capture replays the same tables.

Every column's tensor must be laid out like its row's first column (same shape and strides) and
be dense (no gaps, no overlap), so that one flat offset addresses the same element in each.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import on_device
from ..plan import cached_plan, heuristics_for
from ..registry import normalize_device, op_spec
from ._common import capturing


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill ``t.numel()`` consecutive memory slots (any dim order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def check_columns(op: str, names: Sequence[str], columns: Sequence[Sequence[torch.Tensor]]) -> None:
    """Each row's tensors share shape, strides and device with the row's first column, and are dense."""
    lead_name, lead = names[0], columns[0]
    for name, column in zip(names, columns):
        if len(column) != len(lead):
            raise argument_error(InvalidProblemError, op, name, f"has {len(column)} tensors; '{lead_name}' has {len(lead)}")
    for i, first in enumerate(lead):
        if not is_dense(first):
            raise argument_error(InvalidProblemError, op, f"{lead_name}[{i}]",
                                 f"is not dense (strides {first.stride()} for shape {tuple(first.shape)})")
        for name, column in zip(names[1:], columns[1:]):
            t = column[i]
            if t.shape != first.shape or t.stride() != first.stride() or t.device != first.device:
                raise argument_error(
                    InvalidProblemError, op, f"{name}[{i}]",
                    f"has shape {tuple(t.shape)}, strides {t.stride()} on {t.device}; '{lead_name}[{i}]' has "
                    f"shape {tuple(first.shape)}, strides {first.stride()} on {first.device}")


@dataclass(frozen=True, eq=False)
class MultiTensorHeuristics:
    """The multi-tensor kernels' tunables (trainops.heuristics(...) overrides them).

    block: elements per program (a tensor's last block is masked); 2048 at 4 warps was best of the
    block / warp variants of the AdamW kernel on the H100 (benchmarks/bench_optim.py --sweep,
    benchmarks/NOTES.md). sum_chunk: per-block partials one program of grad_stats' second
    reduction stage sums. Compared by identity (a plan's cache key holds the object it was made
    with)."""

    block: int = 2048
    warps: int = 4
    sum_chunk: int = 8192


@dataclass
class BlockTables:
    """Device tables of one launch: see the module docstring. ``block``: elements per program (the
    kernels' BLOCK). ``aligned``: every column address is a multiple of 16 bytes (the kernels may
    then use 16-byte vector accesses)."""

    addresses: torch.Tensor
    block_tensor: torch.Tensor
    first_block: torch.Tensor
    numels: torch.Tensor
    n_tensors: int
    n_blocks: int
    aligned: bool
    block: int


# What captured CUDA graphs read at every replay, by id: the host buffers of tables made while
# capturing (the graph copies from them) and the device tables they launched with. They live as
# long as the process (a few bytes per tensor of a captured step; PyTorch tells no one when a
# graph is freed): a table dropped from its cache and freed would otherwise hand its memory to
# other tensors under a graph that still reads it.
_CAPTURED: dict[int, object] = {}


def _keep_for_graphs(obj) -> None:
    _CAPTURED.setdefault(id(obj), obj)


def _to_device(host: torch.Tensor, device: torch.device, in_capture: bool) -> torch.Tensor:
    """A CPU tensor copied to ``device`` without a host sync: from pageable memory (staged by the
    driver), or ``in_capture`` (a CUDA graph is being captured) from pinned memory kept for the
    process's life, since every replay copies it again."""
    if in_capture:
        host = host.pin_memory()
        _keep_for_graphs(host)
    return host.to(device, non_blocking=True)


class TensorTable:
    """The cached tables of one bucket. ``tables(columns, scalars, validate, user_columns, gradient_column)``
    returns them.

    The cache key is every tensor's address, the shapes and strides of the tensors of the first
    ``user_columns`` columns (those a user may swap for another view of the same memory, such as
    ``p.grad = buf.view(32, 64).t()``: torch checks a new gradient's shape, dtype and device, not
    its strides) and the lead column's sizes. ``validate`` (the launcher's shape/stride/dtype
    checks) runs only when that key changes, so a steady step pays one pass of ``data_ptr()`` calls
    plus one of ``stride()`` and one of ``size()`` calls over the user's columns, and nothing else.
    The other columns (optimizer state) are ours and keep their layout at a given address.

    ``gradient_column``: the index of a column of gradients (one of the user columns), which
    ``zero_grad(set_to_none=True)`` makes anew at every step, usually at other addresses. When only
    that column's addresses changed since the last validation (its tensors' shapes, strides,
    dtypes and devices, and every other address, shape, stride and size, are as validated), the
    address table is rebuilt without calling ``validate`` again: the per-tensor checks depend on
    nothing else. GPT-2's 148 tensors with fresh gradients: 0.70 ms -> 0.30 ms a table call on the
    CPU machine (benchmarks/NOTES.md, sixth session).
    """

    def __init__(self, block: int, units=None):
        self.block = block
        # units(tensor) -> int: what is cut into blocks of ``block`` (default: the elements;
        # the low-bit optimizer steps cut their tensors' 256-element row chunks)
        self._units = units or torch.Tensor.numel
        self._sizes_key: tuple | None = None
        self._key: tuple | None = None
        self._validated: tuple | None = None   # the key's part validate() saw, gradient addresses left out
        self._blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        self._tables: BlockTables | None = None

    def tables(self, columns: Sequence[Sequence[torch.Tensor]], scalars: Sequence[Sequence[torch.Tensor]] = (),
               validate=None, user_columns: int | None = None, gradient_column: int | None = None) -> BlockTables:
        """Tables for ``columns`` (blocked by the first column's sizes); ``scalars`` (e.g. per-tensor
        step counters) only add rows of addresses, after the columns. ``user_columns``: how many
        leading columns hold tensors the caller does not own (default: all). ``gradient_column``:
        see the class docstring (it must be one of the user columns)."""
        lead = columns[0]
        # map over the unbound methods: the cheapest way to call them per tensor (a steady step's only cost)
        addresses = tuple(map(torch.Tensor.data_ptr, itertools.chain(*columns, *scalars)))
        strides = tuple(map(torch.Tensor.stride, itertools.chain(*columns[:user_columns])))
        shapes = tuple(map(torch.Tensor.size, itertools.chain(*columns[:user_columns])))
        sizes = tuple(map(self._units, lead))
        key = (addresses, strides, shapes, sizes)
        device = lead[0].device
        in_capture = capturing(device)
        if key == self._key:
            if in_capture:
                _keep_for_graphs(self._tables)
            return self._tables
        validated = key
        if gradient_column is not None:
            n = len(lead)
            grads = columns[gradient_column]
            validated = (addresses[:gradient_column * n] + addresses[(gradient_column + 1) * n:],
                         tuple((t.dtype, t.device) for t in grads), strides, shapes, sizes)
        if validate is not None and validated != self._validated:
            validate()
        if in_capture:
            # Made for this capture alone: its copies run at the graph's replays, so it must not serve
            # later calls (their kernels could read it before any replay); the graph keeps it.
            blocks = self._new_blocks(sizes, device, True)
            tables = self._build(addresses, len(columns), len(scalars), sizes, device, blocks, True)
            _keep_for_graphs(tables)
            return tables
        if (device, sizes) != self._sizes_key:
            self._blocks = self._new_blocks(sizes, device, False)
            self._sizes_key = (device, sizes)
        self._tables = self._build(addresses, len(columns), len(scalars), sizes, device, self._blocks, False)
        self._key, self._validated = key, validated
        return self._tables

    def _new_blocks(self, sizes, device, in_capture: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(owner tensor of each block, first block of each tensor, numels, block count) on ``device``."""
        counts = [-(-n // self.block) for n in sizes]
        first, total = [], 0
        for c in counts:
            first.append(total)
            total += c
        owner = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32),
                                        torch.tensor(counts, dtype=torch.int64))
        return (_to_device(owner, device, in_capture),
                _to_device(torch.tensor(first, dtype=torch.int32), device, in_capture),
                _to_device(torch.tensor(sizes, dtype=torch.int64), device, in_capture), total)

    def _build(self, addresses, n_columns: int, n_scalars: int, sizes, device, blocks, in_capture: bool) -> BlockTables:
        n_tensors = len(sizes)
        address_table = _to_device(torch.tensor(addresses, dtype=torch.int64).view(n_columns + n_scalars, n_tensors),
                                   device, in_capture)
        owner, first, numels, total = blocks
        return BlockTables(address_table, owner, first, numels, n_tensors, total,
                           aligned=all(a % 16 == 0 for a in addresses[:n_columns * n_tensors]), block=self.block)


class TableCache:
    """TensorTables by key (e.g. (param group, device, dtype, layout)); owned by an optimizer or scaler.
    Each is cut in the block of the MultiTensorHeuristics in force."""

    def __init__(self):
        self._tables: dict = {}

    def get(self, key) -> TensorTable:
        block = heuristics_for(MultiTensorHeuristics).block
        table = self._tables.get((key, block))
        if table is None:
            table = self._tables[(key, block)] = TensorTable(block)
        return table


def new_table() -> TensorTable:
    """A TensorTable cut in the block of the MultiTensorHeuristics in force (for a call that brings no cache)."""
    return TensorTable(heuristics_for(MultiTensorHeuristics).block)


def bucket_by(tensors: Sequence[torch.Tensor], *keys) -> dict:
    """Indices of ``tensors`` grouped by (device, dtype) and any extra per-index keys."""
    out: dict = {}
    for i, t in enumerate(tensors):
        out.setdefault((t.device, t.dtype, *(k[i] for k in keys)), []).append(i)
    return out


@dataclass(frozen=True)
class MultiTensorProblem:
    """The problem of a multi-tensor op: device, dtype (of its lead column) and compile-time options.

    The tensors themselves vary step to step; the launcher checks them (``check_columns``), so a
    plan of a multi-tensor op reports its kernel and precision, and its ``run`` refuses (the op
    runs through its launcher: trainops.ops.optimizers / amp / grad, or trainops.optim, amp, grad).
    """

    op: str
    device: torch.device
    dtype: torch.dtype
    options: tuple = ()
    heuristics: MultiTensorHeuristics = None  # set by describe (the one in force when none is given)
    index_dtype: None = None

    def option(self, name: str, default=None):
        return dict(self.options).get(name, default)

    def check(self, tensors, out) -> None:
        raise UnsupportedError(f"trainops.plan({self.op!r}).run: a multi-tensor op takes lists of tensors through its "
                               f"launcher (trainops.ops.*.{self.op} and the optim, amp and grad modules above it); its "
                               "plan reports the kernel and precision only")

    def new_output(self):
        self.check((), None)


@dataclass(frozen=True)
class MultiTensorLaunch:
    """What a multi-tensor kernel's ``prepare(problem)`` returns. ``run`` takes the op's own
    arguments (lists of tensors and the op's scalars, see each launcher), not Plan.run's."""

    run: Callable[..., None]
    kernel: object
    accumulator: torch.dtype
    workspace_bytes: int = 0
    bitwise_reproducible: bool = True


def multi_tensor_launch(op: str, device: torch.device, dtype: torch.dtype, **options) -> MultiTensorLaunch:
    """The launch of a multi-tensor op for (device, dtype, options), planned once (plan cache). On a
    CUDA device its ``run`` makes that device current while it launches (Triton launches on the
    current device; the tensors' device may be another, as in a model spread over several GPUs)."""
    launch = cached_plan(op_spec(op).descriptor(dtype, device, tuple(sorted(options.items())),
                                                heuristics_for(MultiTensorHeuristics))).launch
    if device.type != "cuda" or device.index is None:
        return launch
    kept = _ON_DEVICE.get((id(launch), device.index))
    if kept is None:
        if len(_ON_DEVICE) >= _ON_DEVICE_LIMIT:
            _ON_DEVICE.clear()
        kept = _ON_DEVICE[(id(launch), device.index)] = (
            launch, dataclasses.replace(launch, run=_run_on_device(launch.run, device)))
    return kept[1]


# (id(launch), CUDA device index) -> (launch, the launch run with that device current); the launch is
# kept so that its id is not reused while the entry lives; emptied when full (plans made anew after
# trainops.plan's cache was cleared would otherwise add entries for as long as the process runs)
_ON_DEVICE: dict = {}
_ON_DEVICE_LIMIT = 256


def _run_on_device(run: Callable[..., None], device: torch.device) -> Callable[..., None]:
    def run_on_device(*args, **kwargs):
        with on_device(device):
            return run(*args, **kwargs)

    return run_on_device


def prepared_launches(op: str, names: Sequence[str], buckets, cache: TableCache) -> list:
    """[(launch, columns, tables)] for ``buckets`` of (device, dtype, options, columns), with every
    kernel looked up (UnsupportedError) and every bucket's tensors checked (InvalidProblemError,
    through the table cache) before the caller runs any: an op over several buckets writes all of
    them or none."""
    prepared = []
    for device, dtype, options, columns in buckets:
        launch = multi_tensor_launch(op, device, dtype, **options)
        table = cache.get((op, device, dtype, *sorted(options.items())))
        tables = table.tables(columns, validate=lambda columns=columns: check_columns(op, names, columns))
        prepared.append((launch, columns, tables))
    return prepared


def check_scalar(op: str, name: str, t, device: torch.device) -> None:
    """``t`` must be a one-element float32 tensor on ``device`` (loss scale, found_inf, step counter...)."""
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        raise argument_error(InvalidProblemError, op, name, "must be a one-element float32 tensor")
    if t.device != device:
        raise argument_error(InvalidProblemError, op, name, f"is on {t.device}; the tensors are on {device}")


def multi_tensor_describer(op: str):
    """The ``describe`` of a multi-tensor op: ``(dtype, device, options) -> MultiTensorProblem``,
    options a dict or (name, value) pairs (the kernel's compile-time choices)."""
    def describe(dtype: torch.dtype, device="cuda", options=(), heuristics=None) -> MultiTensorProblem:
        if not isinstance(dtype, torch.dtype):
            raise argument_error(InvalidProblemError, op, "dtype", f"must be a torch.dtype, got {dtype!r}")
        pairs = options.items() if isinstance(options, dict) else options
        try:
            options = tuple(sorted((str(name), value) for name, value in pairs))
        except (TypeError, ValueError):
            raise argument_error(InvalidProblemError, op, "options", f"must be a dict or (name, value) pairs, got "
                                 f"{options!r}") from None
        if heuristics is None:
            heuristics = heuristics_for(MultiTensorHeuristics)
        elif not isinstance(heuristics, MultiTensorHeuristics):
            raise argument_error(InvalidProblemError, op, "heuristics", f"must be a MultiTensorHeuristics, got "
                                 f"{type(heuristics).__name__}")
        return MultiTensorProblem(op, normalize_device(device), dtype, options, heuristics)

    describe.__doc__ = f"Problem of the multi-tensor op {op!r}: dtype and device of its lead column, options."
    return describe


def column_dtypes_ok(op: str, name: str, column: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    for i, t in enumerate(column):
        if t.dtype != dtype:
            raise argument_error(InvalidProblemError, op, f"{name}[{i}]", f"has dtype {t.dtype}; expected {dtype}")


from ..registry import triton_available  # noqa: E402

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def block_of_program(block_tensor, first_block, numels, BLOCK: tl.constexpr):
        """(tensor index, first flat offset, tensor numel) of this program's block."""
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        return t, (pid - tl.load(first_block + t)).to(tl.int64) * BLOCK, tl.load(numels + t)

    @triton.jit
    def load_block(pointer, offsets, limit, MASKED: tl.constexpr):
        """pointer[offsets], masked to offsets < limit (zeros there) only on the tail block.

        Full blocks load unmasked: a mask against a loaded limit would defeat 16-byte vector loads.
        """
        if MASKED:
            value = tl.load(pointer + offsets, mask=offsets < limit, other=0.0)
        else:
            value = tl.load(pointer + offsets)
        return value

    @triton.jit
    def store_block(pointer, offsets, limit, value, MASKED: tl.constexpr):
        if MASKED:
            tl.store(pointer + offsets, value, mask=offsets < limit)
        else:
            tl.store(pointer + offsets, value)

    @triton.jit
    def column_pointer(addresses, n_tensors, column, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
        """Typed pointer to tensor ``t`` of ``column``; ALIGNED promises 16-byte alignment (vector loads)."""
        pointer = tl.load(addresses + column * n_tensors + t).to(tl.pointer_type(DTYPE))
        if ALIGNED:
            pointer = tl.multiple_of(pointer, 16)
        return pointer

    @triton.jit
    def runtime_scalar(value, IS_POINTER: tl.constexpr):
        """A hyper-parameter given either as a number or as a pointer to a one-element tensor."""
        if IS_POINTER:
            return tl.load(value).to(tl.float32)
        else:
            return value

    TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                 torch.float64: tl.float64}
