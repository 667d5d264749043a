"""Rotary position embedding (RoPE) of attention queries and keys, forward and backward: Triton
kernels, CPU path, registrations and custom ops.

Hugging Face's convention (``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``): q of shape
(batch, q_heads, seq, head_dim), k of shape (batch, k_heads, seq, head_dim) (GQA: the head counts
may differ), cos and sin of shape (batch, seq, R), (1, seq, R) or (seq, R) (any size-1 axis
broadcast; the same angle for every head), R = rotary_dim. On the first R features of each head

    out = x * cos + rotate(x) * sin                 (x = q or k; the features R.. pass unchanged)

    rotate_half (default, Llama / GPT-NeoX):  rotate(x) = cat(-x[R/2:R], x[:R/2]); HF's cos and sin
        hold each frequency twice: cos = cat(freqs, freqs).cos()
    interleaved (GPT-J):  rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i]; cos[2i] == cos[2i+1]

Nothing assumes the duplicated layout: every feature's own cos and sin are read, so any cos and sin
give exactly the formula above. With ``position_ids`` (int32 / int64, broadcastable to (batch, seq)),
cos and sin are tables of shape (max_position, R) and row (b, s) uses cos[position_ids[b, s]]; the
kernel reads the table row itself (nothing gathered into memory).

Backward (out is linear in x): dx = dy * cos + rotate^T(dy * sin), rotate^T the transpose (the
rotation by the negative angle): rotate_half^T(z) = cat(z[R/2:R], -z[:R/2]), interleaved
rotate^T(z)[2i] = z[2i+1], rotate^T(z)[2i+1] = -z[2i]; the passed-through features get dy. The same
kernel computes it (``rotary_embedding_backward``); its own gradient is the forward rotation, so
double backward works. cos and sin get no gradient (the functional raises UnsupportedError when
either requires one).

Dtypes: q and k float32 / float16 / bfloat16 / float64, one dtype; cos and sin any of those, one
dtype (float32 tables with bf16 q, as HF computes them, are read as they are). The math is in
float32 (float64 for float64 q): each output element is rounded once, from x*cos -/+ x'*sin in
float32. HF rounds cos and sin to q's dtype first and then rounds each product and the sum in q's
dtype (three more roundings): the two agree within a few units in the last place of q's dtype,
ours being the closer to the exact value. Deterministic (no reductions): bit-identical run to run.

Layouts: q, k, cos, sin, position_ids and the gradients of the outputs are read in place with any
strides (HF's q is a transposed view of (batch, seq, heads, head_dim): nothing is copied). The
outputs take the layout of their input as ``torch.empty_like`` does for a dense input (dims ordered
by the input's strides, written dense), so HF's (b, s, h, d)-ordered q gives a (b, s, h, d)-ordered
q_out, and dq the layout of q.

Position ids out of range ([0, max_position); negative ids are out of range too): by default
(``check_position_ids=False``: no host synchronisation on a training path) an out-of-range id reads
nothing, and its row's rotated features come out NaN (forward and backward), so the error shows in
the loss rather than training silently on a wrong angle. ``check_position_ids=True`` makes the
launcher read their min and max first and raise IndexOutOfRangeError before anything is written;
on the GPU that is one small reduction and one host synchronisation per forward (the backward
does not check again).

Triton plan (``_prepare_triton``): one launch handles q and k. Programs form a grid of
(batch * seq rows, head splits); a program loads its row's cos and sin once, then rotates its
share of the q heads and of the k heads, BLOCK_H heads a step with each head's features in
registers. Bytes moved: q, k, cos, sin read once, q_out, k_out written once. Rows fewer than
``programs_per_sm`` x SMs split their heads over several programs (each reloads the row's cos and
sin: small next to the heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..compiled import Decomposition
from ..errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import next_pow2
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics, heuristics_for
from ..registry import (FLOATS, INDEX_DTYPES, accumulator_dtype, normalize_device, register, register_op, sm_count,
                        triton_available)
from ._common import assert_on_device, capturing, contiguous_strides, first_step, float_dtype

ROTARY_OPS = ("rotary_embedding", "rotary_embedding_backward")
_MATH = "none (float32 math; float64 for float64)"


# ----------------------------------------------------------------------------------------------
# Heuristics
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class RotaryHeuristics:
    """The rotary family's tunables (trainops.heuristics(...) overrides them).

    tile: elements of one tensor a program holds per step: BLOCK_H heads (a power of two, at most
        ``tile`` // the head's padded feature count) of the row's heads at once.
    programs_per_sm: when batch * seq rows give fewer programs than SMs x this, a row's heads are
        split over several programs (0: never split).
    warps: (tile elements at most, warps) steps, the first that fits.
    Defaults measured on the H100 (2026-11-24, benchmarks/NOTES.md "Transformer-block families",
    GPU time of forward + backward at q 4x32x2048x128, k 4x8x2048x128 bf16): 2048-element tiles
    123.5 us against 134.9 at 4096 and 135.1 at 8192; programs_per_sm 2 and 8 gave the same time
    there (no split at 8192 rows), 4 kept. Compared by identity (a plan's cache key holds the
    object it was made with).
    """

    tile: int = 2048
    programs_per_sm: int = 4
    warps: tuple[tuple[int, int], ...] = ((1024, 2), (4096, 4), (1 << 62, 8))

    def num_warps(self, elements: int) -> int:
        return first_step(self.warps, elements)


# ----------------------------------------------------------------------------------------------
# Problem
# ----------------------------------------------------------------------------------------------

def dense_like(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Dense strides in ``strides``' order of dims, as ``torch.empty_like`` chooses them for an input
    that is not itself dense (torch's ``infer_dense_strides``): dims sorted innermost-first by
    increasing stride (equal strides: the larger size outer), a stride-0 (broadcast) dim keeping its
    place in the dims' own order. A dense input keeps its strides (up to its size-1 dims)."""
    n = len(shape)
    perm = list(range(n - 1, -1, -1))  # perm[0]: the innermost dim

    def should_swap(d0: int, d1: int) -> int:
        s0, s1 = strides[d0], strides[d1]
        if s0 == 0 or s1 == 0:
            return 0
        if s0 != s1:
            return -1 if s0 < s1 else 1
        return 1 if shape[d0] > shape[d1] else 0

    for i in range(1, n):  # insertion sort, stable where the comparison is ambiguous
        d1 = i
        for d0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[d0], perm[d1])
            if comparison > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif comparison < 0:
                break
    out = [0] * n
    step = 1
    for d in perm:
        out[d] = step
        step *= max(int(shape[d]), 1)
    return tuple(out)


def _is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """No two elements share memory and no gap: sizes > 1 ordered by stride walk memory densely."""
    step = 1
    for size, stride in sorted(((s, st) for s, st in zip(shape, strides) if s > 1), key=lambda p: p[1]):
        if stride != step:
            return False
        step *= size
    return True


@dataclass(frozen=True)
class RotaryProblem:
    """One rotary problem: inputs (x_q, x_k, cos, sin, position_ids) -> (out_q, out_k).

    Forward: x_q, x_k = q, k. Backward: x_q, x_k = the gradients of q_out and k_out, outputs dq, dk.
    q_shape (batch, q_heads, seq, head_dim), k_shape (batch, k_heads, seq, head_dim); cos_shape as
    given; ``cos_view`` / ``sin_view`` the (batch, seq, feature) strides the kernel reads cos and sin
    with (0 on broadcast axes; with position ids: (0, table row stride, feature stride)).
    position_shape / strides / index_dtype: None without position ids.
    """

    op: str
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    cos_shape: tuple[int, ...]
    dtype: torch.dtype
    cos_dtype: torch.dtype
    device: torch.device
    q_strides: tuple[int, ...]
    k_strides: tuple[int, ...]
    cos_strides: tuple[int, ...]
    sin_strides: tuple[int, ...]
    index_dtype: torch.dtype | None
    position_shape: tuple[int, ...] | None
    position_strides: tuple[int, ...] | None
    interleaved: bool
    rotary_dim: int
    check_position_ids: bool
    q_out_strides: tuple[int, ...]
    k_out_strides: tuple[int, ...]
    heuristics: RotaryHeuristics

    @property
    def backward(self) -> bool:
        return self.op == "rotary_embedding_backward"

    @property
    def compiled_size(self) -> int | None:
        """The size CompiledChoices key a forward on (the rotated features of a head); None for a
        backward, a forward with position ids or a partial rotary (never decomposed:
        trainops.compiled)."""
        if self.backward or self.position_shape is not None or self.rotary_dim != self.q_shape[-1]:
            return None
        return self.rotary_dim

    @property
    def names(self) -> tuple[str, str]:
        return ("dq_out", "dk_out") if self.backward else ("q", "k")

    @property
    def batch(self) -> int:
        return self.q_shape[0]

    @property
    def seq(self) -> int:
        return self.q_shape[2]

    @property
    def head_dim(self) -> int:
        return self.q_shape[3]

    @property
    def positions(self) -> int:
        """Rows of the cos / sin tables (position ids index them); 0 without position ids."""
        return self.cos_shape[0] if self.index_dtype is not None else 0

    @property
    def acc_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    def _view(self, strides) -> tuple[int, int, int]:
        if self.index_dtype is not None:
            return 0, strides[0], strides[1]
        shape = (1,) * (3 - len(self.cos_shape)) + self.cos_shape
        strides = (0,) * (3 - len(strides)) + tuple(strides)
        return tuple(st if size > 1 else 0 for size, st in zip(shape, strides))

    @property
    def cos_view(self) -> tuple[int, int, int]:
        return self._view(self.cos_strides)

    @property
    def sin_view(self) -> tuple[int, int, int]:
        return self._view(self.sin_strides)

    @property
    def position_view(self) -> tuple[int, int]:
        """(batch, seq) strides of the position ids (0 on broadcast axes)."""
        if self.position_shape is None:
            return 0, 0
        shape = (1,) * (2 - len(self.position_shape)) + self.position_shape
        strides = (0,) * (2 - len(self.position_strides)) + self.position_strides
        return tuple(st if size > 1 else 0 for size, st in zip(shape, strides))

    def check(self, tensors: Sequence[Tensor | None], out) -> None:
        """Cheap checks of concrete tensors against the plan (shape, strides, dtype, device)."""
        names = self.names + ("cos", "sin", "position_ids")
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(names)} tensors ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        xq, xk, cos, sin, pos = tensors
        check_tensor(self.op, names[0], xq, self.q_shape, self.dtype, self.device, self.q_strides)
        check_tensor(self.op, names[1], xk, self.k_shape, self.dtype, self.device, self.k_strides)
        check_tensor(self.op, "cos", cos, self.cos_shape, self.cos_dtype, self.device, self.cos_strides)
        check_tensor(self.op, "sin", sin, self.cos_shape, self.cos_dtype, self.device, self.sin_strides)
        if (pos is None) != (self.index_dtype is None):
            raise argument_error(InvalidProblemError, self.op, "position_ids",
                                 "is missing; the plan has them" if pos is None else "is given; the plan has none")
        if pos is not None:
            check_tensor(self.op, "position_ids", pos, self.position_shape, self.index_dtype, self.device,
                         self.position_strides)
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    def new_output(self) -> tuple[Tensor, Tensor]:
        return (torch.empty_strided(self.q_shape, self.q_out_strides, dtype=self.dtype, device=self.device),
                torch.empty_strided(self.k_shape, self.k_out_strides, dtype=self.dtype, device=self.device))


def _strides(op: str, name: str, strides, shape) -> tuple[int, ...]:
    if strides is None:
        return contiguous_strides(shape)
    try:
        strides = tuple(int(s) for s in strides)
    except TypeError:
        raise argument_error(InvalidProblemError, op, name, f"has strides {strides!r}; expected ints") from None
    if len(strides) != len(shape) or any(s < 0 for s in strides):
        raise argument_error(InvalidProblemError, op, name,
                             f"has strides {strides}; expected {len(shape)} non-negative strides for shape {shape}")
    return strides


def _describe(op: str, q_shape, k_shape, cos_shape, dtype, device="cuda", *, cos_dtype=None, q_strides=None,
              k_strides=None, cos_strides=None, sin_strides=None, position_dtype=None, position_shape=None,
              position_strides=None, interleaved=False, rotary_dim=None, check_position_ids=False,
              out_strides=None, heuristics=None) -> RotaryProblem:
    """Validate a rotary descriptor.

    q_shape (batch, q_heads, seq, head_dim) and k_shape (batch, k_heads, seq, head_dim): of q and k
    (backward: of the gradients of q_out and k_out); dtype: theirs. cos_shape: of cos and sin, each
    axis broadcastable to (batch, seq, rotary_dim): (batch | 1, seq | 1, R) or (seq | 1, R); with
    position ids, the tables' (max_position, R). cos_dtype: default dtype. *_strides: None
    (contiguous) or each tensor's strides. position_dtype: int32 / int64, None without position ids;
    position_shape broadcastable to (batch, seq): (batch | 1, seq | 1) or (seq | 1,).
    interleaved: GPT-J's pairs (2i, 2i+1) instead of rotate_half. rotary_dim: the rotated features
    (default cos_shape[-1], which it must equal): even, at most head_dim. check_position_ids: check
    the ids' range on every run (a host synchronisation on the GPU). out_strides: the outputs'
    strides (q's, k's; dense), default ``dense_like`` of the inputs. heuristics: a RotaryHeuristics.
    """
    first, second = ("dq_out", "dk_out") if op == "rotary_embedding_backward" else ("q", "k")
    q_shape = checked_shape(op, first, q_shape)
    k_shape = checked_shape(op, second, k_shape)
    for name, shape in ((first, q_shape), (second, k_shape)):
        if len(shape) != 4:
            raise argument_error(InvalidProblemError, op, name, f"has shape {shape}; expected 4 axes "
                                 "(batch, heads, seq, head_dim)")
    batch, _, seq, head_dim = q_shape
    if (k_shape[0], k_shape[2], k_shape[3]) != (batch, seq, head_dim):
        raise argument_error(InvalidProblemError, op, second,
                             f"has shape {k_shape}; its batch, seq and head_dim must be {first}'s "
                             f"({batch}, _, {seq}, {head_dim})")
    dtype = float_dtype(op, first, dtype)
    cos_dtype = float_dtype(op, "cos", dtype if cos_dtype is None else cos_dtype)
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    cos_shape = checked_shape(op, "cos", cos_shape)
    has_pos = position_dtype is not None
    if has_pos:
        if not isinstance(position_dtype, torch.dtype) or position_dtype.is_floating_point \
                or position_dtype.is_complex or position_dtype == torch.bool:
            raise argument_error(InvalidProblemError, op, "position_ids",
                                 f"has dtype {position_dtype}; position ids must be integers (int32 or int64)")
        if position_dtype not in INDEX_DTYPES:
            raise argument_error(UnsupportedError, op, "position_ids",
                                 f"has dtype {position_dtype}; supported: int32, int64")
        position_shape = checked_shape(op, "position_ids", position_shape)
        target = (batch, seq)[2 - len(position_shape):] if len(position_shape) <= 2 else None
        if target is None or not position_shape or any(p not in (1, t) for p, t in zip(position_shape, target)):
            raise argument_error(InvalidProblemError, op, "position_ids",
                                 f"has shape {position_shape}; expected one broadcastable to (batch, seq) = "
                                 f"({batch}, {seq})")
        if len(cos_shape) != 2:
            raise argument_error(InvalidProblemError, op, "cos",
                                 f"has shape {cos_shape}; with position_ids cos and sin are tables of shape "
                                 "(max_position, rotary_dim)")
        position_strides = _strides(op, "position_ids", position_strides, position_shape)
    else:
        if position_shape is not None or position_strides is not None:
            raise argument_error(InvalidProblemError, op, "position_ids", "has a shape or strides but no dtype")
        target = (batch, seq)[3 - len(cos_shape):] if len(cos_shape) in (2, 3) else None
        if target is None or any(c not in (1, t) for c, t in zip(cos_shape[:-1], target)):
            raise argument_error(InvalidProblemError, op, "cos",
                                 f"has shape {cos_shape}; expected one broadcastable to (batch, seq, rotary_dim) = "
                                 f"({batch}, {seq}, R): (batch or 1, seq or 1, R) or (seq or 1, R)")
        position_shape = None
    if rotary_dim is None:
        rotary_dim = cos_shape[-1]
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
        raise argument_error(InvalidProblemError, op, "rotary_dim", f"must be an int, got {rotary_dim!r}")
    if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
        raise argument_error(InvalidProblemError, op, "rotary_dim",
                             f"is {rotary_dim}; it must be even and within [0, head_dim = {head_dim}]")
    if cos_shape[-1] != rotary_dim:
        raise argument_error(InvalidProblemError, op, "cos", f"has {cos_shape[-1]} features (shape {cos_shape}); "
                             f"rotary_dim is {rotary_dim}")
    q_strides = _strides(op, first, q_strides, q_shape)
    k_strides = _strides(op, second, k_strides, k_shape)
    cos_strides = _strides(op, "cos", cos_strides, cos_shape)
    sin_strides = _strides(op, "sin", sin_strides, cos_shape)
    if out_strides is None:
        out_strides = (dense_like(q_shape, q_strides), dense_like(k_shape, k_strides))
    if len(out_strides) != 2:
        raise argument_error(InvalidProblemError, op, "out_strides", "needs two entries (q's, k's)")
    out_strides = tuple(_strides(op, "out_strides", st, shape) for st, shape in zip(out_strides, (q_shape, k_shape)))
    for st, shape in zip(out_strides, (q_shape, k_shape)):
        if not _is_dense(shape, st):
            raise argument_error(InvalidProblemError, op, "out_strides", f"{st} are not dense for shape {shape}")
    if heuristics is None:
        heuristics = heuristics_for(RotaryHeuristics)
    elif not isinstance(heuristics, RotaryHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"must be a RotaryHeuristics, got {type(heuristics).__name__}")
    return RotaryProblem(op, q_shape, k_shape, cos_shape, dtype, cos_dtype, device, q_strides, k_strides, cos_strides,
                         sin_strides, position_dtype, position_shape, position_strides, bool(interleaved), rotary_dim,
                         bool(check_position_ids), out_strides[0], out_strides[1], heuristics)


def _describer(op: str):
    def describe(q_shape, k_shape, cos_shape, dtype, device="cuda", *, cos_dtype=None, q_strides=None,
                 k_strides=None, cos_strides=None, sin_strides=None, position_dtype=None, position_shape=None,
                 position_strides=None, interleaved=False, rotary_dim=None, check_position_ids=False,
                 out_strides=None, heuristics=None) -> RotaryProblem:
        return _describe(op, q_shape, k_shape, cos_shape, dtype, device, cos_dtype=cos_dtype, q_strides=q_strides,
                         k_strides=k_strides, cos_strides=cos_strides, sin_strides=sin_strides,
                         position_dtype=position_dtype, position_shape=position_shape,
                         position_strides=position_strides, interleaved=interleaved, rotary_dim=rotary_dim,
                         check_position_ids=check_position_ids, out_strides=out_strides, heuristics=heuristics)
    describe.__doc__ = _describe.__doc__
    return describe


RotaryDescriptor, RotaryBackwardDescriptor = (register_op(op, _describer(op)) for op in ROTARY_OPS)


def check_position_range(op: str, position_ids: Tensor, positions: int) -> None:
    """Raise IndexOutOfRangeError unless every id lies in [0, positions): one min/max reduction, whose
    two scalars come back with one synchronisation on the GPU; while a CUDA graph is being captured,
    a device-side assert instead (``assert_on_device``)."""
    if position_ids.numel() == 0:
        return
    if capturing(position_ids.device):
        assert_on_device(((position_ids >= 0) & (position_ids < positions)).all())
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(position_ids)).tolist())
    if lo < 0 or hi >= positions:
        bad = lo if lo < 0 else hi
        raise IndexOutOfRangeError(
            f"trainops.{op}: argument 'position_ids' holds {bad}, out of range [0, {positions - 1}] for cos / sin "
            f"tables of {positions} positions (min {lo}, max {hi}); nothing was written")


def _empty(problem: RotaryProblem) -> bool:
    """Nothing to write: no rows, no heads or no features."""
    return problem.batch * problem.seq * problem.head_dim * (problem.q_shape[1] + problem.k_shape[1]) == 0


# ----------------------------------------------------------------------------------------------
# CPU path: torch's CPU ops in float32 (float64 for float64), the kernels' formulas
# ----------------------------------------------------------------------------------------------

def _cpu_table(problem: RotaryProblem, table: Tensor, pos: Tensor | None) -> Tensor:
    """cos or sin in the math dtype as (batch | 1, 1, seq | 1, R): broadcasts against (b, h, s, R)."""
    table = table.to(problem.acc_dtype)
    if pos is None:
        return (table if table.dim() == 3 else table[None])[:, None]
    ids = pos.to(torch.int64)
    ids = ids if ids.dim() == 2 else ids[None]
    valid = (ids >= 0) & (ids < problem.positions)
    rows = table.index_select(0, torch.where(valid, ids, 0).reshape(-1)).reshape(*ids.shape, -1) \
        if problem.positions else table.new_zeros((*ids.shape, problem.rotary_dim))
    return torch.where(valid[..., None], rows, float("nan"))[:, None]


def _cpu_rotate(problem: RotaryProblem, x: Tensor, out: Tensor, cos: Tensor, sin: Tensor) -> None:
    r = problem.rotary_dim
    xr = x[..., :r].to(problem.acc_dtype)
    if problem.interleaved:
        pick_a, pick_b = slice(0, r, 2), slice(1, r, 2)
    else:
        pick_a, pick_b = slice(0, r // 2), slice(r // 2, r)
    xa, xb, ca, cb = xr[..., pick_a], xr[..., pick_b], cos[..., pick_a], cos[..., pick_b]
    sa, sb = sin[..., pick_a], sin[..., pick_b]
    if problem.backward:  # the transpose: a's partner term uses b's sin and vice versa, negated
        sa, sb = -sb, -sa
    out[..., pick_a].copy_(xa * ca - xb * sa)
    out[..., pick_b].copy_(xb * cb + xa * sb)
    out[..., r:].copy_(x[..., r:])


def _prepare_cpu(problem: RotaryProblem) -> Launch:
    def run(tensors, outputs):
        xq, xk, cos, sin, pos = tensors
        if problem.check_position_ids and pos is not None:
            check_position_range(problem.op, pos, problem.positions)
        if _empty(problem):
            return
        cos, sin = _cpu_table(problem, cos, pos), _cpu_table(problem, sin, pos)
        for x, out in zip((xq, xk), outputs):
            _cpu_rotate(problem, x, out, cos, sin)

    return Launch(run, KernelChoice(f"{problem.op}_cpu", "cpu", ()), problem.acc_dtype)


for _op in ROTARY_OPS:
    register(_op, backend="cpu", dtypes=FLOATS, index_dtypes=INDEX_DTYPES, deterministic=True, accumulator=_MATH,
             name=f"{_op}_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate_heads(
        X, OUT,                                   # one tensor's input and output
        x_row, o_row, h_first, h_last,            # the row's element offsets; the heads [h_first, h_last)
        x_sh, x_sd, o_sh, o_sd,                   # head and feature strides
        c_a, c_b, s_a, s_b,                       # the row's cos and sin of the a / b features (ACC)
        ROT: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr,
    ):
        """out_a = x_a c_a - x_b s_a, out_b = x_b c_b + x_a s_b, BLOCK_H heads a step; features
        ROT.. copied. a / b: the first / second half (rotate_half) or the even / odd features."""
        for h0 in range(h_first, h_last, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            h_mask = heads < h_last
            xh = x_row + heads.to(tl.int64) * x_sh
            oh = o_row + heads.to(tl.int64) * o_sh
            if ROT > 0:
                if INTERLEAVED:
                    cols = tl.arange(0, BLOCK_R).to(tl.int64)  # BLOCK_R >= ROT features, pairs side by side
                    mask = h_mask[:, None] & (cols < ROT)[None, :]
                    x = tl.load(X + xh[:, None] + cols[None, :] * x_sd, mask=mask, other=0.0).to(ACC)
                    x_a, x_b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_R // 2, 2)))
                    y_a = x_a * c_a[None, :] - x_b * s_a[None, :]
                    y_b = x_b * c_b[None, :] + x_a * s_b[None, :]
                    y = tl.reshape(tl.join(y_a, y_b), (BLOCK_H, BLOCK_R))
                    tl.store(OUT + oh[:, None] + cols[None, :] * o_sd, y.to(OUT.dtype.element_ty), mask=mask)
                else:
                    cols = tl.arange(0, BLOCK_R).to(tl.int64)  # BLOCK_R >= ROT / 2 features of each half
                    mask = h_mask[:, None] & (cols < ROT // 2)[None, :]
                    pa = X + xh[:, None] + cols[None, :] * x_sd
                    x_a = tl.load(pa, mask=mask, other=0.0).to(ACC)
                    x_b = tl.load(pa + (ROT // 2) * x_sd, mask=mask, other=0.0).to(ACC)
                    qa = OUT + oh[:, None] + cols[None, :] * o_sd
                    tl.store(qa, (x_a * c_a[None, :] - x_b * s_a[None, :]).to(OUT.dtype.element_ty), mask=mask)
                    tl.store(qa + (ROT // 2) * o_sd, (x_b * c_b[None, :] + x_a * s_b[None, :])
                             .to(OUT.dtype.element_ty), mask=mask)
            if BLOCK_P > 0:
                cols = ROT + tl.arange(0, BLOCK_P).to(tl.int64)
                mask = h_mask[:, None] & (cols < HEAD_DIM)[None, :]
                v = tl.load(X + xh[:, None] + cols[None, :] * x_sd, mask=mask, other=0.0)
                tl.store(OUT + oh[:, None] + cols[None, :] * o_sd, v, mask=mask)

    @triton.jit
    def _load_angles(T, t_row, t_sr, valid, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
                     BLOCK_R: tl.constexpr, ACC: tl.constexpr):
        """The row's cos (or sin) of the a and b features as ACC; NaN for an out-of-range position id."""
        if INTERLEAVED:
            r = tl.arange(0, BLOCK_R).to(tl.int64)
            if HAS_POS:  # an out-of-range id reads nothing (the mask's bound folded into one compare)
                mask = r < tl.where(valid, ROT, 0)
            else:
                mask = r < ROT
            t = tl.load(T + t_row + r * t_sr, mask=mask, other=0.0).to(ACC)
            if HAS_POS:
                t = tl.where(valid, t, float("nan"))
            t_a, t_b = tl.split(tl.reshape(t, (BLOCK_R // 2, 2)))
        else:
            j = tl.arange(0, BLOCK_R).to(tl.int64)
            if HAS_POS:
                mask = j < tl.where(valid, ROT // 2, 0)
            else:
                mask = j < ROT // 2
            t_a = tl.load(T + t_row + j * t_sr, mask=mask, other=0.0).to(ACC)
            t_b = tl.load(T + t_row + (j + ROT // 2) * t_sr, mask=mask, other=0.0).to(ACC)
            if HAS_POS:
                t_a = tl.where(valid, t_a, float("nan"))
                t_b = tl.where(valid, t_b, float("nan"))
        return t_a, t_b

    @triton.jit
    def _rotary_rows(
        Q, K, QO, KO, COS, SIN, POS,              # inputs (q, k or their output gradients); outputs; tables; ids
        seq, positions,                           # sequence length; table rows (with position ids)
        q_heads, k_heads, q_per, k_per,           # heads; heads a program rotates (its split of the row)
        q_sb, q_ss, q_sh, q_sd, k_sb, k_ss, k_sh, k_sd,           # input strides (batch, seq, head, feature)
        qo_sb, qo_ss, qo_sh, qo_sd, ko_sb, ko_ss, ko_sh, ko_sd,   # output strides
        c_sb, c_ss, c_sr, s_sb, s_ss, s_sr,       # cos / sin (batch, seq or table row, feature); 0 broadcast
        p_sb, p_ss,                               # position ids (batch, seq); 0 broadcast
        ROT: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
        HAS_POS: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr, ACC: tl.constexpr,
    ):
        """Row (b, s) = program_id(0): its cos and sin loaded once, then its share (program_id(1))
        of the q heads and of the k heads rotated."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        b = (row // seq).to(tl.int64)
        s = (row % seq).to(tl.int64)
        if HAS_POS:
            pos = tl.load(POS + b * p_sb + s * p_ss).to(tl.int64)
            valid = (pos >= 0) & (pos < positions)
            pos = tl.where(valid, pos, 0)
            c_row = pos * c_ss
            s_row = pos * s_ss
        else:
            valid = False  # unused
            c_row = b * c_sb + s * c_ss
            s_row = b * s_sb + s * s_ss
        c_a, c_b = _load_angles(COS, c_row, c_sr, valid, ROT, INTERLEAVED, HAS_POS, BLOCK_R, ACC)
        s_a, s_b = _load_angles(SIN, s_row, s_sr, valid, ROT, INTERLEAVED, HAS_POS, BLOCK_R, ACC)
        if BACKWARD:  # the transpose of the rotation: a's partner term uses b's sin and vice versa, negated
            s_a, s_b = -s_b, -s_a
        h_first = split * q_per
        _rotate_heads(Q, QO, b * q_sb + s * q_ss, b * qo_sb + s * qo_ss, h_first,
                      tl.minimum(h_first + q_per, q_heads), q_sh, q_sd, qo_sh, qo_sd, c_a, c_b, s_a, s_b,
                      ROT, HEAD_DIM, INTERLEAVED, BLOCK_HQ, BLOCK_R, BLOCK_P, ACC)
        h_first = split * k_per
        _rotate_heads(K, KO, b * k_sb + s * k_ss, b * ko_sb + s * ko_ss, h_first,
                      tl.minimum(h_first + k_per, k_heads), k_sh, k_sd, ko_sh, ko_sd, c_a, c_b, s_a, s_b,
                      ROT, HEAD_DIM, INTERLEAVED, BLOCK_HK, BLOCK_R, BLOCK_P, ACC)


def _prev_pow2(v: int) -> int:
    return 1 << (max(1, int(v)).bit_length() - 1)


@dataclass(frozen=True)
class RotaryConfig:
    """A Triton plan: head splits per row, heads a program rotates (q, k) and per step (BLOCK_HQ,
    BLOCK_HK), feature blocks (rotated BLOCK_R, passed-through BLOCK_P), warps."""

    splits: int
    q_per: int
    k_per: int
    block_hq: int
    block_hk: int
    block_r: int
    block_p: int
    num_warps: int


def _choose_config(problem: RotaryProblem) -> RotaryConfig:
    """Split a row's heads over programs when rows are fewer than ``programs_per_sm`` x SMs; hold
    BLOCK_H heads a step, BLOCK_H x the padded features at most ``tile`` elements."""
    h = problem.heuristics
    hq, hk = problem.q_shape[1], problem.k_shape[1]
    rows = max(1, problem.batch * problem.seq)
    target = sm_count(problem.device) * h.programs_per_sm
    splits = max(1, min(-(-target // rows), max(hq, hk, 1))) if rows < target else 1
    q_per, k_per = max(1, -(-hq // splits)), max(1, -(-hk // splits))
    splits = max(1, -(-hq // q_per), -(-hk // k_per))  # no program left without heads
    r = problem.rotary_dim
    block_r = max(2, next_pow2(r)) if problem.interleaved else next_pow2(max(1, r // 2))
    passed = problem.head_dim - r
    block_p = next_pow2(passed) if passed else 0
    features = (block_r if problem.interleaved else 2 * block_r) + block_p
    tile_heads = _prev_pow2(max(1, h.tile // features))
    block_hq, block_hk = min(next_pow2(q_per), tile_heads), min(next_pow2(k_per), tile_heads)
    warps = h.num_warps(max(block_hq, block_hk) * features)
    return RotaryConfig(splits, q_per, k_per, block_hq, block_hk, block_r, block_p, warps)


def _prepare_triton(problem: RotaryProblem, config: RotaryConfig | None = None) -> Launch:
    config = config or _choose_config(problem)
    acc = problem.acc_dtype
    has_pos = problem.index_dtype is not None
    meta = dict(ROT=problem.rotary_dim, HEAD_DIM=problem.head_dim, INTERLEAVED=problem.interleaved,
                BACKWARD=problem.backward, HAS_POS=has_pos, BLOCK_HQ=config.block_hq, BLOCK_HK=config.block_hk,
                BLOCK_R=config.block_r, BLOCK_P=config.block_p, ACC=tl.float64 if acc == torch.float64 else tl.float32,
                num_warps=config.num_warps)

    def bshd(st):  # (batch, heads, seq, feature) strides -> the kernel's (batch, seq, head, feature)
        return st[0], st[2], st[1], st[3]

    # every scalar argument is fixed by the plan: built once here, not per call
    args = (problem.seq, problem.positions, problem.q_shape[1], problem.k_shape[1], config.q_per, config.k_per,
            *bshd(problem.q_strides), *bshd(problem.k_strides), *bshd(problem.q_out_strides),
            *bshd(problem.k_out_strides), *problem.cos_view, *problem.sin_view, *problem.position_view)
    launch = launcher(_rotary_rows, (problem.batch * problem.seq, config.splits), trailing=args, **meta)
    empty = _empty(problem)
    check = problem.check_position_ids and has_pos

    def run(tensors, outputs):
        xq, xk, cos, sin, pos = tensors
        if check:
            check_position_range(problem.op, pos, problem.positions)
        if empty:
            return
        launch(xq, xk, outputs[0], outputs[1], cos, sin, cos if pos is None else pos)

    params = (("grid", (problem.batch * problem.seq, config.splits)),
              ("heads_per_program", (config.q_per, config.k_per)),
              ("BLOCK_HQ", config.block_hq), ("BLOCK_HK", config.block_hk), ("BLOCK_R", config.block_r),
              ("BLOCK_P", config.block_p), ("num_warps", config.num_warps))
    return Launch(run, KernelChoice("rotary_rows", "triton", params), acc)


if triton_available():
    for _op in ROTARY_OPS:
        register(_op, backend="triton", dtypes=FLOATS, index_dtypes=INDEX_DTYPES, deterministic=True,
                 accumulator=_MATH, name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.rotary_embedding and its backward, with autograd
# ----------------------------------------------------------------------------------------------

def _same(op: str, names: tuple[str, str], q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
          position_ids: Tensor | None) -> None:
    """The per-call checks the descriptor does not hold: k's dtype, sin against cos, one device."""
    if k.dtype != q.dtype:
        raise argument_error(InvalidProblemError, op, names[1], f"has dtype {k.dtype} but {names[0]} has {q.dtype}")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise argument_error(InvalidProblemError, op, "sin", f"has shape {tuple(sin.shape)} and dtype {sin.dtype}; "
                             f"cos has {tuple(cos.shape)} and {cos.dtype}")
    for name, t in ((names[1], k), ("cos", cos), ("sin", sin), ("position_ids", position_ids)):
        if t is not None and t.device != q.device:
            raise argument_error(InvalidProblemError, op, name, f"is on {t.device} but {names[0]} is on {q.device}")


def _run(op: str, descriptor_type, xq: Tensor, xk: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None,
         interleaved: bool, rotary_dim: int | None, check: bool, out_strides) -> tuple[Tensor, Tensor]:
    _same(op, ("dq_out", "dk_out") if out_strides is not None else ("q", "k"), xq, xk, cos, sin, position_ids)
    if position_ids is None:
        pos_dtype = pos_shape = pos_strides = None
    else:
        pos_dtype, pos_shape, pos_strides = position_ids.dtype, position_ids.shape, position_ids.stride()
    descriptor = descriptor_type(xq.shape, xk.shape, cos.shape, xq.dtype, xq.device, cos_dtype=cos.dtype,
                                 q_strides=xq.stride(), k_strides=xk.stride(), cos_strides=cos.stride(),
                                 sin_strides=sin.stride(), position_dtype=pos_dtype, position_shape=pos_shape,
                                 position_strides=pos_strides, interleaved=interleaved, rotary_dim=rotary_dim,
                                 check_position_ids=check, out_strides=out_strides,
                                 heuristics=heuristics_for(RotaryHeuristics))
    return cached_plan(descriptor).run_unchecked((xq, xk, cos, sin, position_ids))


def _rotary_impl(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor],
                 interleaved: bool, rotary_dim: Optional[int], check_position_ids: bool) -> tuple[Tensor, Tensor]:
    return _run("rotary_embedding", RotaryDescriptor, q, k, cos, sin, position_ids, interleaved, rotary_dim,
                check_position_ids, None)


def _rotary_fake(q, k, cos, sin, position_ids, interleaved, rotary_dim, check_position_ids):
    return (q.new_empty_strided(q.shape, dense_like(q.shape, q.stride())),
            k.new_empty_strided(k.shape, dense_like(k.shape, k.stride())))


def _rotary_backward_impl(dq_out: Tensor, dk_out: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor],
                          interleaved: bool, rotary_dim: int, q_strides: Sequence[int],
                          k_strides: Sequence[int]) -> tuple[Tensor, Tensor]:
    return _run("rotary_embedding_backward", RotaryBackwardDescriptor, dq_out, dk_out, cos, sin, position_ids,
                interleaved, rotary_dim, False, (tuple(q_strides), tuple(k_strides)))


def _rotary_backward_fake(dq_out, dk_out, cos, sin, position_ids, interleaved, rotary_dim, q_strides, k_strides):
    return dq_out.new_empty_strided(dq_out.shape, q_strides), dk_out.new_empty_strided(dk_out.shape, k_strides)


def _decomposed(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor], interleaved: bool,
                rotary_dim: Optional[int], check_position_ids: bool) -> tuple[Tensor, Tensor]:
    """(q_out, k_out) in torch ops, for Inductor (trainops.compiled): the module docstring's formula
    in float32 (float64 for float64 q), each output rounded once to q's dtype. Without position
    ids only (their out-of-range rows are the kernel's NaN, not a gather's error)."""
    acc = accumulator_dtype(q.dtype)
    r = cos.shape[-1] if rotary_dim is None else rotary_dim
    c, s = cos[..., :r].to(acc), sin[..., :r].to(acc)
    c, s = (c, s) if c.dim() == 3 else (c[None], s[None])
    c, s = c[:, None], s[:, None]   # (batch or 1, 1, seq, R): every head
    half = r // 2

    def rotate(x: Tensor) -> Tensor:
        xr = x[..., :r].to(acc)
        if interleaved:
            turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
        else:
            turned = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        out = (xr * c + turned * s).to(q.dtype)
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)

    return rotate(q), rotate(k)


def _rotated_features(arguments) -> int | None:
    """The decomposition's size (the rotated features), or None where it does not apply: position
    ids, and partial rotary (its outputs would not take q's layout, as the op's do)."""
    if arguments.position_ids is not None or arguments.check_position_ids:
        return None
    rotated = arguments.cos.shape[-1] if arguments.rotary_dim is None else arguments.rotary_dim
    return rotated if rotated == arguments.q.shape[-1] else None


ROTARY_DECOMPOSITION = Decomposition(_decomposed, _rotated_features, lambda arguments: arguments.q.dtype)


def _no_angle_gradient(op: str, ctx) -> None:
    for name in ("cos", "sin"):
        if getattr(ctx.needs_grad, name):
            raise argument_error(UnsupportedError, op, name, "requires grad; rotary_embedding gives cos and sin "
                                 "no gradient")


def _zeros(shape, dtype: torch.dtype, like: Tensor) -> Tensor:
    """A gradient of zeros that takes no memory (stride 0 everywhere): the kernel reads it in place."""
    return like.new_zeros((), dtype=dtype).expand(shape)


def _save(ctx, inputs, outputs) -> None:
    ctx.save_for_backward(inputs.cos, inputs.sin, inputs.position_ids)
    ctx.interleaved = inputs.interleaved
    ctx.rotary_dim = inputs.cos.shape[-1] if inputs.rotary_dim is None else inputs.rotary_dim
    # dq and dk take the outputs' layout (q's and k's, as torch.empty_like)
    ctx.shapes, ctx.dtype = (inputs.q.shape, inputs.k.shape), inputs.q.dtype
    ctx.out_strides = (list(outputs[0].stride()), list(outputs[1].stride()))
    # the backward plans with the forward's heuristics: autograd may run it on another thread
    ctx.heuristics = heuristics_for(RotaryHeuristics)


def _grad(ctx, dq_out, dk_out) -> dict:
    _no_angle_gradient("rotary_embedding", ctx)
    cos, sin, position_ids = ctx.saved_tensors
    dq_out = _zeros(ctx.shapes[0], ctx.dtype, cos) if dq_out is None else dq_out
    dk_out = _zeros(ctx.shapes[1], ctx.dtype, cos) if dk_out is None else dk_out
    with heuristics(ctx.heuristics):
        dq, dk = rotary_backward_op(dq_out, dk_out, cos, sin, position_ids, ctx.interleaved, ctx.rotary_dim,
                                    *ctx.out_strides)
    return {"q": dq if ctx.needs_grad.q else None, "k": dk if ctx.needs_grad.k else None}


def _save_backward(ctx, inputs, outputs) -> None:
    ctx.save_for_backward(inputs.cos, inputs.sin, inputs.position_ids)
    ctx.interleaved, ctx.rotary_dim = inputs.interleaved, inputs.rotary_dim
    ctx.shapes, ctx.dtype = (inputs.dq_out.shape, inputs.dk_out.shape), inputs.dq_out.dtype
    ctx.heuristics = heuristics_for(RotaryHeuristics)


def _backward_grad(ctx, ggq, ggk) -> dict:
    """The backward is linear in the output gradients; its own gradient is the forward rotation."""
    _no_angle_gradient("rotary_embedding_backward", ctx)
    cos, sin, position_ids = ctx.saved_tensors
    ggq = _zeros(ctx.shapes[0], ctx.dtype, cos) if ggq is None else ggq
    ggk = _zeros(ctx.shapes[1], ctx.dtype, cos) if ggk is None else ggk
    with heuristics(ctx.heuristics):
        gq, gk = rotary_op(ggq, ggk, cos, sin, position_ids, ctx.interleaved, ctx.rotary_dim, False)
    return {"dq_out": gq if ctx.needs_grad.dq_out else None, "dk_out": gk if ctx.needs_grad.dk_out else None}



def _reads_no_host_values(call) -> bool:
    """Inlined under torch.compile unless check_position_ids, which reads the ids on the host."""
    return not call.check_position_ids


rotary_backward_op = custom_op("rotary_embedding_backward", _rotary_backward_impl, _rotary_backward_fake,
                               backward=_backward_grad, save=_save_backward, inline_triton=True)
rotary_op = custom_op("rotary_embedding", _rotary_impl, _rotary_fake, backward=_grad, save=_save,
                      inline_triton=_reads_no_host_values, decomposition=ROTARY_DECOMPOSITION)
