"""Query / key RMSNorm followed by the rotary position embedding, in one pass, forward and backward
(Qwen3, Gemma 3, OLMo 2): Triton kernels, CPU path, registrations and custom ops.

Those models normalise the projected queries and keys, then rotate them, back to back:

    n = x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps)       over each head's D features (Qwen3, Gemma 3)
                                                           or over the token's H * D features (OLMo 2)
    y = n * (w + weight_offset)                            w: (D,) per head, or (H * D,) across heads
    out = y * cos + rotate_half(y) * sin                   rotate_half(y) = cat(-y[D/2:], y[:D/2])

for x = q (weight q_weight) and x = k (k_weight). Gemma 3's norms multiply by (1 + w):
``weight_offset=1.0``. Every feature's own cos and sin are read (HF's duplicated layout, cos =
cat(f, f).cos(), is not assumed); the rotation covers the whole head (no partial rotary, no GPT-J
interleaving: ``trainops.rotary_embedding`` has those).

Backward (dout given): the rotation's transpose, then RMSNorm's backward, from the saved inputs
(nothing normalised is stored; rstd is recomputed from x, which is in registers anyway):

    dy_a = dout_a * cos_a + dout_b * sin_b,  dy_b = dout_b * cos_b - dout_a * sin_a   (a / b: halves)
    g = dy * (w + weight_offset)
    dx = rstd * (g - n * mean(g * n))                      (mean over the norm's width)
    dw = sum over tokens (and heads, per head) of dy * n

Shapes: q (batch, seq, q_heads, D) and k (batch, seq, k_heads, D), the projections' layout before
HF's ``.transpose(1, 2)`` (GQA: the head counts may differ); D even. cos and sin (batch, seq, D),
(1, seq, D) or (seq, D): HF's position embeddings (``apply_rotary_pos_emb``'s ``unsqueeze_dim=2``
for this layout). Any strides for q, k, cos, sin and the output gradients, read in place (views of a
fused qkv projection, transposes: nothing copied). Outputs (q_out, k_out): (batch, seq, heads, D),
contiguous, so that the caller's ``.transpose(1, 2)`` is a free view whose (batch, heads, seq, D)
layout SDPA's flash and memory-efficient kernels read without a copy (FlashAttention's own layout
is (batch, seq, heads, D)), and each token's heads are written as one dense run. dq and dk are
contiguous in q's and k's shape.

Dtypes: q and k float32 / float16 / bfloat16 / float64, one dtype; q_weight and k_weight any float
dtype, one dtype (their gradients in it); cos and sin any float dtype, one dtype. Outputs in
``out_dtype`` (default q's dtype; Qwen3's norm returns torch's promotion of weight and input,
pass ``out_dtype=torch.promote_types(q.dtype, weight.dtype)`` there). Math in float32 (float64 for
float64 q), each output element rounded once (HF rounds after the norm, after the weight, and three
times in the rotation: within a few units in the last place of the output dtype, ours the closer to
the exact value).

Deterministic, bit-identical run to run: the weight gradients are summed per program over a fixed
block of tokens into a float32 workspace (float64 for float64), then across programs in a fixed order (``_common``'s
column sum; no atomics). The number of programs depends on the device's SM count.

Triton plans: forward, one program per token (batch * seq programs): its cos and sin loaded once,
then its q heads and k heads, BLOCK_H heads a step (across heads: all of them at once). Bytes:
q, k, cos, sin read once, q_out and k_out written once. Backward, two kernels: "tiles" (the
default) and "tokens" (one token a step, its weight sums reduced across the heads each step,
latency-bound; ``QKNormRotaryHeuristics(backward_kernel="tokens")``). On the H200 (bf16, kernel time,
benchmarks/bench_qk_norm_rotary.py) "tiles" takes 0.117 / 0.198 / 0.167 / 0.111 ms at Qwen3-0.6B /
Qwen3-8B / OLMo 2 1B / Gemma 3 1B's shapes against "tokens"' 0.385 / 0.533 / 0.254 / 0.176 ms,
1.6-3.0x its floor of bytes at copy bandwidth. "tiles": 2 x P programs
(P <= SMs x ``tile_programs_per_sm``), the even ones walking q's tiles (BLOCK_T tokens x BLOCK_H
heads x the head), the odd ones k's over the same tokens, every load of a tile issued before its
stores, no reduction across warps inside the loop (the weight-gradient terms summed element by
element in registers, reduced once at the program's end into its partial row), then one column
sum per weight over the P partial rows. Bytes: dq_out, dk_out, q, k read once, dq, dk written
once, cos and sin read once from memory (the k program's read hits the L2 cache), the partial
rows written and read once (P x (weight sizes) floats).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..compiled import Decomposition
from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import next_pow2
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics, heuristics_for
from ..registry import (ACCUMULATOR, FLOATS, accumulator_dtype, normalize_device, register, register_op, sm_count,
                        triton_available)
from ._common import check_heuristic_fields, checked_strides, first_step, float_dtype

OPS = ("qk_norm_rotary", "qk_norm_rotary_backward")
BACKWARD_KERNELS = ("tiles", "tokens")
PARTIAL_SHARE = 32   # a tiles program's partial weight-gradient row: at most 1/32 of its tensor's bytes a program


# ----------------------------------------------------------------------------------------------
# Heuristics
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class QKNormRotaryHeuristics:
    """The family's tunables (trainops.heuristics(...) overrides them).

    tile: elements of one tensor a forward (and "tokens" backward) program holds per step: BLOCK_H
        heads (a power of two) of its token's heads at once, BLOCK_H x the head's padded features
        at most ``tile`` (per-head norms; across heads every head is held: at most ``across_max``
        elements, else UnsupportedError).
    warps / backward_warps: (tile elements at most, warps) steps, the first that fits (the
        backward's keyed by its kernel's tile: ``backward_tile`` for "tiles", ``tile`` for "tokens").
    backward_kernel: "tiles" (the default; 1.5-3.3x faster than "tokens" on the H200 at the four
        shapes of benchmarks/bench_qk_norm_rotary.py) or "tokens" (the first backward, about 5x its
        bytes' time at Qwen3-0.6B's shape). Under torch.compile the forward's choice reaches the
        backward as an argument of the backward op.
    "tiles" backward: each program walks tiles of one tensor of BLOCK_T tokens x BLOCK_H heads x
        the head, ``backward_tile`` elements at most (per head the heads first, then tokens; across
        heads every head, BLOCK_T >= 1), with no reduction across warps inside its loop (the
        weight-gradient terms accumulate element by element); ``tile_programs_per_sm`` x SMs
        programs a tensor at most, fewer where their partial rows would exceed 1/32 of the tensor's
        bytes (OLMo 2's wide weights; one a SM at least). The partial rows are summed by a column
        sum whose programs own ``tile_reduce_block`` columns and add row slabs as tall as its tile
        allows (528 partial rows: two serial steps; 64 x 64 blocks would take 9). ``tile_stages``:
        the tile loop's ``num_stages`` (1: plain loads, each warp's next tile loaded after its
        stores; 2-3: Triton's software pipelining, the next tiles' loads issued as cp.async into
        shared memory while this one computes: 36 KB a program at 3 and Qwen3-0.6B's tile, two
        barriers a step).
        Defaults: 4096 elements at 8 warps, 114-122 registers (two programs a SM), no spills, 4
        programs a SM a tensor, 1 stage. The H200 sweep (40 variants a shape, 2026-11-29,
        benchmarks/NOTES.md) found no variant better at all four shapes: 3 stages gain 4-27% at
        Qwen3 and Gemma 3 and lose 33% at OLMo 2.
    "tokens" backward: ``programs_per_sm`` programs per SM (each sums its tokens' weight gradients
        into one workspace row); reduce_block: columns one program of its partials' sum owns.
        straight_line: where one step holds a token's heads, no loop over head steps (the compiler
        may then issue k's loads beside q's, with more registers: 168 against 127 at 4 warps);
        False keeps the loop. step_head_sums: each step's dy * n summed over its heads at once (a
        reduction across the head axis per token: across warps, two barriers each); False keeps
        one sum per head slot in registers and adds the slots once, at the program's end.
    Untimed defaults: tile and forward warps are the rotary family's (measured on the H100 for its
    own per-token kernel). ``benchmarks/bench_qk_norm_rotary.py --sweep`` times the tiles
    backward's alternatives. Compared by identity (a plan's cache key holds the object it was made
    with).
    """

    tile: int = 2048
    warps: tuple[tuple[int, int], ...] = ((1024, 2), (4096, 4), (1 << 62, 8))
    backward_warps: tuple[tuple[int, int], ...] = ((1024, 4), (1 << 62, 8))
    programs_per_sm: int = 4
    straight_line: bool = True
    step_head_sums: bool = True
    reduce_block: int = 64
    across_max: int = 16384
    backward_kernel: str = "tiles"
    backward_tile: int = 4096
    tile_programs_per_sm: int = 4
    tile_reduce_block: int = 16
    tile_stages: int = 1


# ----------------------------------------------------------------------------------------------
# Problem
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QKNormRotaryProblem:
    """One problem. Forward inputs (q, k, q_weight, k_weight, cos, sin) -> (q_out, k_out); backward
    inputs (dq_out, dk_out, q, k, q_weight, k_weight, cos, sin) -> (dq, dk, dq_weight, dk_weight)
    (the weight gradients empty tensors without ``weight_grad``). ``strides``: of the strided inputs
    in the order of ``strided_names``."""

    op: str
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    cos_shape: tuple[int, ...]
    dtype: torch.dtype
    out_dtype: torch.dtype
    weight_dtype: torch.dtype
    cos_dtype: torch.dtype
    device: torch.device
    strides: tuple[tuple[int, ...], ...]
    eps: float
    weight_offset: float
    across_heads: bool
    weight_grad: bool
    heuristics: QKNormRotaryHeuristics
    index_dtype = None

    @property
    def backward(self) -> bool:
        return self.op == "qk_norm_rotary_backward"

    @property
    def compiled_size(self) -> int | None:
        """The size CompiledChoices key a forward on: the norm's width (the head dim; across heads
        q_heads x head dim); None for a backward, which runs under torch.compile whenever its
        forward op does (trainops.compiled)."""
        if self.backward:
            return None
        return self.q_shape[2] * self.q_shape[3] if self.across_heads else self.q_shape[3]

    @property
    def strided_names(self) -> tuple[str, ...]:
        return ("dq_out", "dk_out", "q", "k", "cos", "sin") if self.backward else ("q", "k", "cos", "sin")

    def stride_of(self, name: str) -> tuple[int, ...]:
        return self.strides[self.strided_names.index(name)]

    @property
    def batch(self) -> int:
        return self.q_shape[0]

    @property
    def seq(self) -> int:
        return self.q_shape[1]

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    @property
    def head_dim(self) -> int:
        return self.q_shape[3]

    @property
    def acc_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    @property
    def weight_shapes(self) -> tuple[tuple[int], tuple[int]]:
        d = self.head_dim
        if self.across_heads:
            return (self.q_shape[2] * d,), (self.k_shape[2] * d,)
        return (d,), (d,)

    def table_view(self, name: str) -> tuple[int, int, int]:
        """(batch, seq, feature) strides of cos or sin, 0 on broadcast axes."""
        shape = (1,) * (3 - len(self.cos_shape)) + self.cos_shape
        strides = (0,) * (3 - len(self.cos_shape)) + self.stride_of(name)
        return tuple(st if size > 1 else 0 for size, st in zip(shape, strides))

    def check(self, tensors: Sequence[Tensor], out) -> None:
        """Cheap checks of concrete tensors against the plan (shape, strides, dtype, device)."""
        names = (("dq_out", "dk_out") if self.backward else ()) + ("q", "k", "q_weight", "k_weight", "cos", "sin")
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(names)} tensors ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        given = dict(zip(names, tensors))
        shapes = {"dq_out": self.q_shape, "dk_out": self.k_shape, "q": self.q_shape, "k": self.k_shape,
                  "cos": self.cos_shape, "sin": self.cos_shape}
        dtypes = {"dq_out": self.out_dtype, "dk_out": self.out_dtype, "q": self.dtype, "k": self.dtype,
                  "cos": self.cos_dtype, "sin": self.cos_dtype}
        for name in self.strided_names:
            check_tensor(self.op, name, given[name], shapes[name], dtypes[name], self.device, self.stride_of(name))
        for name, shape in zip(("q_weight", "k_weight"), self.weight_shapes):
            check_tensor(self.op, name, given[name], shape, self.weight_dtype, self.device)
            if not given[name].is_contiguous():
                raise argument_error(InvalidProblemError, self.op, name, "must be contiguous")
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    def new_output(self) -> tuple[Tensor, ...]:
        def dense(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=self.device)
        if not self.backward:
            return dense(self.q_shape, self.out_dtype), dense(self.k_shape, self.out_dtype)
        wq, wk = self.weight_shapes if self.weight_grad else ((0,), (0,))
        wdtype = self.weight_dtype if self.weight_grad else self.dtype
        return (dense(self.q_shape, self.dtype), dense(self.k_shape, self.dtype), dense(wq, wdtype),
                dense(wk, wdtype))


def _describe(op: str, q_shape, k_shape, cos_shape, dtype, device="cuda", *, out_dtype=None, weight_dtype=None,
              cos_dtype=None, strides=None, eps=1e-6, weight_offset=0.0, across_heads=False, weight_grad=True,
              heuristics=None) -> QKNormRotaryProblem:
    """Validate a descriptor.

    q_shape (batch, seq, q_heads, D), k_shape (batch, seq, k_heads, D), D even and positive;
    dtype: q's and k's. out_dtype: the outputs' (forward) or the output gradients' (backward),
    default dtype. weight_dtype: q_weight's and k_weight's (default dtype); their shapes are (D,),
    or with ``across_heads`` (q_heads * D,) and (k_heads * D,). cos_shape: of cos and sin,
    (batch | 1, seq | 1, D) or (seq | 1, D); cos_dtype default dtype. strides: None (contiguous)
    or one entry per strided input (forward q, k, cos, sin; backward dq_out, dk_out, q, k, cos,
    sin). eps >= 0 finite; weight_offset finite (Gemma: 1.0). weight_grad: backward, whether the
    weight gradients are computed. heuristics: a QKNormRotaryHeuristics.
    """
    backward = op == "qk_norm_rotary_backward"
    q_shape = checked_shape(op, "q", q_shape)
    k_shape = checked_shape(op, "k", k_shape)
    for name, shape in (("q", q_shape), ("k", k_shape)):
        if len(shape) != 4:
            raise argument_error(InvalidProblemError, op, name,
                                 f"has shape {shape}; expected 4 axes (batch, seq, heads, head_dim)")
    batch, seq, q_heads, head_dim = q_shape
    if (k_shape[0], k_shape[1], k_shape[3]) != (batch, seq, head_dim):
        raise argument_error(InvalidProblemError, op, "k", f"has shape {k_shape}; its batch, seq and head_dim must "
                             f"be q's ({batch}, {seq}, _, {head_dim})")
    if head_dim <= 0 or head_dim % 2:
        raise argument_error(InvalidProblemError, op, "q", f"has head_dim {head_dim} (shape {q_shape}); rotate_half "
                             "needs an even, positive head_dim")
    dtype = float_dtype(op, "q", dtype)
    out_dtype = float_dtype(op, "dq_out" if backward else "out_dtype", dtype if out_dtype is None else out_dtype)
    weight_dtype = float_dtype(op, "q_weight", dtype if weight_dtype is None else weight_dtype)
    cos_dtype = float_dtype(op, "cos", dtype if cos_dtype is None else cos_dtype)
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    cos_shape = checked_shape(op, "cos", cos_shape)
    target = (batch, seq)[3 - len(cos_shape):] if len(cos_shape) in (2, 3) else None
    if target is None or cos_shape[-1] != head_dim or any(c not in (1, t) for c, t in zip(cos_shape[:-1], target)):
        raise argument_error(InvalidProblemError, op, "cos",
                             f"has shape {cos_shape}; expected one broadcastable to (batch, seq, head_dim) = "
                             f"({batch}, {seq}, {head_dim}): (batch or 1, seq or 1, {head_dim}) or (seq or 1, "
                             f"{head_dim})")
    names = ("dq_out", "dk_out", "q", "k", "cos", "sin") if backward else ("q", "k", "cos", "sin")
    shapes = ((q_shape, k_shape) if backward else ()) + (q_shape, k_shape, cos_shape, cos_shape)
    strides = checked_strides(op, names, (True,) * len(names), strides, shapes)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise argument_error(InvalidProblemError, op, "eps", f"must be a finite number >= 0, got {eps!r}")
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)) \
            or not math.isfinite(weight_offset):
        raise argument_error(InvalidProblemError, op, "weight_offset",
                             f"must be a finite number, got {weight_offset!r}")
    if heuristics is None:
        heuristics = heuristics_for(QKNormRotaryHeuristics)
    elif not isinstance(heuristics, QKNormRotaryHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"must be a QKNormRotaryHeuristics, got {type(heuristics).__name__}")
    check_heuristic_fields(op, heuristics, powers_of_two=("tile", "reduce_block", "backward_tile", "tile_reduce_block"),
                           at_least_one=("programs_per_sm", "across_max", "tile_programs_per_sm", "tile_stages"))
    if heuristics.backward_kernel not in BACKWARD_KERNELS:
        raise argument_error(InvalidProblemError, op, "heuristics", f"backward_kernel must be one of "
                             f"{BACKWARD_KERNELS}, got {heuristics.backward_kernel!r}")
    if across_heads:
        held = next_pow2(max(q_heads, k_shape[2], 1)) * 2 * next_pow2(head_dim // 2)
        if held > heuristics.across_max:
            raise argument_error(UnsupportedError, op, "across_heads",
                                 f"norms over {max(q_heads, k_shape[2])} heads of {head_dim} features "
                                 f"({held} padded elements) exceed what a program holds ({heuristics.across_max})")
    return QKNormRotaryProblem(op, q_shape, k_shape, cos_shape, dtype, out_dtype, weight_dtype, cos_dtype, device,
                               strides, float(eps), float(weight_offset), bool(across_heads), bool(weight_grad),
                               heuristics)


def _describer(op: str):
    def describe(q_shape, k_shape, cos_shape, dtype, device="cuda", *, out_dtype=None, weight_dtype=None,
                 cos_dtype=None, strides=None, eps=1e-6, weight_offset=0.0, across_heads=False, weight_grad=True,
                 heuristics=None) -> QKNormRotaryProblem:
        return _describe(op, q_shape, k_shape, cos_shape, dtype, device, out_dtype=out_dtype,
                         weight_dtype=weight_dtype, cos_dtype=cos_dtype, strides=strides, eps=eps,
                         weight_offset=weight_offset, across_heads=across_heads, weight_grad=weight_grad,
                         heuristics=heuristics)
    describe.__doc__ = _describe.__doc__
    return describe


QKNormRotaryDescriptor, QKNormRotaryBackwardDescriptor = (register_op(op, _describer(op)) for op in OPS)


# ----------------------------------------------------------------------------------------------
# CPU path: torch's CPU ops in float32 (float64 for float64), the kernels' formulas
# ----------------------------------------------------------------------------------------------

def _cpu_table(problem: QKNormRotaryProblem, t: Tensor) -> Tensor:
    """cos or sin in the math dtype as (batch | 1, seq | 1, 1, D): broadcasts against (b, s, h, D)."""
    t = t.to(problem.acc_dtype)
    return (t if t.dim() == 3 else t[None])[:, :, None, :]


def _cpu_normed(problem: QKNormRotaryProblem, x: Tensor, w: Tensor):
    """(n, rstd, w_eff) of x: n = x * rstd, rstd over the norm's width, w_eff broadcastable to x."""
    acc = problem.acc_dtype
    xf = x.to(acc)
    dims = (-2, -1) if problem.across_heads else (-1,)
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + problem.eps)
    w_eff = w.to(acc) + problem.weight_offset
    if problem.across_heads:
        w_eff = w_eff.reshape(x.shape[2], x.shape[3])
    return xf * rstd, rstd, w_eff


def _halves(t: Tensor) -> tuple[Tensor, Tensor]:
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def _cpu_forward(problem: QKNormRotaryProblem, tensors, outputs) -> None:
    q, k, wq, wk, cos, sin = tensors
    (c_a, c_b), (s_a, s_b) = _halves(_cpu_table(problem, cos)), _halves(_cpu_table(problem, sin))
    for x, w, out in ((q, wq, outputs[0]), (k, wk, outputs[1])):
        n, _, w_eff = _cpu_normed(problem, x, w)
        y_a, y_b = _halves(n * w_eff)
        out.copy_(torch.cat((y_a * c_a - y_b * s_a, y_b * c_b + y_a * s_b), -1))


def _cpu_backward(problem: QKNormRotaryProblem, tensors, outputs) -> None:
    dqo, dko, q, k, wq, wk, cos, sin = tensors
    dq, dk, dwq, dwk = outputs
    acc = problem.acc_dtype
    (c_a, c_b), (s_a, s_b) = _halves(_cpu_table(problem, cos)), _halves(_cpu_table(problem, sin))
    dims = (-2, -1) if problem.across_heads else (-1,)
    for do, x, w, dx, dw in ((dqo, q, wq, dq, dwq), (dko, k, wk, dk, dwk)):
        do_a, do_b = _halves(do.to(acc))
        dy = torch.cat((do_a * c_a + do_b * s_b, do_b * c_b - do_a * s_a), -1)
        n, rstd, w_eff = _cpu_normed(problem, x, w)
        g = dy * w_eff
        dx.copy_(rstd * (g - n * (g * n).mean(dims, keepdim=True)))
        if problem.weight_grad:
            dw_full = (dy * n).sum((0, 1))
            dw.copy_((dw_full if problem.across_heads else dw_full.sum(0)).reshape(dw.shape))


def _prepare_cpu(problem: QKNormRotaryProblem) -> Launch:
    def run(tensors, outputs):
        if problem.rows == 0:
            for t in outputs[2:]:   # backward: weight gradients of no token are zero
                t.zero_()
            return
        (_cpu_backward if problem.backward else _cpu_forward)(problem, tensors, outputs)

    return Launch(run, KernelChoice(f"{problem.op}_cpu", "cpu", ()), problem.acc_dtype)


for _op in OPS:
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
             name=f"{_op}_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from ._common import column_sum

    @triton.jit
    def _load_halves(T, row, sd, HALF: tl.constexpr, BLOCK_R: tl.constexpr, ACC: tl.constexpr):
        """The first and second halves of a token's cos (or sin) as ACC."""
        j = tl.arange(0, BLOCK_R).to(tl.int64)
        mask = j < HALF
        a = tl.load(T + row + j * sd, mask=mask, other=0.0).to(ACC)
        b = tl.load(T + row + (j + HALF) * sd, mask=mask, other=0.0).to(ACC)
        return a, b

    @triton.jit
    def _norm_scale(x_a, x_b, heads, eps, ACROSS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                    ACC: tl.constexpr):
        """rstd of each head held ([BLOCK_H]; across heads the token's one rstd, repeated)."""
        sq = tl.sum(x_a * x_a + x_b * x_b, 1)
        if ACROSS:
            mean = tl.sum(sq, 0) / (heads * 2 * HALF)
            rstd = tl.zeros([BLOCK_H], ACC) + (1.0 / tl.sqrt(mean + eps)).to(ACC)
        else:
            rstd = (1.0 / tl.sqrt(sq / (2 * HALF) + eps)).to(ACC)   # eps: fp64 under Inductor
        return rstd

    @triton.jit
    def _weight_halves(W, h, h_mask, w_offset, ACROSS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_R: tl.constexpr, ACC: tl.constexpr):
        """(w + w_offset) of the held heads' a and b halves as [BLOCK_H or 1, BLOCK_R] ACC tiles."""
        j = tl.arange(0, BLOCK_R)
        if ACROSS:
            mask = h_mask[:, None] & (j < HALF)[None, :]
            p = W + h[:, None].to(tl.int64) * (2 * HALF) + j[None, :]
        else:
            mask = (j < HALF)[None, :]
            p = W + j[None, :]
        w_a = (tl.load(p, mask=mask, other=0.0).to(ACC) + w_offset).to(ACC)
        w_b = (tl.load(p + HALF, mask=mask, other=0.0).to(ACC) + w_offset).to(ACC)
        return w_a, w_b

    @triton.jit
    def _forward_step(
        X, OUT, W,                                # one tensor's input, output (contiguous), weight
        x_row, o_row, h0, heads, x_sh, x_sd,      # the token's offsets; heads h0 .. h0 + BLOCK_H of heads
        c_a, c_b, s_a, s_b, eps, w_offset,        # the token's cos / sin halves (ACC)
        ACROSS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, ACC: tl.constexpr,
    ):
        """out = rotate(norm(x) * w_eff) of BLOCK_H of the token's heads."""
        j = tl.arange(0, BLOCK_R)
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < heads
        mask = h_mask[:, None] & (j < HALF)[None, :]
        pa = X + x_row + h[:, None].to(tl.int64) * x_sh + j[None, :].to(tl.int64) * x_sd
        x_a = tl.load(pa, mask=mask, other=0.0).to(ACC)
        x_b = tl.load(pa + HALF * x_sd, mask=mask, other=0.0).to(ACC)
        rstd = _norm_scale(x_a, x_b, heads, eps, ACROSS, HALF, BLOCK_H, ACC)
        w_a, w_b = _weight_halves(W, h, h_mask, w_offset, ACROSS, HALF, BLOCK_H, BLOCK_R, ACC)
        y_a = x_a * rstd[:, None] * w_a
        y_b = x_b * rstd[:, None] * w_b
        po = OUT + o_row + h[:, None].to(tl.int64) * (2 * HALF) + j[None, :]
        tl.store(po, (y_a * c_a[None, :] - y_b * s_a[None, :]).to(OUT.dtype.element_ty), mask=mask)
        tl.store(po + HALF, (y_b * c_b[None, :] + y_a * s_b[None, :]).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _forward_heads(
        X, OUT, W, x_row, o_row, heads, x_sh, x_sd, c_a, c_b, s_a, s_b, eps, w_offset,
        ACROSS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
        ONE_STEP: tl.constexpr, ACC: tl.constexpr,
    ):
        """The token's heads, BLOCK_H a step; ONE_STEP (BLOCK_H >= heads, always across heads):
        straight-line code, whose loads the compiler may issue beside the other tensor's."""
        if ONE_STEP:
            _forward_step(X, OUT, W, x_row, o_row, 0, heads, x_sh, x_sd, c_a, c_b, s_a, s_b, eps, w_offset,
                          ACROSS, HALF, BLOCK_H, BLOCK_R, ACC)
        else:
            for h0 in range(0, heads, BLOCK_H):
                _forward_step(X, OUT, W, x_row, o_row, h0, heads, x_sh, x_sd, c_a, c_b, s_a, s_b, eps, w_offset,
                              ACROSS, HALF, BLOCK_H, BLOCK_R, ACC)

    @triton.jit
    def _qk_norm_rotary_fwd(
        Q, K, WQ, WK, COS, SIN, QO, KO,           # inputs; weights; cos / sin; outputs (contiguous)
        seq, q_heads, k_heads,
        q_sb, q_ss, q_sh, q_sd, k_sb, k_ss, k_sh, k_sd,   # (batch, seq, head, feature) strides
        c_sb, c_ss, c_sd, s_sb, s_ss, s_sd,       # cos / sin (batch, seq, feature) strides; 0 broadcast
        eps, w_offset,
        ACROSS: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
        BLOCK_R: tl.constexpr, ONE_STEP_Q: tl.constexpr, ONE_STEP_K: tl.constexpr, ACC: tl.constexpr,
    ):
        """Token program_id(0): its cos and sin loaded once, then its q heads and its k heads."""
        row = tl.program_id(0).to(tl.int64)
        b = row // seq
        s = row % seq
        c_a, c_b = _load_halves(COS, b * c_sb + s * c_ss, c_sd, HALF, BLOCK_R, ACC)
        s_a, s_b = _load_halves(SIN, b * s_sb + s * s_ss, s_sd, HALF, BLOCK_R, ACC)
        _forward_heads(Q, QO, WQ, b * q_sb + s * q_ss, row * q_heads * (2 * HALF), q_heads, q_sh, q_sd,
                       c_a, c_b, s_a, s_b, eps, w_offset, ACROSS, HALF, BLOCK_HQ, BLOCK_R, ONE_STEP_Q, ACC)
        _forward_heads(K, KO, WK, b * k_sb + s * k_ss, row * k_heads * (2 * HALF), k_heads, k_sh, k_sd,
                       c_a, c_b, s_a, s_b, eps, w_offset, ACROSS, HALF, BLOCK_HK, BLOCK_R, ONE_STEP_K, ACC)

    @triton.jit
    def _backward_step(
        DO, X, W, DX,                             # output gradient, saved input, weight; dx (contiguous)
        do_row, x_row, dx_row, h0, heads, do_sh, do_sd, x_sh, x_sd,
        c_a, c_b, s_a, s_b, eps, w_offset,
        dw_a, dw_b,                               # the program's weight-gradient sums (a / b halves)
        ACROSS: tl.constexpr, DW: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr, STEP_SUMS: tl.constexpr, ACC: tl.constexpr,
    ):
        """dx of the token's heads h0 .. h0 + BLOCK_H; their dy * n added to dw_a / dw_b (per head
        with STEP_SUMS: summed over the step's heads first; else kept per head slot)."""
        j = tl.arange(0, BLOCK_R)
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < heads
        mask = h_mask[:, None] & (j < HALF)[None, :]
        h64 = h[:, None].to(tl.int64)
        pd = DO + do_row + h64 * do_sh + j[None, :].to(tl.int64) * do_sd
        do_a = tl.load(pd, mask=mask, other=0.0).to(ACC)
        do_b = tl.load(pd + HALF * do_sd, mask=mask, other=0.0).to(ACC)
        px = X + x_row + h64 * x_sh + j[None, :].to(tl.int64) * x_sd
        x_a = tl.load(px, mask=mask, other=0.0).to(ACC)
        x_b = tl.load(px + HALF * x_sd, mask=mask, other=0.0).to(ACC)
        # the rotation's transpose
        dy_a = do_a * c_a[None, :] + do_b * s_b[None, :]
        dy_b = do_b * c_b[None, :] - do_a * s_a[None, :]
        rstd = tl.where(h_mask, _norm_scale(x_a, x_b, heads, eps, ACROSS, HALF, BLOCK_H, ACC), 0.0)   # eps 0: no NaN
        w_a, w_b = _weight_halves(W, h, h_mask, w_offset, ACROSS, HALF, BLOCK_H, BLOCK_R, ACC)
        n_a = x_a * rstd[:, None]
        n_b = x_b * rstd[:, None]
        g_a = dy_a * w_a
        g_b = dy_b * w_b
        gn = tl.sum(g_a * n_a + g_b * n_b, 1)
        if ACROSS:
            c = tl.zeros([BLOCK_H], ACC) + tl.sum(gn, 0) / (heads * 2 * HALF)
        else:
            c = gn / (2 * HALF)
        pdx = DX + dx_row + h64 * (2 * HALF) + j[None, :]
        tl.store(pdx, (rstd[:, None] * (g_a - n_a * c[:, None])).to(DX.dtype.element_ty), mask=mask)
        tl.store(pdx + HALF, (rstd[:, None] * (g_b - n_b * c[:, None])).to(DX.dtype.element_ty), mask=mask)
        if DW:
            if ACROSS or not STEP_SUMS:
                dw_a += dy_a * n_a
                dw_b += dy_b * n_b
            else:
                dw_a += tl.sum(dy_a * n_a, 0)
                dw_b += tl.sum(dy_b * n_b, 0)
        return dw_a, dw_b

    @triton.jit
    def _backward_heads(
        DO, X, W, DX, do_row, x_row, dx_row, heads, do_sh, do_sd, x_sh, x_sd,
        c_a, c_b, s_a, s_b, eps, w_offset, dw_a, dw_b,
        ACROSS: tl.constexpr, DW: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr, ONE_STEP: tl.constexpr, STEP_SUMS: tl.constexpr, ACC: tl.constexpr,
    ):
        """The token's heads, BLOCK_H a step; ONE_STEP (BLOCK_H >= heads, always across heads):
        straight-line code, no loop, so that the loop over tokens around it can be pipelined."""
        if ONE_STEP:
            dw_a, dw_b = _backward_step(DO, X, W, DX, do_row, x_row, dx_row, 0, heads, do_sh, do_sd, x_sh, x_sd,
                                        c_a, c_b, s_a, s_b, eps, w_offset, dw_a, dw_b,
                                        ACROSS, DW, HALF, BLOCK_H, BLOCK_R, STEP_SUMS, ACC)
        else:
            for h0 in range(0, heads, BLOCK_H):
                dw_a, dw_b = _backward_step(DO, X, W, DX, do_row, x_row, dx_row, h0, heads, do_sh, do_sd, x_sh,
                                            x_sd, c_a, c_b, s_a, s_b, eps, w_offset, dw_a, dw_b,
                                            ACROSS, DW, HALF, BLOCK_H, BLOCK_R, STEP_SUMS, ACC)
        return dw_a, dw_b

    @triton.jit
    def _store_partial(PART, pid, dw_a, dw_b, heads, ACROSS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, STEP_SUMS: tl.constexpr):
        """The program's weight-gradient sums as its row of the (programs, weight size) workspace
        (per head without STEP_SUMS: its head slots summed here)."""
        j = tl.arange(0, BLOCK_R)
        if not ACROSS and not STEP_SUMS:
            dw_a = tl.sum(dw_a, 0)
            dw_b = tl.sum(dw_b, 0)
        if ACROSS:
            h = tl.arange(0, BLOCK_H)
            mask = (h < heads)[:, None] & (j < HALF)[None, :]
            p = PART + pid.to(tl.int64) * heads * (2 * HALF) + h[:, None] * (2 * HALF) + j[None, :]
        else:
            mask = j < HALF
            p = PART + pid.to(tl.int64) * (2 * HALF) + j
        tl.store(p, dw_a, mask=mask)
        tl.store(p + HALF, dw_b, mask=mask)

    @triton.jit
    def _qk_norm_rotary_bwd(
        DQO, DKO, Q, K, WQ, WK, COS, SIN, DQ, DK, DWQ_PART, DWK_PART,   # DW*_PART: (programs, weight size)
        rows, seq, q_heads, k_heads, rows_per_program,
        dqo_sb, dqo_ss, dqo_sh, dqo_sd, dko_sb, dko_ss, dko_sh, dko_sd,
        q_sb, q_ss, q_sh, q_sd, k_sb, k_ss, k_sh, k_sd,
        c_sb, c_ss, c_sd, s_sb, s_ss, s_sd,
        eps, w_offset,
        ACROSS: tl.constexpr, DW: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr, ONE_STEP_Q: tl.constexpr, ONE_STEP_K: tl.constexpr,
        STEP_SUMS: tl.constexpr, ACC: tl.constexpr,
    ):
        """``rows_per_program`` tokens a program, one after another: dq, dk written; the weight
        gradients summed in registers and written once as the program's partial rows."""
        pid = tl.program_id(0)
        first = pid * rows_per_program
        last = tl.minimum(first + rows_per_program, rows)
        if ACROSS or not STEP_SUMS:
            dwq_a = tl.zeros([BLOCK_HQ, BLOCK_R], ACC)
            dwq_b = tl.zeros([BLOCK_HQ, BLOCK_R], ACC)
            dwk_a = tl.zeros([BLOCK_HK, BLOCK_R], ACC)
            dwk_b = tl.zeros([BLOCK_HK, BLOCK_R], ACC)
        else:
            dwq_a = tl.zeros([BLOCK_R], ACC)
            dwq_b = tl.zeros([BLOCK_R], ACC)
            dwk_a = tl.zeros([BLOCK_R], ACC)
            dwk_b = tl.zeros([BLOCK_R], ACC)
        first64 = first.to(tl.int64)
        for i in range(0, last - first):
            row = first64 + i
            b = row // seq
            s = row % seq
            c_a, c_b = _load_halves(COS, b * c_sb + s * c_ss, c_sd, HALF, BLOCK_R, ACC)
            s_a, s_b = _load_halves(SIN, b * s_sb + s * s_ss, s_sd, HALF, BLOCK_R, ACC)
            dwq_a, dwq_b = _backward_heads(DQO, Q, WQ, DQ, b * dqo_sb + s * dqo_ss, b * q_sb + s * q_ss,
                                           row * q_heads * (2 * HALF), q_heads, dqo_sh, dqo_sd, q_sh, q_sd,
                                           c_a, c_b, s_a, s_b, eps, w_offset, dwq_a, dwq_b,
                                           ACROSS, DW, HALF, BLOCK_HQ, BLOCK_R, ONE_STEP_Q, STEP_SUMS, ACC)
            dwk_a, dwk_b = _backward_heads(DKO, K, WK, DK, b * dko_sb + s * dko_ss, b * k_sb + s * k_ss,
                                           row * k_heads * (2 * HALF), k_heads, dko_sh, dko_sd, k_sh, k_sd,
                                           c_a, c_b, s_a, s_b, eps, w_offset, dwk_a, dwk_b,
                                           ACROSS, DW, HALF, BLOCK_HK, BLOCK_R, ONE_STEP_K, STEP_SUMS, ACC)
        if DW:
            _store_partial(DWQ_PART, pid, dwq_a, dwq_b, q_heads, ACROSS, HALF, BLOCK_HQ, BLOCK_R, STEP_SUMS)
            _store_partial(DWK_PART, pid, dwk_a, dwk_b, k_heads, ACROSS, HALF, BLOCK_HK, BLOCK_R, STEP_SUMS)

    @triton.jit
    def _tiles_tensor(
        DO, X, W, DX, PART, p, programs, n_tiles, head_blocks,   # one tensor; this program's index p
        rows, seq, heads, do_sb, do_ss, do_sh, do_sd, x_sb, x_ss, x_sh, x_sd,
        COS, SIN, c_sb, c_ss, c_sd, s_sb, s_ss, s_sd, eps, w_offset,
        ACROSS: tl.constexpr, DW: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr, ACC: tl.constexpr,
    ):
        """Tiles p, p + programs, ... of one tensor's (token block, head block) tiles: dx written,
        dy * n added element by element to [BLOCK_T, BLOCK_H, BLOCK_R] sums, which are reduced (over
        tokens, and per head over heads) once, at the end, into the program's partial row."""
        j = tl.arange(0, BLOCK_R)[None, None, :]
        j64 = j.to(tl.int64)
        j_mask = j < HALF
        if DW:
            sum_a = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_R], ACC)
            sum_b = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_R], ACC)
        # (w + w_offset) in ACC: w_offset (and eps) may come as float64 from Inductor's launch
        if ACROSS:   # every head in the tile: the weights once, per head slot
            h0 = tl.arange(0, BLOCK_H)[None, :, None]
            wp = W + h0 * (2 * HALF) + j
            wm = (h0 < heads) & j_mask
            w_a = (tl.load(wp, mask=wm, other=0.0).to(ACC) + w_offset).to(ACC)
            w_b = (tl.load(wp + HALF, mask=wm, other=0.0).to(ACC) + w_offset).to(ACC)
        else:
            w_a = (tl.load(W + j, mask=j_mask, other=0.0).to(ACC) + w_offset).to(ACC)
            w_b = (tl.load(W + HALF + j, mask=j_mask, other=0.0).to(ACC) + w_offset).to(ACC)
        for tile in tl.range(p, n_tiles, programs, num_stages=STAGES):
            t = (tile // head_blocks).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
            h = (tile % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
            h64 = h.to(tl.int64)
            t_mask = t < rows
            mask = t_mask & (h < heads) & j_mask
            b = t // seq
            s = t % seq
            # every load of the tile before any store (the stores may alias the inputs for all the
            # compiler knows: loads after them would wait)
            pd = DO + b * do_sb + s * do_ss + h64 * do_sh + j64 * do_sd
            do_a = tl.load(pd, mask=mask, other=0.0).to(ACC)
            do_b = tl.load(pd + HALF * do_sd, mask=mask, other=0.0).to(ACC)
            px = X + b * x_sb + s * x_ss + h64 * x_sh + j64 * x_sd
            x_a = tl.load(px, mask=mask, other=0.0).to(ACC)
            x_b = tl.load(px + HALF * x_sd, mask=mask, other=0.0).to(ACC)
            cm = t_mask & j_mask
            pc = COS + b * c_sb + s * c_ss + j64 * c_sd
            c_a = tl.load(pc, mask=cm, other=0.0).to(ACC)
            c_b = tl.load(pc + HALF * c_sd, mask=cm, other=0.0).to(ACC)
            ps = SIN + b * s_sb + s * s_ss + j64 * s_sd
            s_a = tl.load(ps, mask=cm, other=0.0).to(ACC)
            s_b = tl.load(ps + HALF * s_sd, mask=cm, other=0.0).to(ACC)
            # the rotation's transpose, then RMSNorm's backward
            dy_a = do_a * c_a + do_b * s_b
            dy_b = do_b * c_b - do_a * s_a
            sq = tl.sum(x_a * x_a + x_b * x_b, 2)                      # [BLOCK_T, BLOCK_H]
            # padded lanes (heads, a ragged tile's tokens) get rstd 0: with eps 0 their 1 / sqrt(0)
            # would make n = 0 * inf = NaN and poison the weight-gradient sums
            if ACROSS:
                rstd = 1.0 / tl.sqrt(tl.sum(sq, 1) / (heads * 2 * HALF) + eps)   # [BLOCK_T]
                rstd = tl.where(t_mask, rstd[:, None, None].to(ACC), 0.0)
            else:
                rstd = (1.0 / tl.sqrt(sq / (2 * HALF) + eps)).to(ACC)[:, :, None]
                rstd = tl.where(t_mask & (h < heads), rstd, 0.0)
            n_a = x_a * rstd
            n_b = x_b * rstd
            g_a = dy_a * w_a
            g_b = dy_b * w_b
            gn = tl.sum(g_a * n_a + g_b * n_b, 2)
            if ACROSS:
                c = (tl.sum(gn, 1) / (heads * 2 * HALF))[:, None, None]
            else:
                c = (gn / (2 * HALF))[:, :, None]
            pdx = DX + (t * heads + h64) * (2 * HALF) + j
            tl.store(pdx, (rstd * (g_a - n_a * c)).to(DX.dtype.element_ty), mask=mask)
            tl.store(pdx + HALF, (rstd * (g_b - n_b * c)).to(DX.dtype.element_ty), mask=mask)
            if DW:
                sum_a += dy_a * n_a
                sum_b += dy_b * n_b
        if DW:
            jj = tl.arange(0, BLOCK_R)
            if ACROSS:
                hh = tl.arange(0, BLOCK_H)[:, None]
                pp = PART + p.to(tl.int64) * heads * (2 * HALF) + hh * (2 * HALF) + jj[None, :]
                pm = (hh < heads) & (jj < HALF)[None, :]
                tl.store(pp, tl.sum(sum_a, 0), mask=pm)
                tl.store(pp + HALF, tl.sum(sum_b, 0), mask=pm)
            else:
                pp = PART + p.to(tl.int64) * (2 * HALF) + jj
                tl.store(pp, tl.sum(tl.sum(sum_a, 0), 0), mask=jj < HALF)
                tl.store(pp + HALF, tl.sum(tl.sum(sum_b, 0), 0), mask=jj < HALF)

    @triton.jit
    def _qk_norm_rotary_bwd_tiles(
        DQO, DKO, Q, K, WQ, WK, COS, SIN, DQ, DK, DWQ_PART, DWK_PART,   # DW*_PART: (programs, weight size)
        rows, seq, q_heads, k_heads, programs, q_tiles, k_tiles, q_head_blocks, k_head_blocks,
        dqo_sb, dqo_ss, dqo_sh, dqo_sd, dko_sb, dko_ss, dko_sh, dko_sd,
        q_sb, q_ss, q_sh, q_sd, k_sb, k_ss, k_sh, k_sd,
        c_sb, c_ss, c_sd, s_sb, s_ss, s_sd,
        eps, w_offset,
        ACROSS: tl.constexpr, DW: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """Even programs 2p take q's tiles p, p + programs, ...; odd ones 2p + 1 k's, the same tokens
        (neighbouring programs run together: cos and sin come from the L2 cache the second time)."""
        pid = tl.program_id(0)
        p = pid // 2
        if pid % 2 == 0:
            _tiles_tensor(DQO, Q, WQ, DQ, DWQ_PART, p, programs, q_tiles, q_head_blocks, rows, seq, q_heads,
                          dqo_sb, dqo_ss, dqo_sh, dqo_sd, q_sb, q_ss, q_sh, q_sd,
                          COS, SIN, c_sb, c_ss, c_sd, s_sb, s_ss, s_sd, eps, w_offset,
                          ACROSS, DW, HALF, BLOCK_T, BLOCK_HQ, BLOCK_R, STAGES, ACC)
        else:
            _tiles_tensor(DKO, K, WK, DK, DWK_PART, p, programs, k_tiles, k_head_blocks, rows, seq,
                          k_heads, dko_sb, dko_ss, dko_sh, dko_sd, k_sb, k_ss, k_sh, k_sd,
                          COS, SIN, c_sb, c_ss, c_sd, s_sb, s_ss, s_sd, eps, w_offset,
                          ACROSS, DW, HALF, BLOCK_T, BLOCK_HK, BLOCK_R, STAGES, ACC)

def _prev_pow2(v: int) -> int:
    return 1 << (max(1, int(v)).bit_length() - 1)


@dataclass(frozen=True)
class QKNormRotaryConfig:
    """A Triton plan: heads held a step (q, k), the padded half head (BLOCK_R), warps, and for the
    backward its programs and tokens per program."""

    block_hq: int
    block_hk: int
    block_r: int
    num_warps: int
    programs: int
    rows_per_program: int


def _choose_config(problem: QKNormRotaryProblem) -> QKNormRotaryConfig:
    """Per head: BLOCK_H x 2 BLOCK_R at most ``tile`` elements; across heads: every head at once.
    Backward: at most SMs x ``programs_per_sm`` programs, a block of consecutive tokens each."""
    h = problem.heuristics
    hq, hk = problem.q_shape[2], problem.k_shape[2]
    block_r = next_pow2(problem.head_dim // 2)
    if problem.across_heads:
        block_hq, block_hk = next_pow2(max(hq, 1)), next_pow2(max(hk, 1))
    else:
        tile_heads = _prev_pow2(max(1, h.tile // (2 * block_r)))
        block_hq, block_hk = min(next_pow2(max(hq, 1)), tile_heads), min(next_pow2(max(hk, 1)), tile_heads)
    elements = max(block_hq, block_hk) * 2 * block_r
    warps = first_step(h.backward_warps if problem.backward else h.warps, elements)
    rows = max(1, problem.rows)
    programs = max(1, min(rows, sm_count(problem.device) * max(1, h.programs_per_sm)))
    per = -(-rows // programs)
    return QKNormRotaryConfig(block_hq, block_hk, block_r, warps, -(-rows // per), per)


@dataclass(frozen=True)
class TilesConfig:
    """The tiles backward's plan: tokens a tile holds (both tensors: a q program and its k twin walk
    the same tokens, so that cos and sin come from the L2 cache the second time); per tensor (q, k)
    heads a tile holds, tiles and head blocks; programs per tensor; the padded half head; warps."""

    block_t: int
    block_h: tuple[int, int]
    tiles: tuple[int, int]
    head_blocks: tuple[int, int]
    programs: int
    block_r: int
    num_warps: int


def _choose_tiles_config(problem: QKNormRotaryProblem) -> TilesConfig:
    """BLOCK_H x 2 BLOCK_R x BLOCK_T at most ``backward_tile`` elements for the tensor with more
    heads (per head: the heads first, BLOCK_T >= 1 tokens with what is left; across heads: every
    head); programs per tensor at most SMs x ``tile_programs_per_sm``, and at most the number whose
    partial rows (weight size x the accumulator's bytes) stay within 1/PARTIAL_SHARE of each
    tensor's bytes (but one a SM at least)."""
    h = problem.heuristics
    block_r = next_pow2(problem.head_dim // 2)
    rows = max(1, problem.rows)
    heads = (max(problem.q_shape[2], 1), max(problem.k_shape[2], 1))
    if problem.across_heads:
        block_h = tuple(next_pow2(n) for n in heads)
    else:
        fit = _prev_pow2(max(1, h.backward_tile // (2 * block_r)))
        block_h = tuple(min(next_pow2(n), fit) for n in heads)
    block_t = min(next_pow2(rows), _prev_pow2(max(1, h.backward_tile // (max(block_h) * 2 * block_r))))
    head_blocks = tuple(-(-n // b) for n, b in zip(heads, block_h))
    tiles = tuple(-(-rows // block_t) * hb for hb in head_blocks)
    programs = min(max(tiles), sm_count(problem.device) * h.tile_programs_per_sm)
    if problem.weight_grad:
        for n, wsize in zip(heads, (math.prod(s) for s in problem.weight_shapes)):
            tensor_bytes = rows * n * problem.head_dim * problem.dtype.itemsize
            programs = min(programs, max(sm_count(problem.device),
                                         tensor_bytes // (PARTIAL_SHARE * max(1, wsize) * problem.acc_dtype.itemsize)))
    warps = first_step(h.backward_warps, block_t * max(block_h) * 2 * block_r)
    return TilesConfig(block_t, block_h, tiles, head_blocks, max(1, programs), block_r, warps)


def _prepare_tiles(problem: QKNormRotaryProblem, config: TilesConfig | None = None) -> Launch:
    config = config or _choose_tiles_config(problem)
    acc = problem.acc_dtype
    hq, hk = problem.q_shape[2], problem.k_shape[2]
    rows = problem.rows
    dw = problem.weight_grad
    tables = (*problem.table_view("cos"), *problem.table_view("sin"))
    pq = pk = config.programs
    launch = launcher(_qk_norm_rotary_bwd_tiles, (2 * pq,),
                      trailing=(rows, problem.seq, hq, hk, pq, *config.tiles, *config.head_blocks,
                                *(s for name in ("dq_out", "dk_out", "q", "k") for s in problem.stride_of(name)),
                                *tables, problem.eps, problem.weight_offset),
                      ACROSS=problem.across_heads, DW=dw, HALF=problem.head_dim // 2, BLOCK_T=config.block_t,
                      BLOCK_HQ=config.block_h[0], BLOCK_HK=config.block_h[1],
                      BLOCK_R=config.block_r, STAGES=problem.heuristics.tile_stages,
                      ACC=tl.float64 if acc == torch.float64 else tl.float32, num_warps=config.num_warps)
    wq_size, wk_size = (math.prod(s) for s in problem.weight_shapes)
    # the partials' sum: narrow column blocks, tall row slabs (up to the tile): few serial steps
    sums = [column_sum(parts, size, problem.heuristics.tile_reduce_block, 1 << 30)
            for parts, size in ((pq, wq_size), (pk, wk_size))]

    def run(tensors, outputs):
        dq, dk, dwq, dwk = outputs
        if rows == 0:
            dwq.zero_()
            dwk.zero_()
            return
        parts = ([torch.empty((n, size), dtype=acc, device=dq.device) for n, size in ((pq, wq_size), (pk, wk_size))]
                 if dw else [None, None])
        launch(*tensors, dq, dk, *parts)
        if dw:
            sums[0](parts[0], dwq)
            sums[1](parts[1], dwk)

    params = (("grid", (2 * pq,)), ("programs", pq), ("tiles", config.tiles),
              ("stages", problem.heuristics.tile_stages),
              ("BLOCK_T", config.block_t), ("BLOCK_H", config.block_h), ("BLOCK_R", config.block_r),
              ("num_warps", config.num_warps))
    workspace = (pq * wq_size + pk * wk_size) * acc.itemsize if dw else 0
    return Launch(run, KernelChoice("qk_norm_rotary_bwd_tiles", "triton", params), acc, workspace_bytes=workspace)


def _prepare_triton(problem: QKNormRotaryProblem, config: QKNormRotaryConfig | None = None) -> Launch:
    if problem.backward and problem.heuristics.backward_kernel == "tiles" and config is None:
        return _prepare_tiles(problem)
    config = config or _choose_config(problem)
    acc = problem.acc_dtype
    hq, hk = problem.q_shape[2], problem.k_shape[2]
    meta = dict(ACROSS=problem.across_heads, HALF=problem.head_dim // 2, BLOCK_HQ=config.block_hq,
                BLOCK_HK=config.block_hk, BLOCK_R=config.block_r,
                ONE_STEP_Q=config.block_hq >= hq and problem.heuristics.straight_line,
                ONE_STEP_K=config.block_hk >= hk and problem.heuristics.straight_line,
                ACC=tl.float64 if acc == torch.float64 else tl.float32,
                num_warps=config.num_warps)
    tables = (*problem.table_view("cos"), *problem.table_view("sin"))
    scalars = (problem.eps, problem.weight_offset)
    rows = problem.rows
    if not problem.backward:
        # every scalar argument is fixed by the plan: bound once here, not per call
        launch = launcher(_qk_norm_rotary_fwd, (max(1, rows),),
                          trailing=(problem.seq, hq, hk, *problem.stride_of("q"), *problem.stride_of("k"), *tables,
                                    *scalars), **meta)

        def run(tensors, outputs):
            if rows:
                launch(*tensors, *outputs)

        params = (("grid", (rows,)), ("BLOCK_HQ", config.block_hq), ("BLOCK_HK", config.block_hk),
                  ("BLOCK_R", config.block_r), ("num_warps", config.num_warps))
        return Launch(run, KernelChoice("qk_norm_rotary_fwd", "triton", params), acc)

    dw = problem.weight_grad
    programs = config.programs
    launch = launcher(_qk_norm_rotary_bwd, (programs,),
                      trailing=(rows, problem.seq, hq, hk, config.rows_per_program,
                                *(s for name in ("dq_out", "dk_out", "q", "k") for s in problem.stride_of(name)),
                                *tables, *scalars), DW=dw, STEP_SUMS=problem.heuristics.step_head_sums,
                      **meta)
    wq_size, wk_size = (math.prod(s) for s in problem.weight_shapes)
    sums = [column_sum(programs, size, problem.heuristics.reduce_block, 64) for size in (wq_size, wk_size)]

    def run(tensors, outputs):
        dq, dk, dwq, dwk = outputs
        if rows == 0:
            dwq.zero_()
            dwk.zero_()
            return
        parts = ([torch.empty((programs, size), dtype=acc, device=dq.device) for size in (wq_size, wk_size)]
                 if dw else [None, None])
        launch(*tensors, dq, dk, *parts)
        if dw:
            sums[0](parts[0], dwq)
            sums[1](parts[1], dwk)

    params = (("grid", (programs,)), ("rows_per_program", config.rows_per_program),
              ("step_head_sums", problem.heuristics.step_head_sums), ("BLOCK_HQ", config.block_hq),
              ("BLOCK_HK", config.block_hk), ("BLOCK_R", config.block_r), ("num_warps", config.num_warps))
    workspace = programs * (wq_size + wk_size) * acc.itemsize if dw else 0
    return Launch(run, KernelChoice("qk_norm_rotary_bwd", "triton", params), acc, workspace_bytes=workspace)


if triton_available():
    for _op in OPS:
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
                 name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.qk_norm_rotary and its backward, with autograd
# ----------------------------------------------------------------------------------------------

def _same(op: str, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
          grads: tuple = ()) -> None:
    """The per-call checks the descriptor does not hold: k's, k_weight's and sin's dtypes, the
    weights' shapes, sin's shape, one device."""
    if k.dtype != q.dtype:
        raise argument_error(InvalidProblemError, op, "k", f"has dtype {k.dtype} but q has {q.dtype}")
    if k_weight.dtype != q_weight.dtype:
        raise argument_error(InvalidProblemError, op, "k_weight", f"has dtype {k_weight.dtype} but q_weight has "
                             f"{q_weight.dtype}")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise argument_error(InvalidProblemError, op, "sin", f"has shape {tuple(sin.shape)} and dtype {sin.dtype}; "
                             f"cos has {tuple(cos.shape)} and {cos.dtype}")
    for name, t in (("k", k), ("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin), *grads):
        if t.device != q.device:
            raise argument_error(InvalidProblemError, op, name, f"is on {t.device} but q is on {q.device}")


def _weights(op: str, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, across_heads: bool):
    """The weights as the kernels read them (dense), after a check of their shapes."""
    d = q.shape[-1]   # q and k are 4-d (the descriptor checked them)
    for name, w, x in (("q_weight", q_weight, q), ("k_weight", k_weight, k)):
        want = (x.shape[2] * d,) if across_heads else (d,)
        if tuple(w.shape) != want:
            how = f"{name[0]}_heads * head_dim (across_heads)" if across_heads else "head_dim"
            raise argument_error(InvalidProblemError, op, name, f"has shape {tuple(w.shape)}; expected {want} "
                                 f"({how})")
    return (w if w.is_contiguous() else w.contiguous() for w in (q_weight, k_weight))


def _qk_norm_rotary_impl(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                         eps: float, weight_offset: float, across_heads: bool,
                         out_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    op = "qk_norm_rotary"
    _same(op, q, k, q_weight, k_weight, cos, sin)
    descriptor = QKNormRotaryDescriptor(q.shape, k.shape, cos.shape, q.dtype, q.device, out_dtype=out_dtype,
                                        weight_dtype=q_weight.dtype, cos_dtype=cos.dtype,
                                        strides=(q.stride(), k.stride(), cos.stride(), sin.stride()), eps=eps,
                                        weight_offset=weight_offset, across_heads=across_heads,
                                        heuristics=heuristics_for(QKNormRotaryHeuristics))
    plan = cached_plan(descriptor)
    q_weight, k_weight = _weights(op, q, k, q_weight, k_weight, across_heads)
    return plan.run_unchecked((q, k, q_weight, k_weight, cos, sin))


def _qk_norm_rotary_fake(q, k, q_weight, k_weight, cos, sin, eps, weight_offset, across_heads, out_dtype):
    dtype = q.dtype if out_dtype is None else out_dtype
    return q.new_empty(q.shape, dtype=dtype), k.new_empty(k.shape, dtype=dtype)


def _backward_impl(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                   cos: Tensor, sin: Tensor, eps: float, weight_offset: float, across_heads: bool,
                   weight_grad: bool, backward_kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """backward_kernel: the forward's choice (its heuristics' backward_kernel), an argument so that
    it holds where the backward is planned without the forward's heuristics in force: a compiled
    graph whose backward calls this op at run time, on autograd's thread. The other heuristics are
    those in force there."""
    op = "qk_norm_rotary_backward"
    if backward_kernel not in BACKWARD_KERNELS:
        raise argument_error(InvalidProblemError, op, "backward_kernel", f"must be one of {BACKWARD_KERNELS}, "
                             f"got {backward_kernel!r}")
    _same(op, q, k, q_weight, k_weight, cos, sin, (("dq_out", dq_out), ("dk_out", dk_out)))
    if dk_out.dtype != dq_out.dtype:
        raise argument_error(InvalidProblemError, op, "dk_out", f"has dtype {dk_out.dtype} but dq_out has "
                             f"{dq_out.dtype}")
    descriptor = QKNormRotaryBackwardDescriptor(
        q.shape, k.shape, cos.shape, q.dtype, q.device, out_dtype=dq_out.dtype, weight_dtype=q_weight.dtype,
        cos_dtype=cos.dtype, strides=(dq_out.stride(), dk_out.stride(), q.stride(), k.stride(), cos.stride(),
                                      sin.stride()),
        eps=eps, weight_offset=weight_offset, across_heads=across_heads, weight_grad=weight_grad,
        heuristics=_with_backward_kernel(heuristics_for(QKNormRotaryHeuristics), backward_kernel))
    plan = cached_plan(descriptor)
    q_weight, k_weight = _weights(op, q, k, q_weight, k_weight, across_heads)
    return plan.run_unchecked((dq_out, dk_out, q, k, q_weight, k_weight, cos, sin))


_OTHER_KERNEL: "weakref.WeakKeyDictionary[QKNormRotaryHeuristics, dict]" = weakref.WeakKeyDictionary()


def _with_backward_kernel(h: QKNormRotaryHeuristics, backward_kernel: str) -> QKNormRotaryHeuristics:
    """``h`` with ``backward_kernel``: ``h`` itself when it has it, else one derived object per
    (``h``, kernel), kept as long as ``h`` lives, since a plan's cache key holds its heuristics by
    identity and a new object each call would miss the cache every time."""
    if h.backward_kernel == backward_kernel:
        return h
    derived = _OTHER_KERNEL.setdefault(h, {})
    found = derived.get(backward_kernel)
    if found is None:
        found = derived[backward_kernel] = replace(h, backward_kernel=backward_kernel)
    return found


def _backward_fake(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, weight_offset, across_heads, weight_grad,
                   backward_kernel):
    if weight_grad:
        dwq, dwk = q_weight.new_empty(q_weight.shape), k_weight.new_empty(k_weight.shape)
    else:
        dwq, dwk = q.new_empty(0), q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), dwq, dwk


def _save(ctx, inputs, outputs) -> None:
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(inputs.q, inputs.k, inputs.q_weight, inputs.k_weight, inputs.cos, inputs.sin)
    ctx.eps, ctx.weight_offset, ctx.across_heads = inputs.eps, inputs.weight_offset, inputs.across_heads
    ctx.out_dtype = outputs[0].dtype
    # the backward plans with the forward's heuristics: autograd may run it on another thread
    ctx.heuristics = heuristics_for(QKNormRotaryHeuristics)


def _grad(ctx, dq_out, dk_out) -> dict:
    for name in ("cos", "sin"):
        if getattr(ctx.needs_grad, name):
            raise argument_error(UnsupportedError, "qk_norm_rotary", name, "requires grad; qk_norm_rotary gives "
                                 "cos and sin no gradient")
    if torch.is_grad_enabled():   # create_graph=True: the backward op records no graph of its own
        raise UnsupportedError("trainops.qk_norm_rotary: double backward (create_graph=True) is not supported")
    if dq_out is None and dk_out is None:
        return {}
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    # an unused output's gradient: zeros that take no memory (stride 0), read in place
    zeros = (dq_out if dq_out is not None else dk_out).new_zeros(())
    dq_out = zeros.to(ctx.out_dtype).expand(q.shape) if dq_out is None else dq_out
    dk_out = zeros.to(ctx.out_dtype).expand(k.shape) if dk_out is None else dk_out
    weight_grad = ctx.needs_grad.q_weight or ctx.needs_grad.k_weight
    with heuristics(ctx.heuristics):
        dq, dk, dwq, dwk = backward_op(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, ctx.eps, ctx.weight_offset,
                                       ctx.across_heads, weight_grad, ctx.heuristics.backward_kernel)
    grads = {"q": dq if ctx.needs_grad.q else None, "k": dk if ctx.needs_grad.k else None}
    if weight_grad:
        grads["q_weight"] = dwq if ctx.needs_grad.q_weight else None
        grads["k_weight"] = dwk if ctx.needs_grad.k_weight else None
    return grads


# The backward op has no autograd of its own (double backward through the norm is not supported).
def _decomposed(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float,
                weight_offset: float, across_heads: bool, out_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """(q_out, k_out) in torch ops, for Inductor (trainops.compiled): the module docstring's
    formulas in float32 (float64 for float64 q), each output rounded once to its dtype."""
    acc = accumulator_dtype(q.dtype)
    dtype = q.dtype if out_dtype is None else out_dtype
    c, s = cos.to(acc), sin.to(acc)
    c, s = (c, s) if c.dim() == 3 else (c[None], s[None])
    c, s = c[:, :, None], s[:, :, None]   # (batch or 1, seq, 1, D): every head

    def one(x: Tensor, w: Tensor) -> Tensor:
        batch, seq, heads, d = x.shape
        xf = x.to(acc)
        if across_heads:
            xf = xf.reshape(batch, seq, heads * d)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * (w.to(acc) + weight_offset)
        y = y.reshape(batch, seq, heads, d)
        turned = torch.cat((-y[..., d // 2:], y[..., :d // 2]), dim=-1)
        return (y * c + turned * s).to(dtype)

    return one(q, q_weight), one(k, k_weight)


def _compiled_size(arguments):
    """The norm's width, the CompiledChoices size: the head dim, or across heads q's heads x head
    dim (OLMo 2's 16 x 128: class 2048, apart from the per-head classes 64-256)."""
    q = arguments.q
    return q.shape[2] * q.shape[-1] if arguments.across_heads else q.shape[-1]


DECOMPOSITION = Decomposition(_decomposed, _compiled_size, lambda arguments: arguments.q.dtype)

backward_op = custom_op("qk_norm_rotary_backward", _backward_impl, _backward_fake, inline_triton=True)
qk_norm_rotary_op = custom_op("qk_norm_rotary", _qk_norm_rotary_impl, _qk_norm_rotary_fake, backward=_grad,
                              save=_save, inline_triton=True, decomposition=DECOMPOSITION)
