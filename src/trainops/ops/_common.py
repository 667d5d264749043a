"""Pieces shared by the op families (activations, dropout, normalization, attention softmax,
rotary, cross-entropy, gather): dtype and stride checks of the descriptors, deferred error flags
(a check made on the GPU, reported by a later call without a host sync), and two Triton helpers:
the fixed-order column sum that turns per-program partial rows into a bias / weight gradient, and
the row offset of a strided operand.

Not an op family: nothing here registers an op or a kernel in the registry.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import Sequence

import torch

from ..errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import next_pow2
from ..plan import check_tensor
from ..registry import FLOATS, triton_available

FLOAT_NAMES = "float32, float16, bfloat16, float64"
MAX_GRID_Y = 65535   # CUDA's limit on a grid's second (and third) axis

# Deferred checks of eager CUDA calls. A check's kernel (or a one-program report kernel reading an
# op's flag) writes the message's code into one int32 word of pinned host memory, which every CUDA
# device addresses (unified addressing: torch's pinned allocator uses cudaHostAlloc, or with
# PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True cudaHostRegisterDefault, both mapped
# and portable under UVA; Triton's launcher takes the device address from cuPointerGetAttribute and
# raises "cannot be accessed from Triton" rather than writing elsewhere). Only a failing check
# writes. A later call reads the word on the host: no copy, event, fill or synchronisation per
# call. One word: when several calls fail before one is raised, the last report's message is
# raised. Measured on the H200 host (benchmarks/NOTES.md, "The error word"; probe
# benchmarks/probe_deferred_checks.py): the former pinned copy and its event 28.4 us a call, the
# event query 2.7, the host read of the copy 3.5, against 0.12 for reading the word.
_WORD: list = []        # [the pinned int32 tensor of one element, its numpy view], made on first use
_MESSAGES: list[str] = ["", ""]   # code -> message; codes 0 (no error) and 1 unused
_CODES: dict[str, int] = {}
_MESSAGES_LIMIT = 4096  # distinct messages kept; further ones share _OVERFLOW_MESSAGE's code
_OVERFLOW_MESSAGE = ("trainops: an index or class index out of range, found by a check on the GPU that did not "
                     "wait for it (the call's own message was not kept: more than 4096 distinct messages)")
_NOTED_DEVICES: set[int] = set()   # CUDA devices with checks noted since the last check_pending
_CODES_LOCK = threading.Lock()      # a new code: read len(_MESSAGES), append, record (threads)


def error_word() -> torch.Tensor:
    """The process's error word: one int32 of pinned host memory when CUDA is available (a kernel on
    any device stores into it), else of plain CPU memory (the interpreter's kernels write it). 0 =
    no error; else the code of the message to raise (``message_code``)."""
    if not _WORD:
        word = torch.zeros(1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        _WORD.extend((word, word.numpy()))
    return _WORD[0]


def message_code(message: str) -> int:
    """The code a check kernel stores for ``message``: a run-time kernel argument, never 0, 1 or a
    multiple of 16, so that every code shares one compiled specialisation of the kernel. Past
    _MESSAGES_LIMIT distinct messages, new ones get _OVERFLOW_MESSAGE's code."""
    code = _CODES.get(message)
    if code is not None:
        return code
    with _CODES_LOCK:
        if len(_CODES) >= _MESSAGES_LIMIT:
            message = _OVERFLOW_MESSAGE
        code = _CODES.get(message)
        if code is not None:
            return code
        code = len(_MESSAGES)
        while code % 16 == 0:
            _MESSAGES.append("")
            code += 1
        _MESSAGES.append(message)
        _CODES[message] = code
        return code


def capturing(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device whose current stream is capturing a CUDA graph
    (``torch.cuda.graph``, or the recording of torch.compile's ``mode="reduce-overhead"``). Such a
    stream allows no host synchronisation, no event query and no copy from pageable memory. A
    driver query on CUDA (0.6 us of host time on the H100 machine, measured; more on slower hosts):
    asked once per call, passed down."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def assert_on_device(ok: torch.Tensor) -> None:
    """A device-side assert of the one-element ``ok`` (nonzero = fine), for checks inside a CUDA
    graph capture: every replay checks, and a failure is CUDA's "device-side assert triggered"
    (as torch's own index kernels report a bad index; the CUDA context is lost). Nothing waits."""
    torch._assert_async(ok.reshape(-1)[:1].reshape(()))


_REPORT_LAUNCH: list = []


def report_flag(flag: torch.Tensor, message: str) -> None:
    """Launch the one-program kernel that stores ``message``'s code into the error word when
    ``flag``'s first element is nonzero, on the current stream (after the kernel that wrote the flag).
    Any device the kernels run on (the interpreter's CPU tensors included); a CUDA one is noted for
    check_pending here, so that no writer of the word goes unwaited."""
    if not _REPORT_LAUNCH:
        _REPORT_LAUNCH.append(launcher(_report_nonzero, (1,)))
    if flag.is_cuda:
        _NOTED_DEVICES.add(flag.get_device())
    _REPORT_LAUNCH[0](flag, error_word(), message_code(message))


def note_flag(flag: torch.Tensor, message: str, in_capture: bool | None = None) -> None:
    """Have a CUDA call's error flag (``flag``'s first element, nonzero = the error) reported by a
    later check that never waits for the GPU: once the GPU has run the report (``report_flag``: one
    launch, no copy, event or fill), ``raise_flagged`` raises IndexOutOfRangeError with ``message``,
    or with the message of another failing check that wrote the one error word after it. Off CUDA,
    nothing (CPU callers check at once). While a CUDA graph is being captured the flag becomes a
    device-side assert instead (``assert_on_device``), checked at every replay. ``in_capture``: the
    caller's ``capturing(flag.device)``, if it asked already."""
    if flag.device.type != "cuda":
        return
    if in_capture if in_capture is not None else capturing(flag.device):
        assert_on_device(flag.reshape(-1)[:1] == 0)
        return
    report_flag(flag, message)


def note_device(device: torch.device) -> None:
    """Record that a check kernel on CUDA ``device`` may write the error word (for check_pending)."""
    _NOTED_DEVICES.add(device.index if device.index is not None else torch.cuda.current_device())


CHECK_MODES = "True, False or 'immediate'"


def check_mode(op: str, name: str, value) -> tuple[bool, bool]:
    """(check, immediate) of a ``check_index`` / ``check_target`` argument: True (the default: on
    the GPU, eager or inside a compiled graph, a check on the device that the host does not wait
    for, reported by a later trainops call; on the CPU before the launch), "immediate" (before the
    launch everywhere: on the GPU one reduction and one host synchronisation per call), False
    (none). Inside a CUDA graph capture both checks are device-side asserts. Anything else:
    InvalidProblemError naming ``name``."""
    if isinstance(value, bool):
        return value, False
    if isinstance(value, str) and value == "immediate":
        return True, True
    raise argument_error(InvalidProblemError, op, name, f"must be {CHECK_MODES}, got {value!r}")


def raise_flagged(in_capture: bool | None = None) -> None:
    """Raise IndexOutOfRangeError for an error a check on the GPU has reported by now (reads the
    error word: never waits, no CUDA call). The word is cleared first, so a report raises at most
    once (several reports before the read raise once, with the last written code's message).
    Nothing while a CUDA graph is being captured: the next call after the capture reports it.
    ``in_capture``: the caller's ``capturing`` of its device, if it asked already (else asked here
    when the word is set)."""
    if not _WORD or not _WORD[1][0]:
        return
    if in_capture if in_capture is not None else (torch.cuda.is_available()
                                                  and torch.cuda.is_current_stream_capturing()):
        return
    _raise_word()


def _raise_word() -> None:
    view = _WORD[1]
    code = int(view[0])
    if code:
        view[0] = 0
        raise IndexOutOfRangeError(_MESSAGES[code] if 1 < code < len(_MESSAGES) and _MESSAGES[code]
                                   else f"trainops: a check on the GPU reported an unknown error code {code}")


def check_pending() -> None:
    """Wait for every CUDA device a deferred check ran on since the last call, then raise
    IndexOutOfRangeError for an error one of them reported (``trainops.check_pending``: the end of
    an evaluation, before trusting its loss). One host synchronisation a device when checks are
    pending; nothing otherwise."""
    while _NOTED_DEVICES:
        torch.cuda.synchronize(_NOTED_DEVICES.pop())
    if _WORD:
        _raise_word()


def _report_pending_at_exit() -> None:
    """At interpreter exit: an error a GPU check found but no later call raised is printed, not lost."""
    import sys

    try:
        while True:
            try:
                check_pending()
                return
            except IndexOutOfRangeError as error:
                print(f"trainops: at exit, an error found on the GPU that no later call raised: {error}",
                      file=sys.stderr)
    except Exception:   # the CUDA context may already be gone at exit
        return


import atexit  # noqa: E402

atexit.register(_report_pending_at_exit)


def float_dtype(op: str, name: str, dtype, optional: bool = False) -> torch.dtype | None:
    """``dtype`` when it is one of FLOATS (None passes with ``optional``), else UnsupportedError naming ``name``."""
    if dtype is None and optional:
        return None
    if not isinstance(dtype, torch.dtype) or dtype not in FLOATS:
        raise argument_error(UnsupportedError, op, name, f"has dtype {dtype}; supported: {FLOAT_NAMES}")
    return dtype


def check_heuristic_fields(op: str, heuristics, powers_of_two: Sequence[str] = (), at_least_one: Sequence[str] = (),
                           optional: Sequence[str] = ()) -> None:
    """InvalidProblemError naming ``heuristics`` unless each field named in ``powers_of_two`` is a
    power of two and each in ``at_least_one`` an int >= 1 (a field in ``optional`` may also be None:
    the family's rule then decides). Block sizes become tile shapes, so a wrong one would fail
    inside a kernel or divide by zero; checked once, when a plan is made."""
    for name in (*powers_of_two, *at_least_one):
        value = getattr(heuristics, name)
        if value is None and name in optional:
            continue
        power = name in powers_of_two
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (power and value & (value - 1)):
            raise argument_error(InvalidProblemError, op, "heuristics",
                                 f"{name} must be {'a power of two' if power else 'an int >= 1'}, got {value!r}")


def first_step(table: Sequence[tuple[int, int]], size: int) -> int:
    """The value of the first (limit, value) step of a heuristics table whose limit is at least
    ``size`` (the families' warps and stages tables, keyed by row block or tile size)."""
    return next(value for limit, value in table if size <= limit)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, as torch's (a size-0 or size-1 dim counts as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def checked_strides(op: str, names: Sequence[str], present: Sequence[bool], strides, shapes) -> tuple:
    """A descriptor's ``strides`` (None: every present input contiguous) as one tuple of ints per
    input, None for an absent one; InvalidProblemError naming ``strides`` or the input when an
    entry is missing, given for an absent input, not ints, or not one non-negative stride per axis
    of that input's shape (``shapes``: one per name)."""
    if strides is None:
        strides = tuple(contiguous_strides(shape) if p else None for shape, p in zip(shapes, present))
    try:
        strides = tuple(None if s is None else tuple(int(v) for v in s) for s in strides)
    except TypeError:
        raise argument_error(InvalidProblemError, op, "strides", f"must be sequences of ints, got {strides!r}") from None
    if len(strides) != len(names):
        raise argument_error(InvalidProblemError, op, "strides", f"needs one entry per input ({', '.join(names)})")
    for name, st, p, shape in zip(names, strides, present, shapes):
        if (st is None) == p:
            raise argument_error(InvalidProblemError, op, "strides", f"of {name} is {'missing' if p else 'given'}")
        if st is not None and (len(st) != len(shape) or any(v < 0 for v in st)):
            raise argument_error(InvalidProblemError, op, name, f"has strides {st}; expected {len(shape)} "
                                 f"non-negative strides for shape {tuple(shape)}")
    return strides


def math_value(value: float, acc: torch.dtype) -> float:
    """``value`` as kernels of math dtype ``acc`` use it: rounded once to float32 unless ``acc`` is
    float64 (the CPU paths' match of ``float_bits`` / ``from_bits``)."""
    return value if acc == torch.float64 else struct.unpack("<f", struct.pack("<f", value))[0]


def float_bits(value: float, acc: torch.dtype) -> int:
    """``value`` in the math dtype ``acc`` (float32, rounded once, or float64) as the int of its bits.
    Kernels take float constants this way (Triton types a Python float argument float32; a tensor of
    constants kept by a plan would live in whatever memory pool was current when the plan was made,
    a CUDA graph's included) and turn them back with ``from_bits``. Such arguments belong in the
    kernel's ``do_not_specialize`` (their bits say nothing about alignment)."""
    if acc == torch.float64:
        return struct.unpack("<q", struct.pack("<d", value))[0]
    try:
        packed = struct.pack("<f", value)
    except OverflowError:   # beyond float32's range: inf, as a float32 tensor of it holds
        packed = struct.pack("<f", math.copysign(math.inf, value))
    return struct.unpack("<i", packed)[0]


def raise_mismatch(op: str, name: str, t, shape, dtype, device) -> None:
    """Raise the named error for a tensor the descriptor does not cover (the checks of Plan.run)."""
    check_tensor(op, name, t, shape, dtype, device)
    raise AssertionError(f"trainops.{op}: {name} passed check_tensor after failing the fast check")


# elements of a (BLOCK_P, BLOCK_C) tile of _sum_columns one program holds: 8192 float32 values over
# 4 warps are 64 registers a thread (chosen, not measured on the GPU)
_SUM_TILE = 8192

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _report_nonzero(flag_ptr, word_ptr, code):
        """*word = code if *flag != 0 (one program): an op's device flag reported into the error word."""
        tl.store(word_ptr, code, mask=tl.load(flag_ptr) != 0)

    @triton.jit
    def from_bits(bits, ACC: tl.constexpr):
        """A float constant passed as the int of its bits (``float_bits``), in the math dtype ACC."""
        # tl.cast, not bits.to: Inductor's analysis of an inlined launch may pass the int as a constexpr.
        # One return after an if / else: the compiler (not the interpreter) also generates the code after
        # an `if ACC == ...: return`, and two returns of different types fail to compile (float64).
        if ACC == tl.float64:
            value = tl.cast(tl.cast(bits, tl.int64), tl.float64, bitcast=True)
        else:
            value = tl.cast(tl.cast(bits, tl.int32), tl.float32, bitcast=True)
        return value

    @triton.jit
    def _row_offset(r, OUTER1, INNER, s_o0, s_o1, s_i):
        """Element offset (int64) of row ``r`` (numbered as the layout's reference: the contiguous
        output's rows) in a strided operand: row axes (outer0, outer1, inner), strides s_o0, s_o1, s_i."""
        i = r % INNER
        t = r // INNER
        return (t // OUTER1).to(tl.int64) * s_o0 + (t % OUTER1).to(tl.int64) * s_o1 + i.to(tl.int64) * s_i

    @triton.jit
    def _sum_columns(PART, OUT, parts, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """OUT[j] = sum over p of PART[p, j] (PART: contiguous (parts, C)), in a fixed order
        (deterministic): BLOCK_P-row slabs added elementwise in order, then the BLOCK_P lanes
        reduced by tl.sum. BLOCK_P sets the order; BLOCK_C (columns a program owns) does not."""
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        acc = tl.zeros([BLOCK_P, BLOCK_C], PART.dtype.element_ty)
        for start in range(0, parts, BLOCK_P):
            p = start + tl.arange(0, BLOCK_P)
            mask = (p < parts)[:, None] & (c < C)[None, :]
            acc += tl.load(PART + p[:, None].to(tl.int64) * C + c[None, :], mask=mask, other=0.0)
        tl.store(OUT + c, tl.sum(acc, 0).to(OUT.dtype.element_ty), mask=c < C)

    def column_sum(parts: int, cols: int, block_c: int, max_parts: int):
        """A launcher of ``_sum_columns`` for a (parts, cols) workspace, built at plan time:
        ``run(part, out)`` writes out[j] = sum over p of part[p, j] (cast to out's dtype).

        block_c: columns a program owns (capped by next_pow2(cols)); max_parts: workspace rows added
        per step (capped by next_pow2(parts) and the tile); the family's heuristic fixes both, and
        with them the summation order. Four warps."""
        block_c = min(block_c, next_pow2(max(cols, 1)))
        block_p = max(1, min(max_parts, next_pow2(parts), _SUM_TILE // block_c))
        return launcher(_sum_columns, (triton.cdiv(max(cols, 1), block_c),), trailing=(parts, cols),
                        BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4)


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (+)= a @ b with ``out`` in the accumulator dtype and a, b maybe half: on CUDA the matmul
    reads and writes ``out`` itself (torch.mm / addmm's out_dtype: no float32 copies of a or b);
    on the CPU a and b are converted first. The chunked LM-head losses' gradient matmuls."""
    if out.dtype != a.dtype and out.device.type == "cuda":
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
    else:
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)
