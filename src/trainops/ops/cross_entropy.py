"""Softmax cross-entropy loss, forward and gradient in one pass: Triton kernel, CPU path, registration.

Logits (N, C) or (N, C, d1, ..., dk) (or (C,)) are seen as R = N * d1 * ... * dk rows of C classes,
read through their strides. Per row, with lse = log sum_c exp(x_c), w the class weights (1 when
absent), eps the label smoothing, z the z-loss coefficient and p = softmax(x):

  class-index target t (rows with t == ignore_index count for nothing):
    loss = (1 - eps) * w_t * (lse - x_t) + eps / C * sum_c w_c * (lse - x_c) + z * lse^2
    dloss/dx_c = p_c * ((1 - eps) * w_t + eps / C * sum(w) + 2 z lse) - (1 - eps) * w_t * [c = t] - eps / C * w_c
  class-probability target q (q' = (1 - eps) * q + eps / C):
    loss = sum_c w_c * q'_c * (lse - x_c) + z * lse^2
    dloss/dx_c = p_c * (sum_k w_k q'_k + 2 z lse) - w_c * q'_c

Reductions as torch.nn.functional.cross_entropy: "mean" divides the cross-entropy terms by the
summed target weights of the non-ignored rows (by R for probability targets) and the z-loss term
by the number of non-ignored rows; "sum" adds the rows; "none" returns them (shape (N, d1, ...)).
A batch with every row ignored gives NaN for "mean", as torch does, and a zero gradient.

Fused: when a gradient is wanted, the kernel writes dloss/dlogits for an upstream gradient of 1
in the same pass that computes the loss; the backward only scales it by the upstream gradient
(a kernel that reads the upstream gradient on the device and does nothing when it is exactly 1).
Each row is read once and its gradient written once: short rows in registers (plan "fused");
rows of class-index targets without label smoothing of more than half an exchange block (16384
half or 8192 float32 classes) by a persistent grid that loads the next row while it writes this one
("pipelined"), longer ones cut into chunks held by programs that trade partial sums ("exchange",
exchange.py). Where those plans would give fewer programs than SMs (a few long rows), the rows are
cut into smaller chunks of the exchange plan, so that every SM gets programs (exchange.fill_tile),
label smoothing included (its chunks also trade sum_c w_c x_c). Rows of the exchange plans whose
length (or row stride) is no multiple of 16 elements, GPT-2's 50257 classes say, are cut from the
16-byte boundary at or below each row's start ("aligned windows", exchange.window,
CrossEntropyHeuristics.aligned_windows), so that their loads and stores stay 16-byte vectors.
Other rows longer than a register row (probability targets, label smoothing, float64) are read
twice, the second time newest chunk first so that the re-read hits L2.

Dtypes: float32, float16, bfloat16, float64 logits (float32 math, float64 for float64); int32 or
int64 targets; the loss in the logits' dtype or ``loss_dtype``; the logsumexp in float32 (float64).
Deterministic: fixed reduction order, no atomics. Through aligned windows a row's sums are grouped
by its offset from a 16-byte boundary, and only 16-byte aligned pointers take them: the same row
can round differently (a few ulp) at another position in the batch or another address, as between
any two plans; run to run the bits are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from ..errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError, argument_error
from ..layout import REGISTER_TILE, merge_dims, next_pow2
from ..launch import launcher
from ..library import custom_op
from .multi_tensor import MultiTensorLaunch, is_dense, multi_tensor_describer, multi_tensor_launch
from ..plan import KernelChoice, Launch, cached_plan, check_tensor, heuristics_for
from ..registry import (ACCUMULATOR, FLOATS, INDEX_DTYPES, accumulator_dtype, normalize_device, register,
                        register_op, sm_count, triton_available)
from ._common import assert_on_device, capturing, float_bits, note_flag, raise_flagged
from .exchange import ExchangeGrid, ExchangeHeuristics, fill_tile, launch_exchange

REDUCTIONS = ("mean", "sum", "none")


# float16 fused gradients are stored times 2^k with |stored| <= about 2^GRAD_HEADROOM_BITS (see
# gradient_exponent).
GRAD_HEADROOM_BITS = 12
# |lse| of a float16 row is at most its largest |logit| (65504) plus log(classes).
FLOAT16_MAX = 65504.0


def z_gradient_bound(z_loss: float, classes: int) -> float:
    """The largest |2 z lse| float16 logits can give: the z-loss term of |dloss/dx| is at most this over its divisor."""
    return 2.0 * z_loss * (FLOAT16_MAX + math.log(max(classes, 1)))


def gradient_exponent(norm: torch.Tensor, z_norm: torch.Tensor, w_max: torch.Tensor, z_bound: float) -> torch.Tensor:
    """k such that the fused float16 gradient is stored times 2^k (the CPU path; the kernels compute the same).

    Per entry, |dloss/dx| <= (1 + label smoothing) * w_max / norm + z_bound / z_norm, where norm
    and z_norm are the reduction's divisors ("mean": the summed target weights and the target
    count; else 1), w_max the largest class weight and z_bound = z_gradient_bound(z_loss, classes).
    For a real batch and vocabulary the entries p_c * w_t / norm sit far below float16's normal
    range (6.1e-5): rounded to float16 as they are, they would lose their bits or flush to zero
    before a loss scale (GradScaler's) could lift them, as torch's own backward does in float32.
    Stored times 2^k, k = GRAD_HEADROOM_BITS + floor(log2(norm / (w_max + z_bound * norm / z_norm))),
    they fill float16's range with room to spare and never overflow, z-loss included (which costs
    log2(1 + z_bound * norm / (w_max * z_norm)) bits of headroom: about 4 at z_loss = 1e-4 and an
    unweighted mean); the backward multiplies by dloss * 2^-k in float32 (exact scalings). k = 0
    where norm, z_norm or w_max is 0.
    """
    ratio = (norm / (w_max + z_bound * norm / z_norm)).to(torch.float32)
    k = torch.floor(torch.log2(ratio)) + GRAD_HEADROOM_BITS
    return torch.where((ratio > 0) & torch.isfinite(ratio), k, 0).clamp(-60, 60).to(torch.int32)


def row_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int, int] | None:
    """(stride of N, stride of C, stride of the merged d1..dk) of a logits-shaped tensor, or None."""
    if len(shape) == 1:
        return 0, strides[0], 0
    spatial = merge_dims(shape[2:], strides[2:])
    return None if spatial is None else (strides[0], strides[1], spatial[1])


# ----------------------------------------------------------------------------------------------
# Heuristics: the tables the launchers plan with (trainops.heuristics(...) overrides them)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class CrossEntropyHeuristics(ExchangeHeuristics):
    """Cross-entropy's tunables; the defaults are the choices measured on the H100
    (benchmarks/NOTES.md). Tables are keyed by the logits' element size in bytes.

    register_row: classes one program keeps in registers (one read of the row), as the softmax
        family's register tile (layout.REGISTER_TILE). stream_block, stream_warps: longer rows
        stream this many classes a step at these warps (bf16: 32K-class steps at 16 warps were
        best of six settings, 2.80 vs 2.98-3.24 ms, 8192x128256). fused_programs_per_sm,
        stream_programs_per_sm: persistent grids; streaming rows re-read each row, and one row
        in flight per SM (132 x 256 KiB for 128K bf16 classes) fits in the H100's 50 MiB L2.
    first_pass_evict, grad_store: cache hints; the first pass over a streamed row asks L2 to keep
        it for the second, and gradient stores stream past L2 (".cs") so they do not evict it.
    exchange_block, exchange_warps, exchange_per_sm: the exchange plan (ops/exchange.py, flagged
        partials) for class-index targets without label smoothing, rows of more than half a
        block: a block of classes a program (64 KiB of logits), one program of 16 warps per SM (64
        classes a thread in 128 registers, no spill), the next row's chunk loaded while this
        one's gradient is written; a row of up to one block stays in one program ("pipelined").
        Sweep, kernel alone: bf16 8192x32000 0.480 ms (fused plan 0.520), 4096x262144 2.105 (32
        warps: 2.29, spilling), 8192x128256 1.881 (32 warps 1.856); fp32 8192x16000 0.385 (fused
        0.420). An element size without a block takes the other plans.
    fill_per_sm, fill_min_bytes, fill_min_row_bytes: few long rows (class-index targets, label
        smoothing or not, float32 / half logits, rows of at least fill_min_row_bytes) whose usual
        plan (one row, or one exchange_block, a program) gives
        fewer programs than SMs are cut into chunks of a power of two of at least fill_min_bytes
        (exchange.fill_tile) so that about fill_per_sm programs an SM share them: the exchange plan
        at those chunks, one warp per 512 classes (4 to exchange_warps); 0 turns it off. Measured
        on the H200 (bf16 unless said, forward + backward kernel time, benchmarks/probe_split_rows.py,
        2026-11-29) against the plans without it: 1x262144 1.37x faster (label smoothing 0.1: 7.2x),
        4x131072 1.34x (4.2x), 16x65536 1.29x (1.9x), 64x32768 1.11x (0.96x: the one case it
        costs, 4%), 32x151936 1.00x (2.4x), 8x1048576 bf16 and float32 1.00x (8.0x and 7.8x).
    pipelined_warps: warps of the pipelined plan (a row in one exchange block, one program), by
        element size; sizes left out take exchange_warps. 2 bytes (bf16 measured; fp16 moves the
        same bytes) 32: 10240x32000 forward + backward
        0.453 ms of kernel time against 0.485 at 16 warps (quack 0.516; H200, 2026-11-30, bench
        --sweep's CUDA-graph replays; benchmarks/NOTES.md, ninth session).
    aligned_windows: the exchange and pipelined plans read and write rows whose length or stride is
        no multiple of 16 elements through aligned windows (exchange.window: chunks cut from the
        16-byte boundary at or below each row's start, so that loads and stores stay 16-byte
        vectors; GPT-2's 50257 classes, say), where logits and gradient rows have unit class stride
        and start at one offset from a 16-byte boundary, the pointers are 16-byte aligned (else
        that call takes the plain chunks), and the windows need no more chunks than the plain plan
        (a row whose window overflows by up to VEC - 1 classes, 7 in 2-byte types and 3 in float32,
        keeps the plain chunks). False: always the
        plain chunks (the plan before the windows, for measuring them against each other).
    sms and row_exchange: ExchangeHeuristics.
    Compared by identity (a plan's cache key holds the object it was made with).
    """

    register_row: Mapping[int, int] = field(default_factory=lambda: dict(REGISTER_TILE))
    stream_block: Mapping[int, int] = field(default_factory=lambda: {1: 16384, 2: 32768, 4: 8192, 8: 4096})
    stream_warps: int = 16
    fused_programs_per_sm: int = 8
    stream_programs_per_sm: int = 1
    first_pass_evict: str = "evict_last"
    grad_store: str = ".cs"
    exchange_block: Mapping[int, int] = field(default_factory=lambda: {2: 32768, 4: 16384})
    exchange_warps: int = 16
    pipelined_warps: Mapping[int, int] = field(default_factory=lambda: {2: 32})
    exchange_per_sm: int = 1
    fill_per_sm: int = 4
    fill_min_bytes: int = 4096
    fill_min_row_bytes: int = 16384
    aligned_windows: bool = True

    def __post_init__(self):
        """pipelined_warps checked here, naming the field (a wrong warp count would otherwise fail
        inside a Triton launch)."""
        warps = self.pipelined_warps
        if not isinstance(warps, Mapping) or not all(
                isinstance(size, int) and isinstance(w, int) and not isinstance(w, bool) and w in (4, 8, 16, 32)
                for size, w in warps.items()):
            raise argument_error(InvalidProblemError, "CrossEntropyHeuristics", "pipelined_warps",
                                 f"must map element sizes to 4, 8, 16 or 32 warps, got {warps!r}")


# ----------------------------------------------------------------------------------------------
# Problem: validation shared by every backend
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CrossEntropyProblem:
    """One cross-entropy problem. Tensors: logits, target, then weight when ``has_weight``.

    Outputs of ``run``: (loss, lse, grad, flags): loss as reduced (or per row), lse per row
    (float32, float64 for float64 logits), grad like logits (contiguous) when ``compute_grad``
    else empty: dloss/dlogits for an upstream gradient of 2^k, and flags (int32 [2]): [1 if an
    out-of-range class index was met (and ignored) else 0, k] (k = 0 but for float16 logits: see
    gradient_exponent).
    """

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    target_dtype: torch.dtype
    device: torch.device
    strides: tuple[int, ...]
    target_strides: tuple[int, ...]
    probabilities: bool
    has_weight: bool
    ignore_index: int
    reduction: str
    label_smoothing: float
    z_loss: float
    loss_dtype: torch.dtype
    compute_grad: bool
    check_target: bool
    grad_into_input: bool = False
    heuristics: CrossEntropyHeuristics = None  # set by _describe (the one in force when none is given)

    @property
    def index_dtype(self):
        return None if self.probabilities else self.target_dtype

    @property
    def classes(self) -> int:
        return self.shape[0] if len(self.shape) == 1 else self.shape[1]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return () if len(self.shape) == 1 else (self.shape[0],) + self.shape[2:]

    @cached_property
    def rows(self) -> int:   # read several times a launch: computed once per plan
        return math.prod(self.batch_shape)

    @property
    def target_shape(self) -> tuple[int, ...]:
        return self.shape if self.probabilities else self.batch_shape

    @property
    def lse_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    @property
    def scales_gradient(self) -> bool:
        """float16 gradients are stored times 2^k (gradient_exponent)."""
        return self.dtype == torch.float16 and self.compute_grad

    def check(self, tensors: Sequence[torch.Tensor], out) -> None:
        names = ("logits", "target", "weight") if self.has_weight else ("logits", "target")
        if len(tensors) != len(names):
            raise InvalidProblemError(f"trainops.cross_entropy: expected {len(names)} tensors ({', '.join(names)}), "
                                      f"got {len(tensors)}")
        if out is not None:
            raise argument_error(InvalidProblemError, self.op, "out", "is not supported: the op returns three tensors")
        specs = [(self.shape, self.dtype, self.strides), (self.target_shape, self.target_dtype, self.target_strides)]
        if self.has_weight:
            specs.append(((self.classes,), None, None))
        for name, t, (shape, dtype, strides) in zip(names, tensors, specs):
            check_tensor(self.op, name, t, shape, dtype, self.device, strides)

    def new_output(self, flags: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(loss, lse, grad, flags): flags[0] becomes 1 if a class index is out of range (and not
        ignored), flags[1] is the gradient's exponent k. ``flags``: two zeroed int32 to use (else
        allocated)."""
        loss_shape = self.batch_shape if self.reduction == "none" else ()
        loss = torch.empty(loss_shape, dtype=self.loss_dtype, device=self.device)
        lse = torch.empty(self.batch_shape, dtype=self.lse_dtype, device=self.device)
        grad_shape = self.shape if self.compute_grad and not self.grad_into_input else (0,)
        grad = torch.empty(grad_shape, dtype=self.dtype, device=self.device)
        if flags is None:
            flags = torch.zeros(2, dtype=torch.int32, device=self.device)
        return loss, lse, grad, flags

    def new_output_and_scratch(self, acc: torch.dtype) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(new_output's tensors, the Triton kernels' zeroed per-row losses): rows + 1 entries in
        ``acc``, the last one holding _sum_row_losses' int32 ticket; for reduction "none" the loss
        itself. The scratch and the flags are cut from one zeroed buffer (the flags its last 8
        bytes): one allocation and one fill instead of two (a fill is a kernel launch on the GPU)."""
        if self.reduction == "none":
            out = self.new_output()
            return out, out[0]
        rows = self.rows
        zeroed = torch.zeros(rows + 1 + 8 // acc.itemsize, dtype=acc, device=self.device)
        return self.new_output(zeroed[rows + 1:].view(torch.int32)), zeroed[:rows + 1]


def _describe(shape, dtype, target_dtype, device="cuda", *, strides=None, target_shape=None, target_strides=None,
              has_weight=False, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
              loss_dtype=None, compute_grad=True, check_target=True, grad_into_input=False,
              heuristics=None) -> CrossEntropyProblem:
    """Validate a cross-entropy descriptor.

    shape: logits (C,), (N, C) or (N, C, d1, ...); dtype: theirs. target_dtype: int32/int64 for
    class indices, or a float dtype for class probabilities (then target_shape == shape).
    target_shape: checked when given (class indices: shape without C). strides / target_strides:
    None (contiguous) or the tensors' strides; logits' d1..dk must merge into one strided axis.
    has_weight: a per-class weight of C elements is passed. The rest as torch's cross_entropy,
    plus z_loss (coefficient of lse^2), loss_dtype (default: dtype), compute_grad (write the
    gradient in the same pass), check_target (validate class indices; a host sync on the GPU) and
    grad_into_input (write the gradient over the logits, which must then be the run's own tensor).
    heuristics: a CrossEntropyHeuristics (default: the one in force, trainops.heuristics).
    """
    op = "cross_entropy"
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise argument_error(InvalidProblemError, op, "shape", f"must be a sequence of ints, got {shape!r}") from None
    if not shape or any(s < 0 for s in shape) or shape[0 if len(shape) == 1 else 1] == 0:
        raise argument_error(InvalidProblemError, op, "input", f"has shape {shape}; expected (C,), (N, C) or "
                             "(N, C, d1, ...) with C >= 1 and non-negative sizes")
    if len(shape) > 8:
        raise argument_error(UnsupportedError, op, "input", f"has rank {len(shape)}; ranks 1 to 8 are supported")
    if not isinstance(dtype, torch.dtype) or dtype not in FLOATS:
        raise argument_error(UnsupportedError, op, "input", f"has dtype {dtype}; supported: float32, float16, "
                             "bfloat16, float64")
    probabilities = isinstance(target_dtype, torch.dtype) and target_dtype.is_floating_point
    if probabilities:
        if target_dtype != dtype:
            raise argument_error(InvalidProblemError, op, "target", f"holds probabilities of dtype {target_dtype}; "
                                 f"expected the input's dtype {dtype}")
    elif not isinstance(target_dtype, torch.dtype) or target_dtype not in INDEX_DTYPES:
        raise argument_error(InvalidProblemError, op, "target", f"has dtype {target_dtype}; expected class indices "
                             f"(int32 or int64) or class probabilities ({dtype})")
    if reduction not in REDUCTIONS:
        raise argument_error(InvalidProblemError, op, "reduction", f"is {reduction!r}; expected one of {REDUCTIONS}")
    label_smoothing, z_loss = float(label_smoothing), float(z_loss)
    if not 0.0 <= label_smoothing <= 1.0:
        raise argument_error(InvalidProblemError, op, "label_smoothing", f"is {label_smoothing}; expected [0, 1]")
    if not math.isfinite(z_loss) or z_loss < 0:
        raise argument_error(InvalidProblemError, op, "z_loss", f"is {z_loss}; expected a finite value >= 0")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise argument_error(InvalidProblemError, op, "ignore_index", f"must be an int, got {ignore_index!r}")
    loss_dtype = dtype if loss_dtype is None else loss_dtype
    if loss_dtype not in FLOATS:
        raise argument_error(UnsupportedError, op, "loss_dtype", f"is {loss_dtype}; expected a float dtype")
    try:
        device = normalize_device(device)
    except (RuntimeError, TypeError) as e:
        raise argument_error(InvalidProblemError, op, "device", f"is not a device: {e}") from None
    batch = () if len(shape) == 1 else (shape[0],) + shape[2:]
    expected_target = shape if probabilities else batch
    if target_shape is not None and tuple(target_shape) != expected_target:
        raise argument_error(InvalidProblemError, op, "target", f"has shape {tuple(target_shape)}; input of shape "
                             f"{shape} needs {expected_target}")
    contiguous = torch.empty(shape, device="meta").stride()
    strides = contiguous if strides is None else tuple(int(s) for s in strides)
    if len(strides) != len(shape) or row_strides(shape, strides) is None:
        raise argument_error(UnsupportedError, op, "input", f"has strides {strides} whose d1..dk do not merge; "
                             "pass input.contiguous()")
    target_strides = (torch.empty(expected_target, device="meta").stride() if target_strides is None
                      else tuple(int(s) for s in target_strides))
    if probabilities and row_strides(shape, target_strides) is None:
        raise argument_error(UnsupportedError, op, "target", f"has strides {target_strides} whose d1..dk do not "
                             "merge; pass target.contiguous()")
    if grad_into_input and not compute_grad:
        raise argument_error(InvalidProblemError, op, "grad_into_input", "needs compute_grad=True")
    if heuristics is None:
        heuristics = heuristics_for(CrossEntropyHeuristics)
    elif not isinstance(heuristics, CrossEntropyHeuristics):
        raise argument_error(InvalidProblemError, op, "heuristics", f"must be a CrossEntropyHeuristics, got "
                             f"{type(heuristics).__name__}")
    return CrossEntropyProblem(op, shape, dtype, target_dtype, device, strides, target_strides, probabilities,
                               bool(has_weight), ignore_index, reduction, label_smoothing, z_loss, loss_dtype,
                               bool(compute_grad), bool(check_target), bool(grad_into_input), heuristics)


CrossEntropyDescriptor = register_op("cross_entropy", _describe)
register_op("cross_entropy_grad_scale", multi_tensor_describer("cross_entropy_grad_scale"),
            doc="grad *= dloss * 2^-flags[1] in place, skipped when that is 1: the backward of the fused gradient")


def scale_gradient_(grad: torch.Tensor, dloss: torch.Tensor, flags: torch.Tensor) -> None:
    """grad *= dloss * 2^-k in place, where dloss is the one-element upstream gradient of a reduced
    loss and k = flags[1] the exponent the forward stored the gradient with (gradient_exponent).

    The kernel reads dloss and k on the device and returns at once when the factor is exactly 1
    (the usual ``loss.backward()`` with k = 0), so the backward neither synchronises with the host
    nor rereads the gradient. grad: dense (any dim order), float dtypes; math in float32 (float64
    for float64).
    """
    if dloss.numel() != 1 or dloss.device != grad.device:
        raise argument_error(InvalidProblemError, "cross_entropy_grad_scale", "dloss",
                             f"must be one element on {grad.device}; got shape {tuple(dloss.shape)} on {dloss.device}")
    if not is_dense(grad):
        raise argument_error(InvalidProblemError, "cross_entropy_grad_scale", "grad",
                             f"is not dense (strides {grad.stride()} for shape {tuple(grad.shape)})")
    multi_tensor_launch("cross_entropy_grad_scale", grad.device, grad.dtype).run(grad, dloss.reshape(1), flags)


_UNIT_FLAGS: dict = {}   # device -> int32 [0, 0]: flags meaning "stored times 2^0" for scale_gradient_


def scale_unless_one_(grad: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    """grad *= dloss in place (returned): ``scale_gradient_`` with the exponent 0, for the fused
    losses whose forward computed their gradients (linear_cross_entropy, the post-training losses).
    The kernel reads dloss on the device and returns at once when it is exactly 1 (a plain
    ``loss.backward()``): no pass over grad, no host sync. grad: dense, float dtypes (empty: nothing
    done); dloss: one element on grad's device."""
    if not grad.numel():
        return grad
    unit = _UNIT_FLAGS.get(grad.device)
    if unit is None:
        unit = torch.zeros(2, dtype=torch.int32, device=grad.device)
        if not capturing(grad.device):  # made in a capture, it would hold zeros only once replayed
            _UNIT_FLAGS[grad.device] = unit
    scale_gradient_(grad, dloss.reshape(1), unit)
    return grad


def check_targets(problem: CrossEntropyProblem, target: torch.Tensor) -> None:
    """Raise IndexOutOfRangeError unless every class index is in [0, C) or equals ignore_index (one sync)."""
    if not problem.probabilities:
        check_class_indices("cross_entropy", target, problem.classes, problem.ignore_index)


def check_class_indices(op: str, target: torch.Tensor, classes: int, ignore_index: int) -> None:
    """IndexOutOfRangeError naming ``op`` unless every index of ``target`` is in [0, classes) or
    ignore_index: one min/max, one host sync on the GPU; while a CUDA graph is being captured, a
    device-side assert instead (``assert_on_device``)."""
    if target.numel() == 0:
        return
    valid = torch.where(target == ignore_index, 0, target)
    if capturing(target.device):
        assert_on_device(((valid >= 0) & (valid < classes)).all())
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(valid)).tolist())
    if lo < 0 or hi >= classes:
        raise IndexOutOfRangeError(f"trainops.{op}: argument 'target' holds class {lo if lo < 0 else hi}, out of "
                                   f"range [0, {classes - 1}] and not ignore_index ({ignore_index})")


def normalizers(problem: CrossEntropyProblem, target: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """[cross-entropy divisor, z-loss divisor] on the device (no sync): the reduction's denominators."""
    acc = accumulator_dtype(problem.dtype)
    if problem.reduction != "mean":
        return torch.ones(2, dtype=acc, device=target.device)
    if problem.probabilities:
        return torch.full((2,), float(problem.rows), dtype=acc, device=target.device)
    target = target.reshape(-1)
    valid = (target != problem.ignore_index) & (target >= 0) & (target < problem.classes)
    count = valid.sum(dtype=acc)
    if weight is None:
        return torch.stack([count, count])
    picked = weight.to(acc)[torch.where(valid, target, 0).long()]
    return torch.stack([torch.where(valid, picked, 0).sum(), count])


def finish_loss(problem: CrossEntropyProblem, row_loss: torch.Tensor, norm: torch.Tensor | None,
                loss: torch.Tensor) -> None:
    """loss <- the reduction of the (already normalised) per-row losses (the CPU path, and any
    path with no rows; the Triton kernels reduce in the kernel).

    "mean" over a zero total weight (every row ignored, or no rows) is NaN, as torch's 0 / 0: from
    ``norm`` when given, else the kernel has written NaN into row 0.
    """
    if problem.reduction == "none":
        loss.copy_(row_loss.view(problem.batch_shape))
    elif problem.reduction == "mean" and row_loss.numel() == 0:
        loss.fill_(float("nan"))
    elif problem.reduction == "mean" and norm is not None:
        loss.copy_(torch.where(norm[0] == 0, float("nan"), row_loss.sum()))
    else:
        loss.copy_(row_loss.sum())


# ----------------------------------------------------------------------------------------------
# CPU path: the same formulas in torch ops, in the accumulator dtype
# ----------------------------------------------------------------------------------------------

def _cpu_math(problem: CrossEntropyProblem, logits, target, weight):
    """(normalised per-row loss, lse, gradient for an upstream gradient of 1, normalizers): the formulas above."""
    acc = accumulator_dtype(problem.dtype)
    c, eps, z = problem.classes, problem.label_smoothing, problem.z_loss
    x = logits.to(acc).reshape(1, c) if logits.dim() == 1 else logits.to(acc).movedim(1, -1).reshape(-1, c)
    w = torch.ones(c, dtype=acc) if weight is None else weight.to(acc)
    norm = normalizers(problem, target, weight)
    lse = torch.logsumexp(x, dim=1)
    p = torch.exp(x - lse[:, None])
    if problem.probabilities:
        q = target.to(acc).reshape(1, c) if target.dim() == 1 else target.to(acc).movedim(1, -1).reshape(-1, c)
        q = (1 - eps) * q + eps / c
        wq = w * q
        valid = torch.ones(x.shape[0], dtype=torch.bool)
        ce = (wq * (lse[:, None] - x)).sum(1)
        scale = wq.sum(1)
        direct = wq  # the gradient's term not proportional to p, for an upstream gradient of 1 (times the normaliser)
    else:
        t = target.reshape(-1).long()
        valid = (t != problem.ignore_index) & (t >= 0) & (t < c)
        ts = torch.where(valid, t, 0)
        wt = w[ts]
        ce = (1 - eps) * wt * (lse - x.gather(1, ts[:, None])[:, 0])
        scale = (1 - eps) * wt
        if eps:  # (0 * a -inf logit would be NaN)
            ce = ce + eps / c * (lse * w.sum() - x @ w)
            scale = scale + eps / c * w.sum()
        direct = None  # the one-hot and smoothing terms, subtracted below without an N x C tensor of them
    row_loss = torch.where(valid, ce / norm[0] + z * lse * lse / norm[1], 0)
    grad = None
    if problem.compute_grad:
        a = scale / norm[0] + 2 * z * lse / norm[1]
        grad = p.mul_(a[:, None])
        if direct is not None:
            grad.sub_(direct / norm[0])
        else:
            grad.scatter_add_(1, ts[:, None], (-(1 - eps) * wt / norm[0])[:, None])
            if eps:
                grad.sub_(eps / c * w / norm[0])
        grad.masked_fill_(~valid[:, None], 0)
    return row_loss, lse, grad, norm


def _prepare_cpu(problem: CrossEntropyProblem) -> Launch:
    def run(tensors, out):
        logits, target, weight = (*tensors, None)[:3]
        if problem.check_target:
            check_targets(problem, target)
        loss, lse, grad, flags = out
        row_loss, row_lse, row_grad, norm = _cpu_math(problem, logits, target, weight)
        if not problem.probabilities:
            t = target.reshape(-1)
            flags[0] = ((t != problem.ignore_index) & ((t < 0) | (t >= problem.classes))).any()
        finish_loss(problem, row_loss, norm, loss)
        lse.copy_(row_lse.view(problem.batch_shape))
        if problem.compute_grad:
            if problem.scales_gradient:
                w_max = torch.ones(()) if weight is None else weight.abs().max().to(norm.dtype)
                z_bound = z_gradient_bound(problem.z_loss, problem.classes)
                flags[1] = gradient_exponent(norm[0], norm[1], w_max, z_bound)
                row_grad = torch.ldexp(row_grad, flags[1].to(row_grad.dtype))  # exact
            target_grad = logits if problem.grad_into_input else grad
            if logits.dim() == 1:
                target_grad.copy_(row_grad.view(-1))
            else:
                target_grad.copy_(row_grad.view(problem.batch_shape + (problem.classes,)).movedim(-1, 1))

    return Launch(run, KernelChoice("cross_entropy_cpu", "cpu"), accumulator_dtype(problem.dtype))


register("cross_entropy", backend="cpu", dtypes=FLOATS, index_dtypes=INDEX_DTYPES, deterministic=True,
         accumulator=ACCUMULATOR, name="cross_entropy_cpu")(_prepare_cpu)


def _prepare_grad_scale_cpu(problem) -> MultiTensorLaunch:
    def run(grad, dloss, flags):
        acc = accumulator_dtype(grad.dtype)
        factor = torch.ldexp(dloss.to(acc), -flags[1].to(acc))
        if factor.item() != 1:  # a CPU tensor: no synchronisation to avoid
            grad.copy_(grad.to(acc) * factor)

    return MultiTensorLaunch(run, KernelChoice("cross_entropy_grad_scale_cpu", "cpu"), accumulator_dtype(problem.dtype))


register("cross_entropy_grad_scale", backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=ACCUMULATOR,
         name="cross_entropy_grad_scale_cpu")(_prepare_grad_scale_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from ._common import from_bits
    from .exchange import load_window, merge_max_sum, pack_flagged, place_in_group, poll_flagged, store_window, window

    _GRAD_HEADROOM_BITS = tl.constexpr(GRAD_HEADROOM_BITS)

    @triton.jit
    def _pow2(k):
        """2.0^k for an int32 k in [-126, 127], exactly (from the float32 bits)."""
        return ((k + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _gradient_unit(norm, z_norm, z_bound, w_ptr, C, flags_ptr, HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr):
        """2^k, the factor float16 gradients are stored with (gradient_exponent); program 0 stores k in flags[1]."""
        w_max = 1.0
        if HAS_WEIGHT:
            largest = tl.zeros([1024], ACC)
            for start in range(0, C, 1024):
                i = start + tl.arange(0, 1024)
                largest = tl.maximum(largest, tl.abs(tl.load(w_ptr + i, mask=i < C, other=0.0).to(ACC)))
            w_max = tl.max(largest, axis=0)
        ratio = (norm / (w_max + z_bound * norm / z_norm)).to(tl.float32)
        usable = (ratio > 0) & (ratio < float("inf"))
        k = tl.where(usable, tl.floor(tl.log2(tl.where(usable, ratio, 1.0))) + _GRAD_HEADROOM_BITS, 0.0)
        k = tl.minimum(tl.maximum(k, -60.0), 60.0).to(tl.int32)
        if tl.program_id(0) == 0:
            tl.store(flags_ptr + 1, k)
        return _pow2(k).to(ACC)

    @triton.jit
    def _ce_load(x_ptr, t_ptr, w_ptr, c, mask, x_sc, t_sc, smoothing, eps_c,
                 PROBS: tl.constexpr, HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr, EVICT: tl.constexpr):
        """Logits, class weights and smoothed target probabilities of one chunk of classes."""
        x = tl.load(x_ptr + c * x_sc, mask=mask, other=float("-inf"), eviction_policy=EVICT).to(ACC)
        w = 1.0
        if HAS_WEIGHT:
            w = tl.load(w_ptr + c, mask=mask, other=0.0).to(ACC)
        q = 0.0
        if PROBS:
            q = tl.load(t_ptr + c * t_sc, mask=mask, other=0.0).to(ACC) * (1.0 - smoothing) + eps_c
        return x, w, q

    @triton.jit
    def _ce_sums(x, w, q, mask, va, vb, vw, PROBS: tl.constexpr, SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr):
        """Per-lane sums the loss needs besides lse (see the module docstring)."""
        if PROBS:
            wq = tl.where(mask, w * q, 0.0)
            va += wq
            vb += wq * tl.where(mask, x, 0.0)
        elif SMOOTH:
            va += tl.where(mask, w * x, 0.0)
            if HAS_WEIGHT:
                vw += tl.where(mask, w, 0.0)
        return va, vb, vw

    @triton.jit
    def _ce_grad(p, w, q, c, a, hit, target, valid, inv_norm, eps_c, PROBS: tl.constexpr, SMOOTH: tl.constexpr):
        """dloss/dx for one chunk (upstream gradient 1) from p = softmax(x); zeros for an ignored row."""
        g = p * a
        if PROBS:
            g -= w * q * inv_norm
        else:
            g -= tl.where(c == target, hit, 0.0)
            if SMOOTH:
                g -= eps_c * w * inv_norm
        return tl.where(valid, g, 0.0)

    @triton.jit
    def _store_nearest(ptrs, v, mask, CACHE: tl.constexpr):
        """Store v in the pointers' dtype rounded to nearest: the GPU's rounding for half types, which
        Triton's interpreter would otherwise replace by truncation."""
        tl.store(ptrs, _nearest(v, ptrs.dtype.element_ty), mask=mask, cache_modifier=CACHE)

    @triton.jit
    def _sum_row_losses(rows_ptr, ticket_ptr, loss_ptr, R, BLOCK: tl.constexpr):
        """Called by every program once its rows' losses are stored: the program that arrives last
        (a zeroed int32 ticket) sums rows_ptr[0:R] in row order into loss_ptr[0], so "mean" and
        "sum" need no further launch and stay deterministic."""
        tl.debug_barrier()  # every thread's row stores come before the release below
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            total = tl.zeros([BLOCK], rows_ptr.dtype.element_ty)
            for start in range(0, R, BLOCK):
                i = start + tl.arange(0, BLOCK)
                total += tl.load(rows_ptr + i, mask=i < R, other=0.0, volatile=True)
            _store_nearest(loss_ptr, tl.sum(total, axis=0), None, "")

    @triton.jit
    def _ce_row(r, x_ptr, t_ptr, w_ptr, g_ptr, rows_ptr, lse_ptr, flags_ptr,
                C, S, x_sn, x_sc, x_ss, t_sn, t_sc, t_ss, g_sn, g_sc, g_ss,
                ignore_index, smoothing, z_coef, ce_norm, z_norm, unit,
                PROBS: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, GRAD: tl.constexpr,
                ACC: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr,
                FIRST_PASS_EVICT: tl.constexpr, GRAD_STORE: tl.constexpr):
        """Loss, lse and (GRAD) the gradient of row r, times ``unit`` (2^k, see _gradient_unit)."""
        n = r // S
        s = r % S
        x_ptr += n * x_sn + s * x_ss
        g_ptr += n * g_sn + s * g_ss
        t_ptr += n * t_sn + s * t_ss
        cols = tl.arange(0, BLOCK_C)
        eps_c = smoothing / C
        if PROBS:
            valid = True
            target = -1
            w_t = 0.0
            x_t = 0.0
        else:
            target = tl.load(t_ptr).to(tl.int64)
            valid = (target != ignore_index) & (target >= 0) & (target < C)
            tl.store(flags_ptr, 1, mask=(target != ignore_index) & ~valid)  # reported by the caller, not used
            safe_t = tl.where(valid, target, 0)
            x_t = tl.load(x_ptr + safe_t * x_sc, mask=valid, other=0.0).to(ACC)
            w_t = 1.0
            if HAS_WEIGHT:
                w_t = tl.load(w_ptr + safe_t, mask=valid, other=0.0).to(ACC)
        va = tl.zeros([BLOCK_C], ACC)
        vb = tl.zeros([BLOCK_C], ACC)
        vw = tl.zeros([BLOCK_C], ACC)
        if CHUNKS == 1:  # the row in registers: exp once
            mask = cols < C
            x, w, q = _ce_load(x_ptr, t_ptr, w_ptr, cols, mask, x_sc, t_sc, smoothing, eps_c, PROBS, HAS_WEIGHT, ACC,
                               "evict_first")
            va, vb, vw = _ce_sums(x, w, q, mask, va, vb, vw, PROBS, SMOOTH, HAS_WEIGHT)
            m = tl.max(x, axis=0)
            m_ref = tl.where(m == float("-inf"), 0.0, m)
            e = tl.exp(x - m_ref)
            total = tl.sum(e, axis=0)
            lse = m_ref + tl.log(total)
        else:  # online max / sum over chunks
            m = tl.full([], float("-inf"), ACC)
            total = tl.zeros([], ACC)
            for k in range(CHUNKS):
                c = k * BLOCK_C + cols
                mask = c < C
                x, w, q = _ce_load(x_ptr, t_ptr, w_ptr, c, mask, x_sc, t_sc, smoothing, eps_c, PROBS, HAS_WEIGHT,
                                   ACC, FIRST_PASS_EVICT)
                va, vb, vw = _ce_sums(x, w, q, mask, va, vb, vw, PROBS, SMOOTH, HAS_WEIGHT)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                total = total * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), axis=0)
                m = m_new
            m_ref = tl.where(m == float("-inf"), 0.0, m)
            lse = m_ref + tl.log(total)
        if PROBS:
            ce = lse * tl.sum(va, axis=0) - tl.sum(vb, axis=0)
            scale = tl.sum(va, axis=0)
        else:
            ce = (1.0 - smoothing) * w_t * (lse - x_t)
            scale = (1.0 - smoothing) * w_t
            if SMOOTH:
                w_total = C * 1.0
                if HAS_WEIGHT:
                    w_total = tl.sum(vw, axis=0)
                ce += eps_c * (lse * w_total - tl.sum(va, axis=0))
                scale += eps_c * w_total
        row_loss = tl.where(valid, ce / ce_norm + z_coef * lse * lse / z_norm, 0.0)
        row_loss = tl.where((r == 0) & (ce_norm == 0), float("nan"), row_loss)  # "mean" over no weight: 0 / 0
        _store_nearest(rows_ptr + r, row_loss, None, "")
        tl.store(lse_ptr + r, lse)
        if GRAD:
            a = (scale / ce_norm + 2.0 * z_coef * lse / z_norm) * unit
            hit = (1.0 - smoothing) * w_t / ce_norm * unit
            inv_norm = unit / ce_norm
            if CHUNKS == 1:
                g = _ce_grad(e * (1.0 / total), w, q, cols, a, hit, target, valid, inv_norm, eps_c, PROBS, SMOOTH)
                _store_nearest(g_ptr + cols * g_sc, g, cols < C, GRAD_STORE)
            else:
                for k in range(CHUNKS):  # newest chunk first: its bytes are the likeliest still in L2
                    c = (CHUNKS - 1 - k) * BLOCK_C + cols
                    mask = c < C
                    x, w, q = _ce_load(x_ptr, t_ptr, w_ptr, c, mask, x_sc, t_sc, smoothing, eps_c, PROBS,
                                       HAS_WEIGHT, ACC, "evict_first")
                    g = _ce_grad(tl.exp(x - lse), w, q, c, a, hit, target, valid, inv_norm, eps_c, PROBS, SMOOTH)
                    _store_nearest(g_ptr + c * g_sc, g, mask, GRAD_STORE)

    @triton.jit
    def _ce_target_weight(t_ptr, w_ptr, R, C, ignore_index, HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr,
                          BLOCK: tl.constexpr):
        """(summed weight of the non-ignored targets, their count): "mean"'s divisors, fixed order."""
        total = tl.zeros([BLOCK], ACC)
        count = tl.zeros([BLOCK], ACC)
        for start in range(0, R, BLOCK):
            i = start + tl.arange(0, BLOCK)
            t = tl.load(t_ptr + i, mask=i < R, other=ignore_index).to(tl.int64)
            valid = (t != ignore_index) & (t >= 0) & (t < C)
            w = 1.0
            if HAS_WEIGHT:
                w = tl.load(w_ptr + tl.where(valid, t, 0), mask=valid, other=0.0).to(ACC)
            total += tl.where(valid, w, 0.0)
            count += tl.where(valid, 1.0, 0.0)
        return tl.sum(total, axis=0), tl.sum(count, axis=0)

    @triton.jit(do_not_specialize=["smoothing_bits", "z_bits", "norm_bits", "z_bound_bits"])
    def _ce_rows(x_ptr, t_ptr, w_ptr, g_ptr, rows_ptr, ticket_ptr, loss_ptr, lse_ptr, flags_ptr,
                 smoothing_bits, z_bits, norm_bits, z_bound_bits, R, C, S, x_sn, x_sc, x_ss, t_sn, t_sc, t_ss, g_sn, g_sc, g_ss, ignore_index,
                 PROBS: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, GRAD: tl.constexpr,
                 ACC: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr,
                 FIRST_PASS_EVICT: tl.constexpr, GRAD_STORE: tl.constexpr, MEAN_BY_TARGETS: tl.constexpr,
                 REDUCE: tl.constexpr, SCALE_GRAD: tl.constexpr):
        """Rows pid, pid + programs, ... (a persistent grid): loss, lse and the gradient of each.
        Per-row losses go to rows_ptr (the "none" output itself, else a scratch that REDUCE sums
        into loss_ptr[0], see _sum_row_losses). SCALE_GRAD: gradients stored times 2^k (float16).

        CHUNKS == 1: the row stays in registers (one read). Else pass 1 streams the row (online
        max / sum), pass 2 re-reads it newest chunk first and writes the gradient; few programs
        per SM keep the rows in flight small enough for that re-read to hit L2. The float constants
        (label smoothing, z-loss coefficient, the fixed divisor of both losses, the z-loss gradient
        bound) come as their bits in ACC (float_bits).
        """
        smoothing = from_bits(smoothing_bits, ACC)
        z_coef = from_bits(z_bits, ACC)
        if MEAN_BY_TARGETS:  # every program sums the targets' weights the same way: no extra launch
            ce_norm, z_norm = _ce_target_weight(t_ptr, w_ptr, R, C, ignore_index, HAS_WEIGHT, ACC, 1024)
        else:
            ce_norm = from_bits(norm_bits, ACC)
            z_norm = ce_norm
        unit = tl.full([], 1.0, ACC)
        if SCALE_GRAD:
            unit = _gradient_unit(ce_norm, z_norm, from_bits(z_bound_bits, ACC), w_ptr, C, flags_ptr, HAS_WEIGHT,
                                  ACC)
        for r in range(tl.program_id(0), R, tl.num_programs(0)):
            _ce_row(r + tl.zeros([], tl.int64), x_ptr, t_ptr, w_ptr, g_ptr, rows_ptr, lse_ptr, flags_ptr,
                    C, S, x_sn, x_sc, x_ss, t_sn, t_sc, t_ss, g_sn, g_sc, g_ss, ignore_index, smoothing, z_coef,
                    ce_norm, z_norm, unit,
                    PROBS, HAS_WEIGHT, SMOOTH, GRAD, ACC, BLOCK_C, CHUNKS, FIRST_PASS_EVICT, GRAD_STORE)
        if REDUCE:
            _sum_row_losses(rows_ptr, ticket_ptr, loss_ptr, R, 1024)


    @triton.jit
    def _ce_chunk(x_ptr, r, R, S, x_sn, x_ss, x_sc, c, mask):
        """Classes c of row r (all masked when r >= R): the chunk one exchange program holds."""
        n = (r + tl.zeros([], tl.int64)) // S
        row_mask = mask & tl.where(r < R, True, False)  # not `mask & (r < R)`: see softmax's _chunk (Triton 3.9)
        return tl.load(x_ptr + n * x_sn + (r % S) * x_ss + c * x_sc, mask=row_mask, other=float("-inf"))

    @triton.jit
    def _ce_window(r, R, S, x_sn, x_ss, split, C, BLOCK_C: tl.constexpr, SPLITS: tl.constexpr, VEC: tl.constexpr):
        """Chunk ``split`` of row r's aligned window (exchange.window; unit class stride, everything
        masked when r >= R): (w0, head, j, body, v, first, t, last), class c of the row sitting at
        window position c + head."""
        n = (r + tl.zeros([], tl.int64)) // S
        start = n * x_sn + (r % S) * x_ss
        w0, j, body, v, first, t, last = window(start, split, C, tl.where(r < R, True, False), BLOCK_C, SPLITS, VEC)
        return w0, (start % VEC).to(tl.int32), j, body, v, first, t, last

    @triton.jit
    def _ce_window_parts(x_ptr, r, R, S, x_sn, x_ss, split, C, BLOCK_C: tl.constexpr, SPLITS: tl.constexpr,
                         VEC: tl.constexpr):
        """The logits of chunk ``split`` of row r's window (``_ce_window``): body, first and last vector."""
        w0, head, j, body, v, first, t, last = _ce_window(r, R, S, x_sn, x_ss, split, C, BLOCK_C, SPLITS, VEC)
        return load_window(x_ptr, w0, j, body, v, first, t, last, float("-inf"))

    @triton.jit
    def _nearest(v, DT: tl.constexpr):
        """v in DT, rounded to nearest for half types: the GPU's rounding, which Triton's interpreter
        would otherwise replace by truncation (_store_nearest stores it)."""
        if DT.primitive_bitwidth == 16:
            out = v.to(DT, fp_downcast_rounding="rtne")
        else:
            out = v.to(DT)
        return out

    @triton.jit(do_not_specialize=["z_bits", "norm_bits", "z_bound_bits", "smoothing_bits"])
    def _ce_rows_exchange(x_ptr, t_ptr, w_ptr, g_ptr, rows_ptr, ticket_ptr, loss_ptr, lse_ptr, flags_ptr,
                          z_bits, norm_bits, z_bound_bits, words_ptr, R, C, S, x_sn, x_sc, x_ss, t_sn, t_sc, t_ss, g_sn, g_sc, g_ss, ignore_index,
                          smoothing_bits, w_total_ptr,
                          HAS_WEIGHT: tl.constexpr, GRAD: tl.constexpr, BLOCK_C: tl.constexpr,
                          SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, GRAD_STORE: tl.constexpr,
                          MEAN_BY_TARGETS: tl.constexpr, REDUCE: tl.constexpr, SCALE_GRAD: tl.constexpr,
                          PHASE: tl.constexpr, SMOOTH: tl.constexpr = False, VEC: tl.constexpr = 0):
        """Class-index targets, float32 math: rows cut into SPLITS chunks of BLOCK_C classes, one per
        program of a group, which trade (max, sum exp) as flagged words [R, SPLITS] (exchange.py);
        with SPLITS == 1 a program holds whole rows and trades nothing. Program 0 of a group writes
        the row's loss and lse; every program writes its chunk's gradient from registers: one read of
        the logits, one write. Losses and constants as _ce_rows (float32 bits).

        SMOOTH (label smoothing eps > 0): the chunks also trade sum_c w_c x_c as a second flagged
        word [R, SPLITS] after the first R * SPLITS; w_total_ptr holds sum_c w_c (float32, summed by
        the launcher; C without a weight, when it is not read).

        VEC > 0 (VEC elements in 16 bytes; unit class stride, logits and gradient rows starting at one
        offset from a 16-byte boundary, 16-byte aligned pointers, SPLITS * BLOCK_C >= C + VEC - 1):
        the chunks are those of each row's aligned window (exchange.window), a body masked only at
        multiples of VEC plus the window's first and last partial vectors, so that rows of a length
        (or stride) off a multiple of 16 elements keep their 16-byte accesses."""
        z_coef = from_bits(z_bits, tl.float32)
        split, group, groups = place_in_group(SPLITS)
        c = split * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = c < C
        if PHASE == 0:
            if VEC == 0:
                x_next = _ce_chunk(x_ptr, group, R, S, x_sn, x_ss, x_sc, c, mask)
            else:
                x_next, first_next, last_next = _ce_window_parts(x_ptr, group, R, S, x_sn, x_ss, split, C, BLOCK_C,
                                                                 SPLITS, VEC)
        if MEAN_BY_TARGETS and PHASE != 1:  # every program sums the same way, while its first chunk loads
            ce_norm, z_norm = _ce_target_weight(t_ptr, w_ptr, R, C, ignore_index, HAS_WEIGHT, tl.float32, 2048)
        else:
            ce_norm = from_bits(norm_bits, tl.float32)
            z_norm = ce_norm
        unit = 1.0
        if SCALE_GRAD and PHASE != 1:
            unit = _gradient_unit(ce_norm, z_norm, from_bits(z_bound_bits, tl.float32), w_ptr, C, flags_ptr,
                                  HAS_WEIGHT, tl.float32)
        for r in range(group, R, groups):
            if PHASE == 0:
                x_raw = x_next
                if VEC != 0:
                    first_raw, last_raw = first_next, last_next
            elif VEC == 0:
                x_raw = _ce_chunk(x_ptr, r, R, S, x_sn, x_ss, x_sc, c, mask)
            else:
                x_raw, first_raw, last_raw = _ce_window_parts(x_ptr, r, R, S, x_sn, x_ss, split, C, BLOCK_C,
                                                              SPLITS, VEC)
            if VEC != 0:   # this row's window: masks, and the offset of its classes (class c at position c + head)
                w0, head, j, body, v, first, t, last = _ce_window(r, R, S, x_sn, x_ss, split, C, BLOCK_C, SPLITS,
                                                                  VEC)
            if SMOOTH:   # the chunk's class weights (the same every row, but for the window's offset)
                w_c = 1.0
                w_first = 1.0
                w_last = 1.0
                if HAS_WEIGHT:
                    if VEC == 0:
                        w_c = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
                    else:
                        w_c, w_first, w_last = load_window(w_ptr, -head, j, body, v, first, t, last, 0.0)
                        w_c, w_first, w_last = w_c.to(tl.float32), w_first.to(tl.float32), w_last.to(tl.float32)
            if PHASE != 1:
                # The target's logit is read before this program publishes: when the gradient is
                # written over the logits, the program holding the target's chunk writes it as
                # soon as every program of the group has published (under the interpreter the
                # phases run in program order, and program 0 of a group runs first).
                n = (r + tl.zeros([], tl.int64)) // S
                row_s = r % S
                target = tl.load(t_ptr + n * t_sn + row_s * t_ss).to(tl.int64)
                valid = (target != ignore_index) & (target >= 0) & (target < C)
                safe_t = tl.where(valid, target, 0)
                x_t = tl.load(x_ptr + n * x_sn + row_s * x_ss + safe_t * x_sc, mask=valid & (split == 0),
                              other=0.0).to(tl.float32)
            if PHASE != 2:
                x = x_raw.to(tl.float32)
                if VEC == 0:
                    m = tl.max(x, axis=0)
                else:
                    x_first = first_raw.to(tl.float32)
                    x_last = last_raw.to(tl.float32)
                    m = tl.maximum(tl.max(x, axis=0), tl.maximum(tl.max(x_first, axis=0), tl.max(x_last, axis=0)))
                m_ref = tl.where(m == float("-inf"), 0.0, m)
                total = tl.sum(tl.exp(x - m_ref), axis=0)
                if VEC != 0:
                    total += tl.sum(tl.exp(x_first - m_ref), axis=0) + tl.sum(tl.exp(x_last - m_ref), axis=0)
                if SMOOTH:
                    if VEC == 0:
                        wx = tl.sum(tl.where(mask, w_c * x, 0.0), axis=0)
                    else:
                        wx = (tl.sum(tl.where(body, w_c * x, 0.0), axis=0)
                              + (tl.sum(tl.where(first, w_first * x_first, 0.0), axis=0)
                                 + tl.sum(tl.where(last, w_last * x_last, 0.0), axis=0)))
                if SPLITS > 1:
                    if SMOOTH:
                        tl.store(words_ptr + (R + r) * SPLITS + split, pack_flagged(wx, tl.zeros([], tl.float32)))
                    tl.store(words_ptr + r * SPLITS + split, pack_flagged(m, total))
            if PHASE == 0:  # the next row's chunk loads while this one waits
                if VEC == 0:
                    x_next = _ce_chunk(x_ptr, r + groups, R, S, x_sn, x_ss, x_sc, c, mask)
                else:
                    x_next, first_next, last_next = _ce_window_parts(x_ptr, r + groups, R, S, x_sn, x_ss, split, C,
                                                                     BLOCK_C, SPLITS, VEC)
            if PHASE != 1:
                w_t = 1.0
                if HAS_WEIGHT:
                    w_t = tl.load(w_ptr + safe_t, mask=valid, other=0.0).to(tl.float32)
                if SPLITS > 1:
                    if SMOOTH:   # polled first: published before the (max, sum) word
                        k = tl.arange(0, SPLITS_P2)
                        wx_k, _ = poll_flagged(words_ptr + (R + r) * SPLITS, SPLITS, SPLITS_P2)
                        wx = tl.sum(tl.where(k < SPLITS, wx_k, 0.0), axis=0)   # chunk order
                    m_k, s_k = poll_flagged(words_ptr + r * SPLITS, SPLITS, SPLITS_P2)
                    m_ref, total = merge_max_sum(m_k, s_k)
                lse = m_ref + tl.log(total)
                w_hit = w_t     # the target's weight in the loss and the gradient
                scale = w_t     # what p is multiplied by (before the divisor)
                if SMOOTH:
                    smoothing = from_bits(smoothing_bits, tl.float32)
                    eps_c = smoothing / C
                    w_total = C * 1.0
                    if HAS_WEIGHT:
                        w_total = tl.load(w_total_ptr)
                    w_hit = (1.0 - smoothing) * w_t
                    scale = w_hit + eps_c * w_total
                if split == 0:
                    tl.store(flags_ptr, 1, mask=(target != ignore_index) & ~valid)
                    ce = w_hit * (lse - x_t)
                    if SMOOTH:
                        ce += eps_c * (lse * w_total - wx)
                    row_loss = tl.where(valid, ce / ce_norm + z_coef * lse * lse / z_norm, 0.0)
                    row_loss = tl.where((r == 0) & (ce_norm == 0), float("nan"), row_loss)  # "mean" of no weight
                    _store_nearest(rows_ptr + r, row_loss, None, "")
                    tl.store(lse_ptr + r, lse)
                if GRAD:
                    a = (scale / ce_norm + 2.0 * z_coef * lse / z_norm) * unit
                    if VEC == 0:
                        hit = tl.arange(0, BLOCK_C) == (target - split * BLOCK_C).to(tl.int32)  # 32-bit compares
                        g = tl.exp(x_raw.to(tl.float32) - lse) * a - tl.where(hit, w_hit / ce_norm * unit, 0.0)
                        if SMOOTH:
                            g -= eps_c * w_c * unit / ce_norm
                        g = tl.where(valid, g, 0.0)
                        _store_nearest(g_ptr + n * g_sn + row_s * g_ss + c * g_sc, g, mask, GRAD_STORE)
                    else:
                        at = (target + head).to(tl.int32)   # the target's window position (32-bit compares)
                        hit_g = w_hit / ce_norm * unit
                        g = tl.exp(x_raw.to(tl.float32) - lse) * a - tl.where(j == at, hit_g, 0.0)
                        g_first = tl.exp(first_raw.to(tl.float32) - lse) * a - tl.where(v == at, hit_g, 0.0)
                        g_last = tl.exp(last_raw.to(tl.float32) - lse) * a - tl.where(t == at, hit_g, 0.0)
                        if SMOOTH:
                            g -= eps_c * w_c * unit / ce_norm
                            g_first -= eps_c * w_first * unit / ce_norm
                            g_last -= eps_c * w_last * unit / ce_norm
                        DT: tl.constexpr = g_ptr.dtype.element_ty
                        # the gradient's rows start as far past a 16-byte boundary as the logits' (the plan checks)
                        g_w0 = tl.multiple_of(n * g_sn + row_s * g_ss - head, VEC)
                        store_window(g_ptr, g_w0, j, body, v, first, t, last,
                                     _nearest(tl.where(valid, g, 0.0), DT), _nearest(tl.where(valid, g_first, 0.0), DT),
                                     _nearest(tl.where(valid, g_last, 0.0), DT), GRAD_STORE)
        if REDUCE and PHASE != 1:
            _sum_row_losses(rows_ptr, ticket_ptr, loss_ptr, R, 1024)


    @triton.jit
    def _scale_unless_one(g_ptr, dloss_ptr, flags_ptr, numel, ACC: tl.constexpr, ROUND: tl.constexpr,
                          BLOCK: tl.constexpr):
        """g *= dloss * 2^-flags[1] over blocks pid, pid + programs, ...; nothing is read or written
        when that is 1. ROUND: "rtne" for half types (the GPU's rounding; the interpreter would
        truncate otherwise)."""
        scale = tl.load(dloss_ptr).to(ACC) * _pow2(-tl.load(flags_ptr + 1)).to(ACC)
        if scale != 1.0:
            for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, tl.num_programs(0) * BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                mask = offsets < numel
                g = tl.load(g_ptr + offsets, mask=mask)
                tl.store(g_ptr + offsets, (g.to(ACC) * scale).to(g.dtype, fp_downcast_rounding=ROUND), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

def _exchange_config(problem: CrossEntropyProblem) -> tuple[int, int, int, int] | None:
    """(BLOCK_C, chunks per row, num_warps, programs per SM) of the exchange plan, or None where it
    does not apply (see CrossEntropyHeuristics): rows of more than half an exchange block without
    label smoothing, or rows whose usual plan gives fewer programs than SMs cut into smaller chunks
    (exchange.fill_tile), label smoothing or not."""
    h = problem.heuristics
    size, c = problem.dtype.itemsize, problem.classes
    block = h.exchange_block.get(size)
    if block is None or problem.probabilities or not h.exchange_on():
        return None
    sms = h.sm_count(problem.device)
    smooth = problem.label_smoothing > 0   # the usual plan then streams one row a program (_ce_rows)
    fill = fill_tile(problem.rows, c, size, sms, h.fill_per_sm, h.fill_min_bytes, block, c if smooth else block,
                     h.fill_min_row_bytes)
    if smooth and not fill:   # measured without label smoothing: many long rows stream
        return None
    warps, per_sm = h.exchange_warps, h.exchange_per_sm
    if fill and fill < block:
        block, warps, per_sm = fill, min(warps, max(4, fill // 512)), max(per_sm, h.fill_per_sm)
    elif not fill and next_pow2(c) < block:
        return None
    splits = -(-c // block)
    if splits == 1 and not fill:
        warps = h.pipelined_warps.get(size, warps)
    return (block, splits, warps, per_sm) if splits <= sms else None


def _window_vec(problem: CrossEntropyProblem, x_strides: Sequence[int], g_strides: Sequence[int], block: int,
                splits: int) -> int:
    """VEC, the elements in 16 bytes, when the exchange plan (``block`` classes a chunk, ``splits``
    chunks a row; pipelined or not) reads and writes its rows through aligned windows
    (exchange.window, CrossEntropyHeuristics.aligned_windows), else 0. ``plan.kernel["window"]``
    reports it; a call whose logits or gradient pointer is not 16-byte aligned runs the plain
    chunks of the same plan. Windows need a unit class stride in the logits and the gradient
    (x_strides, g_strides: (row, class, spatial) strides), every row of the gradient starting as
    far past a 16-byte boundary as the same row of the logits (strides congruent modulo VEC), and
    no more chunks than the plain ones (``splits * block >= classes + VEC - 1``: a window starts up
    to VEC - 1 classes early; a chunk more would be nearly empty and idle a program a row). They
    are used only where the plain chunks lose vectorised access: a row length, or a stride of a
    batch axis, that is no multiple of 16 elements."""
    if not problem.heuristics.aligned_windows:
        return 0
    c = problem.classes
    vec = 16 // problem.dtype.itemsize
    operands = [x_strides] + ([g_strides] if problem.compute_grad else [])   # no gradient: nothing written
    if any(strides[1] != 1 for strides in operands):
        return 0
    batch = problem.batch_shape
    n, spatial = (batch[0] if batch else 1), math.prod(batch[1:])
    # per operand: the strides its rows start at combinations of (those of axes with more than one entry)
    starts = [(sn if n > 1 else 0, ss if spatial > 1 else 0) for sn, _, ss in operands]
    if c % 16 == 0 and all(o % 16 == 0 for operand in starts for o in operand):
        return 0
    if any(a % vec != b % vec for a, b in zip(starts[0], starts[-1])):
        return 0
    return vec if splits * block >= c + vec - 1 else 0


def _choose_block(problem: CrossEntropyProblem) -> tuple[int, int, int, int]:
    """(BLOCK_C, CHUNKS, num_warps, programs per SM) of the fused and two-pass plans."""
    h = problem.heuristics
    c, size = problem.classes, problem.dtype.itemsize
    full = next_pow2(c)
    if full <= h.register_row[size] or problem.probabilities and full <= h.register_row[size] // 2:
        return full, 1, min(32, max(4, full // 1024)), h.fused_programs_per_sm
    block = h.stream_block[size] // (2 if problem.probabilities else 1)
    return block, -(-c // block), h.stream_warps, h.stream_programs_per_sm


def _kernel_operands(problem: CrossEntropyProblem, tensors, acc: torch.dtype):
    """(outputs, operands): the call's outputs (loss, lse, grad, flags; Plan.run_unchecked hands
    them back: the launches allocate), and what both Triton launchers pass their kernel: (logits,
    target, weight or a placeholder, gradient destination, per-row losses, ticket, loss, lse,
    flags), after the target check; operands None when there are no rows (the loss is then
    finished here).

    Per-row losses: the "none" output itself (no ticket), or a zeroed scratch of rows + 1 entries
    in ``acc`` whose last one holds _sum_row_losses' int32 ticket (cut from one buffer with the
    flags: CrossEntropyProblem.new_output_and_scratch).
    """
    logits, target, weight = (*tensors, None)[:3]
    if problem.check_target:
        check_targets(problem, target)
    if not problem.rows:
        out = problem.new_output()
        finish_loss(problem, torch.empty(0, dtype=acc, device=out[0].device), None, out[0])
        return out, None
    out, row_loss = problem.new_output_and_scratch(acc)
    loss, lse, grad, flags = out
    ticket = row_loss if problem.reduction == "none" else row_loss[problem.rows:].view(torch.int32)
    g = logits if problem.grad_into_input or not problem.compute_grad else grad
    return out, (logits, target, logits if weight is None else weight, g, row_loss, ticket, loss, lse, flags)


def _prepare_triton(problem: CrossEntropyProblem) -> Launch:
    acc = accumulator_dtype(problem.dtype)
    c = problem.classes
    s = 1 if len(problem.shape) <= 2 else math.prod(problem.shape[2:])
    x_strides = row_strides(problem.shape, problem.strides)
    t_strides = row_strides(problem.shape, problem.target_strides) if problem.probabilities else (s, 0, 1)
    g_strides = x_strides if problem.grad_into_input else row_strides(
        problem.shape, torch.empty(problem.shape, device="meta").stride())
    mean_by_targets = problem.reduction == "mean" and not problem.probabilities
    fixed_norm = float(problem.rows) if problem.reduction == "mean" else 1.0  # probability targets: the row count
    z_bound = z_gradient_bound(problem.z_loss, problem.classes)
    strides = (*x_strides, *t_strides, *g_strides)
    exchange = _exchange_config(problem)
    if exchange:
        consts = tuple(float_bits(v, torch.float32) for v in (problem.z_loss, fixed_norm, z_bound))
        return _prepare_exchange(problem, consts, strides, mean_by_targets, exchange, s)
    consts = tuple(float_bits(v, acc) for v in (problem.label_smoothing, problem.z_loss, fixed_norm, z_bound))
    block, chunks, warps, per_sm = _choose_block(problem)
    programs = problem.heuristics.sm_count(problem.device) * per_sm
    smooth = problem.label_smoothing > 0
    meta = dict(PROBS=problem.probabilities, HAS_WEIGHT=problem.has_weight, SMOOTH=smooth, GRAD=problem.compute_grad,
                ACC=tl.float64 if acc == torch.float64 else tl.float32, BLOCK_C=block, CHUNKS=chunks, num_warps=warps,
                FIRST_PASS_EVICT=problem.heuristics.first_pass_evict, GRAD_STORE=problem.heuristics.grad_store,
                MEAN_BY_TARGETS=mean_by_targets,
                REDUCE=problem.reduction != "none", SCALE_GRAD=problem.scales_gradient)
    # the plan's scalars bound once (trailing): a call passes the nine tensors alone
    rows_launch = launcher(_ce_rows, (max(1, min(problem.rows, programs)),),
                           trailing=(*consts, problem.rows, c, s, *strides, problem.ignore_index), **meta)

    def run(tensors, _):
        out, operands = _kernel_operands(problem, tensors, acc)
        if operands is not None:
            rows_launch(*operands)
        return out

    params = (("BLOCK_C", block), ("chunks", chunks), ("num_warps", warps), ("programs", programs),
              ("plan", "fused" if chunks == 1 else "two-pass"))
    return Launch(run, KernelChoice("ce_rows", "triton", params), acc,
                  workspace_bytes=(problem.rows + 1) * acc.itemsize * (problem.reduction != "none"), allocates=True)


def _prepare_exchange(problem: CrossEntropyProblem, consts: tuple[int, ...], strides: tuple[int, ...],
                      mean_by_targets: bool, config: tuple[int, int, int, int], s: int) -> Launch:
    """The exchange plan (``config`` from _exchange_config: BLOCK_C, ``splits`` chunks a row, warps,
    programs per SM; ``s`` = d1 * ... * dk): flagged partials [rows, splits] zeroed per call, one
    launch (two under the interpreter); with one chunk a row ("pipelined") no partials and one
    launch everywhere."""
    h = problem.heuristics
    block, splits, warps, per_sm = config
    c, rows = problem.classes, problem.rows
    smooth = problem.label_smoothing > 0
    meta = dict(HAS_WEIGHT=problem.has_weight, GRAD=problem.compute_grad, BLOCK_C=block, SPLITS=splits,
                SPLITS_P2=next_pow2(splits), GRAD_STORE=h.grad_store, MEAN_BY_TARGETS=mean_by_targets,
                REDUCE=problem.reduction != "none", SCALE_GRAD=problem.scales_gradient, num_warps=warps,
                SMOOTH=smooth)
    grid = ExchangeGrid(_ce_rows_exchange, rows, splits, per_sm, h.sm_count(problem.device))
    words_per_row = splits * (2 if smooth else 1)   # (max, sum exp), then sum w x with label smoothing
    smoothing_bits = float_bits(problem.label_smoothing, torch.float32)
    vec = _window_vec(problem, strides[:3], strides[6:], block, splits)
    window_meta = dict(meta, VEC=vec)

    def run(tensors, _):
        out, operands = _kernel_operands(problem, tensors, torch.float32)
        if operands is not None:
            flags = operands[-1]
            words = torch.zeros(rows * words_per_row, dtype=torch.int64, device=flags.device) if splits > 1 else flags
            # sum of the class weights (label smoothing's eps / C * sum w), one float32 sum in torch's fixed order
            w_total = operands[2].sum(dtype=torch.float32) if smooth and problem.has_weight else flags
            args = (*operands, *consts, words, rows, c, s, *strides, problem.ignore_index, smoothing_bits, w_total)
            # windows start at 16-byte boundaries of the rows' offsets: the logits' and gradient's pointers too
            aligned = vec and operands[0].data_ptr() % 16 == 0 and operands[3].data_ptr() % 16 == 0
            launch_exchange(_ce_rows_exchange, grid, args, window_meta if aligned else meta, flags.device)
        return out

    params = (("BLOCK_C", block), ("splits", splits), ("num_warps", warps), ("per_sm", per_sm),
              ("plan", "exchange" if splits > 1 else "pipelined"), ("window", vec))
    return Launch(run, KernelChoice("ce_rows_exchange", "triton", params), torch.float32,
                  workspace_bytes=(rows + 1) * 4 * (problem.reduction != "none")
                  + rows * words_per_row * 8 * (splits > 1),
                  allocates=True)


_SCALE_BLOCK = 4096
_SCALE_PROGRAMS_PER_SM = 8


def _prepare_grad_scale_triton(problem) -> MultiTensorLaunch:
    acc = accumulator_dtype(problem.dtype)
    programs = sm_count(problem.device) * _SCALE_PROGRAMS_PER_SM
    meta = dict(ACC=tl.float64 if acc == torch.float64 else tl.float32, BLOCK=_SCALE_BLOCK, num_warps=4,
                ROUND="rtne" if problem.dtype.itemsize == 2 else None)
    launches: dict[int, object] = {}  # one launcher a grid size (at most ``programs`` of them)

    def run(grad, dloss, flags):
        numel = grad.numel()
        if numel:
            base = grad if grad.is_contiguous() else grad.as_strided((numel,), (1,))
            grid = min(programs, -(-numel // _SCALE_BLOCK))
            launch = launches.get(grid)
            if launch is None:
                launch = launches[grid] = launcher(_scale_unless_one, (grid,), **meta)
            launch(base, dloss, flags, numel)

    return MultiTensorLaunch(run, KernelChoice("scale_unless_one", "triton", (("BLOCK", _SCALE_BLOCK),)), acc)


if triton_available():
    register("cross_entropy_grad_scale", backend="triton", dtypes=FLOATS, deterministic=True,
             accumulator=ACCUMULATOR, name="cross_entropy_grad_scale_triton")(_prepare_grad_scale_triton)
    register("cross_entropy", backend="triton", dtypes=FLOATS, index_dtypes=INDEX_DTYPES, deterministic=True,
             accumulator=ACCUMULATOR, name="cross_entropy_triton")(_prepare_triton)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.cross_entropy (loss and gradient in one pass; the backward scales
# the saved gradient) and cross_entropy_inplace (the gradient written over the logits)
# ----------------------------------------------------------------------------------------------

def _check_weight(logits: Tensor, target: Tensor, weight: Tensor | None) -> None:
    """What the descriptor leaves out: the target's device and the weight (length, dtype, device)."""
    op = "cross_entropy"
    if target.device != logits.device:
        raise argument_error(InvalidProblemError, op, "target", f"is on {target.device} but input is on {logits.device}")
    if weight is not None:
        classes = logits.shape[0] if logits.dim() == 1 else logits.shape[1] if logits.dim() > 1 else None
        if not isinstance(weight, Tensor) or weight.dim() != 1 or weight.shape[0] != classes:
            shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
            raise argument_error(InvalidProblemError, op, "weight", f"has shape {shape}; expected ({classes},), one "
                                 "weight per class")
        if not weight.is_floating_point() or weight.device != logits.device:
            raise argument_error(InvalidProblemError, op, "weight", f"must be a float tensor on {logits.device}, got "
                                 f"{weight.dtype} on {weight.device}")


def _descriptor_of(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, loss_dtype,
                   compute_grad, check_target, grad_into_input):
    """(descriptor, tensors) of a call: the tensors as the kernels take them, and their plan's key."""
    _check_weight(logits, target, weight)
    # rare layouts whose d1..dk do not merge (a contiguous tensor's always do: the check is skipped)
    if not logits.is_contiguous() and row_strides(logits.shape, logits.stride()) is None:
        if grad_into_input:
            raise UnsupportedError("trainops.cross_entropy: inplace_backward needs logits whose d1..dk merge")
        logits = logits.contiguous()  # one copy
    if target.is_floating_point():
        target = target if row_strides(target.shape, target.stride()) is not None else target.contiguous()
    else:
        target = target.contiguous()
    descriptor = CrossEntropyDescriptor(
        logits.shape, logits.dtype, target.dtype, logits.device, strides=logits.stride(), target_shape=target.shape,
        target_strides=target.stride(), has_weight=weight is not None, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss=z_loss, loss_dtype=loss_dtype, compute_grad=compute_grad,
        check_target=check_target, grad_into_input=grad_into_input, heuristics=heuristics_for(CrossEntropyHeuristics))
    return descriptor, (logits, target) if weight is None else (logits, target, weight)


def _fake_outputs(descriptor) -> tuple[Tensor, ...]:
    """The outputs of a call, allocated by its problem (validated, no plan: a plan made while
    tracing would keep fake tensors)."""
    return _describe(**descriptor._asdict()).new_output()


def _cross_entropy_impl(logits: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int,
                        reduction: str, label_smoothing: float, z_loss: float, loss_dtype: Optional[torch.dtype],
                        compute_grad: bool, check_target: bool,
                        deferred_check: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    descriptor, tensors = _descriptor_of(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                         loss_dtype, compute_grad, check_target, False)
    return _run_deferred(cached_plan(descriptor), tensors, deferred_check and logits.device.type == "cuda")


def _run_deferred(plan, tensors, on_device: bool, op: str = "cross_entropy"):
    """The plan's outputs; ``on_device``: the deferred target check of a CUDA call, made by the op
    itself (eager mode or inside a compiled graph): an earlier flagged error raised first, then
    this call's flag (the outputs' last) remembered without waiting for the GPU."""
    if not on_device:
        if tensors[0].device.type == "cuda":   # an earlier call's flagged error first, checked or not
            raise_flagged()
        return plan.run_unchecked(tensors)
    in_capture = capturing(tensors[0].device)
    raise_flagged(in_capture)
    outputs = plan.run_unchecked(tensors)
    note_target_flag(outputs[-1], op, in_capture)
    return outputs


def _cross_entropy_fake(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, loss_dtype,
                        compute_grad, check_target, deferred_check):
    return _fake_outputs(_descriptor_of(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                        loss_dtype, compute_grad, check_target, False)[0])


def _keep_for_backward(ctx, reduction: str, ndim: int, deferred_check: bool, compute_grad: bool,
                       grad: Tensor, flags: Tensor) -> None:
    """What scale_fused_gradient needs, saved by both custom ops' autograd."""
    ctx.reduction, ctx.ndim, ctx.deferred_check, ctx.compute_grad = reduction, ndim, deferred_check, compute_grad
    ctx.save_for_backward(grad, flags)
    ctx.consumed = False


def _save_cross_entropy(ctx, inputs, output) -> None:
    _keep_for_backward(ctx, inputs.reduction, inputs.logits.dim(), inputs.deferred_check, inputs.compute_grad,
                       output[2], output[3])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero-filled logits-sized gradient for the unused grad output


def _cross_entropy_grad(ctx, dloss: Tensor, dlse, dgrad, dflags) -> dict:
    if dloss is None:
        return {}
    return {"logits": scale_fused_gradient(ctx, dloss, in_place=False)}


_BAD_TARGET_MESSAGE = ("trainops.{}: argument 'target' holds a class index out of range [0, C) that is not "
                       "ignore_index (found by the fused kernel{}; such rows were left out of the loss)")


_DEFERRED_MESSAGES: dict[str, str] = {}   # op -> its deferred message


def note_target_flag(flags: Tensor, op: str = "cross_entropy", in_capture: bool | None = None) -> None:
    """Remember a CUDA call's bad-target flag (flags[0]) for a later check that does not wait for the
    GPU (ops/_common.py's deferred flags); ``op``: the public function the error will name."""
    message = _DEFERRED_MESSAGES.get(op)
    if message is None:
        message = _DEFERRED_MESSAGES[op] = _BAD_TARGET_MESSAGE.format(
            op, " of a call on the GPU, reported once the GPU had run it")
    note_flag(flags, message, in_capture)   # flags[0]: the bad-target flag



def scale_fused_gradient(ctx, dloss: Tensor, in_place: bool) -> Tensor:
    """dloss/dlogits from the gradient the forward kernel wrote for an upstream gradient of 2^k,
    saved with its flags [bad target, k] as ``ctx.saved_tensors`` (k = 0 but for float16 logits:
    gradient_exponent).

    Eager mode, no host synchronisation: the buffer is scaled in place by a kernel that reads
    dloss on the device and does nothing when it is exactly 1 (``loss.backward()``), then handed
    over, so a second backward through the same loss raises. float64 logits (gradcheck's dtype)
    and torch.compile scale out of place instead, and any number of backwards may follow.
    ``in_place``: the buffer is the caller's (the logits'), so scaling always happens in it.
    The deferred target check raises here at once for CPU tensors; for CUDA tensors it raises at
    the first trainops.cross_entropy call or backward after the GPU has set the flag.
    """
    if torch.is_grad_enabled():
        raise UnsupportedError("trainops.cross_entropy: double backward is not supported (the gradient is "
                               "computed in the forward pass)")
    if not ctx.compute_grad:
        raise UnsupportedError("trainops.cross_entropy: no gradient was computed in the forward (input did not "
                               "require grad when the loss was computed)")
    if ctx.consumed:
        raise UnsupportedError("trainops.cross_entropy: a second backward through the same loss "
                               "(retain_graph=True) is not supported for float16/bfloat16/float32 logits: the first "
                               "one handed its gradient buffer over")
    grad, flags = ctx.saved_tensors  # after the checks: an in-place scale has bumped the buffer's version
    tracing = torch.compiler.is_compiling() or type(dloss) is not torch.Tensor  # fake / functional tensors
    if not tracing and ctx.deferred_check:
        if flags.device.type == "cpu":
            if flags[0]:
                raise IndexOutOfRangeError(_BAD_TARGET_MESSAGE.format("cross_entropy", ""))
        else:
            raise_flagged()
    if not tracing and grad.dtype != torch.float64:
        ctx.consumed = True  # the buffer is handed over
        if dloss.numel() == 1 and is_dense(grad):
            scale_gradient_(grad, dloss, flags)
            return grad
    half = grad.dtype == torch.float16  # times dloss * 2^-k, in float32 (the factor may be subnormal in float16)
    scale = torch.ldexp(dloss.float(), -flags[1].float()) if half else dloss.to(grad.dtype)
    if ctx.reduction == "none" and ctx.ndim > 1:
        scale = scale.unsqueeze(1)
    out_of_place = tracing or grad.dtype == torch.float64
    if out_of_place:
        ctx.consumed = in_place
    write_back = in_place or not out_of_place
    if half:
        scaled = (grad.float() * scale).to(grad.dtype)
        return grad.copy_(scaled) if write_back else scaled
    return grad.mul_(scale) if write_back else grad * scale


def _cross_entropy_inplace_impl(logits: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int,
                                reduction: str, label_smoothing: float, z_loss: float,
                                loss_dtype: Optional[torch.dtype], check_target: bool,
                                deferred_check: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    descriptor, tensors = _descriptor_of(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                         loss_dtype, True, check_target, True)
    loss, lse, _, flags = _run_deferred(cached_plan(descriptor), tensors,
                                        deferred_check and logits.device.type == "cuda")
    return loss, lse, flags


def _cross_entropy_inplace_fake(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                loss_dtype, check_target, deferred_check=False):
    loss, lse, _, flags = _fake_outputs(_descriptor_of(logits, target, weight, ignore_index, reduction, label_smoothing,
                                                       z_loss, loss_dtype, True, check_target, True)[0])
    return loss, lse, flags


cross_entropy_op = custom_op("cross_entropy", _cross_entropy_impl, _cross_entropy_fake, backward=_cross_entropy_grad,
                             save=_save_cross_entropy)
# The gradient written over the logits; no autograd of its own (_InplaceCrossEntropy is its Function).
cross_entropy_inplace_op = custom_op("cross_entropy_inplace", _cross_entropy_inplace_impl,
                                     _cross_entropy_inplace_fake, mutates_args=("logits",))


class _InplaceCrossEntropy(torch.autograd.Function):
    """cross_entropy whose forward kernel writes the gradient over the logits (``inplace_backward``)."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, loss_dtype,
                check_target, deferred_check):
        loss, lse, flags = cross_entropy_inplace_op(logits, target, weight, ignore_index, reduction, label_smoothing,
                                                    z_loss, loss_dtype, check_target, deferred_check)
        _keep_for_backward(ctx, reduction, logits.dim(), deferred_check, True, logits, flags)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, dloss, dlse):
        return (scale_fused_gradient(ctx, dloss, in_place=True),) + (None,) * 9


def cross_entropy(logits: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, reduction: str,
                  label_smoothing: float, z_loss: float, loss_dtype: torch.dtype | None, check_target: bool,
                  inplace_backward: bool, immediate_check: bool = False) -> tuple[Tensor, Tensor]:
    """(loss, lse) of trainops.cross_entropy (functional.py checks the arguments' types): the deferred
    target check (see functional.cross_entropy; none with ``immediate_check``), and the in-place
    variant."""
    compute_grad = logits.requires_grad and torch.is_grad_enabled()
    compiling = torch.compiler.is_compiling()
    if not compiling:
        raise_flagged()
    # On the GPU (eager or compiled) the kernel flags bad targets and the op remembers the flag for a
    # later call, without a host sync; on the CPU the eager backward checks it (without a gradient,
    # or compiled, the op checks first, which costs no sync there).
    deferred = (check_target and not immediate_check and not target.is_floating_point()
                and (logits.device.type == "cuda" or (compute_grad and not compiling)))
    if inplace_backward and compute_grad:
        if logits.is_leaf:
            raise argument_error(InvalidProblemError, "cross_entropy", "inplace_backward",
                                 "needs a non-leaf input (its gradient would alias the leaf's own values)")
        return _InplaceCrossEntropy.apply(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                          loss_dtype, check_target and not deferred, deferred)
    loss, lse, _, _ = cross_entropy_op(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                       loss_dtype, compute_grad, check_target and not deferred, deferred)
    return loss, lse
