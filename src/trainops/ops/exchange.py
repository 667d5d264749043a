"""Row exchange: long rows split across programs that run at the same time and trade partial sums.

Used by the softmax family and cross-entropy for rows longer than one program's register tile.
Programs ``g * SPLITS + k`` (k < SPLITS) form group g; a group handles rows g, g + groups, ...
(a persistent grid). For each row, program k loads chunk k of the row into registers, reduces it,
publishes its partial, waits until the group's SPLITS partials are published, merges them in a
fixed order (so the result is deterministic and bit-identical run to run), and writes its chunk
from registers. The next row's chunk is loaded while the program waits. Each element is read
once and written once, where a single program streaming the row must read it twice.

Two ways to publish and wait (both need one small zeroed buffer per call):

    counter  partials go to a float workspace, then ``atomic_add(count[row], 1)`` with release
             semantics; waiters spin on an acquire load of the count. Best measured for the
             softmax family (16-64 chunks a row).
    flagged  a pair of float32 partials is packed into one int64 whose bit 63 marks it written;
             waiters poll the row's words directly (one round trip less). Best measured for
             cross-entropy (4-8 chunks a row, one program per SM). See benchmarks/NOTES.md.

Every program of a group must be resident at the same time, or the waiters spin forever. The
grid is at most SMs x programs per SM, with programs per SM capped by the compiled kernel's
occupancy (registers, threads, shared memory: ``resident_per_sm``), and a plan splits a row into
at most as many chunks as the device has SMs. Where something else limits the SMs a process may
use (MPS thread percentages, green contexts), set ``TRAINOPS_ROW_EXCHANGE=0``: the plans then
stream long rows twice instead.

Triton's interpreter runs programs one after another, so a waiter would wait forever there.
Under the interpreter the same kernel runs as two launches instead: PHASE 1 publishes every
partial, PHASE 2 waits (the wait then returns at once), merges, reads its chunk again and writes
it. PHASE 0 is the one-launch kernel the GPU runs.

Aligned windows (``window``, ``load_window``, ``store_window``): where a row's length or its
start is no multiple of 16 elements, a chunk masked against the length (or reached through a
stride the compiler cannot divide) loses its 16-byte vector accesses (benchmarks/NOTES.md, "Odd
row lengths of softmax"). The row is then read and written from the 16-byte boundary at or below
its start, its window cut into the chunks: each chunk's body is masked only at multiples of the
vector, the window's first and last partial vectors apart. A window can cover up to VEC - 1 more
positions than the row. Used by the softmax family's exchange and fused plans and by
cross-entropy's exchange and pipelined plans, on 16-byte aligned pointers, where every operand's rows start at
one offset from a 16-byte boundary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from ..launch import on_device
from ..layout import next_pow2
from ..registry import sm_count, triton_available, triton_interpreting


def exchange_enabled() -> bool:
    """False when ``TRAINOPS_ROW_EXCHANGE=0``: long rows then take the two-read plans."""
    return os.environ.get("TRAINOPS_ROW_EXCHANGE", "1") != "0"


@dataclass(frozen=True, eq=False)
class ExchangeHeuristics:
    """The part of a family's heuristics the exchange plans share: ``sms``, the streaming
    multiprocessors to plan for (None: the device's), and ``row_exchange``, whether to plan the
    exchange at all (None: unless TRAINOPS_ROW_EXCHANGE=0)."""

    sms: int | None = None
    row_exchange: bool | None = None

    def sm_count(self, device: torch.device) -> int:
        return self.sms if self.sms is not None else sm_count(device)

    def exchange_on(self) -> bool:
        return self.row_exchange if self.row_exchange is not None else exchange_enabled()


def exchange_phases() -> tuple[int, ...]:
    """(0,): one launch on a GPU; (1, 2): publish, then merge, under the interpreter."""
    return (1, 2) if triton_interpreting() else (0,)


def resident_per_sm(kernel, device: torch.device) -> int:
    """How many programs of a compiled Triton kernel fit on one SM at once (registers, threads, shared memory)."""
    kernel._init_handles()  # loads the module: n_regs is known from then on
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    regs_per_warp = -(-max(kernel.n_regs, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (kernel.metadata.shared + 1024)  # the driver reserves 1 KiB a block
    return max(1, min(by_regs, by_threads, by_smem, 32))


def balanced_groups(rows: int, splits: int, programs: int) -> int:
    """Groups of ``splits`` programs, at most ``programs`` in all, with as few idle ones in the last round as can be."""
    groups = max(1, min(rows, programs // splits))
    rounds = -(-rows // groups)
    return -(-rows // rounds)


def fill_tile(rows: int, n: int, itemsize: int, sms: int, per_sm: int, min_bytes: int, largest: int,
              usual: int, min_row_bytes: int = 0) -> int:
    """The chunk length that spreads ``rows`` rows of ``n`` elements over about ``sms * per_sm``
    programs where the plan's usual chunks (``usual`` elements: n for one row a program) give
    fewer programs than the device has SMs, for rows of at least ``min_row_bytes``; else 0.

    The chunk is a power of two between ``min_bytes`` of elements (a program has too little to load
    below that) and ``largest`` (the exchange plan's own chunk), and at least n / sms elements, so that a
    row never needs more programs than the device has SMs (an exchange group must be resident at
    once). 0 when ``per_sm`` is 0 (splitting off), when the usual chunks already give every SM a
    program, for shorter rows (their few programs are latency-bound: splitting them adds a wait and
    a zeroed buffer for nothing), or when the chunk would hold the whole row. Used by the softmax
    family and cross-entropy."""
    if per_sm <= 0 or n <= 1 or n * itemsize < min_row_bytes or rows * -(-n // max(1, usual)) >= sms:
        return 0
    target = sms * per_sm
    tile = max(next_pow2(-(-rows * n // target)), next_pow2(max(1, min_bytes // itemsize)), next_pow2(-(-n // sms)))
    tile = min(tile, largest)
    return tile if tile < n else 0


class ExchangeGrid:
    """The grid of an exchange kernel, per Triton specialisation of its arguments.

    Triton compiles one kernel per argument specialisation (16-byte aligned pointers, integers
    divisible by 16 or equal to 1, 32- or 64-bit integers), and each may use a different number
    of registers, so the occupancy is looked up per specialisation: the first launch of each
    compiles through ``warmup`` and reads the kernel's registers and shared memory. A grid
    belongs to one launch of one plan, whose integer arguments (sizes, strides, that launch's
    bases) are fixed: only the tensors' alignment varies from call to call, and only it is looked
    at (a cheap key on every call). A plan with several host launches keeps a grid for each: their
    bases may specialise differently (divisible by 16 or not), and so compile differently.
    """

    def __init__(self, fn, rows: int, splits: int, per_sm: int, sms: int):
        self.fn, self.rows, self.splits, self.per_sm, self.sms = fn, rows, splits, per_sm, sms
        self._grids: dict[tuple, tuple[int]] = {}

    @staticmethod
    def _key(args: Sequence) -> tuple:
        return tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))

    def __call__(self, args: Sequence, meta: dict, device: torch.device) -> tuple[int]:
        if device.type != "cuda":  # the interpreter: programs run one after another anyway
            return (balanced_groups(self.rows, self.splits, self.sms * self.per_sm) * self.splits,)
        key = self._key(args)
        grid = self._grids.get(key)
        if grid is None:
            kernel = self.fn.warmup(*args, grid=(self.splits,), **meta)
            per_sm = min(self.per_sm, resident_per_sm(kernel, device))
            grid = (balanced_groups(self.rows, self.splits, self.sms * per_sm) * self.splits,)
            self._grids[key] = grid
        return grid


def launch_exchange(fn, grid: ExchangeGrid, args: Sequence, meta: dict, device: torch.device) -> None:
    """Launch ``fn`` once (PHASE 0), or as its two interpreter phases; see the module docstring.
    With one chunk a row (``grid.splits == 1``) nothing is traded and nobody waits: one launch
    (PHASE 0) under the interpreter too."""
    with on_device(device):   # Triton compiles, warms up and launches on the current device
        for phase in (0,) if grid.splits == 1 else exchange_phases():
            kwargs = {**meta, "PHASE": phase}
            fn[grid(args, kwargs, device)](*args, **kwargs)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def place_in_group(SPLITS: tl.constexpr):
        """(chunk index, group, number of groups) of this program: programs g * SPLITS + k form group g."""
        pid = tl.program_id(0)
        return pid % SPLITS, pid // SPLITS, tl.num_programs(0) // SPLITS

    @triton.jit
    def arrive(count_ptr):
        """Count this program's partial of a row as published (release: the partial's store comes first)."""
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release")

    @triton.jit
    def wait_for(count_ptr, SPLITS):
        """Spin until SPLITS programs have arrived at ``count_ptr`` (acquire: their partials are visible after)."""
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
        while seen < SPLITS:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire")

    @triton.jit
    def merge_max_sum(m_k, s_k):
        """(m_ref, s) of a row from its chunks' (max, sum exp(x - max)), in chunk order; m_ref is 0 for an all -inf row."""
        m = tl.max(m_k, axis=0)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        return m_ref, tl.sum(s_k * tl.exp(m_k - m_ref), axis=0)

    @triton.jit
    def pack_flagged(lo, hi):
        """Two float32 in one int64, bit 63 set as the 'written' flag (``hi`` must be >= 0 or NaN)."""
        lo_bits = lo.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        hi_bits = (hi.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) | 0x80000000) << 32
        return lo_bits | hi_bits

    @triton.jit
    def poll_flagged(words_ptr, SPLITS, SPLITS_P2: tl.constexpr):
        """Wait until the SPLITS words at ``words_ptr`` are all written; return their (lo, hi) float32 pairs
        (SPLITS_P2 = next power of two; the pairs past SPLITS are (-inf, 0))."""
        k = tl.arange(0, SPLITS_P2)
        w = tl.load(words_ptr + k, mask=k < SPLITS, other=-1, volatile=True)
        while tl.max(w, axis=0) >= 0:  # an unwritten word is 0: no flag
            w = tl.load(words_ptr + k, mask=k < SPLITS, other=-1, volatile=True)
        w = tl.where(k < SPLITS, w, 0xFF800000)  # -inf, 0
        lo = (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        hi = ((w >> 32) & 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        return lo, hi

    @triton.jit
    def window(start, split, N, valid, BLOCK: tl.constexpr, SPLITS: tl.constexpr, VEC: tl.constexpr):
        """Chunk ``split`` (of SPLITS chunks of BLOCK positions) of a row of N elements that starts
        ``start`` elements past a 16-byte aligned pointer, in the row's window: the row read from the
        VEC-element (16-byte) boundary at or below its start, so that whole vectors are aligned
        (SPLITS * BLOCK >= N + VEC - 1). ``valid``: a scalar bool, False for a row past the last one
        (everything masked). Returns the window's first element offset w0 (a multiple of VEC; the
        row's element i sits at window position i + start - w0) and three masked parts: the chunk's
        body (positions j), whose mask changes only at multiples of VEC (so the compiler keeps its
        accesses vectorised), and the window's first and last partial vectors (positions v and t),
        masked element by element and held by the first split and the split of the last whole
        vector. Every position of the row is in exactly one part of exactly one chunk."""
        head = (start % VEC).to(tl.int32)
        end = head + N
        end_vec = tl.multiple_of((end // VEC) * VEC, VEC)
        j = split * BLOCK + tl.arange(0, BLOCK)
        body = (j >= VEC) & (j < end_vec) & valid
        v = tl.arange(0, VEC)
        first = (v >= head) & (v < end) & valid & tl.where(split == 0, True, False)
        t = end_vec + v
        last = (t >= VEC) & (t < end) & valid & tl.where(split == tl.minimum(end_vec // BLOCK, SPLITS - 1), True, False)
        return tl.multiple_of(start - head, VEC), j, body, v, first, t, last

    @triton.jit
    def load_window(ptr, w0, j, body, v, first, t, last, OTHER: tl.constexpr):
        """The three parts of a window's chunk (``window``'s w0 and masks), ``OTHER`` where masked."""
        return (tl.load(ptr + w0 + j, mask=body, other=OTHER), tl.load(ptr + w0 + v, mask=first, other=OTHER),
                tl.load(ptr + w0 + t, mask=last, other=OTHER))

    @triton.jit
    def store_window(ptr, w0, j, body, v, first, t, last, body_values, first_values, last_values,
                     CACHE: tl.constexpr):
        """Store the three parts of a window's chunk (``window``'s w0 and masks); CACHE: the stores' cache modifier."""
        tl.store(ptr + w0 + j, body_values, mask=body, cache_modifier=CACHE)
        tl.store(ptr + w0 + v, first_values, mask=first, cache_modifier=CACHE)
        tl.store(ptr + w0 + t, last_values, mask=last, cache_modifier=CACHE)
