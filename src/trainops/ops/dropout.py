"""Dropout and the fused bias-dropout-add, forward and backward: Triton kernels, CPU path,
registrations and custom ops (ONNX Runtime's Dropout / DropoutGrad / BitmaskDropout / BiasDropout).

    dropout            y = x * m
    bias_dropout_add   y = residual + (x + bias) * m          (bias of shape x.shape[-1:], or none)
    m = keep / (1 - p): keep is 1 with probability 1 - p, else 0; p = 1 gives m = 0 (y = x * 0)

Backward: dx = dy * m; dbias = the sum of dx over every leading element (x.shape[:-1]);
d residual = dy (handed over as it is, no copy).

The mask. Element i (its logical, row-major index in x's shape; not its memory offset) is kept
when the uint32 draw r_i of Philox-4x32-10 (Triton's ``tl.randint4x``) passes ``tl.rand``'s
uniform map: with v = r_i as an int32, flipped (~v) when negative, u = float32(v) *
float32(4.6566127342e-10) in [0, 1), keep when u >= p (p as a float32). The kernels compare the
integer v with the threshold that map gives (``keep_threshold``: the same decision, without the
float conversion). r_i is lane (offset + i) % 4 of the Philox block of counter (offset + i) // 4
(64-bit counter in the first two words, the last two zero, as ``tl.randint4x`` sets them) under
the 64-bit key ``seed``: it depends only on (seed, offset, i), never on block sizes, grids or
strides. ``offset`` (a multiple of 4) shifts an element's place in the stream: a shard starting at
element o of a larger tensor, given offset o, draws the larger tensor's mask. The CPU path
(``keep_mask``) runs the same Philox rounds in torch integer ops and gives the same mask bit for
bit. It is not torch's mask (torch draws with curand / mt19937); its statistics are torch's: each
element kept with probability 1 - p (to 2**-24), independently.

Seeds. The functions draw a fresh 63-bit seed on every call that drops anything (offset 0), in
eager mode from a CPU torch.Generator (``generator``, default torch's default CPU generator:
``torch.manual_seed(s)`` makes runs repeat): a host op, one 0-d int64 CPU tensor the op reads on
the host when it launches, no GPU synchronisation. On a CUDA device under torch.compile or while a
CUDA graph is being captured, the seed is drawn on the device instead (``torch.randint`` of
torch's CUDA generator, also seeded by ``torch.manual_seed``) and the kernels read it from device
memory: a captured graph (``torch.cuda.graph``, ``mode="reduce-overhead"``) draws a new seed at
every replay. A ``generator`` object cannot be traced or captured (UnsupportedError there).

Saved for backward: by default only the seed (``mask_mode="regenerate"``: the backward runs Philox
again, no mask memory). ``mask_mode="bits"``: the forward also writes the mask packed 1 bit an
element (uint8, ceil(numel / 8) bytes, bit i % 8 of byte i // 8: ORT's BitmaskDropout) and the
backward reads it instead of regenerating. Both give identical gradients.

Dtypes: x and residual float32 / float16 / bfloat16 / float64, one dtype; bias any of those (its
gradient in its own dtype); y in x's dtype (no promotion, unlike torch's ``residual +
dropout(x + bias)`` with a float32 bias). Math in float32 (float64 for float64): each output is
rounded once (y = x * m exactly as torch's float32 x * scale, scale = float32(1 / (1 - p));
bias_dropout_add rounds residual + (x + bias) * m once (a fused multiply-add in the Triton kernel),
where torch rounds x + bias and the dropout first). dbias is summed in float32 (float64) per program
over a fixed block of rows, the programs' partial rows then summed in a fixed order by a second
kernel: deterministic, bit-identical run to run on one device (the number of programs follows the
device's SM count); no atomics.

Layouts: x, residual and dy with any strides, read in place: their axes are merged jointly
(adjacent axes that walk as one in every operand) and up to four merged axes are walked by index
arithmetic in the kernel (a contiguous operand is the fast path: one merged axis of stride 1).
A layout of more than four merged axes (five or more axes no two of which merge) is copied first
(the one copy, said here). Outputs are contiguous. Empty tensors launch nothing.

Triton plans (``DropoutHeuristics``): the forward and the backward without a bias gradient are
one-dimensional: a program owns ``block`` consecutive elements as a (block / 8, 2, 4) tile, one
``tl.randint4x`` per 4 elements (Philox is ~40 integer instructions a call: one call per element
would make the kernel compute-bound on the H100), bits packed per row of 8. Bytes: forward read x
(bias, residual), write y (+ bits); backward read dy (+ bits), write dx. The backward with a bias
gradient tiles rows: programs over (column blocks, row ranges), each summing its rows' dx into one
float32 partial row. None of these defaults is measured on the GPU yet.
"""

from __future__ import annotations

import functools
import math
import numbers
import struct
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import next_pow2
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics, heuristics_for
from ..registry import (ACCUMULATOR, FLOATS, accumulator_dtype, normalize_device, register, register_op, sm_count,
                        triton_available)
from ._common import checked_strides, float_bits, float_dtype, math_value, raise_mismatch

DROPOUT_OPS = ("dropout", "dropout_backward")
MASK_MODES = ("regenerate", "bits")
MAX_MERGED_AXES = 4
SEED_BOUND = 2 ** 63 - 1        # seeds are in [0, SEED_BOUND)
_M32 = 0xFFFFFFFF
# Philox-4x32 constants, as triton/language/random.py
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10
_U31_SCALE = 4.6566127342e-10   # tl.rand's uint -> [0, 1) factor (as a float32)


# ----------------------------------------------------------------------------------------------
# Heuristics
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DropoutHeuristics:
    """The dropout family's tunables (trainops.heuristics(...) overrides them).

    block: elements one program of the one-dimensional kernels owns (a power of two >= 8; smaller
        for tensors that need fewer). warps: their warps.
    rows_block_n: columns (x's last axis) a program of the dbias backward owns at most (a power of
        two); rows_tile: elements a step of it holds (rows a step = rows_tile // its columns);
        rows_programs_per_sm: its programs per SM (each writes one float32 partial row);
        rows_warps: its warps. reduce_block: columns one program of the partial-sum kernel owns.
    block and warps measured on the H100 (2026-11-24, benchmarks/NOTES.md "Transformer-block
    families", GPU time of dropout p=0.1 forward + backward on 8192x4096 bf16): 2048 elements with
    8 warps 91.6 us, against 105.8 at 4096 / 4 warps, 93.2 at 4096 / 8, 113.5 at 8192 / 8 (torch
    124.7). The dbias kernel's choices are not yet measured (as normalization's backward;
    ``trainops.bench.cases_dropout.dropout_sweep_cases`` times the alternatives).
    """

    block: int = 2048
    warps: int = 8
    rows_block_n: int = 1024
    rows_tile: int = 4096
    rows_programs_per_sm: int = 2
    rows_warps: int = 8
    reduce_block: int = 64


# ----------------------------------------------------------------------------------------------
# The mask: Philox-4x32-10 as Triton's tl.randint4x, and tl.rand's uniform map
# ----------------------------------------------------------------------------------------------

class DropoutRandom(NamedTuple):
    """The run-time arguments of one call: Philox key (an int; on CUDA also a one-element int64
    tensor on the plan's device, read by the kernels: ``draw_seed`` under torch.compile or a CUDA
    graph capture), stream offset (elements, a multiple of 4, >= 0) and the drop probability p in [0, 1]."""

    seed: int | Tensor
    offset: int
    p: float


def _f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


@functools.lru_cache(maxsize=512)
def keep_threshold(p: float) -> int:
    """The largest v in [-1, 2**31 - 1] that is dropped: an element is kept when its int31 draw v
    (r, or ~r when r is negative as an int32) is > this. It is the decision ``tl.rand``'s map makes:
    u = float32(v) * float32(4.6566127342e-10) >= float32(p) (u is monotone in v: a binary search
    over v). p = 0 gives -1 (every element kept), p = 1 gives 2**31 - 1 (none)."""
    target, scale = _f32(float(p)), _f32(_U31_SCALE)
    lo, hi = 0, 2 ** 31                  # the smallest kept v; 2**31: none
    while lo < hi:
        mid = (lo + hi) // 2
        if _f32(_f32(float(mid)) * scale) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


@functools.lru_cache(maxsize=512)
def _scale(p: float, acc: torch.dtype) -> tuple[float, int]:
    """(scale, its bits as an int) in the math dtype: 1 / (1 - p) rounded once; 0 for p = 1 (every
    element dropped). The kernels take the bits (an exact integer argument, bitcast back)."""
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    scale = math_value(scale, acc)
    return scale, float_bits(scale, acc)


_CPU_CHUNK = 1 << 14  # Philox counters a step of the CPU path: its int64 temporaries stay in cache (16K beat
                      # 64K and 1M by 3-4x on this project's 2-core CPU machine)


def philox4x32(seed: int, counters: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton's ``tl.randint4x(seed, counters)`` on the CPU: Philox-4x32-10 of the 64-bit counters
    (words 2 and 3 zero) under the 64-bit key ``seed``. counters: int64 >= 0. Returns four int64
    tensors of uint32 values. A uint32 x uint32 product is taken in int64, where it wraps modulo
    2**64 (torch's integer multiply): its high word is then masked to 32 bits (tests check every
    word against Triton's)."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1 = counters & _M32, counters >> 32
    c2 = torch.zeros_like(c0)
    c3 = c2
    for _ in range(_ROUNDS):
        pb, pa = c2 * _ROUND_B, c0 * _ROUND_A
        c0 = (pb >> 32).bitwise_and_(_M32).bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = (pa >> 32).bitwise_and_(_M32).bitwise_xor_(c3).bitwise_xor_(k1)
        c1, c3 = pb.bitwise_and_(_M32), pa.bitwise_and_(_M32)
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def keep_mask(numel: int, seed: int, offset: int, p: float) -> Tensor:
    """The mask of ``numel`` elements (bool, CPU, logical order) drawn at stream ``offset`` (a
    multiple of 4): the CPU path's, and the Triton kernels' bit for bit."""
    threshold = keep_threshold(p)
    groups = (numel + 3) // 4
    keep = torch.empty((groups, 4), dtype=torch.bool)
    for start in range(0, groups, _CPU_CHUNK):
        stop = min(start + _CPU_CHUNK, groups)
        counters = torch.arange(offset // 4 + start, offset // 4 + stop, dtype=torch.int64)
        for lane, r in enumerate(philox4x32(seed, counters)):
            # tl.rand's int31: r, or ~r (= 2**32 - 1 - r) when r is negative as an int32
            torch.gt(torch.minimum(r, _M32 - r), threshold, out=keep[start:stop, lane])
    return keep.view(-1)[:numel]


def pack_bits(keep: Tensor) -> Tensor:
    """A flat bool mask packed 8 elements a byte (bit i % 8 of byte i // 8), uint8."""
    n = keep.numel()
    padded = torch.zeros(((n + 7) // 8) * 8, dtype=torch.uint8, device=keep.device)
    padded[:n] = keep.reshape(-1)
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=keep.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(bits: Tensor, numel: int) -> Tensor:
    """The inverse of pack_bits: a flat bool mask of ``numel`` elements."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits[:, None] >> shifts) & 1).reshape(-1)[:numel].bool()


def draw_seed(generator: torch.Generator | None = None, device: torch.device | None = None,
              op: str = "dropout") -> Tensor:
    """A fresh seed in [0, 2**63 - 1): a 0-d int64 tensor. On the CPU, drawn from ``generator`` (a
    CPU torch.Generator; default torch's default CPU generator): advances it, no GPU sync.

    For a CUDA ``device`` under torch.compile or while a CUDA graph is being captured, drawn on that
    device instead by ``torch.randint`` of torch's CUDA generator (``torch.manual_seed`` seeds it
    too), which CUDA graphs support: every replay draws a new seed (a host seed would be baked into
    the graph and drop the same elements at every replay). A ``generator`` cannot be captured:
    UnsupportedError naming ``generator`` (``op``: the function the error names)."""
    if device is not None and device.type == "cuda" and (torch.compiler.is_compiling()
                                                         or torch.cuda.is_current_stream_capturing()):
        if generator is not None:
            raise argument_error(UnsupportedError, op, "generator", "cannot be used inside a CUDA graph capture (its "
                                 "host seed would be replayed); leave it None: seeds then come from torch's CUDA "
                                 "generator, drawn anew at every replay")
        return torch.randint(0, SEED_BOUND, (), dtype=torch.int64, device=device)
    if generator is None:
        return torch.randint(0, SEED_BOUND, (), dtype=torch.int64)
    return torch.randint(0, SEED_BOUND, (), dtype=torch.int64, generator=generator)


def check_seed(op: str, seed, device: torch.device) -> None:
    """A Philox key: an int in [0, 2**63 - 1), or on a CUDA ``device`` a one-element int64 tensor on
    it (its value is not read: no sync). Else InvalidProblemError naming ``seed``."""
    if isinstance(seed, Tensor):
        if device.type == "cuda" and seed.device == device and seed.dtype == torch.int64 and seed.numel() == 1:
            return
        raise argument_error(InvalidProblemError, op, "seed", f"is a {seed.dtype} tensor of {seed.numel()} elements "
                             f"on {seed.device}; a seed tensor is one int64 element on the plan's CUDA device")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_BOUND:
        raise argument_error(InvalidProblemError, op, "seed", f"must be an int in [0, 2**63 - 1), got {seed!r}")


def _check_random(op: str, random, device: torch.device) -> DropoutRandom:
    if not isinstance(random, tuple) or len(random) != 3:
        raise argument_error(InvalidProblemError, op, "random", f"must be a DropoutRandom(seed, offset, p), "
                             f"got {type(random).__name__}")
    seed, offset, p = random
    check_seed(op, seed, device)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset % 4 or offset >= 2 ** 62:
        raise argument_error(InvalidProblemError, op, "offset",
                             f"must be an int in [0, 2**62) and a multiple of 4, got {offset!r}")
    check_p(op, p)
    return DropoutRandom(seed, offset, float(p))


def check_p(op: str, p) -> float:
    """``p`` as a float: any real number (Python's, numpy's scalars) in [0, 1], or InvalidProblemError
    naming 'p' (a bool, a tensor or another non-number, NaN, outside [0, 1])."""
    if isinstance(p, (bool, Tensor)) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:
        raise argument_error(InvalidProblemError, op, "p", f"must be a probability in [0, 1], got {p!r}")
    return float(p)


# ----------------------------------------------------------------------------------------------
# Problem
# ----------------------------------------------------------------------------------------------

def merged_axes(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """(size, one stride per operand) of ``shape``'s axes in row-major order, size-1 axes dropped and
    neighbours merged where they walk as one axis in every operand ([] for one element)."""
    merged: list[tuple[int, tuple[int, ...]]] = []
    for d, size in enumerate(shape):
        if size == 1:
            continue
        st = tuple(s[d] for s in strides)
        if merged and all(outer == inner * size for outer, inner in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * size, st)
        else:
            merged.append((size, st))
    return merged


@dataclass(frozen=True)
class DropoutProblem:
    """One dropout problem over ``shape``.

    Forward ("dropout"): inputs (x, bias, residual, random) -> (y, bits). Backward
    ("dropout_backward"): inputs (dy, bits, random) -> (dx, dbias). ``random`` is a DropoutRandom.
    bias_dtype: forward, a bias is added (shape (shape[-1],), contiguous); backward, its gradient is
    summed in this dtype (None: no dbias). has_residual: forward only. mask_bits: forward writes the
    packed mask, backward reads it (instead of regenerating it from the seed). masked: False keeps
    every element (p = 0 or eval: bias_dropout_add's plain adds). strides: forward (x, residual),
    backward (dy,); None for an absent operand. Absent outputs are empty tensors.
    """

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    bias_dtype: torch.dtype | None
    has_residual: bool
    mask_bits: bool
    masked: bool
    strides: tuple[tuple[int, ...] | None, ...]
    heuristics: DropoutHeuristics
    index_dtype = None

    @property
    def backward(self) -> bool:
        return self.op == "dropout_backward"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_last(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def acc_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    @property
    def strided_names(self) -> tuple[str, ...]:
        return ("dy",) if self.backward else ("x", "residual")

    def check(self, tensors: Sequence, out) -> None:
        """Cheap checks of concrete arguments against the plan (shape, strides, dtype, device, random)."""
        names = ("dy", "bits", "random") if self.backward else ("x", "bias", "residual", "random")
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(names)} arguments ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        given = dict(zip(names, tensors))
        for name, strides in zip(self.strided_names, self.strides):
            if (given[name] is None) != (strides is None):
                raise argument_error(InvalidProblemError, self.op, name,
                                     "is missing; the plan has one" if strides is not None else
                                     "is given; the plan has none")
            if strides is not None:
                check_tensor(self.op, name, given[name], self.shape, self.dtype, self.device, strides)
        if self.backward:
            expected_bits = self.mask_bits
        else:
            expected_bits = False
            bias = given["bias"]
            if (bias is None) != (self.bias_dtype is None):
                raise argument_error(InvalidProblemError, self.op, "bias",
                                     "is missing; the plan has one" if bias is None else "is given; the plan has none")
            if bias is not None:
                check_tensor(self.op, "bias", bias, (self.n_last,), self.bias_dtype, self.device)
                if not bias.is_contiguous():
                    raise argument_error(InvalidProblemError, self.op, "bias", "must be contiguous")
        if expected_bits:
            bits = given["bits"]
            check_tensor(self.op, "bits", bits, ((self.numel + 7) // 8,), torch.uint8, self.device)
            if not bits.is_contiguous():
                raise argument_error(InvalidProblemError, self.op, "bits", "must be contiguous (the forward's)")
        elif self.backward and given["bits"] is not None:
            raise argument_error(InvalidProblemError, self.op, "bits", "is given; the plan regenerates the mask")
        _check_random(self.op, given["random"], self.device)
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    def new_output(self) -> tuple[Tensor, Tensor]:
        """Forward: (y, bits); backward: (dx, dbias). Absent outputs are empty."""
        y = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if self.backward:
            dbias = (torch.empty((self.n_last,), dtype=self.bias_dtype, device=self.device)
                     if self.bias_dtype is not None else torch.empty(0, dtype=self.dtype, device=self.device))
            return y, dbias
        bits = torch.empty(((self.numel + 7) // 8,) if self.mask_bits and self.masked else (0,), dtype=torch.uint8,
                           device=self.device)
        return y, bits


def _describe(op: str, shape, dtype, device="cuda", *, bias_dtype=None, has_residual=False, mask_bits=False,
              masked=True, strides=None, heuristics=None) -> DropoutProblem:
    """Validate a dropout descriptor.

    shape: x's (dy's) sizes, any rank (a bias needs rank >= 1). dtype: x's (residual's, dy's).
    bias_dtype: forward, the bias's dtype (None: no bias); backward, dbias's dtype (None: no dbias).
    has_residual: forward, a residual is added. mask_bits: the packed mask is written (forward) /
    read (backward). masked: False keeps every element (p = 0 or not training). strides: None
    (contiguous) or one entry per strided input (forward x, residual; backward dy), None for an
    absent one; any strides. heuristics: a DropoutHeuristics.
    """
    backward = op == "dropout_backward"
    first = "dy" if backward else "x"
    shape = checked_shape(op, "shape", shape)
    dtype = float_dtype(op, first, dtype)
    bias_dtype = float_dtype(op, "bias", bias_dtype, optional=True)
    if bias_dtype is not None and not shape:
        raise argument_error(InvalidProblemError, op, "bias", f"needs {first} of rank >= 1 (the bias runs along "
                             "its last axis)")
    if backward and has_residual:
        raise argument_error(InvalidProblemError, op, "has_residual", "is a forward argument (d residual = dy)")
    if backward and mask_bits and not masked:
        raise argument_error(InvalidProblemError, op, "mask_bits", "needs masked=True")
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    names = ("dy",) if backward else ("x", "residual")
    present = (True,) if backward else (True, bool(has_residual))
    strides = checked_strides(op, names, present, strides, (shape,) * len(names))
    if heuristics is None:
        heuristics = heuristics_for(DropoutHeuristics)
    elif not isinstance(heuristics, DropoutHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"must be a DropoutHeuristics, got {type(heuristics).__name__}")
    if heuristics.block < 8 or heuristics.block & (heuristics.block - 1) \
            or heuristics.rows_block_n < 1 or heuristics.rows_block_n & (heuristics.rows_block_n - 1):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"block must be a power of two >= 8 and rows_block_n a power of two, got {heuristics}")
    return DropoutProblem(op, shape, dtype, device, bias_dtype, bool(has_residual), bool(mask_bits), bool(masked),
                          strides, heuristics)


def _describer(op: str):
    def describe(shape, dtype, device="cuda", *, bias_dtype=None, has_residual=False, mask_bits=False, masked=True,
                 strides=None, heuristics=None) -> DropoutProblem:
        return _describe(op, shape, dtype, device, bias_dtype=bias_dtype, has_residual=has_residual,
                         mask_bits=mask_bits, masked=masked, strides=strides, heuristics=heuristics)
    describe.__doc__ = _describe.__doc__
    return describe


DropoutDescriptor, DropoutBackwardDescriptor = (register_op(op, _describer(op)) for op in DROPOUT_OPS)


# ----------------------------------------------------------------------------------------------
# CPU path: the same Philox mask (keep_mask) and formulas in torch's CPU ops
# ----------------------------------------------------------------------------------------------

def _multiplier(problem: DropoutProblem, keep: Tensor, p: float) -> Tensor:
    """m = keep ? scale : 0 in the math dtype, shaped as the problem."""
    acc = problem.acc_dtype
    scale = torch.tensor(_scale(p, acc)[0], dtype=acc)
    return torch.where(keep.view(problem.shape), scale, torch.zeros((), dtype=acc))


def _cpu_forward(problem: DropoutProblem, tensors, outputs) -> None:
    x, bias, residual, random = tensors
    y, bits = outputs
    acc = problem.acc_dtype
    h = x.to(acc)
    if bias is not None:
        h = h + bias.to(acc)
    if problem.masked:
        keep = keep_mask(problem.numel, random.seed, random.offset, random.p)
        h = h * _multiplier(problem, keep, random.p)
        if problem.mask_bits:
            bits.copy_(pack_bits(keep))
    if residual is not None:
        h = h + residual.to(acc)
    y.copy_(h)


def _cpu_backward(problem: DropoutProblem, tensors, outputs) -> None:
    dy, bits, random = tensors
    dx, dbias = outputs
    g = dy.to(problem.acc_dtype)
    if problem.masked:
        keep = unpack_bits(bits, problem.numel) if problem.mask_bits else \
            keep_mask(problem.numel, random.seed, random.offset, random.p)
        g = g * _multiplier(problem, keep, random.p)
    dx.copy_(g)
    if problem.bias_dtype is not None:
        dbias.copy_(g.reshape(-1, problem.n_last).sum(0))


def _prepare_cpu(problem: DropoutProblem) -> Launch:
    compute = _cpu_backward if problem.backward else _cpu_forward

    def run(tensors, outputs):
        if problem.numel:
            compute(problem, tensors, outputs)
        elif problem.backward and problem.bias_dtype is not None:
            outputs[1].zero_()

    return Launch(run, KernelChoice(f"{problem.op}_cpu", "cpu", ()), problem.acc_dtype)


for _op in DROPOUT_OPS:
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
             name=f"{_op}_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from ._common import column_sum, from_bits

    @triton.jit
    def _keep(seed, counter, lane, threshold):
        """The keep mask of the elements at ``lane`` (0..3) of Philox blocks ``counter`` (int64)."""
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
        v = r.to(tl.int32, bitcast=True)
        v = v ^ (v >> 31)  # tl.rand's int31: ~v for a negative v
        return v > threshold

    @triton.jit
    def _strided(i, D1, D2, D3, s0, s1, s2, s3, RANK: tl.constexpr):
        """Memory offset of logical (row-major) element ``i`` in an operand of RANK merged axes: the
        last RANK of (D0, D1, D2, D3) with strides (s0, s1, s2, s3)."""
        if RANK == 1:
            off = i * s3
        elif RANK == 2:
            off = (i % D3) * s3 + (i // D3) * s2
        elif RANK == 3:
            t = i // D3
            off = (i % D3) * s3 + (t % D2) * s2 + (t // D2) * s1
        else:
            t = i // D3
            u = t // D2
            off = (i % D3) * s3 + (t % D2) * s2 + (u % D1) * s1 + (u // D1) * s0
        return off

    @triton.jit(do_not_specialize=["seed", "counter_base", "threshold", "scale_bits"])
    def _dropout_fwd(
        X, BIAS, RES, Y, BITS,                # x, bias (contiguous), residual; outputs y (contiguous), mask bits
        n, n_last,                            # elements; bias length (x's last axis)
        D1, D2, D3,                           # merged axes' sizes (strided operands; axis 0's is implied)
        xs0, xs1, xs2, xs3,                   # x's strides of the merged axes
        rs0, rs1, rs2, rs3,                   # residual's
        SEED,                                 # the seed in device memory (read when SEED_ON_DEVICE)
        seed, counter_base, threshold, scale_bits,  # Philox key; offset // 4; keep when v > threshold; scale's bits
        BLOCK: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, STORE_BITS: tl.constexpr,
        MASKED: tl.constexpr, STRIDED: tl.constexpr, RANK: tl.constexpr, INT64: tl.constexpr,
        BIAS_WRAP_ONCE: tl.constexpr, ACC: tl.constexpr, SEED_ON_DEVICE: tl.constexpr,
    ):
        """BLOCK consecutive elements a program, as a (BLOCK / 8, 2, 4) tile: one Philox call per 4."""
        if SEED_ON_DEVICE:
            seed = tl.load(SEED)
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK if INT64 else pid * BLOCK
        rows = tl.arange(0, BLOCK // 8)
        a = rows[:, None, None]
        h = tl.arange(0, 2)[None, :, None]
        c = tl.arange(0, 4)[None, None, :]
        local = a * 8 + h * 4 + c
        mask = local < n - base
        if STRIDED:
            i = base + local
            x = tl.load(X + _strided(i, D1, D2, D3, xs0, xs1, xs2, xs3, RANK), mask=mask, other=0.0)
        else:
            x = tl.load(X + base + local, mask=mask, other=0.0)
        v = x.to(ACC)
        if HAS_B:
            col = base % n_last + local
            if BIAS_WRAP_ONCE:  # n_last >= BLOCK: a program crosses at most one row end
                col = tl.where(col >= n_last, col - n_last, col)
            else:
                col = col % n_last
            v += tl.load(BIAS + col, mask=mask, other=0.0).to(ACC)
        if HAS_R:
            if STRIDED:
                r = tl.load(RES + _strided(base + local, D1, D2, D3, rs0, rs1, rs2, rs3, RANK), mask=mask, other=0.0)
            else:
                r = tl.load(RES + base + local, mask=mask, other=0.0)
            r = r.to(ACC)
        if MASKED:
            counter = counter_base.to(tl.int64) + ((base + a * 8 + h * 4) >> 2).to(tl.int64)
            keep = _keep(seed, counter, c, threshold)
            m = tl.where(keep, from_bits(scale_bits, ACC), 0.0)
            # v * m + r as one fused multiply-add: the compiler contracted it in some specialisations
            # and not in others (strided and contiguous x then differed in the last bit on the GPU)
            if HAS_R:
                v = tl.fma(v, m, r)
            else:
                v = v * m
            if STORE_BITS:
                bit = tl.where(keep & mask, 1 << (h * 4 + c), 0)
                byte = tl.sum(tl.sum(bit, 2), 1)
                first_byte = base // 8
                tl.store(BITS + first_byte + rows, byte.to(tl.uint8), mask=rows < (n + 7) // 8 - first_byte)
        elif HAS_R:
            v += r
        tl.store(Y + base + local, v.to(Y.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["seed", "counter_base", "threshold", "scale_bits"])
    def _dropout_bwd(
        DY, DX, BITS,                         # dy; dx (contiguous); the forward's mask bits
        n, D1, D2, D3, s0, s1, s2, s3,        # elements; dy's merged axes (as _dropout_fwd)
        SEED, seed, counter_base, threshold, scale_bits,
        BLOCK: tl.constexpr, LOAD_BITS: tl.constexpr, MASKED: tl.constexpr, STRIDED: tl.constexpr,
        RANK: tl.constexpr, INT64: tl.constexpr, ACC: tl.constexpr, SEED_ON_DEVICE: tl.constexpr,
    ):
        """dx = dy * m, BLOCK consecutive elements a program (the forward's tiles)."""
        if SEED_ON_DEVICE:
            seed = tl.load(SEED)
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK if INT64 else pid * BLOCK
        rows = tl.arange(0, BLOCK // 8)
        a = rows[:, None, None]
        h = tl.arange(0, 2)[None, :, None]
        c = tl.arange(0, 4)[None, None, :]
        local = a * 8 + h * 4 + c
        mask = local < n - base
        if STRIDED:
            dy = tl.load(DY + _strided(base + local, D1, D2, D3, s0, s1, s2, s3, RANK), mask=mask, other=0.0)
        else:
            dy = tl.load(DY + base + local, mask=mask, other=0.0)
        g = dy.to(ACC)
        if MASKED:
            if LOAD_BITS:
                first_byte = base // 8
                byte = tl.load(BITS + first_byte + rows, mask=rows < (n + 7) // 8 - first_byte, other=0)
                keep = ((byte.to(tl.int32)[:, None, None] >> (h * 4 + c)) & 1) != 0
            else:
                counter = counter_base.to(tl.int64) + ((base + a * 8 + h * 4) >> 2).to(tl.int64)
                keep = _keep(seed, counter, c, threshold)
            g = g * tl.where(keep, from_bits(scale_bits, ACC), 0.0)
        tl.store(DX + base + local, g.to(DX.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["seed", "counter_base", "threshold", "scale_bits"])
    def _dropout_bwd_rows(
        DY, DX, BITS, PART,                   # dy; dx (contiguous); mask bits; float partial rows (programs, n_last)
        rows_total, n_last, rows_per_program,
        D1, D2, D3, s0, s1, s2, s3,           # dy's merged axes (as _dropout_fwd)
        SEED, seed, counter_base, threshold, scale_bits,
        BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, LANES: tl.constexpr, LOAD_BITS: tl.constexpr,
        MASKED: tl.constexpr, STRIDED: tl.constexpr, RANK: tl.constexpr, INT64: tl.constexpr, ACC: tl.constexpr,
        SEED_ON_DEVICE: tl.constexpr,
    ):
        """dx of a column block over ``rows_per_program`` rows, BLOCK_M rows a step, as a (BLOCK_M,
        BLOCK_G, LANES) tile; the columns' dx summed per (row slot, column) in registers and written as
        the program's partial row. LANES = 4 (n_last % 4 == 0): one Philox call per 4 elements; 1:
        each element runs its own block's call."""
        if SEED_ON_DEVICE:
            seed = tl.load(SEED)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)[None, :, None]
        c = tl.arange(0, LANES)[None, None, :]
        col_first = pid_n * (BLOCK_G * LANES) + g * LANES
        col = col_first + c
        first = pid_m * rows_per_program
        last = tl.minimum(first + rows_per_program, rows_total)
        acc = tl.zeros([BLOCK_M, BLOCK_G, LANES], ACC)
        for start in range(first, last, BLOCK_M):
            r = start + tl.arange(0, BLOCK_M)[:, None, None]
            mask = (r < last) & (col < n_last)
            row_base = r.to(tl.int64) * n_last if INT64 else r * n_last
            i = row_base + col
            if STRIDED:
                dy = tl.load(DY + _strided(i, D1, D2, D3, s0, s1, s2, s3, RANK), mask=mask, other=0.0)
            else:
                dy = tl.load(DY + i, mask=mask, other=0.0)
            v = dy.to(ACC)
            if MASKED:
                if LOAD_BITS:
                    byte = tl.load(BITS + (i >> 3), mask=mask, other=0)
                    keep = ((byte.to(tl.int32) >> (i & 7).to(tl.int32)) & 1) != 0
                else:
                    if LANES == 4:
                        counter = counter_base.to(tl.int64) + ((row_base + col_first) >> 2).to(tl.int64)
                        keep = _keep(seed, counter, c, threshold)
                    else:
                        counter = counter_base.to(tl.int64) + (i >> 2).to(tl.int64)
                        keep = _keep(seed, counter, i & 3, threshold)
                v = v * tl.where(keep, from_bits(scale_bits, ACC), 0.0)
            tl.store(DX + i, v.to(DX.dtype.element_ty), mask=mask)
            acc += tl.where(mask, v, 0.0)
        cols = pid_n * (BLOCK_G * LANES) + tl.arange(0, BLOCK_G)[:, None] * LANES + tl.arange(0, LANES)[None, :]
        tl.store(PART + pid_m.to(tl.int64) * n_last + cols, tl.sum(acc, 0), mask=cols < n_last)



@dataclass(frozen=True)
class _KernelLayout:
    """How the kernels walk the strided operands: STRIDED (any operand not contiguous), RANK merged
    axes, sizes (D1, D2, D3), per operand strides (s0..s3), INT64 (offsets past int32)."""

    strided: bool
    rank: int
    sizes: tuple[int, int, int]
    strides: tuple[tuple[int, int, int, int], ...]
    int64: bool


def kernel_layout(shape: Sequence[int], strides: Sequence[Sequence[int]], slack: int = 0) -> _KernelLayout | None:
    """The kernels' view of operands of ``shape`` with ``strides`` (None: more than four merged axes).
    ``slack``: how far past the last element a program's indices run (its block)."""
    merged = merged_axes(shape, strides) or [(1, (1,) * len(strides))]
    if len(merged) > MAX_MERGED_AXES:
        return None
    n = math.prod(shape)
    strided = len(merged) > 1 or any(s != 1 for s in merged[0][1])
    padded = [(1, (0,) * len(strides))] * (MAX_MERGED_AXES - len(merged)) + merged
    sizes = tuple(size for size, _ in padded[1:])
    per_operand = tuple(tuple(st[k] for _, st in padded) for k in range(len(strides)))
    reach = max([sum((size - 1) * st[k] for size, st in merged) for k in range(len(strides))] + [0])
    int64 = n + slack >= 2 ** 31 or reach >= 2 ** 31
    return _KernelLayout(strided, len(merged), sizes, per_operand, int64)


def _operand_strides(problem: DropoutProblem) -> list[tuple[int, ...]]:
    return [st for st in problem.strides if st is not None]


def seed_launchers(kernel, grid: tuple, meta: dict) -> dict:
    """Launchers of a dropout kernel by where its seed is: {False: a host int argument, True: a
    one-element int64 tensor on the device (``draw_seed`` under torch.compile or a capture)}."""
    return {on_device: launcher(kernel, grid, **meta, SEED_ON_DEVICE=on_device) for on_device in (False, True)}


def seed_args(seed: int | Tensor) -> tuple[bool, Tensor | None, int]:
    """(seed on the device?, the SEED pointer, the seed argument) of a call whose seed is a host int
    or a device tensor (the pointer is None for a host seed: the kernel does not read it)."""
    if isinstance(seed, Tensor):
        return True, seed, 0
    return False, None, seed


def _prepare_triton(problem: DropoutProblem) -> Launch:
    acc = problem.acc_dtype
    h = problem.heuristics
    n = problem.numel
    acc_tl = tl.float64 if acc == torch.float64 else tl.float32
    strides = _operand_strides(problem)
    rows_plan = problem.backward and problem.bias_dtype is not None
    block = max(8, min(h.block, next_pow2(n)))
    layout = kernel_layout(problem.shape, strides, slack=block)
    if layout is None:
        raise argument_error(UnsupportedError, problem.op, problem.strided_names[0],
                             f"has strides {problem.strides} of more than {MAX_MERGED_AXES} merged axes; "
                             "copy it first (the custom op does)")
    masked = problem.masked
    threshold_of, scale_of = keep_threshold, _scale

    if not problem.backward:
        x_st = layout.strides[0]
        r_st = layout.strides[1] if problem.has_residual else (0, 0, 0, 0)
        meta = dict(BLOCK=block, HAS_B=problem.bias_dtype is not None, HAS_R=problem.has_residual,
                    STORE_BITS=problem.mask_bits and masked, MASKED=masked, STRIDED=layout.strided, RANK=layout.rank,
                    INT64=layout.int64, BIAS_WRAP_ONCE=problem.n_last >= block, ACC=acc_tl, num_warps=h.warps)
        args = (n, problem.n_last, *layout.sizes, *x_st, *r_st)  # fixed by the plan: built once here
        launch = seed_launchers(_dropout_fwd, (triton.cdiv(n, block),), meta)

        def run(tensors, outputs):
            x, bias, residual, random = tensors
            y, bits = outputs
            if not n:
                return
            p = random.p
            on_device, seed_ptr, seed = seed_args(random.seed)
            launch[on_device](x, y if bias is None else bias, y if residual is None else residual, y,
                              bits if bits.numel() else y, *args, seed_ptr, seed, random.offset // 4,
                              threshold_of(p), scale_of(p, acc)[1])

        params = (("BLOCK", block), ("num_warps", h.warps), ("strided", layout.strided), ("axes", layout.rank))
        return Launch(run, KernelChoice("dropout_fwd", "triton", params), acc)

    if not rows_plan:
        meta = dict(BLOCK=block, LOAD_BITS=problem.mask_bits, MASKED=masked, STRIDED=layout.strided,
                    RANK=layout.rank, INT64=layout.int64, ACC=acc_tl, num_warps=h.warps)
        args = (n, *layout.sizes, *layout.strides[0])
        launch = seed_launchers(_dropout_bwd, (triton.cdiv(n, block),), meta)

        def run(tensors, outputs):
            dy, bits, random = tensors
            dx, _ = outputs
            if not n:
                return
            p = random.p
            on_device, seed_ptr, seed = seed_args(random.seed)
            launch[on_device](dy, dx, dx if bits is None else bits, *args, seed_ptr, seed, random.offset // 4,
                              threshold_of(p), scale_of(p, acc)[1])

        params = (("BLOCK", block), ("num_warps", h.warps), ("strided", layout.strided), ("axes", layout.rank))
        return Launch(run, KernelChoice("dropout_bwd", "triton", params), acc)

    # dbias: rows of n_last, programs over (column blocks, row ranges), partial rows summed in order
    n_last = problem.n_last
    rows_total = n // n_last if n_last else 0
    block_n = min(next_pow2(max(n_last, 1)), h.rows_block_n)
    lanes = 4 if n_last % 4 == 0 and block_n >= 4 else 1
    block_m = max(1, min(h.rows_tile // block_n, next_pow2(max(rows_total, 1))))
    col_blocks = triton.cdiv(max(n_last, 1), block_n)
    programs = max(1, min(triton.cdiv(max(rows_total, 1), block_m),
                          triton.cdiv(sm_count(problem.device) * h.rows_programs_per_sm, col_blocks)))
    rows_per_program = triton.cdiv(triton.cdiv(max(rows_total, 1), programs), block_m) * block_m
    programs = triton.cdiv(max(rows_total, 1), rows_per_program)
    layout = kernel_layout(problem.shape, strides, slack=block_m * n_last + block_n)
    meta = dict(BLOCK_M=block_m, BLOCK_G=block_n // lanes, LANES=lanes, LOAD_BITS=problem.mask_bits, MASKED=masked,
                STRIDED=layout.strided, RANK=layout.rank, INT64=layout.int64, ACC=acc_tl, num_warps=h.rows_warps)
    args = (rows_total, n_last, rows_per_program, *layout.sizes, *layout.strides[0])
    launch = seed_launchers(_dropout_bwd_rows, (col_blocks, programs), meta)
    sum_columns = column_sum(programs, n_last, h.reduce_block, 64)

    def run(tensors, outputs):
        dy, bits, random = tensors
        dx, dbias = outputs
        if not n:
            dbias.zero_()
            return
        p = random.p
        part = torch.empty((programs, n_last), dtype=acc, device=dx.device)
        on_device, seed_ptr, seed = seed_args(random.seed)
        launch[on_device](dy, dx, dx if bits is None else bits, part, *args, seed_ptr, seed, random.offset // 4,
                          threshold_of(p), scale_of(p, acc)[1])
        sum_columns(part, dbias)

    params = (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("lanes", lanes), ("programs", (col_blocks, programs)),
              ("num_warps", h.rows_warps), ("strided", layout.strided), ("axes", layout.rank))
    return Launch(run, KernelChoice("dropout_bwd_rows", "triton", params), acc,
                  workspace_bytes=programs * n_last * acc.itemsize)


if triton_available():
    for _op in DROPOUT_OPS:
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
                 name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.dropout / dropout_backward, with autograd
# ----------------------------------------------------------------------------------------------

def _readable(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """The tensors as they are, or contiguous copies when together they need more than four merged
    axes (five or more axes no two of which merge: the one layout copied)."""
    present = [t for t in tensors if t is not None]
    if len(merged_axes(present[0].shape, [t.stride() for t in present])) <= MAX_MERGED_AXES:
        return tensors
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _random(op: str, seed: Tensor | None, offset: int, p: float, device: torch.device) -> DropoutRandom:
    """The call's DropoutRandom: a CPU seed read on the host (no sync), a CUDA seed on ``device``
    passed on as the tensor (the kernel reads it)."""
    if seed is None:
        return DropoutRandom(0, offset, p)
    if seed.dtype != torch.int64 or seed.numel() != 1 or not (
            seed.device.type == "cpu" or (seed.device == device and device.type == "cuda")):
        raise argument_error(InvalidProblemError, op, "seed", f"must be a one-element int64 tensor on the CPU (a host "
                             f"value: reading it must not sync) or on the input's CUDA device, got {seed.dtype} "
                             f"of {seed.numel()} elements on {seed.device}")
    return DropoutRandom(int(seed) if seed.device.type == "cpu" else seed.reshape(()), offset, p)


def _dropout_impl(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], seed: Optional[Tensor], p: float,
                  offset: int, mask_bits: bool) -> tuple[Tensor, Tensor]:
    op = "dropout"
    if not (x.is_contiguous() and (residual is None or residual.is_contiguous())):
        x, residual = _readable(x, residual)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise_mismatch(op, "residual", residual, x.shape, x.dtype, x.device)
    if bias is not None:
        if bias.shape != x.shape[-1:] or bias.device != x.device:
            raise_mismatch(op, "bias", bias, x.shape[-1:], bias.dtype, x.device)
        bias = bias if bias.is_contiguous() else bias.contiguous()  # a strided bias vector: dense first
    masked = seed is not None
    descriptor = DropoutDescriptor(x.shape, x.dtype, x.device, None if bias is None else bias.dtype,
                                   residual is not None, mask_bits and masked, masked,
                                   (x.stride(), None if residual is None else residual.stride()),
                                   heuristics_for(DropoutHeuristics))
    return cached_plan(descriptor).run_unchecked((x, bias, residual, _random(op, seed, offset, p, x.device)))


def _dropout_fake(x, bias, residual, seed, p, offset, mask_bits):
    nbytes = (x.numel() + 7) // 8 if mask_bits and seed is not None else 0
    return x.new_empty(x.shape), x.new_empty((nbytes,), dtype=torch.uint8)


def _dropout_backward_impl(dy: Tensor, seed: Optional[Tensor], bits: Optional[Tensor], p: float, offset: int,
                           bias_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    op = "dropout_backward"
    if not dy.is_contiguous():
        dy, = _readable(dy)
    descriptor = DropoutBackwardDescriptor(dy.shape, dy.dtype, dy.device, bias_dtype, False, bits is not None,
                                           seed is not None or bits is not None, (dy.stride(),),
                                           heuristics_for(DropoutHeuristics))
    plan = cached_plan(descriptor)
    if bits is not None and (bits.shape != ((dy.numel() + 7) // 8,) or bits.dtype != torch.uint8
                             or bits.device != dy.device or not bits.is_contiguous()):
        plan.problem.check((dy, bits, DropoutRandom(0, offset, p)), None)
    return plan.run_unchecked((dy, bits, _random(op, seed, offset, p, dy.device)))


def _dropout_backward_fake(dy, seed, bits, p, offset, bias_dtype):
    dbias = dy.new_empty(dy.shape[-1:], dtype=bias_dtype) if bias_dtype is not None else dy.new_empty(0)
    return dy.new_empty(dy.shape), dbias


def _save(ctx, inputs, outputs) -> None:
    _, bits = outputs
    ctx.mark_non_differentiable(bits)
    ctx.set_materialize_grads(False)
    # the mask is regenerated from the seed, or read from the bits: nothing else is kept
    stored = inputs.mask_bits and inputs.seed is not None
    ctx.save_for_backward(None if stored else inputs.seed, bits if stored else None)
    ctx.p, ctx.offset = inputs.p, inputs.offset
    ctx.bias_dtype = None if inputs.bias is None else inputs.bias.dtype
    ctx.has_residual = inputs.residual is not None
    ctx.masked = inputs.seed is not None
    # the backward plans with the forward's heuristics (autograd may run it on another thread)
    ctx.heuristics = heuristics_for(DropoutHeuristics)


def _grad(ctx, dy, dbits) -> dict:
    if dy is None:
        return {}
    if torch.is_grad_enabled():  # create_graph=True: the backward op records no graph of its own
        raise UnsupportedError("trainops.dropout: double backward (create_graph=True) is not supported")
    seed, bits = ctx.saved_tensors
    bias_grad = ctx.bias_dtype is not None and ctx.needs_grad.bias
    grads = {"residual": dy} if ctx.has_residual and ctx.needs_grad.residual else {}
    if not (ctx.needs_grad.x or bias_grad):
        return grads
    if not ctx.masked and not bias_grad:
        grads["x"] = dy  # every element kept: dx is dy
        return grads
    with heuristics(ctx.heuristics):
        dx, dbias = dropout_backward_op(dy, seed, bits, ctx.p, ctx.offset, ctx.bias_dtype if bias_grad else None)
    grads["x"] = dx
    if bias_grad:
        grads["bias"] = dbias
    return grads


# The backward op has no autograd of its own (double backward raises UnsupportedError).
dropout_backward_op = custom_op("dropout_backward", _dropout_backward_impl, _dropout_backward_fake)
dropout_op = custom_op("dropout", _dropout_impl, _dropout_fake, backward=_grad, save=_save)


__all__ = ["DropoutHeuristics", "DropoutProblem", "DropoutRandom", "draw_seed", "keep_mask", "keep_threshold",
           "seed_args", "seed_launchers",
           "pack_bits", "philox4x32", "unpack_bits", "dropout_op", "dropout_backward_op", "MASK_MODES"]
