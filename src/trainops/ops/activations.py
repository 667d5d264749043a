"""The transformer MLP activations, forward and backward: GELU (erf and tanh forms), QuickGELU, SiLU,
BiasGelu, and the gated SwiGLU and GeGLU: Triton kernels, CPU path, registrations and custom ops.

    gelu(x)            x * 0.5 * (1 + erf(x / sqrt 2))                      approximate="none"
                       0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))  approximate="tanh"
    quick_gelu(x)      x * sigmoid(1.702 x)
    silu(x)            x / (1 + exp(-x))                                    (= x * sigmoid(x))
    bias_gelu(x, b)    gelu(x + b), b of shape x.shape[-1:]                 (ONNX Runtime's BiasGelu)
    swiglu(gate, up)   silu(gate) * up
    geglu(gate, up)    gelu(gate) * up                                      (approximate="tanh" by default)

Backward, with f the activation and f' its derivative (recomputed from the saved inputs; no output
is saved, so memory is torch's):

    dx = dy * f'(x)    (bias_gelu: f'(x + b); dbias = sum of dx over every leading element)
    dgate = dy * up * f'(gate),  dup = dy * f(gate)

The gated ops also take one tensor holding both halves on its last axis (``up=None``): gate =
x[..., :n], up = x[..., n:], n = x.shape[-1] // 2, read in place; the backward writes both
gradients into one tensor of x's shape.

Formulas and rounding are torch's CUDA kernels' (ActivationGeluKernel.cu, ActivationSiluKernel.cu):
the same expressions in the same order, with libdevice's expf / erff / tanhf and IEEE division
(``ActivationHeuristics.precise_math``). Measured on the H100 (torch 2.11, Triton 3.6, 8192 x 4096):
gelu(tanh), silu, and float32 swiglu / geglu forwards equal torch's bit for bit; exact (erf) gelu
differs from torch's in 9% of float32 elements (1.4% in bfloat16) at the same error against float64
(2.9e-8 ours, 3.1e-8 torch's). At +-inf every activation and derivative takes its limit (f(-inf) = 0, f(inf) = inf,
f'(-inf) = 0, f'(inf) = 1; also where 1.702 x overflows in quick_gelu's derivative) where torch's
formulas give NaN (gelu(-inf), silu(-inf), every derivative at +-inf); NaN stays NaN. The fused
ops round once: bias_gelu adds x + b in the accumulator (torch's ``gelu(x + b)`` rounds x + b to
x's dtype first), the gated ops multiply by ``up`` before rounding (torch's ``silu(gate) * up``
rounds silu(gate) first: in float32 the two agree, in bfloat16 they can differ by a unit in the
last place), quick_gelu rounds x * sigmoid(1.702 x) once.

Shapes: any (rank 0 too). Strides: any, read in place (no copies): dims that walk together in every
operand are merged; a fully contiguous problem is one flat offset; other layouts index rows of a
merged inner axis. Outputs are contiguous, row-major (torch.empty_like would keep a permuted dense
input's layout; the fakes torch.compile traces with say contiguous, and so do the kernels).
Dtypes: float32, float16, bfloat16, float64 (gate and up share one dtype; bias_gelu's bias may have
any of the four, e.g. float32 master weights beside a bfloat16 input under autocast); math in
float32 (float64 for float64 inputs; the bias is read in that accumulator dtype); outputs in the
input's dtype, the bias gradient in the bias's.
Deterministic: the bias gradient is summed per program over a fixed block of rows into a float32
workspace, then across programs in a fixed order by a second kernel (no atomics): bit-identical
run to run on one device (the number of programs depends on its SM count).

Triton plans (``_prepare_triton``): forward reads each input once and writes y once; backward reads
dy and the saved inputs once and writes each needed gradient once. 1-D blocks of
``ActivationHeuristics.block`` elements (flat), or tiles of that many elements (rows x columns)
for strided layouts; offsets in int64 where an operand's extent can pass 2^31. Where numel is not
a multiple of 16, flat whole blocks run unmasked and only the last, partial one masked: a mask
against such a numel made every access one element wide (swiglu 4097 x 1000 fp16: 2-byte loads
and stores, 0.052 ms forward + backward on the H200 against torch.compile's 0.020).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..layout import merge_dims, next_pow2
from ..library import custom_op
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, checked_shape, heuristics, heuristics_for
from ..registry import (ACCUMULATOR, FLOATS, accumulator_dtype, normalize_device, register, register_op, sm_count,
                        triton_available, triton_interpreting)
from ._common import checked_strides, contiguous_strides, first_step, float_dtype

UNARY_OPS = ("gelu", "quick_gelu", "silu")
BIAS_OPS = ("bias_gelu",)
GATED_OPS = ("swiglu", "geglu")
FORWARD_OPS = UNARY_OPS + BIAS_OPS + GATED_OPS
BACKWARD_OPS = tuple(op + "_backward" for op in FORWARD_OPS)
APPROXIMATIONS = ("none", "tanh")
_WITH_APPROXIMATE = {"gelu": "none", "bias_gelu": "none", "geglu": "tanh"}  # op -> default approximate

# the kernels' activation codes (constexpr ACT) and operand modes (constexpr MODE)
GELU, GELU_TANH, QUICK_GELU, SILU = 0, 1, 2, 3
UNARY, BIAS, GATED = 0, 1, 2

# torch's constants (math.h's literals); products as C++ folds them, in double
M_SQRT1_2 = 0.70710678118654752440
M_SQRT2 = 1.41421356237309504880
M_2_SQRTPI = 1.12837916709551257390
K_BETA_ERF = M_2_SQRTPI * M_SQRT1_2 * 0.5    # 1 / sqrt(2 pi): the normal density's factor
K_BETA_TANH = M_SQRT2 * M_2_SQRTPI * 0.5     # sqrt(2 / pi)
K_KAPPA = 0.044715
QUICK_GELU_ALPHA = 1.702


# ----------------------------------------------------------------------------------------------
# Heuristics
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ActivationHeuristics:
    """The activation family's tunables (trainops.heuristics(...) overrides them).

    block: elements one program handles (a power of two): the flat block of a contiguous problem,
        or a tile (rows x columns) of a strided one; a problem smaller than a block gets a block of
        next_pow2(numel) (at least 64). warps: (block elements at most, warps) steps, the first that
        fits. bias_programs_per_sm: programs of bias_gelu's backward per SM and column block; each
        sums the bias gradient of its rows into one float32 workspace row. reduce_block: columns
        one program of the workspace's fixed-order sum owns; reduce_parts: workspace rows it adds
        per step (a power of two). int64_from: offsets are computed in
        int64 when an operand's extent (or numel) plus a block reaches this (2^31; tests lower it
        to run the int64 path on small tensors). precise_math: libdevice's expf / erff / tanhf and
        IEEE division, as torch's CUDA kernels (bit-identical tanh-gelu and silu forwards); False: Triton's
        exp2-based exp, tanh through exp and approximate division (fewer instructions). Triton's
        interpreter has no libdevice: there the plan always uses the portable functions.
    Defaults: not yet measured on the GPU. 4096-element blocks with 8 warps give each thread 16
    elements (two 16-byte loads of a bfloat16 operand); tiles of strided layouts take the column
    block (a power of two, at most ``block``) that pads the inner axis least.
    """

    block: int = 4096
    warps: tuple[tuple[int, int], ...] = ((512, 2), (2048, 4), (1 << 62, 8))
    bias_programs_per_sm: int = 2
    reduce_block: int = 64
    reduce_parts: int = 64
    int64_from: int = 2**31
    precise_math: bool = True

    def num_warps(self, elements: int) -> int:
        return first_step(self.warps, elements)


# ----------------------------------------------------------------------------------------------
# Problem
# ----------------------------------------------------------------------------------------------

def _base(op: str) -> str:
    return op.removesuffix("_backward")


def _mode(op: str) -> int:
    base = _base(op)
    return BIAS if base in BIAS_OPS else GATED if base in GATED_OPS else UNARY


def _act_code(op: str, approximate: str) -> int:
    base = _base(op)
    if base == "quick_gelu":
        return QUICK_GELU
    if base in ("silu", "swiglu"):
        return SILU
    return GELU_TANH if approximate == "tanh" else GELU


def _input_names(op: str) -> tuple[str, ...]:
    names = {UNARY: ("input",), BIAS: ("input", "bias"), GATED: ("gate", "up")}[_mode(op)]
    return ("dy",) + names if op in BACKWARD_OPS else names


@dataclass(frozen=True)
class ActivationProblem:
    """One elementwise activation problem.

    ``shape``: the first input's shape (input / gate; with ``packed``, the tensor holding gate and
    up as the halves of its last axis). ``out_shape``: y's and dy's shape (packed: the last axis
    halved). Inputs, by name (``input_names``): forward (input,) / (input, bias) / (gate, up);
    backward dy first. ``strides``: one entry per input, None for the absent ``up`` of a packed
    problem. ``needs``: backward, which of the two gradients (input / gate, bias / up) to compute.
    Outputs (``new_output``): forward y; backward dx (unary), (dx, dbias) or (dgate, dup)
    (packed: (dx of ``shape``, empty)); a gradient not needed is an empty tensor. ``dtype``: every
    tensor's but bias_gelu's bias (and dbias), whose dtype is ``bias_dtype`` (None for the other ops).
    """

    op: str
    shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    approximate: str
    strides: tuple[tuple[int, ...] | None, ...]
    packed: bool
    needs: tuple[bool, bool]
    heuristics: ActivationHeuristics
    bias_dtype: torch.dtype | None = None
    index_dtype = None
    backward: bool = field(init=False, repr=False, compare=False)   # set from op: read on every call
    mode: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backward", self.op in BACKWARD_OPS)
        object.__setattr__(self, "mode", _mode(self.op))

    @property
    def act(self) -> int:
        return _act_code(self.op, self.approximate)

    @property
    def acc_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    @property
    def input_names(self) -> tuple[str, ...]:
        return _input_names(self.op)

    @property
    def bias_shape(self) -> tuple[int, ...]:
        return self.shape[-1:]

    def _shape_of(self, name: str) -> tuple[int, ...]:
        return {"dy": self.out_shape, "bias": self.bias_shape}.get(name, self.shape)

    def check(self, tensors: Sequence[Tensor | None], out) -> None:
        """Cheap checks of concrete tensors against the plan (shape, strides, dtype, device)."""
        names = self.input_names
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.{self.op}: expected {len(names)} tensors ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        for name, t, strides in zip(names, tensors, self.strides):
            if strides is None:
                if t is not None:
                    raise argument_error(InvalidProblemError, self.op, name,
                                         "is given; the plan is for one tensor holding gate and up (up=None)")
                continue
            check_tensor(self.op, name, t, self._shape_of(name), self.bias_dtype if name == "bias" else self.dtype,
                         self.device, strides)
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported (the op allocates its outputs)")

    def new_output(self):
        """Forward: y. Backward: dx (unary), (dx, dbias), (dgate, dup); not needed: empty tensors."""
        dtype, device = self.dtype, self.device
        if not self.backward:
            return torch.empty(self.out_shape, dtype=dtype, device=device)
        mode = self.mode
        if mode == UNARY:
            return torch.empty(self.shape, dtype=dtype, device=device)
        if self.packed:
            return torch.empty(self.shape, dtype=dtype, device=device), torch.empty(0, dtype=dtype, device=device)
        second, second_dtype = (self.bias_shape, self.bias_dtype) if mode == BIAS else (self.shape, dtype)
        return (torch.empty(self.shape if self.needs[0] else (0,), dtype=dtype, device=device),
                torch.empty(second if self.needs[1] else (0,), dtype=second_dtype, device=device))


def _describe(op: str, shape, dtype, device="cuda", approximate=None, strides=None, packed=False,
              needs=(True, True), heuristics=None, bias_dtype=None) -> ActivationProblem:
    """Validate an activation descriptor; errors name the argument (errors.argument_error).

    shape: the first input's sizes (input / gate, or with ``packed`` the tensor holding gate and
    up). dtype: every tensor's dtype (float32, float16, bfloat16, float64) but bias_gelu's bias.
    bias_dtype: bias_gelu's bias (and dbias) dtype, any of the four (None: ``dtype``); the other
    ops take none. approximate: "none" or
    "tanh" for gelu / bias_gelu / geglu (None: the op's default, geglu's is "tanh"); the others
    take none. strides: None (every input contiguous) or one entry per input in the op's order
    (forward input[, bias | up]; backward dy first), None for the absent ``up`` of a packed gated
    op. packed: gated ops only, gate and up are the two halves of the last axis (even, rank >= 1).
    needs: backward of bias_gelu and the gated ops, which of the two gradients to compute
    (packed: both). heuristics: an ActivationHeuristics.
    """
    backward = op in BACKWARD_OPS
    base = _base(op)
    names = _input_names(op)
    first = names[1] if backward else names[0]
    shape = checked_shape(op, "shape", shape)
    dtype = float_dtype(op, first, dtype)
    if _mode(op) == BIAS:
        bias_dtype = float_dtype(op, "bias", dtype if bias_dtype is None else bias_dtype)
    elif bias_dtype is not None:
        raise argument_error(InvalidProblemError, op, "bias_dtype", f"is for bias_gelu; {base} has no bias")
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    if base in _WITH_APPROXIMATE:
        if approximate is None:
            approximate = _WITH_APPROXIMATE[base]
        if not isinstance(approximate, str) or approximate not in APPROXIMATIONS:
            raise argument_error(InvalidProblemError, op, "approximate",
                                 f"is {approximate!r}; expected 'none' or 'tanh'")
    elif approximate not in (None, "none"):
        raise argument_error(InvalidProblemError, op, "approximate", f"is {approximate!r}; {base} takes none")
    else:
        approximate = "none"
    packed = bool(packed)
    if packed and base not in GATED_OPS:
        raise argument_error(InvalidProblemError, op, "packed", f"is for the gated ops; {base} has one input")
    if packed:
        if not shape:
            raise argument_error(InvalidProblemError, op, first,
                                 "is a 0-d tensor; with up=None it must hold gate and up on its last axis")
        if shape[-1] % 2:
            raise argument_error(InvalidProblemError, op, first,
                                 f"has an odd last axis ({shape[-1]}); with up=None it holds gate and up as its two "
                                 "halves")
    out_shape = shape[:-1] + (shape[-1] // 2,) if packed else shape
    present = [True] * len(names)
    if packed:
        present[-1] = False
    probe = ActivationProblem(op, shape, out_shape, dtype, device, approximate, (), packed, (True, True),
                              ActivationHeuristics())
    strides = checked_strides(op, names, present, strides, [probe._shape_of(name) for name in names])
    if not isinstance(needs, (tuple, list)) or len(needs) != 2:
        raise argument_error(InvalidProblemError, op, "needs", f"must be two bools, got {needs!r}")
    needs = (bool(needs[0]), bool(needs[1]))
    if packed or not backward or _mode(op) == UNARY:
        needs = (True, True)
    if heuristics is None:
        heuristics = heuristics_for(ActivationHeuristics)
    elif not isinstance(heuristics, ActivationHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"must be an ActivationHeuristics, got {type(heuristics).__name__}")
    if heuristics.block < 64 or heuristics.block & (heuristics.block - 1):
        raise argument_error(InvalidProblemError, op, "heuristics",
                             f"has block {heuristics.block}; expected a power of two >= 64")
    return ActivationProblem(op, shape, out_shape, dtype, device, approximate, strides, packed, needs, heuristics,
                             bias_dtype)


def _describer(op: str):
    def describe(shape, dtype, device="cuda", approximate=None, strides=None, packed=False, needs=(True, True),
                 heuristics=None, bias_dtype=None) -> ActivationProblem:
        return _describe(op, shape, dtype, device, approximate, strides, packed, needs, heuristics, bias_dtype)
    describe.__doc__ = _describe.__doc__
    return describe


DESCRIPTORS = {op: register_op(op, _describer(op)) for op in FORWARD_OPS + BACKWARD_OPS}


# ----------------------------------------------------------------------------------------------
# CPU path: torch's CPU ops in the accumulator dtype (the kernels' formulas)
# ----------------------------------------------------------------------------------------------

_INF = float("inf")


def _cpu_f(x: Tensor, act: int) -> Tensor:
    """f(x), its limit at -inf being 0."""
    if act == GELU:
        f = x * 0.5 * (1 + torch.erf(x * M_SQRT1_2))
    elif act == GELU_TANH:
        f = 0.5 * x * (1 + torch.tanh(K_BETA_TANH * (x + K_KAPPA * (x * x * x))))
    elif act == QUICK_GELU:
        f = x * (1 / (1 + torch.exp(-QUICK_GELU_ALPHA * x)))
    else:
        f = x / (1 + torch.exp(-x))
    return f.masked_fill_(x == -_INF, 0.0)


def _cpu_df(x: Tensor, act: int) -> Tensor:
    """f'(x), its limits at +-inf being 1 and 0 (also where alpha x overflows)."""
    if act == GELU:
        cdf = 0.5 * (1 + torch.erf(x * M_SQRT1_2))
        pdf = torch.exp(-0.5 * x * x) * K_BETA_ERF
        return torch.where(pdf == 0, cdf, cdf + x * pdf)
    if act == GELU_TANH:
        x_sq = x * x
        t = torch.tanh(K_BETA_TANH * (x + K_KAPPA * (x_sq * x)))
        tanh_d = 1 - t * t
        right = 0.5 * x * tanh_d * (K_BETA_TANH * (1 + 3 * K_KAPPA * x_sq))
        return 0.5 * (1 + t) + right.masked_fill_(tanh_d == 0, 0.0)
    alpha = QUICK_GELU_ALPHA if act == QUICK_GELU else 1.0
    s = 1 / (1 + torch.exp(-alpha * x))
    df = s * (1 + alpha * x * (1 - s))
    return df.masked_fill_(s == 1, 1.0).masked_fill_(s == 0, 0.0)


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    n = x.shape[-1] // 2
    return x[..., :n], x[..., n:]


def _cpu_forward(problem: ActivationProblem, tensors, y: Tensor) -> None:
    acc, act, mode = problem.acc_dtype, problem.act, problem.mode
    a = tensors[0]
    if mode == GATED:
        a, b = _halves(a) if problem.packed else (a, tensors[1])
        y.copy_(_cpu_f(a.to(acc), act) * b.to(acc))
    elif mode == BIAS:
        y.copy_(_cpu_f(a.to(acc) + tensors[1].to(acc), act))
    else:
        y.copy_(_cpu_f(a.to(acc), act))


def _cpu_backward(problem: ActivationProblem, tensors, outputs) -> None:
    acc, act, mode = problem.acc_dtype, problem.act, problem.mode
    dy, a = tensors[0].to(acc), tensors[1]
    if mode == UNARY:
        outputs.copy_(dy * _cpu_df(a.to(acc), act))
        return
    first, second = outputs
    if mode == BIAS:
        dx = dy * _cpu_df(a.to(acc) + tensors[2].to(acc), act)
        if problem.needs[0]:
            first.copy_(dx)
        if problem.needs[1]:
            n = problem.shape[-1] if problem.shape else 1
            second.copy_(dx.reshape(math.prod(problem.shape[:-1]), n).sum(0).reshape(second.shape))
        return
    if problem.packed:
        (a, b), (first, second) = _halves(a), _halves(first)
    else:
        b = tensors[2]
    a, b = a.to(acc), b.to(acc)
    if problem.needs[0]:
        first.copy_(dy * b * _cpu_df(a, act))
    if problem.needs[1]:
        second.copy_(dy * _cpu_f(a, act))


def _prepare_cpu(problem: ActivationProblem) -> Launch:
    compute = _cpu_backward if problem.backward else _cpu_forward
    return Launch(lambda tensors, outputs: compute(problem, tensors, outputs),
                  KernelChoice(f"{problem.op}_cpu", "cpu", ()), problem.acc_dtype)


for _op in FORWARD_OPS + BACKWARD_OPS:
    register(_op, backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
             name=f"{_op}_cpu")(_prepare_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from ._common import column_sum

    # The kernels write torch's constants as literals (tests check them against the ones above); no
    # float constexpr globals: Inductor re-emits a kernel's globals by repr, and repr(inf) is no name.

    @triton.jit
    def _exp(x, PRECISE: tl.constexpr):
        if PRECISE:
            y = libdevice.exp(x)
        else:
            y = tl.exp(x)
        return y

    @triton.jit
    def _erf(x, PRECISE: tl.constexpr):
        if PRECISE:
            y = libdevice.erf(x)
        else:
            y = tl.math.erf(x)
        return y

    @triton.jit
    def _tanh(x, PRECISE: tl.constexpr):
        if PRECISE:
            y = libdevice.tanh(x)
        else:
            y = 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0
        return y

    @triton.jit
    def _div(a, b, DIV_RN: tl.constexpr):
        """a / b, rounded as IEEE division (float32, DIV_RN) or as Triton divides."""
        if DIV_RN:
            q = tl.math.div_rn(a, b)
        else:
            q = a / b
        return q

    @triton.jit
    def _act(x, ACT: tl.constexpr, PRECISE: tl.constexpr, DIV_RN: tl.constexpr):
        """(f(x), f'(x)) in x's dtype, torch's CUDA expressions in torch's order; limits at +-inf.

        A caller that uses only one of the two pays for that one: the other is dead code."""
        if ACT == 0:  # gelu, erf form: M_SQRT1_2; K_BETA_ERF
            e = _erf(x * 0.7071067811865476, PRECISE)
            f = x * 0.5 * (1.0 + e)
            cdf = 0.5 * (1.0 + e)
            pdf = _exp(-0.5 * x * x, PRECISE) * 0.3989422804014327
            df = tl.where(pdf == 0.0, cdf, cdf + x * pdf)   # x * pdf is inf * 0 at +-inf
        elif ACT == 1:  # gelu, tanh form: K_BETA_TANH, K_KAPPA, 3 * K_KAPPA
            x_sq = x * x
            t = _tanh(0.7978845608028654 * (x + 0.044715 * (x_sq * x)), PRECISE)
            f = 0.5 * x * (1.0 + t)
            tanh_d = 1.0 - t * t
            right = 0.5 * x * tanh_d * (0.7978845608028654 * (1.0 + 0.134145 * x_sq))
            df = 0.5 * (1.0 + t) + tl.where(tanh_d == 0.0, 0.0, right)  # x^2 may overflow where t = +-1
        else:  # quick_gelu (ACT 2, QUICK_GELU_ALPHA), silu (ACT 3)
            if ACT == 2:
                s = _div(1.0, 1.0 + _exp(-1.702 * x, PRECISE), DIV_RN)
                f = x * s
                df = s * (1.0 + 1.702 * x * (1.0 - s))
            else:
                denominator = 1.0 + _exp(-x, PRECISE)
                f = _div(x, denominator, DIV_RN)
                s = _div(1.0, denominator, DIV_RN)
                df = s * (1.0 + x * (1.0 - s))
            # where s rounds to 0 or 1 the formula's value is that, unless alpha x overflowed (0 * inf)
            df = tl.where(s == 0.0, 0.0, tl.where(s == 1.0, 1.0, df))
        f = tl.where(x == float("-inf"), 0.0, f)
        return f, df

    @triton.jit
    def _flat_load(P, offs, numel, ACC: tl.constexpr, MASKED: tl.constexpr):
        """P[offs] in ACC; MASKED (the last, partial block): offsets past numel read 0."""
        if MASKED:
            v = tl.load(P + offs, mask=offs < numel, other=0.0)
        else:
            v = tl.load(P + offs)
        return v.to(ACC)

    @triton.jit
    def _flat_store(P, offs, v, numel, MASKED: tl.constexpr):
        """P[offs] = v in P's dtype; MASKED (the last, partial block): offsets past numel untouched."""
        if MASKED:
            tl.store(P + offs, v.to(P.dtype.element_ty), mask=offs < numel)
        else:
            tl.store(P + offs, v.to(P.dtype.element_ty))

    @triton.jit
    def _act_fwd_block(A, B, Y, offs, numel, ACT: tl.constexpr, GATED: tl.constexpr, ACC: tl.constexpr,
                       PRECISE: tl.constexpr, DIV_RN: tl.constexpr, MASKED: tl.constexpr):
        y, _ = _act(_flat_load(A, offs, numel, ACC, MASKED), ACT, PRECISE, DIV_RN)
        if GATED:
            y = y * _flat_load(B, offs, numel, ACC, MASKED)
        _flat_store(Y, offs, y, numel, MASKED)

    @triton.jit
    def _act_fwd_flat(
        A, B, Y,                  # input (gate), up (GATED) and y: contiguous, numel elements each
        numel,
        ACT: tl.constexpr, GATED: tl.constexpr, ACC: tl.constexpr, PRECISE: tl.constexpr,
        DIV_RN: tl.constexpr, INT64: tl.constexpr, BLOCK: tl.constexpr, TAIL_APART: tl.constexpr,
    ):
        """y = f(a) (* b) over BLOCK elements a program: one flat offset for every operand.

        TAIL_APART (the plan sets it where numel is not a multiple of 16): whole blocks unmasked,
        only the last, partial block masked. Triton vectorises a masked access only where it can
        prove the mask constant over the vector; a numel that is not a multiple of 16 carries no
        divisibility, so masking every block made every access one element wide (4097 x 1000 fp16:
        2-byte loads and stores). Elsewhere the launch marks numel divisible by 16 and every block
        takes the masked path, vectorised (one path: fewer registers than the two)."""
        pid = tl.program_id(0)
        if INT64:
            pid = pid.to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        if TAIL_APART:
            if (pid + 1) * BLOCK <= numel:
                _act_fwd_block(A, B, Y, offs, numel, ACT, GATED, ACC, PRECISE, DIV_RN, False)
            else:
                _act_fwd_block(A, B, Y, offs, numel, ACT, GATED, ACC, PRECISE, DIV_RN, True)
        else:
            _act_fwd_block(A, B, Y, offs, numel, ACT, GATED, ACC, PRECISE, DIV_RN, True)

    @triton.jit
    def _act_bwd_block(DY, A, B, DA, DB, offs, numel, ACT: tl.constexpr, GATED: tl.constexpr,
                       NEED_A: tl.constexpr, NEED_B: tl.constexpr, ACC: tl.constexpr, PRECISE: tl.constexpr,
                       DIV_RN: tl.constexpr, MASKED: tl.constexpr):
        dy = _flat_load(DY, offs, numel, ACC, MASKED)
        f, df = _act(_flat_load(A, offs, numel, ACC, MASKED), ACT, PRECISE, DIV_RN)
        if GATED:
            b = _flat_load(B, offs, numel, ACC, MASKED)
            if NEED_A:
                _flat_store(DA, offs, dy * b * df, numel, MASKED)
            if NEED_B:
                _flat_store(DB, offs, dy * f, numel, MASKED)
        else:
            _flat_store(DA, offs, dy * df, numel, MASKED)

    @triton.jit
    def _act_bwd_flat(
        DY, A, B, DA, DB,         # dy, input (gate), up; gradients of input (gate) and up: contiguous
        numel,
        ACT: tl.constexpr, GATED: tl.constexpr, NEED_A: tl.constexpr, NEED_B: tl.constexpr, ACC: tl.constexpr,
        PRECISE: tl.constexpr, DIV_RN: tl.constexpr, INT64: tl.constexpr, BLOCK: tl.constexpr,
        TAIL_APART: tl.constexpr,
    ):
        """da = dy * f'(a) (* b), db = dy * f(a) over BLOCK elements a program; TAIL_APART as the
        forward's."""
        pid = tl.program_id(0)
        if INT64:
            pid = pid.to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        if TAIL_APART:
            if (pid + 1) * BLOCK <= numel:
                _act_bwd_block(DY, A, B, DA, DB, offs, numel, ACT, GATED, NEED_A, NEED_B, ACC, PRECISE, DIV_RN,
                               False)
            else:
                _act_bwd_block(DY, A, B, DA, DB, offs, numel, ACT, GATED, NEED_A, NEED_B, ACC, PRECISE, DIV_RN,
                               True)
        else:
            _act_bwd_block(DY, A, B, DA, DB, offs, numel, ACT, GATED, NEED_A, NEED_B, ACC, PRECISE, DIV_RN, True)

    @triton.jit
    def _offsets(r, c, O1, O2, s0, s1, s2, sc):
        """Element offsets of a (rows r) x (columns c) tile: row r = (i0, i1, i2) over (O0, O1, O2)."""
        t = r // O2
        row = (t // O1) * s0 + (t % O1) * s1 + (r % O2) * s2
        return row[:, None] + (c * sc)[None, :]

    @triton.jit
    def _act_fwd_strided(
        A, B, Y,                                  # input (gate); bias (BIAS) or up (GATED); y
        a_base, a_s0, a_s1, a_s2, a_sc,           # input: base offset, three row-axis strides, column stride
        b_base, b_s0, b_s1, b_s2, b_sc,           # bias (row strides 0) or up, likewise
        y_base, y_s0, y_s1, y_s2, y_sc,           # y, likewise
        R, C, O1, O2, col_blocks,                 # rows (O0 x O1 x O2), columns, row-axis sizes, column blocks
        ACT: tl.constexpr, MODE: tl.constexpr, ACC: tl.constexpr, PRECISE: tl.constexpr,
        DIV_RN: tl.constexpr, INT64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """y = f(a (+ bias)) (* up) over a BLOCK_R x BLOCK_C tile of any strided layout."""
        pid = tl.program_id(0)
        if INT64:
            pid = pid.to(tl.int64)
        r = (pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = (pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r < R)[:, None] & (c < C)[None, :]
        a = tl.load(A + a_base + _offsets(r, c, O1, O2, a_s0, a_s1, a_s2, a_sc), mask=mask, other=0.0).to(ACC)
        if MODE == 1:
            a += tl.load(B + b_base + _offsets(r, c, O1, O2, b_s0, b_s1, b_s2, b_sc), mask=mask, other=0.0).to(ACC)
        y, _ = _act(a, ACT, PRECISE, DIV_RN)
        if MODE == 2:
            y = y * tl.load(B + b_base + _offsets(r, c, O1, O2, b_s0, b_s1, b_s2, b_sc), mask=mask,
                            other=0.0).to(ACC)
        tl.store(Y + y_base + _offsets(r, c, O1, O2, y_s0, y_s1, y_s2, y_sc), y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _act_bwd_strided(
        DY, A, B, DA, DB, PART,                   # dy, input (gate), bias / up; gradients; bias partials
        dy_base, dy_s0, dy_s1, dy_s2, dy_sc,      # each strided operand: base offset, row strides, column stride
        a_base, a_s0, a_s1, a_s2, a_sc,
        b_base, b_s0, b_s1, b_s2, b_sc,
        da_base, da_s0, da_s1, da_s2, da_sc,
        db_base, db_s0, db_s1, db_s2, db_sc,
        part_row, R, C, O1, O2, col_blocks,       # first partial row of this launch; sizes as the forward's
        rows_per_program,                         # rows a program walks, BLOCK_R at a time
        ACT: tl.constexpr, MODE: tl.constexpr, NEED_A: tl.constexpr, NEED_B: tl.constexpr, ACC: tl.constexpr,
        PRECISE: tl.constexpr, DIV_RN: tl.constexpr, INT64: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr, PACKED: tl.constexpr,
    ):
        """The gradients of ``rows_per_program`` rows x BLOCK_C columns; BIAS: their column sums too,
        written as the program's own row of PART (no other program touches it). PACKED: d up is the
        second half of DA's tensor (DB None; db_base points there)."""
        pid = tl.program_id(0)
        if INT64:
            pid = pid.to(tl.int64)
        pid_r = pid // col_blocks
        c = (pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        first = pid_r * rows_per_program
        last = tl.minimum(first + rows_per_program, R)
        dbias = tl.zeros([BLOCK_R, BLOCK_C], ACC)
        for start in range(first, last, BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)
            mask = (r < last)[:, None] & (c < C)[None, :]
            dy = tl.load(DY + dy_base + _offsets(r, c, O1, O2, dy_s0, dy_s1, dy_s2, dy_sc), mask=mask,
                         other=0.0).to(ACC)
            a = tl.load(A + a_base + _offsets(r, c, O1, O2, a_s0, a_s1, a_s2, a_sc), mask=mask, other=0.0).to(ACC)
            if MODE == 2:
                b = tl.load(B + b_base + _offsets(r, c, O1, O2, b_s0, b_s1, b_s2, b_sc), mask=mask,
                            other=0.0).to(ACC)
                f, df = _act(a, ACT, PRECISE, DIV_RN)
                if NEED_A:
                    tl.store(DA + da_base + _offsets(r, c, O1, O2, da_s0, da_s1, da_s2, da_sc),
                             (dy * b * df).to(DA.dtype.element_ty), mask=mask)
                if NEED_B:
                    DB_OUT = DA if PACKED else DB
                    tl.store(DB_OUT + db_base + _offsets(r, c, O1, O2, db_s0, db_s1, db_s2, db_sc),
                             (dy * f).to(DB_OUT.dtype.element_ty), mask=mask)
            else:
                if MODE == 1:
                    a += tl.load(B + b_base + _offsets(r, c, O1, O2, b_s0, b_s1, b_s2, b_sc), mask=mask,
                                 other=0.0).to(ACC)
                f, df = _act(a, ACT, PRECISE, DIV_RN)
                dx = dy * df
                if NEED_A:
                    tl.store(DA + da_base + _offsets(r, c, O1, O2, da_s0, da_s1, da_s2, da_sc),
                             dx.to(DA.dtype.element_ty), mask=mask)
                if MODE == 1 and NEED_B:
                    dbias += tl.where(mask, dx, 0.0)
        if MODE == 1 and NEED_B:
            tl.store(PART + (part_row + pid_r) * C + c, tl.sum(dbias, 0), mask=c < C)



# ----------------------------------------------------------------------------------------------
# Triton plans: layout (merged dims, per-operand strides), blocks, launch arguments built once
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ActivationLayout:
    """The operands' shared index space after merging dims.

    flat: every operand contiguous with the same offsets (one flat offset). Otherwise rows x
    columns: rows = O0 * O1 * O2 (merged row axes), columns = the last merged axis; per operand,
    strides (s0, s1, s2, sc) and per host launch a base offset (dims beyond four are walked on
    the host, one launch per index: rare layouts only).
    """

    flat: bool
    numel: int
    rows: int
    cols: int
    outer: tuple[int, int, int]
    strides: tuple[tuple[int, int, int, int], ...]   # per operand
    host_bases: tuple[tuple[int, ...], ...]           # per launch, per operand
    extent: int                                       # largest element offset + 1 any operand reaches


def _operands(problem: ActivationProblem) -> tuple[tuple[int, ...], list[tuple[int, ...]], list[int], list[bool]]:
    """(elementwise shape, strides, base offsets, present) of the kernel's operands in its order:
    forward (A, B, Y), backward (DY, A, B, DA, DB)."""
    shape, mode, packed = problem.out_shape, problem.mode, problem.packed
    if mode == BIAS and not shape:
        shape = (1,)  # a 0-d input: one column, its bias the 0-d bias
    rank = len(shape)
    zeros = (0,) * rank
    contiguous = contiguous_strides(shape)
    if problem.backward:
        dy, a, b = (problem.strides + (None,))[:3]
    else:
        dy, (a, b) = None, (problem.strides + (None,))[:2]
    if mode == BIAS:
        a = a if len(a) == rank else zeros          # a 0-d input
        b = zeros[:-1] + ((b[-1] if b else 0),)     # the bias walks the last axis only
    half = problem.shape[-1] // 2 if packed else 0
    a_ops = [(a, 0, True), (b if mode != UNARY else zeros, 0, mode != UNARY)]
    if packed:
        a_ops[1] = (a, half * a[-1], True)
    if not problem.backward:
        ops = a_ops + [(contiguous, 0, True)]
    else:
        full = contiguous_strides(problem.shape) if packed else contiguous
        need_a, need_b = problem.needs
        da = (full, 0, need_a)
        if mode == GATED:
            db = (full, half, True) if packed else (contiguous, 0, need_b)
        else:
            db = (zeros, 0, False)
        ops = [(dy if len(dy) == rank else zeros, 0, True)] + a_ops + [da, db]
    return (shape, [s if p else zeros for s, _, p in ops], [base for _, base, _ in ops], [p for _, _, p in ops])


def _layout(problem: ActivationProblem) -> ActivationLayout:
    shape, strides, bases, present = _operands(problem)
    count = len(strides)
    keep_last = problem.mode == BIAS  # the bias index is the last axis: never merged into the rows
    dims = [(size, tuple(s[d] for s in strides)) for d, size in enumerate(shape)]
    last = dims.pop() if keep_last else None
    merged: list[tuple[int, tuple[int, ...]]] = []
    for size, st in dims:
        if size == 1:
            continue
        if merged and all(merge_dims((merged[-1][0], size), (merged[-1][1][k], st[k])) is not None
                          for k in range(count)):
            merged[-1] = (merged[-1][0] * size, st)
        else:
            merged.append((size, st))
    if last is not None:
        merged.append(last)
    numel = math.prod(shape)
    extent = 1 + max((base + sum((size - 1) * st[k] for size, st in merged) for k, base in enumerate(bases)
                      if present[k]), default=0)
    flat = (not keep_last and len(merged) <= 1 and not any(bases)
            and all(st[k] == 1 for _, st in merged for k in range(count) if present[k]))
    zeros = (0,) * count
    if not merged:
        merged = [(1, zeros)]
    cols, s_c = merged[-1]
    outer = [(1, zeros)] * max(0, 4 - len(merged)) + merged[:-1]
    host, (o0, s0), (o1, s1), (o2, s2) = outer[:-3], outer[-3], outer[-2], outer[-1]
    host_bases = tuple(
        tuple(bases[k] + sum(i * st[k] for i, (_, st) in zip(index, host)) for k in range(count))
        for index in itertools.product(*(range(size) for size, _ in host)))
    per_operand = tuple((s0[k], s1[k], s2[k], s_c[k]) for k in range(count))
    return ActivationLayout(flat, numel, o0 * o1 * o2, cols, (o0, o1, o2), per_operand, host_bases, extent)


def _tile(h: ActivationHeuristics, rows: int, cols: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): the column block (a power of two, at most ``block``, down to a quarter
    of it) that pads the columns least, and as many rows as fill ``block``."""
    cap = min(h.block, next_pow2(max(cols, 1)))
    best = cap
    for bc in (cap // 2, cap // 4):
        if bc >= 1 and triton.cdiv(cols, bc) * bc < triton.cdiv(cols, best) * best:
            best = bc
    return max(1, min(h.block // best, next_pow2(max(rows, 1)))), best


def _prepare_triton(problem: ActivationProblem) -> Launch:
    h = problem.heuristics
    layout = _layout(problem)
    acc = problem.acc_dtype
    mode, backward = problem.mode, problem.backward
    need_a, need_b = problem.needs
    precise = h.precise_math and not triton_interpreting()
    meta = dict(ACT=problem.act, ACC=tl.float64 if acc == torch.float64 else tl.float32, PRECISE=precise,
                DIV_RN=precise and acc == torch.float32,
                INT64=max(layout.extent, layout.numel) + h.block >= h.int64_from)
    workspace = 0
    if layout.numel == 0 or (backward and not (need_a or need_b)):
        def run(tensors, outputs):
            if backward and mode == BIAS and need_b:
                outputs[1].zero_()  # the bias gradient of no element
        return Launch(run, KernelChoice(f"{_base(problem.op)}_empty", "triton", (("plan", "empty"),)), acc)

    if layout.flat:
        block = min(h.block, max(64, next_pow2(layout.numel)))
        # numel not a multiple of 16: the launch marks no divisibility on it, so whole blocks go unmasked
        meta.update(BLOCK=block, TAIL_APART=layout.numel % 16 != 0, num_warps=h.num_warps(block), num_stages=1)
        grid = (triton.cdiv(layout.numel, block),)
        numel = layout.numel
        if not backward:
            meta.update(GATED=mode == GATED)
            launch_fwd = launcher(_act_fwd_flat, grid, trailing=(numel,), **meta)

            def run(tensors, y):
                a = tensors[0]
                launch_fwd(a, tensors[1] if mode == GATED else None, y)
        else:
            meta.update(GATED=mode == GATED, NEED_A=need_a, NEED_B=need_b)
            launch_bwd = launcher(_act_bwd_flat, grid, trailing=(numel,), **meta)

            def run(tensors, outputs):
                dy, a = tensors[0], tensors[1]
                if mode == GATED:
                    da, db = outputs
                    launch_bwd(dy, a, tensors[2], da if need_a else None, db if need_b else None)
                else:
                    launch_bwd(dy, a, None, outputs, None)
        params = (("plan", "flat"), ("BLOCK", block), ("num_warps", meta["num_warps"]), ("int64", meta["INT64"]),
                  ("tail_apart", meta["TAIL_APART"]))
        return Launch(run, KernelChoice(f"{_base(problem.op)}_{'bwd' if backward else 'fwd'}_flat", "triton", params),
                      acc)

    rows, cols = layout.rows, layout.cols
    block_r, block_c = _tile(h, rows, cols)
    col_blocks = triton.cdiv(cols, block_c)
    _, o1, o2 = layout.outer
    meta.update(MODE=mode, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=h.num_warps(block_r * block_c), num_stages=1)

    def operand_args(bases):
        args = []
        for base, strides in zip(bases, layout.strides):
            args += [base, *strides]
        return args

    if not backward:
        grid = (triton.cdiv(rows, block_r) * col_blocks,)
        # every scalar argument is fixed by the plan: bound once here, not per call
        launches = [launcher(_act_fwd_strided, grid, trailing=(*operand_args(bases), rows, cols, o1, o2, col_blocks),
                             **meta) for bases in layout.host_bases]

        def run(tensors, y):
            a = tensors[0]
            b = a if mode == UNARY or tensors[1] is None else tensors[1]
            for launch in launches:
                launch(a, b, y)
        kernel = "fwd_strided"
        rows_per_program = block_r
    else:
        rows_per_program = block_r
        groups = triton.cdiv(rows, block_r)
        if mode == BIAS and need_b:
            wanted = max(1, triton.cdiv(sm_count(problem.device) * h.bias_programs_per_sm, col_blocks))
            groups = max(1, min(groups, wanted))
            rows_per_program = triton.cdiv(triton.cdiv(rows, groups), block_r) * block_r
            groups = triton.cdiv(rows, rows_per_program)
        parts = groups * len(layout.host_bases)
        grid = (groups * col_blocks,)
        meta.update(NEED_A=need_a, NEED_B=need_b, PACKED=problem.packed)
        launches = [launcher(_act_bwd_strided, grid, trailing=(*operand_args(bases), index * groups, rows, cols, o1,
                                                               o2, col_blocks, rows_per_program), **meta)
                    for index, bases in enumerate(layout.host_bases)]
        with_partials = mode == BIAS and need_b
        if with_partials:
            workspace = parts * cols * acc.itemsize
            sum_columns = column_sum(parts, cols, h.reduce_block, h.reduce_parts)

        def run(tensors, outputs):
            dy, a = tensors[0], tensors[1]
            if mode == UNARY:
                da = db = outputs
                b = a
            else:
                da, db = outputs
                b = a if tensors[2] is None else tensors[2]
                if problem.packed:  # d up: the second half of da's tensor, through DA (PACKED)
                    db = None
            part = torch.empty((parts, cols), dtype=acc, device=dy.device) if with_partials else None
            # absent pointers None; packed: da's tensor once, for both halves
            da_arg = da if need_a or problem.packed else None
            for launch in launches:
                launch(dy, a, b, da_arg, db if mode == GATED and need_b else None, part)
            if with_partials:
                sum_columns(part, db)
        kernel = "bwd_strided"
    params = (("plan", "strided"), ("BLOCK_R", block_r), ("BLOCK_C", block_c), ("num_warps", meta["num_warps"]),
              ("rows_per_program", rows_per_program), ("host_launches", len(layout.host_bases)),
              ("int64", meta["INT64"]))
    return Launch(run, KernelChoice(f"{_base(problem.op)}_{kernel}", "triton", params), acc,
                  workspace_bytes=workspace)


if triton_available():
    for _op in FORWARD_OPS + BACKWARD_OPS:
        register(_op, backend="triton", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
                 name=f"{_op}_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.<op> and <op>_backward, with autograd
# ----------------------------------------------------------------------------------------------

_BOTH = (True, True)
_MODES = {op: _mode(op) for op in FORWARD_OPS + BACKWARD_OPS}


def _check_like(op: str, name: str, t, ref_name: str, shape_name: str, shape, dtype, device) -> None:
    """``t`` a tensor of ``shape`` (``shape_name``), and ``ref_name``'s dtype and device, or the named error."""
    if not isinstance(t, Tensor):
        raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise argument_error(InvalidProblemError, op, name, f"has shape {tuple(t.shape)}; expected {tuple(shape)} "
                             f"({shape_name})")
    if t.dtype != dtype:
        raise argument_error(InvalidProblemError, op, name, f"has dtype {t.dtype} but {ref_name} has {dtype}")
    if t.device != device:
        raise argument_error(InvalidProblemError, op, name, f"is on {t.device} but {ref_name} is on {device}")


def _check_second(op: str, a: Tensor, b: Tensor | None) -> None:
    """bias_gelu's bias (shape a.shape[-1:], any float dtype) or a gated op's up (a's shape and
    dtype), on a's device."""
    if _MODES[op] == BIAS:
        if not (isinstance(b, Tensor) and b.shape == a.shape[-1:] and b.dtype in FLOATS and b.device == a.device):
            if isinstance(b, Tensor):
                float_dtype(op, "bias", b.dtype)
            _check_like(op, "bias", b, "input", "input.shape[-1:]", a.shape[-1:], getattr(b, "dtype", a.dtype),
                        a.device)
    elif b is not None and not (isinstance(b, Tensor) and b.shape == a.shape and b.dtype == a.dtype
                                and b.device == a.device):
        _check_like(op, "up", b, "gate", "gate's shape", a.shape, a.dtype, a.device)


def _run(op: str, tensors: tuple, a: Tensor, strides: tuple, approximate, packed: bool, needs=_BOTH,
         bias_dtype=None):
    descriptor = DESCRIPTORS[op](a.shape, a.dtype, a.device, approximate, strides, packed, needs,
                                 heuristics_for(ActivationHeuristics), bias_dtype)
    return cached_plan(descriptor).run_unchecked(tensors)


def _forward(op: str, a: Tensor, b: Tensor | None, approximate) -> Tensor:
    mode = _MODES[op]
    if b is not None or mode == BIAS:
        _check_second(op, a, b)
        return _run(op, (a, b), a, (a.stride(), b.stride()), approximate, False, _BOTH,
                    b.dtype if mode == BIAS else None)
    if mode == GATED:
        return _run(op, (a, None), a, (a.stride(), None), approximate, True)
    return _run(op, (a,), a, (a.stride(),), approximate, False)


def _backward(op: str, dy: Tensor, a: Tensor, b: Tensor | None, approximate, needs=_BOTH):
    mode = _MODES[op]
    packed = mode == GATED and b is None
    out_shape = a.shape[:-1] + (a.shape[-1] // 2,) if packed and a.dim() else a.shape
    if dy.shape != out_shape or dy.dtype != a.dtype or dy.device != a.device:
        _check_like(op, "dy", dy, _input_names(op)[1], "the forward output's shape", out_shape, a.dtype, a.device)
    if b is not None or mode == BIAS:
        _check_second(op, a, b)
        return _run(op, (dy, a, b), a, (dy.stride(), a.stride(), b.stride()), approximate, False, needs,
                    b.dtype if mode == BIAS else None)
    if packed:
        return _run(op, (dy, a, None), a, (dy.stride(), a.stride(), None), approximate, True, needs)
    return _run(op, (dy, a), a, (dy.stride(), a.stride()), approximate, False)


def _validate(op: str, a, b, approximate) -> None:
    """Every check the op makes, without running it (the fakes torch.compile traces with)."""
    if not isinstance(a, Tensor):
        raise argument_error(InvalidProblemError, op, _input_names(op)[0], f"must be a torch.Tensor, got "
                             f"{type(a).__name__}")
    if b is not None or _mode(op) == BIAS:
        _check_second(op, a, b)
    _describe(op, a.shape, a.dtype, a.device, approximate, None, _mode(op) == GATED and b is None,
              bias_dtype=b.dtype if _mode(op) == BIAS else None)


def _in_force(ctx):
    """The forward's heuristics for its backward: autograd may run it on another thread (CUDA
    devices have their own), where the caller's trainops.heuristics(...) block is not in force."""
    if heuristics_for(ActivationHeuristics) is ctx.heuristics:
        return contextlib.nullcontext()
    return heuristics(ctx.heuristics)


def _no_double_backward(op: str) -> None:
    if torch.is_grad_enabled():  # create_graph=True: the backward ops record no graph of their own
        raise UnsupportedError(f"trainops.{op}: double backward (create_graph=True) is not supported")


# -- unary: gelu, quick_gelu, silu ----------------------------------------------------------------

def _gelu_impl(input: Tensor, approximate: str) -> Tensor:
    return _forward("gelu", input, None, approximate)


def _quick_gelu_impl(input: Tensor) -> Tensor:
    return _forward("quick_gelu", input, None, None)


def _silu_impl(input: Tensor) -> Tensor:
    return _forward("silu", input, None, None)


def _gelu_fake(input, approximate):
    _validate("gelu", input, None, approximate)
    return input.new_empty(input.shape)


def _quick_gelu_fake(input):
    _validate("quick_gelu", input, None, None)
    return input.new_empty(input.shape)


def _silu_fake(input):
    _validate("silu", input, None, None)
    return input.new_empty(input.shape)


def _gelu_backward_impl(dy: Tensor, input: Tensor, approximate: str) -> Tensor:
    return _backward("gelu_backward", dy, input, None, approximate)


def _quick_gelu_backward_impl(dy: Tensor, input: Tensor) -> Tensor:
    return _backward("quick_gelu_backward", dy, input, None, None)


def _silu_backward_impl(dy: Tensor, input: Tensor) -> Tensor:
    return _backward("silu_backward", dy, input, None, None)


def _unary_backward_fake(dy, input, approximate=None):
    return input.new_empty(input.shape)


def _save_input(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs.input)
    ctx.approximate = getattr(inputs, "approximate", None)
    ctx.heuristics = heuristics_for(ActivationHeuristics)


def _unary_grad(backward_op, with_approximate: bool):
    def grad(ctx, dy) -> dict:
        _no_double_backward(backward_op.name.removesuffix("_backward"))
        x, = ctx.saved_tensors
        with _in_force(ctx):
            dx = backward_op(dy, x, ctx.approximate) if with_approximate else backward_op(dy, x)
        return {"input": dx}
    return grad


gelu_backward_op = custom_op("gelu_backward", _gelu_backward_impl, _unary_backward_fake, inline_triton=True)
quick_gelu_backward_op = custom_op("quick_gelu_backward", _quick_gelu_backward_impl, _unary_backward_fake,
                                   inline_triton=True)
silu_backward_op = custom_op("silu_backward", _silu_backward_impl, _unary_backward_fake, inline_triton=True)
gelu_op = custom_op("gelu", _gelu_impl, _gelu_fake, backward=_unary_grad(gelu_backward_op, True), save=_save_input,
                    inline_triton=True)
quick_gelu_op = custom_op("quick_gelu", _quick_gelu_impl, _quick_gelu_fake,
                          backward=_unary_grad(quick_gelu_backward_op, False), save=_save_input, inline_triton=True)
silu_op = custom_op("silu", _silu_impl, _silu_fake, backward=_unary_grad(silu_backward_op, False), save=_save_input,
                    inline_triton=True)


# -- bias_gelu ---------------------------------------------------------------------------------------

def _bias_gelu_impl(input: Tensor, bias: Tensor, approximate: str) -> Tensor:
    return _forward("bias_gelu", input, bias, approximate)


def _bias_gelu_fake(input, bias, approximate):
    _validate("bias_gelu", input, bias, approximate)
    return input.new_empty(input.shape)


def _bias_gelu_backward_impl(dy: Tensor, input: Tensor, bias: Tensor, approximate: str, needs_input: bool,
                             needs_bias: bool) -> tuple[Tensor, Tensor]:
    return _backward("bias_gelu_backward", dy, input, bias, approximate, (needs_input, needs_bias))


def _bias_gelu_backward_fake(dy, input, bias, approximate, needs_input, needs_bias):
    return (input.new_empty(input.shape if needs_input else (0,)),
            bias.new_empty(bias.shape if needs_bias else (0,)))


def _save_bias(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs.input, inputs.bias)
    ctx.approximate = inputs.approximate
    ctx.heuristics = heuristics_for(ActivationHeuristics)


def _bias_gelu_grad(ctx, dy) -> dict:
    _no_double_backward("bias_gelu")
    x, bias = ctx.saved_tensors
    needs = (ctx.needs_grad.input, ctx.needs_grad.bias)
    with _in_force(ctx):
        dx, dbias = bias_gelu_backward_op(dy, x, bias, ctx.approximate, *needs)
    return {"input": dx if needs[0] else None, "bias": dbias if needs[1] else None}


bias_gelu_backward_op = custom_op("bias_gelu_backward", _bias_gelu_backward_impl, _bias_gelu_backward_fake,
                                  inline_triton=True)
bias_gelu_op = custom_op("bias_gelu", _bias_gelu_impl, _bias_gelu_fake, backward=_bias_gelu_grad, save=_save_bias,
                         inline_triton=True)


# -- gated: swiglu, geglu ------------------------------------------------------------------------------

def _swiglu_impl(gate: Tensor, up: Optional[Tensor]) -> Tensor:
    return _forward("swiglu", gate, up, None)


def _geglu_impl(gate: Tensor, up: Optional[Tensor], approximate: str) -> Tensor:
    return _forward("geglu", gate, up, approximate)


def _gated_fake(op: str):
    def fake(gate, up, approximate=None):
        _validate(op, gate, up, approximate)
        shape = gate.shape if up is not None else gate.shape[:-1] + (gate.shape[-1] // 2,)
        return gate.new_empty(shape)
    return fake


def _swiglu_backward_impl(dy: Tensor, gate: Tensor, up: Optional[Tensor], needs_gate: bool,
                          needs_up: bool) -> tuple[Tensor, Tensor]:
    return _backward("swiglu_backward", dy, gate, up, None, (needs_gate, needs_up))


def _geglu_backward_impl(dy: Tensor, gate: Tensor, up: Optional[Tensor], approximate: str, needs_gate: bool,
                         needs_up: bool) -> tuple[Tensor, Tensor]:
    return _backward("geglu_backward", dy, gate, up, approximate, (needs_gate, needs_up))


def _gated_backward_fake(dy, gate, up, *rest):
    needs_gate, needs_up = rest[-2:]
    if up is None:  # packed: one gradient of the packed tensor's shape
        return gate.new_empty(gate.shape), gate.new_empty((0,))
    return gate.new_empty(gate.shape if needs_gate else (0,)), gate.new_empty(gate.shape if needs_up else (0,))


def _save_gated(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs.gate, inputs.up)
    ctx.packed = inputs.up is None
    ctx.approximate = getattr(inputs, "approximate", None)
    ctx.heuristics = heuristics_for(ActivationHeuristics)


def _gated_grad(backward_op, with_approximate: bool):
    def grad(ctx, dy) -> dict:
        _no_double_backward(backward_op.name.removesuffix("_backward"))
        gate, up = ctx.saved_tensors
        needs = _BOTH if ctx.packed else (ctx.needs_grad.gate, ctx.needs_grad.up)
        extra = (ctx.approximate,) if with_approximate else ()
        with _in_force(ctx):
            dgate, dup = backward_op(dy, gate, up, *extra, *needs)
        if ctx.packed:
            return {"gate": dgate}
        return {"gate": dgate if needs[0] else None, "up": dup if needs[1] else None}
    return grad


swiglu_backward_op = custom_op("swiglu_backward", _swiglu_backward_impl, _gated_backward_fake, inline_triton=True)
geglu_backward_op = custom_op("geglu_backward", _geglu_backward_impl, _gated_backward_fake, inline_triton=True)
swiglu_op = custom_op("swiglu", _swiglu_impl, _gated_fake("swiglu"), backward=_gated_grad(swiglu_backward_op, False),
                      save=_save_gated, inline_triton=True)
geglu_op = custom_op("geglu", _geglu_impl, _gated_fake("geglu"), backward=_gated_grad(geglu_backward_op, True),
                     save=_save_gated, inline_triton=True)
