"""Low-bit optimizer states and stochastic rounding: 8-bit blockwise Adam / AdamW / LAMB moments,
bf16 parameters rounded stochastically. Triton kernel, CPU path, registration (ops
``adam_step_lowbit``, ``lamb_step_lowbit``).

Blocks. A parameter of shape [R, ...] is seen as R rows of C = numel / R elements (its memory
order: the parameter must be contiguous). Each row is cut into chunks of at most W = 256
elements, and each chunk is one quantisation block with one float32 scale: the scales of a
parameter form a float32 tensor of shape [R, ceil(C / 256)]. Blocks never cross rows, so a
parameter split along dim 0 (FSDP2's ``Shard(0)``, any world size, any shard boundary, even one at
a flat offset that is not a multiple of 256) quantises each of its rows exactly as the whole
tensor does: the sharded state is the same state, and ``state_dict`` does not depend on the world
size.

Codes (one byte an element). A magnitude ``a`` in [0, TOP] (the element over its block's scale)
is stored as a small float: 2^E exponent groups of 2^M mantissa steps, the top group covering
[1/2, 1), group g >= 1 covering [2^(g - 2^E), 2^(g + 1 - 2^E)) and group 0 the linear
(subnormal) range below, rounded to nearest (half up):

    e = clamp(floor(log2 a), 1 - 2^E, -1);  k = (e - 1 + 2^E) * 2^M + floor(a * 2^-e * 2^M + 1/2)
    decode(k) = (k mod 2^M + 2^M [k >= 2^M]) * 2^(max(k >> M, 1) - 2^E - M)
    TOP = 1 - 2^-(M+1) (the largest code), scale = absmax(block) * (1 / TOP)

exp_avg (signed): sign bit + E=4, M=3, rounded to nearest (relative error <= 1/16 down to 2^-15
of the block's largest magnitude, absolute error <= 2^-19 of it below). exp_avg_sq: its square
root is stored, unsigned, E=4, M=4 (relative step 1/16..1/32 on sqrt(v) down to 2^-15, i.e.
gradients spanning 15 binary orders of magnitude in one block): storing sqrt(v) halves the
dynamic range the code must span, so that an element with a small but nonzero first moment never
meets a second moment rounded to 0 (an update of m / eps). sqrt(v) is requantised with
stochastic rounding (floor(a 2^-e 2^M + u), u uniform from the counter hash below, the high 16
bits): rounded to nearest, v froze, since its decay of 1 - beta2 = 0.1% a step never crosses half
a code step, and v stayed the largest g^2 seen (measured, tests' CPU MLP regression, 200 steps:
held-out loss float32 0.1332, 8-bit with v to nearest 0.1385, with v stochastic 0.1333; m
stochastic too 0.1337: m stays to nearest). Bytes per element of state: 2 + 8 / 256 (0.254 of
float32's 8). Which parameters keep float32 states is trainops.optim's choice (1-D, small,
non-contiguous: see its docstring).
Block scales hold inf/NaN when the block's moments do (the block then decodes to NaN, as a
float32 state would carry it).

The step (per element, float32; g after the unscale, clip and maximize of ops/optimizers.py):

    m0 = decode(m codes) * m scale;  v0 = (decode(v codes) * v scale)^2
    p *= 1 - lr * wd (AdamW) or g += wd * p (Adam);  m = m0 + (1 - beta1) (g - m0);
    v = beta2 v0 + (1 - beta2) g^2;  p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    store: m and sqrt(v) requantised per block (the update used the float32 m and v)

in one pass over every tensor of a bucket: bytes an element 28 -> 16.06 for float32 parameters
and gradients (read p, g, the two codes and scales; write p, codes, scales), 10.06 for bfloat16
parameters and gradients with stochastic rounding (22 with float32 states). amsgrad is not
supported with low-bit steps (trainops.optim refuses it by name). LAMB (prepare_lamb_lowbit_step):
two passes as ops/optimizers.py's, the norms of u taken from the stored (requantised) moments
that the second pass decodes again, so the trust ratio is the one of the applied update.

Stochastic rounding (``stochastic_rounding=True``; bfloat16 parameters without a float32
master): the updated float32 value x is written as bfloat16 by adding 16 random bits below
bfloat16's last mantissa bit and truncating, so E[bf16(x)] = x. The random bits are a
counter-based hash (xorshift-multiply, 32 bits) of (seed, tensor key, step t, the element's
global flat index): the same seed gives the same bits whatever the block sizes, the grid, the
bucket order or the sharding (a shard passes its global offset). ``stochastic_round_bf16`` is
the same function in torch (pure: no generator state); the kernel's hash is tested against it.
Per element the step costs one hash (the low 16 bits round p, the high 16 round sqrt(v)).

The Triton kernel: a program takes QB row chunks of one tensor (MultiTensorHeuristics.block / 256)
and loops over them in tiles of R chunks (TILE_ELEMENTS_PER_THREAD elements a thread), its
per-tensor work (pointers, hyper-parameters, bias corrections, random stream) once a program.

found_inf, grad_scale, clip, tensor hyper-parameters and the step counters are as in
ops/optimizers.py (nothing written when found_inf is set; no host synchronisation).
The CPU path computes the same formulas with torch ops (one float32 tensor op at a time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidProblemError, argument_error
from ..plan import KernelChoice, heuristics_for
from ..registry import register, register_op, triton_available, triton_interpreting
from ._common import capturing
from .amp import TRITON_FLOATS
from .multi_tensor import (MultiTensorHeuristics, MultiTensorLaunch, MultiTensorProblem, TensorTable, _to_device,
                           check_columns, column_dtypes_ok, multi_tensor_describer, multi_tensor_launch)
from .optimizers import PreparedStep, _check_hyper, _check_step_scalars, _cpu_grads, _hyper, _skipped, _value

TILE_ELEMENTS_PER_THREAD = 4
"""Elements a thread holds in one tile of the Triton step (a tile is TILE_ELEMENTS_PER_THREAD *
threads / 256 row chunks; a program loops over its chunks tile by tile). Not measured on a GPU:
chosen from the compiled code (ptxas for sm_90, Triton 3.9, this tree): one [8, 256] tile a program
at 4 warps (16 elements a thread) needed 244 registers a thread (2 programs, 8 warps an SM) and
mixed the float32 and uint8 accesses' layouts (shared-memory conversions); a loop over [2, 256]
tiles (4 a thread) needs 102 (float32 parameters; 115 bf16 with stochastic rounding: 4 programs, 16
warps an SM), all accesses in one layout (16-byte float32, 4-byte uint8 vectors), 537 instructions
a tile (134 an element, from about 170). Since then (maxnreg 64, benchmarks/count_lowbit_sass.py,
float32 8-bit): 118 an element before the lowbit-diet changes, 93.5 after them
(benchmarks/notes/lowbit-diet.md). benchmarks/probe_optim_lowbit_speed.py times it."""

MAX_REGISTERS: int | None = 64
"""A cap on the Triton step's registers a thread (Triton's ``maxnreg``), None for none. Uncapped,
the tiles compiled to 102 registers (float32, 8-bit) and 115 (bf16 + stochastic rounding) a
thread before the lowbit-diet changes, 116 and 110 after them (ptxas for sm_90, Triton 3.9,
benchmarks/count_lowbit_sass.py --maxnreg 0): 4 programs of 4 warps an SM either way. Measured on
the H200 before the lowbit-diet changes (benchmarks/probe_optim_lowbit_speed.py, 1.467 B parameters;
results/probe-optim-lowbit-speed-*-h200-20261129.json, four runs): 8-bit AdamW over float32
parameters 11.8-11.9 ms uncapped, 10.7 / 9.5 / 9.4 at 80, 9.2 / 8.7 at 64, 9.2 at 48; bf16 with
stochastic rounding 12.8 / 11.7 / 11.4 uncapped, 9.8 / 9.5 at 80, 9.6 at 64; with the cap of 64 as
the default, 9.16 (float32) and 9.11 (bf16 + stochastic rounding). After them, at 64 (Triton 3.6;
results/probe-optim-lowbit-speed-{main,lowbit-diet,main-2}-h200-20261129-s6.json, one call): 9.04 ms
(float32) and 8.54 (bf16 + stochastic rounding), main 9.58-9.74 and 9.86-9.93 before and after it;
the other caps were not timed on that kernel (offline, uncapped saves about 1 instruction an element
of 93.5). The cap changes no value."""


def _register_cap(device: torch.device) -> dict:
    """The launch option of MAX_REGISTERS: NVIDIA GPUs only (ROCm's Triton has no maxnreg; the
    interpreter ignores registers)."""
    if MAX_REGISTERS is None or triton_interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return {}
    return {"maxnreg": MAX_REGISTERS}

INTERPRETED_ELEMENTS_PER_THREAD = 1 << 20
"""The same under Triton's interpreter: a whole program one tile (the interpreter runs each tile
operation in numpy, so fewer, larger tiles are faster; the values are the same)."""

BLOCK_WIDTH = 256
"""Elements of a quantisation block (a row chunk): the issue's bound, bitsandbytes' and torchao's
8-bit block. Unmeasured as a tunable: fixed, since it is part of the stored state's layout."""


@dataclass(frozen=True)
class BlockCode:
    """A one-byte float code of magnitudes in [0, 1) (see the module docstring)."""

    exponent_bits: int
    mantissa_bits: int
    signed: bool

    @property
    def top(self) -> float:
        return 1.0 - 2.0 ** -(self.mantissa_bits + 1)


EXP_AVG_CODE = BlockCode(4, 3, signed=True)
EXP_AVG_SQ_CODE = BlockCode(4, 4, signed=False)   # of sqrt(exp_avg_sq)


def rows_of(shape) -> tuple[int, int]:
    """(rows, row length) of a parameter's blocks: dim 0 and the rest (a 1-D tensor is one row)."""
    if len(shape) < 2:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def scale_shape(shape) -> tuple[int, int]:
    rows, width = rows_of(shape)
    return rows, -(-width // BLOCK_WIDTH)


def _units(t: torch.Tensor) -> int:
    """Quantisation blocks of ``t`` (the unit the kernel's tables are cut in)."""
    rows, chunks = scale_shape(t.shape)
    return rows * chunks


# ----------------------------------------------------------------------------------------------
# Codes in torch (the CPU path and the optimizers' state conversions)
# ----------------------------------------------------------------------------------------------

def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e for int32 e in float32's normal range, exactly."""
    return ((e + 127) << 23).view(torch.float32)


def encode(a: torch.Tensor, code: BlockCode, noise: torch.Tensor | float = 0.5) -> torch.Tensor:
    """int32 codes of magnitudes ``a`` (float32, >= 0, <= code.top; see the module docstring),
    rounded to nearest (``noise`` 0.5) or stochastically (``noise``: uniform in [0, 1), a's shape)."""
    emin = 1 - (1 << code.exponent_bits)
    steps = 1 << code.mantissa_bits
    e = ((a.contiguous().view(torch.int32) >> 23) - 127).clamp(emin, -1)
    frac = a * _pow2(-e)
    k = (e - emin) * steps + torch.floor(frac * steps + noise).to(torch.int32)
    return k.clamp(0, (1 << (code.exponent_bits + code.mantissa_bits)) - 1)


def decode(k: torch.Tensor, code: BlockCode) -> torch.Tensor:
    """float32 magnitudes of int32 codes ``k``."""
    emin = 1 - (1 << code.exponent_bits)
    steps = 1 << code.mantissa_bits
    group = k >> code.mantissa_bits
    significand = (k & (steps - 1)) + torch.where(group > 0, steps, 0)
    return significand.to(torch.float32) * _pow2(group.clamp(min=1) - 1 + emin - code.mantissa_bits)


def _blocked(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, chunks, 256] float32, zero-padded at each row's end."""
    rows, width = rows_of(x.shape)
    chunks = -(-width // BLOCK_WIDTH)
    x = x.reshape(rows, width).to(torch.float32)
    return torch.nn.functional.pad(x, (0, chunks * BLOCK_WIDTH - width)).view(rows, chunks, BLOCK_WIDTH)


def _unblocked(x: torch.Tensor, shape) -> torch.Tensor:
    rows, width = rows_of(shape)
    return x.reshape(rows, -(-width // BLOCK_WIDTH) * BLOCK_WIDTH)[:, :width].reshape(shape)


def quantize(x: torch.Tensor, code: BlockCode, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes of x's shape, float32 scales [rows, chunks]) of ``x`` (any float dtype);
    rounded to nearest, or stochastically with ``noise`` (float32 uniform in [0, 1), x's shape)."""
    blocks = _blocked(x)
    absmax = blocks.abs().amax(dim=-1) + (blocks * 0.0).sum(dim=-1)  # inf / NaN reach the scale
    scale = absmax * torch.tensor(1.0 / code.top, dtype=torch.float32)
    inverse = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
    k = encode(torch.nan_to_num(blocks.abs() * inverse.unsqueeze(-1), nan=0.0, posinf=0.0), code,
               0.5 if noise is None else _blocked(noise))
    if code.signed:
        k = k | ((blocks < 0).to(torch.int32) << (code.exponent_bits + code.mantissa_bits))
    return _unblocked(k.to(torch.uint8), x.shape).contiguous(), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, code: BlockCode) -> torch.Tensor:
    """float32 tensor of ``codes``' shape from codes and their block scales."""
    k = _blocked(codes.to(torch.int32)).to(torch.int32)
    bits = code.exponent_bits + code.mantissa_bits
    value = decode(k & ((1 << bits) - 1), code)
    if code.signed:
        value = torch.where((k >> bits) & 1 == 1, -value, value)
    return _unblocked(value * scales.to(torch.float32).unsqueeze(-1), codes.shape).contiguous()


def quantize_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict:
    """The 8-bit state of float moments (``exp_avg_sq`` stored as its square root)."""
    m_codes, m_scales = quantize(exp_avg, EXP_AVG_CODE)
    v_codes, v_scales = quantize(exp_avg_sq.to(torch.float32).sqrt(), EXP_AVG_SQ_CODE)
    return {"exp_avg_codes": m_codes, "exp_avg_scales": m_scales, "exp_avg_sq_codes": v_codes,
            "exp_avg_sq_scales": v_scales}


def dequantize_moments(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) in float32 from an 8-bit state (quantize_moments' keys)."""
    m = dequantize(state["exp_avg_codes"], state["exp_avg_scales"], EXP_AVG_CODE)
    root = dequantize(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], EXP_AVG_SQ_CODE)
    return m, root * root


# ----------------------------------------------------------------------------------------------
# Stochastic rounding's random bits (torch; the Triton kernel computes the same hash)
# ----------------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_HASH_A, _HASH_B = 0x7FEB352D, 0x68E31DA5  # odd multipliers below 2^31 (products fit in int64)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply), on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * _HASH_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _HASH_B) & _MASK32
    return x ^ (x >> 16)


def _hash_int(x: int) -> int:
    return int(_hash32(torch.tensor([x & _MASK32], dtype=torch.int64))[0])


def tensor_stream(seed: int, key: int, step: int) -> int:
    """The per-(seed, tensor, step) 32-bit value the element hash starts from."""
    return _hash_int(_hash_int(_hash_int(seed) ^ (key & _MASK32)) ^ (step & _MASK32))


_GOLDEN = 0x9E3779B1


def random_bits(stream: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 in [0, 2^32)) per global element index (int64 tensor): one hash of
    the index's low word mixed with the stream and its high word. The low 16 bits round the
    parameter (stochastic_round_bf16), the high 16 the requantised exp_avg_sq (state_noise)."""
    return _hash32((index & _MASK32) ^ ((stream + (index >> 32) * _GOLDEN) & _MASK32))


def state_noise(stream: int, offset: int, shape, device) -> torch.Tensor:
    """The uniform [0, 1) values (16 bits) that round a tensor's requantised sqrt(exp_avg_sq)."""
    index = offset + torch.arange(math.prod(shape), dtype=torch.int64, device=device).view(shape)
    return (random_bits(stream, index) >> 16).to(torch.float32) * (1.0 / 65536)


def stochastic_round_bf16(x: torch.Tensor, seed: int, key: int, step: int, offset: int = 0) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 stochastically: up with probability equal to the
    fraction of the bfloat16 step x lies above the value below it (unbiased). The bits come from
    (seed, key, step, offset + flat index of each element): pure, no generator state. NaN stays NaN."""
    index = offset + torch.arange(x.numel(), dtype=torch.int64, device=x.device).view(x.shape)
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    rounded = (bits + (random_bits(tensor_stream(seed, key, step), index) & 0xFFFF)) & 0xFFFF0000
    rounded = torch.where(rounded >= 2 ** 31, rounded - 2 ** 32, rounded).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# The op: checks, tables, the prepared step
# ----------------------------------------------------------------------------------------------

register_op("adam_step_lowbit", multi_tensor_describer("adam_step_lowbit"))
register_op("lamb_step_lowbit", multi_tensor_describer("lamb_step_lowbit"))


class LowbitTable:
    """The cached tables of one low-bit bucket: a TensorTable cut in row chunks (blocks of
    ``block // 256`` chunks a program) and the per-tensor int64 ``meta`` [3, n_tensors]: row
    length, global flat offset of the tensor's first element (a shard's place in its parameter),
    stochastic rounding key; rebuilt only when they change."""

    def __init__(self):
        self._tables: dict = {}
        self._meta: dict = {}

    def tables(self, columns, scalars, validate, meta_rows):
        block = max(1, heuristics_for(MultiTensorHeuristics).block // BLOCK_WIDTH)
        table = self._tables.get(block)
        if table is None:
            table = self._tables[block] = TensorTable(block, units=_units)
        tables = table.tables(columns, scalars, validate=validate, user_columns=2, gradient_column=1)
        device = columns[0][0].device
        key = (device, tuple(meta_rows))
        meta = self._meta.get(key)
        if meta is None or capturing(device):
            host = torch.tensor([list(row) for row in meta_rows], dtype=torch.int64).reshape(3, -1)
            meta = _to_device(host, device, capturing(device))
            if not capturing(device):
                self._meta = {key: meta}
        return tables, meta


def _check_options(op, dtype, masters, sr_seed) -> None:
    """The options against the parameters' dtype: checked at every call (they are the call's, not
    the tensors', so the table's cache key does not hold them)."""
    if masters is not None and dtype not in (torch.float16, torch.bfloat16):
        raise argument_error(InvalidProblemError, op, "masters", f"are for half parameters; the parameters are {dtype}")
    if sr_seed is not None and (dtype != torch.bfloat16 or masters is not None):
        raise argument_error(InvalidProblemError, op, "stochastic_rounding",
                             f"(stochastic rounding) is for bfloat16 parameters without master weights; the "
                             f"parameters are {dtype}{' with masters' if masters is not None else ''}")


def _check(op, names, columns, steps, quantized) -> None:
    """Per-tensor checks, run when the bucket's tensors change (the options: _check_options, at every call)."""
    check_columns(op, names[:2], columns[:2])
    params = columns[0]
    dtype = params[0].dtype
    column_dtypes_ok(op, "grads", columns[1], dtype)
    for i, p in enumerate(params):
        if not p.is_contiguous():
            raise argument_error(InvalidProblemError, op, f"params[{i}]",
                                 f"is not contiguous (strides {p.stride()}); row blocks follow memory order")
    state_dtypes = {"exp_avgs": torch.uint8 if quantized else torch.float32,
                    "exp_avg_sqs": torch.uint8 if quantized else torch.float32,
                    "exp_avg_scales": torch.float32, "exp_avg_sq_scales": torch.float32, "masters": torch.float32}
    for name, column in zip(names[2:], columns[2:]):
        column_dtypes_ok(op, name, column, state_dtypes[name])
        if len(column) != len(params):
            raise argument_error(InvalidProblemError, op, name, f"has {len(column)} tensors for {len(params)} parameters")
        for i, (t, p) in enumerate(zip(column, params)):
            expected = scale_shape(p.shape) if name.endswith("_scales") else tuple(p.shape)
            if tuple(t.shape) != tuple(expected) or not t.is_contiguous() or t.device != p.device:
                raise argument_error(InvalidProblemError, op, f"{name}[{i}]",
                                     f"has shape {tuple(t.shape)} on {t.device}; expected a contiguous "
                                     f"{tuple(expected)} on {p.device}")
    if len(steps) != len(params):
        raise argument_error(InvalidProblemError, op, "steps", f"has {len(steps)} tensors for {len(params)} parameters")


def prepare_adam_lowbit_step(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, steps, *,
                             lr, beta1, beta2, eps, weight_decay, decoupled, maximize, masters=None,
                             stochastic_rounding: bool = False, seed: int = 0, keys=None, offsets=None,
                             table: LowbitTable | None = None) -> PreparedStep:
    """An Adam / AdamW step over a bucket, checked; nothing written until the returned step runs.

    ``exp_avg_scales`` is None: float32 moments (``exp_avgs`` / ``exp_avg_sqs`` float32 of the
    parameters' shapes: the step used for stochastic rounding of parameters that keep float32
    state). Otherwise 8-bit: uint8 codes of the parameters' shapes and float32 scales
    [rows, ceil(row / 256)] (the module docstring). ``stochastic_rounding``: round bfloat16
    parameters stochastically. The random bits (those, and the requantised exp_avg_sq's) come
    from ``seed``, ``keys[i]`` (int, default i: names tensor i in the hash), the step and the
    element's index in the whole parameter, ``offsets[i]`` + its flat index (shards: default 0).
    """
    return _prepare("adam_step_lowbit", params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, steps,
                    dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay),
                    dict(decoupled=bool(decoupled), maximize=bool(maximize)), masters, stochastic_rounding, seed, keys,
                    offsets, table)


def prepare_lamb_lowbit_step(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, steps, *,
                             lr, beta1, beta2, eps, weight_decay, bias_correction, maximize, masters=None,
                             stochastic_rounding: bool = False, seed: int = 0, keys=None, offsets=None,
                             table: LowbitTable | None = None, reduce_squares=None) -> PreparedStep:
    """A LAMB step over a bucket with 8-bit (or, for stochastic rounding, float32) moments, checked
    (arguments as prepare_adam_lowbit_step's; ``reduce_squares`` as ops/optimizers.py's LAMB).
    Two passes as the float32 LAMB: the new moments are stored (requantised) and the norms of p
    and u taken with u computed from the stored moments, which the second pass reads back, so the
    trust ratio is the one of the update applied."""
    return _prepare("lamb_step_lowbit", params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, steps,
                    dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay),
                    dict(bias_correction=bool(bias_correction), maximize=bool(maximize)), masters,
                    stochastic_rounding, seed, keys, offsets, table, reduce_squares=reduce_squares)


def _prepare(op, params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, steps, hyper, options,
             masters, stochastic_rounding, seed, keys, offsets, table, **extra) -> PreparedStep:
    lr, beta1, beta2, eps, weight_decay = (hyper[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    quantized = exp_avg_scales is not None
    names = ["params", "grads", "exp_avgs", "exp_avg_sqs",
             *(["exp_avg_scales", "exp_avg_sq_scales"] if quantized else []), *(["masters"] if masters else [])]
    columns = [params, grads, exp_avgs, exp_avg_sqs, *([exp_avg_scales, exp_avg_sq_scales] if quantized else []),
               *([masters] if masters else [])]
    _check_hyper(op, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise argument_error(InvalidProblemError, op, "seed", f"must be an int, got {seed!r}")
    sr_seed = seed if stochastic_rounding else None
    n = len(params)
    sr_keys = list(range(n)) if keys is None else list(keys)
    offsets = [0] * n if offsets is None else list(offsets)
    for name, values in (("keys", sr_keys), ("offsets", offsets)):
        if len(values) != n:
            raise argument_error(InvalidProblemError, op, name, f"has {len(values)} entries for {n} parameters")
    launch = multi_tensor_launch(op, params[0].device, params[0].dtype, **options, master=masters is not None,
                                 quantized=quantized, stochastic_rounding=sr_seed is not None)
    _check_options(op, params[0].dtype, masters, sr_seed)
    validate = lambda: _check(op, names, columns, steps, quantized)  # noqa: E731
    meta_rows = (tuple(rows_of(p.shape)[1] for p in params), tuple(offsets), tuple(sr_keys))
    tables = (table or LowbitTable()).tables(columns, [steps], validate, meta_rows)
    device = params[0].device if n else None
    if not n:
        return lambda grad_scale=None, found_inf=None, clip=None: None

    def write(grad_scale=None, found_inf=None, clip=None) -> None:
        _check_step_scalars(op, device, grad_scale, found_inf, clip)
        launch.run(columns, steps, tables=tables, grad_scale=grad_scale, found_inf=found_inf, clip=clip,
                   seed=seed, sr_keys=sr_keys, offsets=offsets, **hyper, **extra)

    return write


# ----------------------------------------------------------------------------------------------
# CPU path
# ----------------------------------------------------------------------------------------------

def _load_moments(columns, i: int, quantized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor i's (exp_avg, exp_avg_sq) in float32: decoded from its codes, or the states themselves."""
    if not quantized:
        return columns[2][i], columns[3][i]
    root = dequantize(columns[3][i], columns[5][i], EXP_AVG_SQ_CODE)
    return dequantize(columns[2][i], columns[4][i], EXP_AVG_CODE), root * root


def _store_moments(columns, i: int, m: torch.Tensor, v: torch.Tensor, quantized: bool, stream: int,
                   offset: int) -> None:
    """Write tensor i's new moments: exp_avg's code to nearest, sqrt(exp_avg_sq)'s stochastically
    (the noise of ``stream`` at the tensor's global ``offset``), or the float32 states."""
    if not quantized:
        columns[2][i].copy_(m)
        columns[3][i].copy_(v)
        return
    codes, scales = quantize(m, EXP_AVG_CODE)
    columns[2][i].copy_(codes)
    columns[4][i].copy_(scales)
    codes, scales = quantize(v.sqrt(), EXP_AVG_SQ_CODE, state_noise(stream, offset, v.shape, v.device))
    columns[3][i].copy_(codes)
    columns[5][i].copy_(scales)


def _store_parameter(params, masters, i: int, p: torch.Tensor, stochastic: bool, seed: int, key: int, step: int,
                     offset: int) -> None:
    """Write tensor i's updated float32 value: its master copy, and the parameter (rounded
    stochastically to bf16 when asked, else as ``copy_`` rounds)."""
    if masters:
        masters[i].copy_(p)
    params[i].copy_(stochastic_round_bf16(p, seed, key, step, offset) if stochastic else p)


def _prepare_adam_lowbit_cpu(problem: MultiTensorProblem) -> MultiTensorLaunch:
    decoupled, maximize = problem.option("decoupled"), problem.option("maximize")
    master, quantized = problem.option("master"), problem.option("quantized")

    stochastic = problem.option("stochastic_rounding")

    def run(columns, steps, *, tables, lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf, clip, seed,
            sr_keys, offsets):
        if _skipped(found_inf):
            return
        params, grads = columns[:2]
        masters = columns[-1] if master else None
        lr, beta1, beta2, weight_decay = map(_value, (lr, beta1, beta2, weight_decay))
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731  (float32 constants, as the kernel's)
        for i, g in enumerate(_cpu_grads(grads, grad_scale, clip, maximize)):
            steps[i] += 1
            t = steps[i].item()
            g = g.to(torch.float32)
            p = (masters[i] if masters else params[i]).to(torch.float32)
            m0, v0 = _load_moments(columns, i, quantized)
            if decoupled:
                p = p * (1 - f32(lr) * f32(weight_decay))
            else:
                g = g + f32(weight_decay) * p
            m = m0 + (1 - f32(beta1)) * (g - m0)
            v = v0 * f32(beta2) + (1 - f32(beta2)) * g * g
            step_size = f32(lr) / (1 - f32(beta1) ** t)
            denom = v.sqrt() / (1 - f32(beta2) ** t).sqrt() + f32(eps)
            p = p - step_size * (m / denom)
            _store_moments(columns, i, m, v, quantized, tensor_stream(seed, sr_keys[i], int(t)), offsets[i])
            _store_parameter(params, masters, i, p, stochastic, seed, sr_keys[i], int(t), offsets[i])

    return MultiTensorLaunch(run, KernelChoice("adam_step_lowbit_cpu", "cpu"), torch.float32)


def _prepare_lamb_lowbit_cpu(problem: MultiTensorProblem) -> MultiTensorLaunch:
    maximize, master = problem.option("maximize"), problem.option("master")
    quantized, stochastic = problem.option("quantized"), problem.option("stochastic_rounding")
    bias_correction = problem.option("bias_correction")

    def run(columns, steps, *, tables, lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf, clip, seed,
            sr_keys, offsets, reduce_squares=None):
        if _skipped(found_inf):
            return
        params, grads = columns[:2]
        masters = columns[-1] if master else None
        lr, beta1, beta2, weight_decay = map(_value, (lr, beta1, beta2, weight_decay))
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
        squares = torch.zeros(len(params), 2, dtype=torch.float32)
        pending = []
        for i, g in enumerate(_cpu_grads(grads, grad_scale, clip, maximize)):
            steps[i] += 1
            t = steps[i].item()
            g = g.to(torch.float32)
            p = (masters[i] if masters else params[i]).to(torch.float32)
            stream = tensor_stream(seed, sr_keys[i], int(t))
            m0, v0 = _load_moments(columns, i, quantized)
            m = m0 + (1 - f32(beta1)) * (g - m0)
            v = v0 * f32(beta2) + (1 - f32(beta2)) * g * g
            _store_moments(columns, i, m, v, quantized, stream, offsets[i])
            if quantized:   # u is taken from the stored moments (the second pass reads them back)
                m, v = _load_moments(columns, i, True)
            bc1 = 1 - f32(beta1) ** t if bias_correction else f32(1.0)
            bc2 = 1 - f32(beta2) ** t if bias_correction else f32(1.0)
            u = (m / bc1) / ((v / bc2).sqrt() + f32(eps)) + f32(weight_decay) * p
            squares[i, 0], squares[i, 1] = (p * p).sum(), (u * u).sum()
            pending.append((p, u, stream, t))
        if reduce_squares is not None:
            squares = squares.to(params[0].device) if params else squares
            reduce_squares(squares)
        norms = squares.sqrt()
        ratios = torch.where((norms[:, 0] > 0) & (norms[:, 1] > 0), norms[:, 0] / norms[:, 1], 1.0)
        for i, (p, u, stream, t) in enumerate(pending):
            p = p - (f32(lr) * ratios[i].cpu()) * u
            _store_parameter(params, masters, i, p, stochastic, seed, sr_keys[i], int(t), offsets[i])

    return MultiTensorLaunch(run, KernelChoice("lamb_step_lowbit_cpu", "cpu"), torch.float32)


register("lamb_step_lowbit", backend="cpu", dtypes=(torch.float32, torch.float16, torch.bfloat16), deterministic=True,
         accumulator="float32", name="lamb_step_lowbit_cpu")(_prepare_lamb_lowbit_cpu)
register("adam_step_lowbit", backend="cpu", dtypes=(torch.float32, torch.float16, torch.bfloat16), deterministic=True,
         accumulator="float32", name="adam_step_lowbit_cpu")(_prepare_adam_lowbit_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from .multi_tensor import TL_DTYPES, block_of_program, column_pointer, runtime_scalar
    from .optimizers import _advance_steps, _bias_correction, _lamb_trust_ratios, _step_of

    @triton.jit
    def _decode_tl(k, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, SIGNED: tl.constexpr):
        """float32 values of int32 codes (magnitude codes, and a sign bit above them when SIGNED), built
        from bits: the code's bits shifted to the top of a float's exponent and mantissa fields,
        (k_mag << (23 - M)), are a float whose exponent field is the group g (a denormal for g = 0:
        the codes' linear group is float32's own denormal range) and whose value is the code's times
        2^(2^E - 127), exactly; one exact multiply by 2^(127 - 2^E) gives the code's value. Equal, bit
        for bit, to significand * 2^(max(g, 1) - 2^E - M) (decode in torch), without a select between
        a normal and a linear formula (benchmarks/notes/lowbit-diet.md)."""
        if SIGNED:   # the byte at the top (sign at bit 31), moved down arithmetically, the copies cleared
            top = k << (31 - EXP_BITS - MAN_BITS)
            field = ((1 << (EXP_BITS + MAN_BITS)) - 1) << (23 - MAN_BITS)
            magnitude = (top >> (8 - EXP_BITS)) & (field - 0x7FFFFFFF - 1)   # field | the sign bit, as int32
        else:
            magnitude = (k & ((1 << (EXP_BITS + MAN_BITS)) - 1)) << (23 - MAN_BITS)
        # 2^(127 - 2^E) as a float32 constant (exact: a power of 2 in the normal range)
        return magnitude.to(tl.float32, bitcast=True) * float(2.0 ** (127 - (1 << EXP_BITS)))

    @triton.jit
    def _quantize_tl(x, top, noise, INV_TOP: tl.constexpr, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr,
                     SIGNED: tl.constexpr, STOCHASTIC: tl.constexpr):
        """(uint8 codes [R, W], float32 scales [R]) of x [R, W] (padding elements are 0), rounded to
        nearest (not STOCHASTIC; ``noise`` unused) or stochastically with ``noise`` (uint32 [R, W]: 16
        random bits, u = noise / 2^16 uniform in [0, 1)). ``top`` [R]: each row's integer max of |x|'s
        bits (the order of non-negative floats; inf and NaN above every finite value; the caller
        reduces both moments in one tl.max): a block holding inf or NaN gets a NaN scale, as
        quantize's max + sum(x * 0) in torch (its codes are then immaterial: the block decodes to NaN).

        The code of a = |x| / scale from a's bits. In the exponent groups (a >= 2^emin) the float's
        exponent and mantissa fields are the code's group and mantissa: k = (bits(a) - (126 + emin) *
        2^23 + r) >> (23 - M), where r is half a code step (2^(22 - M), to nearest, ties up) or
        u's 16 bits at the code step's scale (u * 2^(23 - M), stochastic): exact integer rounding,
        encode's floor(frac * 2^M + noise) without its float32 sum (the two differ only where that
        sum rounds up across an integer: never to nearest, under 1e-6 of the stochastic codes). In the
        linear group (a < 2^emin) encode's own float formula, floor(a * 2^(M - emin) + noise)."""
        magnitude = tl.abs(x)
        absmax = tl.where(top < 0x7F800000, top.to(tl.float32, bitcast=True), float("nan"))
        scale = absmax * INV_TOP
        inverse = tl.where(scale > 0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
        a = magnitude * inverse[:, None]   # in [0, TOP] but for inf / NaN elements (a NaN scale's block)
        emin: tl.constexpr = 1 - (1 << EXP_BITS)
        if STOCHASTIC:
            r = (noise >> 16) << (7 - MAN_BITS)   # u * 2^(23 - M) (M <= 7)
            u = (noise >> 16).to(tl.float32) * (1.0 / 65536)
        else:
            r = 1 << (22 - MAN_BITS)
            u = 0.5
        grouped = ((a.to(tl.uint32, bitcast=True) - ((126 + emin) << 23)) + r) >> (23 - MAN_BITS)
        linear = tl.floor(a * float(2.0 ** (MAN_BITS - emin)) + u).to(tl.uint32)
        k = tl.where(a < float(2.0 ** emin), linear, grouped)
        k = tl.minimum(k, (1 << (EXP_BITS + MAN_BITS)) - 1)   # a's rounding above TOP; NaN's bits
        if SIGNED:
            k = k | tl.where(x < 0, 1 << (EXP_BITS + MAN_BITS), 0).to(tl.uint32)
        return k.to(tl.uint8), scale

    @triton.jit
    def _hash32_tl(x):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x68E31DA5
        return x ^ (x >> 16)

    @triton.jit
    def _random_bits_tl(stream, index):
        """32 random bits (uint32) of (stream, int64 index): see random_bits."""
        high = ((index >> 32) * 0x9E3779B1).to(tl.uint32)   # int64 product, its low word
        return _hash32_tl((index & 0xFFFFFFFF).to(tl.uint32) ^ (stream + high))

    @triton.jit
    def _tile_bits_tl(stream, index_base, offsets, MASKED: tl.constexpr):
        """random_bits of the global indices index_base + offsets. MASKED: int64 offsets (the general
        path). Else int32 offsets in [0, 2^31) from an int64 base, in 32-bit arithmetic: the index's
        low word wraps, its carry goes to the high word (the same bits as _random_bits_tl)."""
        if MASKED:
            bits = _random_bits_tl(stream, index_base + offsets)
        else:   # the high word's term once a tile; an element whose low word wrapped takes it + 1's
            base_low = (index_base & 0xFFFFFFFF).to(tl.uint32)
            low = base_low + offsets.to(tl.uint32)
            mix = stream + (index_base >> 32).to(tl.uint32) * 0x9E3779B1
            bits = _hash32_tl(low ^ tl.where(low < base_low, mix + 0x9E3779B1, mix))
        return bits

    @triton.jit
    def _stochastic_bf16_tl(x, bits):
        """x (float32) rounded to bfloat16 with the low 16 of ``bits`` (uint32): see stochastic_round_bf16."""
        rounded = (((x.to(tl.uint32, bitcast=True) + (bits & 0xFFFF)) >> 16) << 16).to(tl.float32, bitcast=True)
        return tl.where(x == x, rounded, x).to(tl.bfloat16)

    @triton.jit
    def _load(pointer, offsets, mask, MASKED: tl.constexpr):
        if MASKED:
            value = tl.load(pointer + offsets, mask=mask, other=0)
        else:
            value = tl.load(pointer + offsets)
        return value

    @triton.jit
    def _store(pointer, offsets, value, mask, MASKED: tl.constexpr):
        if MASKED:
            tl.store(pointer + offsets, value, mask=mask)
        else:
            tl.store(pointer + offsets, value)

    @triton.jit
    def _gradient_tl(g_ptr, offsets, mask, grad_scale_ptr, clip_ptr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
                     MAXIMIZE: tl.constexpr, MASKED: tl.constexpr):
        g = _load(g_ptr, offsets, mask, MASKED).to(tl.float32)
        if HAS_SCALE:
            g = g * (1.0 / tl.load(grad_scale_ptr))
        if HAS_CLIP:
            g = g * tl.load(clip_ptr)
        if MAXIMIZE:
            g = -g
        return g

    @triton.jit
    def _param_tl(p_ptr, master_ptr, offsets, mask, MASTER_ROW: tl.constexpr, MASKED: tl.constexpr):
        """The float32 value the step updates: the master copy (MASTER_ROW >= 0) or the parameter."""
        if MASTER_ROW >= 0:
            p = _load(master_ptr, offsets, mask, MASKED)
        else:
            p = _load(p_ptr, offsets, mask, MASKED)
        return p.to(tl.float32)

    @triton.jit
    def _store_param_tl(p_ptr, master_ptr, offsets, mask, p, bits, P_DTYPE: tl.constexpr, MASTER_ROW: tl.constexpr,
                        SR: tl.constexpr, MASKED: tl.constexpr):
        if MASTER_ROW >= 0:
            _store(master_ptr, offsets, p, mask, MASKED)
        if SR:
            _store(p_ptr, offsets, _stochastic_bf16_tl(p, bits), mask, MASKED)
        else:
            _store(p_ptr, offsets, p.to(P_DTYPE), mask, MASKED)

    @triton.jit
    def _moments_tl(m_ptr, v_ptr, m_scale_ptr, v_scale_ptr, q, offsets, mask, row_mask, QUANTIZED: tl.constexpr,
                    MASKED: tl.constexpr):
        """(m, v) in float32: decoded from codes and block scales, or loaded."""
        if QUANTIZED:
            m_scale = _load(m_scale_ptr, q, row_mask, MASKED)
            v_scale = _load(v_scale_ptr, q, row_mask, MASKED)
            m = _decode_tl(_load(m_ptr, offsets, mask, MASKED).to(tl.int32), 4, 3, True) * m_scale[:, None]
            root = _decode_tl(_load(v_ptr, offsets, mask, MASKED).to(tl.int32), 4, 4, False) * v_scale[:, None]
            v = root * root
        else:
            m = _load(m_ptr, offsets, mask, MASKED)
            v = _load(v_ptr, offsets, mask, MASKED)
        return m, v

    @triton.jit
    def _store_moments_tl(m_ptr, v_ptr, m_scale_ptr, v_scale_ptr, q, offsets, mask, row_mask, m, v, root, bits,
                          QUANTIZED: tl.constexpr, STORED: tl.constexpr, MASKED: tl.constexpr):
        """Store m, v (requantised: m to nearest, sqrt(v) = ``root`` stochastically with the high 16 of
        ``bits``); returns the stored values (decoded again when STORED, else m and v as given)."""
        if QUANTIZED:
            tops = tl.max(tl.join(tl.abs(m), root).to(tl.int32, bitcast=True), axis=1)   # one reduction, both
            m_top, root_top = tl.split(tops)
            m_codes, m_scale = _quantize_tl(m, m_top, bits, 16.0 / 15.0, 4, 3, True, False)
            _store(m_ptr, offsets, m_codes, mask, MASKED)
            _store(m_scale_ptr, q, m_scale, row_mask, MASKED)
            v_codes, v_scale = _quantize_tl(root, root_top, bits, 32.0 / 31.0, 4, 4, False, True)
            _store(v_ptr, offsets, v_codes, mask, MASKED)
            _store(v_scale_ptr, q, v_scale, row_mask, MASKED)
            if STORED:
                m = _decode_tl(m_codes.to(tl.int32), 4, 3, True) * m_scale[:, None]
                stored_root = _decode_tl(v_codes.to(tl.int32), 4, 4, False) * v_scale[:, None]
                v = stored_root * stored_root
        else:
            _store(m_ptr, offsets, m, mask, MASKED)
            _store(v_ptr, offsets, v, mask, MASKED)
        return m, v

    @triton.jit
    def _lamb_update_tl(m, v, p, bc1, bc2, eps, weight_decay):
        return tl.div_rn(m / bc1, tl.sqrt_rn(v / bc2) + eps) + weight_decay * p

    @triton.jit
    def _lowbit_tile(p_ptr, g_ptr, m_ptr, v_ptr, m_scale_ptr, v_scale_ptr, master_ptr, q, offsets, mask, row_mask,
                     grad_scale_ptr, clip_ptr, ratio, lr, beta1, beta2, eps, weight_decay, step_size, inv_bc2_root,
                     bc1, bc2, stream, index_base, P_DTYPE: tl.constexpr, MODE: tl.constexpr, DECOUPLED: tl.constexpr,
                     MASTER_ROW: tl.constexpr, QUANTIZED: tl.constexpr, SR: tl.constexpr, HAS_SCALE: tl.constexpr,
                     HAS_CLIP: tl.constexpr, MAXIMIZE: tl.constexpr, MASKED: tl.constexpr):
        """One tile [R, W] of row chunks: elements at the pointers (already at the tile's first element
        when not MASKED) + ``offsets``, scales at the scale pointers + ``q``. MODE 0: the Adam step.
        MODE 1: LAMB's first pass (moments stored); returns the tile's sums of p^2 and u^2. MODE 2:
        LAMB's second pass (p -= lr * ratio * u). Returns (0, 0) but in MODE 1."""
        p = _param_tl(p_ptr, master_ptr, offsets, mask, MASTER_ROW, MASKED)
        m, v = _moments_tl(m_ptr, v_ptr, m_scale_ptr, v_scale_ptr, q, offsets, mask, row_mask, QUANTIZED, MASKED)
        bits = 0
        if (QUANTIZED and MODE != 2) or (SR and MODE != 1):   # one hash an element: v's noise and p's rounding
            bits = _tile_bits_tl(stream, index_base, offsets, MASKED)
        p_squares = 0.0
        u_squares = 0.0
        if MODE != 2:
            g = _gradient_tl(g_ptr, offsets, mask, grad_scale_ptr, clip_ptr, HAS_SCALE, HAS_CLIP, MAXIMIZE, MASKED)
            if MODE == 0:
                if DECOUPLED:
                    p = p * (1.0 - lr * weight_decay)
                else:
                    g = g + weight_decay * p
            m = m + (1.0 - beta1) * (g - m)
            v = v * beta2 + (1.0 - beta2) * g * g
        if MODE == 0:
            root = tl.sqrt_rn(v)
            p = p - step_size * tl.div_rn(m, root * inv_bc2_root + eps)   # 1 / sqrt(1 - beta2^t) once a program
            _store_moments_tl(m_ptr, v_ptr, m_scale_ptr, v_scale_ptr, q, offsets, mask, row_mask, m, v, root, bits,
                              QUANTIZED, False, MASKED)
            _store_param_tl(p_ptr, master_ptr, offsets, mask, p, bits, P_DTYPE, MASTER_ROW, SR, MASKED)
        else:
            if MODE == 1:
                m, v = _store_moments_tl(m_ptr, v_ptr, m_scale_ptr, v_scale_ptr, q, offsets, mask, row_mask, m, v,
                                         tl.sqrt_rn(v), bits, QUANTIZED, True, MASKED)
            u = _lamb_update_tl(m, v, p, bc1, bc2, eps, weight_decay)
            if MODE == 1:
                if MASKED:
                    u = tl.where(mask, u, 0.0)
                p_squares = tl.sum(tl.sum(p * p, axis=1), axis=0)
                u_squares = tl.sum(tl.sum(u * u, axis=1), axis=0)
            else:
                p = p - (lr * ratio) * u
                _store_param_tl(p_ptr, master_ptr, offsets, mask, p, bits, P_DTYPE, MASTER_ROW, SR, MASKED)
        return p_squares, u_squares

    @triton.jit
    def _lowbit_blocks(addresses, n_tensors, block_tensor, first_block, units, meta, grad_scale_ptr, found_inf_ptr,
                       clip_ptr, partials, ratios, lr, beta1, beta2, eps, weight_decay, seed_stream,
                       P_DTYPE: tl.constexpr, LR_POINTER: tl.constexpr, BETA1_POINTER: tl.constexpr,
                       BETA2_POINTER: tl.constexpr, WD_POINTER: tl.constexpr, MODE: tl.constexpr,
                       DECOUPLED: tl.constexpr, BIAS_CORRECTION: tl.constexpr, MASTER_ROW: tl.constexpr,
                       STEP_ROW: tl.constexpr, QUANTIZED: tl.constexpr, SR: tl.constexpr, HAS_SCALE: tl.constexpr,
                       HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr, MAXIMIZE: tl.constexpr,
                       ALIGNED: tl.constexpr, ROWS_ALIGNED: tl.constexpr, QB: tl.constexpr, R: tl.constexpr,
                       W: tl.constexpr):
        """One program: QB row chunks (quantisation blocks) of W elements of one tensor, in QB / R
        tiles of R chunks one after the other (_lowbit_tile's MODE): the per-program work (tables,
        hyper-parameters, bias corrections, the tensor's random stream) once, a tile's registers
        for R chunks (R * W / threads elements a thread). meta [3, n_tensors] int64: row length,
        global offset, rounding key. ROWS_ALIGNED: every row length of the bucket is a multiple of W
        (a program's chunks are then contiguous, and a tile's offsets int32 from an int64 base)."""
        pid = tl.program_id(0)
        t, start, limit = block_of_program(block_tensor, first_block, units, QB)
        if HAS_FOUND_INF:
            limit = tl.where(tl.load(found_inf_ptr) == 0, limit, 0)
        lr = runtime_scalar(lr, LR_POINTER)
        beta1 = runtime_scalar(beta1, BETA1_POINTER)
        beta2 = runtime_scalar(beta2, BETA2_POINTER)
        weight_decay = runtime_scalar(weight_decay, WD_POINTER)
        step = _step_of(addresses, n_tensors, t, STEP_ROW)
        step_size = lr / _bias_correction(beta1, step)
        inv_bc2_root = tl.div_rn(1.0, tl.sqrt_rn(_bias_correction(beta2, step)))
        bc1 = 1.0
        bc2 = 1.0
        if BIAS_CORRECTION:
            bc1 = _bias_correction(beta1, step)
            bc2 = _bias_correction(beta2, step)
        ratio = 0.0
        if MODE == 2:
            ratio = tl.load(ratios + t)
        width = tl.load(meta + t)
        global_offset = tl.load(meta + n_tensors + t)
        key = tl.load(meta + 2 * n_tensors + t).to(tl.uint32)
        stream = _hash32_tl(_hash32_tl(seed_stream.to(tl.uint32) ^ key) ^ step.to(tl.uint32))
        # the tensor's pointers, once a program (the tiles' loads then wait on one memory trip, not two)
        p_ptr = column_pointer(addresses, n_tensors, 0, t, P_DTYPE, ALIGNED)
        g_ptr = column_pointer(addresses, n_tensors, 1, t, P_DTYPE, ALIGNED)
        if QUANTIZED:
            m_ptr = column_pointer(addresses, n_tensors, 2, t, tl.uint8, ALIGNED)
            v_ptr = column_pointer(addresses, n_tensors, 3, t, tl.uint8, ALIGNED)
            m_scale_ptr = column_pointer(addresses, n_tensors, 4, t, tl.float32, ALIGNED)
            v_scale_ptr = column_pointer(addresses, n_tensors, 5, t, tl.float32, ALIGNED)
        else:
            m_ptr = column_pointer(addresses, n_tensors, 2, t, tl.float32, ALIGNED)
            v_ptr = column_pointer(addresses, n_tensors, 3, t, tl.float32, ALIGNED)
            m_scale_ptr = m_ptr
            v_scale_ptr = v_ptr
        if MASTER_ROW >= 0:
            master_ptr = column_pointer(addresses, n_tensors, MASTER_ROW, t, tl.float32, ALIGNED)
        else:
            master_ptr = p_ptr
        rows = tl.arange(0, R)
        columns = tl.arange(0, W)
        p_squares = 0.0
        u_squares = 0.0
        if ROWS_ALIGNED and start + QB <= limit:
            offsets = rows[:, None] * W + columns[None, :]   # int32, within the tile
            full = rows < R
            for i in range(QB // R):
                first = start + i * R   # int64: the tile's first chunk
                base = first * W
                a, b = _lowbit_tile(p_ptr + base, g_ptr + base, m_ptr + base, v_ptr + base, m_scale_ptr + first,
                                    v_scale_ptr + first, master_ptr + base, rows, offsets, full[:, None], full,
                                    grad_scale_ptr, clip_ptr, ratio, lr, beta1, beta2, eps, weight_decay, step_size,
                                    inv_bc2_root, bc1, bc2, stream, global_offset + base, P_DTYPE, MODE, DECOUPLED,
                                    MASTER_ROW, QUANTIZED, SR, HAS_SCALE, HAS_CLIP, MAXIMIZE, False)
                if MODE == 1:
                    p_squares += a
                    u_squares += b
        else:
            chunks = tl.cdiv(width, W)
            for i in range(QB // R):
                q = start + i * R + rows
                row_mask = q < limit
                row = q // chunks
                chunk = q - row * chunks
                length = tl.minimum(width - chunk * W, W)
                offsets = (row * width + chunk * W)[:, None] + columns[None, :]
                mask = row_mask[:, None] & (columns[None, :] < length[:, None])
                a, b = _lowbit_tile(p_ptr, g_ptr, m_ptr, v_ptr, m_scale_ptr, v_scale_ptr, master_ptr, q, offsets,
                                    mask, row_mask, grad_scale_ptr, clip_ptr, ratio, lr, beta1, beta2, eps,
                                    weight_decay, step_size, inv_bc2_root, bc1, bc2, stream, global_offset, P_DTYPE,
                                    MODE, DECOUPLED, MASTER_ROW, QUANTIZED, SR, HAS_SCALE, HAS_CLIP, MAXIMIZE, True)
                if MODE == 1:
                    p_squares += a
                    u_squares += b
        if MODE == 1:
            tl.store(partials + 2 * pid, p_squares)
            tl.store(partials + 2 * pid + 1, u_squares)

    def _tile_rows(chunks: int, warps: int) -> int:
        """Row chunks a tile of _lowbit_blocks holds: TILE_ELEMENTS_PER_THREAD elements a thread (so
        that the float32, bfloat16 and uint8 accesses share one layout and a thread's registers stay
        few; under the interpreter INTERPRETED_ELEMENTS_PER_THREAD), at most the program's
        ``chunks``; a power of 2 dividing it. The values do not depend on it (tested)."""
        per_thread = INTERPRETED_ELEMENTS_PER_THREAD if triton_interpreting() else TILE_ELEMENTS_PER_THREAD
        rows = max(1, warps * 32 * per_thread // BLOCK_WIDTH)
        while rows > 1 and (rows > chunks or chunks % rows):
            rows //= 2
        return rows

    def _lowbit_launch(problem: MultiTensorProblem, name: str, passes):
        """The launch of both ops: step counters advanced, then ``passes(launch, tables)`` runs the
        kernel (``launch(MODE, partials, ratios)``) on the bucket."""
        master, quantized = problem.option("master"), problem.option("quantized")
        p_dtype = TL_DTYPES[problem.dtype]

        def run(columns, steps, *, tables, lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf, clip,
                seed, sr_keys, offsets, **extra):
            tables, meta = tables
            _advance_steps[(1,)](tables.addresses, tables.n_tensors, len(columns),
                                 found_inf if found_inf is not None else tables.numels,
                                 HAS_FOUND_INF=found_inf is not None, BLOCK=128)
            values, flags = {}, {}
            for key, flag, value in (("lr", "LR_POINTER", lr), ("beta1", "BETA1_POINTER", beta1),
                                     ("beta2", "BETA2_POINTER", beta2), ("weight_decay", "WD_POINTER", weight_decay)):
                values[key], flags[flag] = _hyper(value)
            dummy = columns[0][0]
            rows_aligned = all(rows_of(p.shape)[1] % BLOCK_WIDTH == 0 for p in columns[0])
            warps = problem.heuristics.warps
            tile_rows = _tile_rows(tables.block, warps)
            register_cap = _register_cap(problem.device)

            def launch(mode, partials=None, ratios=None):
                _lowbit_blocks[(tables.n_blocks,)](
                    tables.addresses, tables.n_tensors, tables.block_tensor, tables.first_block, tables.numels, meta,
                    grad_scale if grad_scale is not None else dummy, found_inf if found_inf is not None else dummy,
                    clip if clip is not None else dummy, partials if partials is not None else dummy,
                    ratios if ratios is not None else dummy, **values, eps=float(eps), seed_stream=_hash_int(seed),
                    P_DTYPE=p_dtype, **flags, MODE=mode, DECOUPLED=bool(problem.option("decoupled")),
                    BIAS_CORRECTION=bool(problem.option("bias_correction")),
                    MASTER_ROW=len(columns) - 1 if master else -1, STEP_ROW=len(columns), QUANTIZED=quantized,
                    SR=problem.option("stochastic_rounding"), HAS_SCALE=grad_scale is not None,
                    HAS_FOUND_INF=found_inf is not None, HAS_CLIP=clip is not None,
                    MAXIMIZE=problem.option("maximize"), ALIGNED=tables.aligned, ROWS_ALIGNED=rows_aligned,
                    QB=tables.block, R=tile_rows, W=BLOCK_WIDTH, num_warps=warps, **register_cap)

            passes(launch, tables, **extra)

        block = max(1, problem.heuristics.block // BLOCK_WIDTH)
        return MultiTensorLaunch(run, KernelChoice(name, "triton", (("W", BLOCK_WIDTH), ("QB", block),
                                                                     ("R", _tile_rows(block, problem.heuristics.warps)),
                                                                     ("num_warps", problem.heuristics.warps),
                                                                     *_register_cap(problem.device).items())),
                                 torch.float32)

    def _prepare_adam_lowbit_triton(problem: MultiTensorProblem) -> MultiTensorLaunch:
        def passes(launch, tables):
            if tables.n_blocks:
                launch(0)

        return _lowbit_launch(problem, "lowbit_blocks(adam)", passes)

    def _prepare_lamb_lowbit_triton(problem: MultiTensorProblem) -> MultiTensorLaunch:
        def passes(launch, tables, reduce_squares=None):
            device = tables.addresses.device
            if not tables.n_blocks:
                if reduce_squares is not None:  # this rank's parts are empty; the others' sums still need it
                    reduce_squares(torch.zeros(tables.n_tensors, 2, dtype=torch.float32, device=device))
                return
            partials = torch.empty(2 * tables.n_blocks, dtype=torch.float32, device=device)
            ratios = torch.empty(tables.n_tensors * (1 if reduce_squares is None else 2), dtype=torch.float32,
                                 device=device)
            launch(1, partials=partials)
            _lamb_trust_ratios[(tables.n_tensors,)](partials, tables.first_block, tables.numels, ratios,
                                                    STEP_BLOCK=tables.block, BLOCK=256,
                                                    SQUARES=reduce_squares is not None, num_warps=4)
            if reduce_squares is not None:
                squares = ratios.view(tables.n_tensors, 2)
                reduce_squares(squares)
                norms = squares.sqrt()
                ratios = torch.where((norms[:, 0] > 0) & (norms[:, 1] > 0), norms[:, 0] / norms[:, 1], 1.0)
            launch(2, ratios=ratios)

        return _lowbit_launch(problem, "lowbit_blocks(lamb moments)+trust_ratios+lowbit_blocks(lamb apply)", passes)

    register("adam_step_lowbit", backend="triton", dtypes=TRITON_FLOATS, deterministic=True, accumulator="float32",
             name="adam_step_lowbit_triton")(_prepare_adam_lowbit_triton)
    register("lamb_step_lowbit", backend="triton", dtypes=TRITON_FLOATS, deterministic=True, accumulator="float32",
             name="lamb_step_lowbit_triton")(_prepare_lamb_lowbit_triton)
