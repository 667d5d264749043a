"""The chunking base of the fused linear post-training losses (linear_distillation,
linear_preference): an LM head's logits computed ``rows`` tokens at a time, transformed, handed to
a loss's per-chunk function, and the gradient of each chunk's logits pushed back through the
transform and the head's matmuls into dhidden, dweight and dbias.

    logits_c = hidden_c @ W^T (+ b)                          one matmul in hidden's dtype, float32 output
    u_c      = softcap(logit_scale * logits_c)               float32 (float64 for float64), in place
                                                             softcap(v) = c tanh(v / c); none when c is None
    (the loss divides u by its temperature itself: distillation's hard loss reads u at temperature 1)
    dlogits  = du_c * logit_scale * (1 - (u_c / c)^2)        written by the loss's row kernel straight in the
                                                             matmuls' dtype (rounded once), over u_c's own storage
    dhidden_c = dlogits @ W                                   float32 output, rounded once into dhidden's rows
    dW (+)= dlogits^T @ hidden_c                              a half head's own dtype (the default; or a float32
                                                             buffer, ChunkedLinearHeuristics); a float32 weight's
                                                             gradient itself
    db += column sums of dlogits                              float32

The softcap's derivative 1 - tanh^2 is 1 - (u / c)^2 of the capped logits themselves (u = c tanh):
no tanh buffer is kept. The row kernels fold that factor, logit_scale, the temperature and the
loss's normalisation into the one value they store per logit (``ChunkedHead.gradient_buffer``:
for a half head the gradient's row r lies in the first half of the bytes of u's row r, row stride
2V; for a float32 / float64 head it is u itself), so no pass over the chunk scales or casts it.

Chunks go in a fixed order and nothing uses atomics: the gradients are bit-identical run to run.
Only the gradients a call asks for are computed (``needs``: a frozen head costs no dW, no_grad
costs no gradient matmul). A loss computes everything under ``torch.autocast(enabled=False)``.

Not an op family: this module registers no op and no kernel (each loss registers its per-chunk row
kernels; the backward's in-place scaling of the gradients by the upstream gradient is
cross_entropy's ``scale_unless_one_``, which on CUDA reads that gradient on the device and touches
nothing when it is 1, the usual ``loss.backward()``, as linear_cross_entropy's backward).
ChunkedLinearHeuristics sets the chunk sizes of both losses and the memory they hold. Also here: the
backward both losses use when their forward computed the gradients (``scaled_gradients``) and the
argument checks they share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError, argument_error
from ..plan import heuristics_for
from ..registry import accumulator_dtype as accumulator
from ._common import matmul_into
from .cross_entropy import scale_unless_one_

NEEDS_HIDDEN, NEEDS_WEIGHT, NEEDS_BIAS = 1, 2, 4   # the gradients a call computes, as bits
GRADIENTS = NEEDS_HIDDEN | NEEDS_WEIGHT | NEEDS_BIAS
WEIGHT_DTYPE_DW = 8   # with NEEDS_WEIGHT: accumulate a half weight's gradient in its own dtype


@dataclass(frozen=True, eq=False)
class ChunkedLinearHeuristics:
    """chunk_bytes: the most bytes one chunk's logits may take in float32; a chunk's rows are the
    largest power of two that fits, at least ``min_rows``. On the GPU the buffers a call holds beyond
    its inputs and gradients (allocated once a call, reused by every chunk): the preference losses
    one float32 chunk of logits, 4 V rows bytes (+ a float32 dhidden chunk, 4 H rows); distillation
    the student's chunk and the teacher's sub-chunk, 4 V (rows + teacher_rows) bytes (its float32
    dhidden chunk lives in the teacher's buffer once the row kernel has read it, when 4 H rows
    fits there), plus per-token vectors (about 24 N bytes) and, with weight_grad_accumulator
    "float32", 4 V H. Each chunk
    after the first rereads and rewrites the dW accumulator, so fewer, larger chunks are faster and
    hold more memory. The default, 1 GiB, is 2048 rows of a
    128256-class vocabulary (unmeasured here: chosen as linear_cross_entropy's 2048-row chunks at
    that vocabulary, whose choice the H100 measured; benchmarks/bench_linear_post_training.py
    reports the peak memory and time to revisit it).

    weight_grad_accumulator: "weight" (default) accumulates a half weight's gradient across chunks in
    the weight's own dtype (the dW matmul adds into it: one rounding a chunk, no buffer);
    "float32" accumulates it in a float32 buffer rounded once at the end (4 bytes a weight element
    alive during the call, reread and rewritten by every chunk's dW matmul). Float32 weights are
    accumulated in float32 either way. Measured on the H200 (H 4096, V 128256, 8192 tokens, bf16;
    benchmarks/results/linear-post-training-h200-20261129.json): DPO 56.0 ms and 1050 MiB of
    extra memory with "weight" against 58.4 ms and 2052 MiB with "float32"; distillation 64.3 ms
    and 2036 MiB against 63.5 ms and 3038 MiB; the weight gradient's error against float32
    arithmetic 3.3e-3 against 2.2e-3 (distillation), 2.1e-3 against 1.9e-3 (DPO).

    teacher_chunk_bytes: distillation computes the teacher's logits in sub-chunks of the student's
    chunk, each followed by the row kernel on its rows: the largest power of two of rows whose
    float32 logits fit, at least ``min_rows``, at most the student chunk's. The default, 512 MiB, is
    1024 rows at 128256 classes: 4 V (2048 + 1024) bytes = 1503 MiB of logits at H 4096, V 128256
    (the student's and teacher's chunks of 2048 rows took 2004 MiB + a 32 MiB float32 dhidden
    chunk: 2036 MiB measured on the H200 against Liger's 1996). The cost: one more teacher matmul
    and row-kernel launch a chunk, on half the rows (unmeasured; the bench's "teacher chunk 2048"
    row runs the old layout).

    row_block, row_warps: vocabulary entries distillation's row kernel reads at a time a program
    and its warps (unmeasured: a 4096-entry float32 block is 16 KiB a load, the cross-entropy
    kernel's order of size; the bench runs other pairs). alternate_passes: the row kernel's
    read-only passes alternate direction with the pass before, for the L2 reuse at the turns (False,
    the default: every pass forwards, as measured on the H200; True is untimed there: the bench
    compares them)."""

    chunk_bytes: int = 2**30
    min_rows: int = 16
    weight_grad_accumulator: str = "weight"
    teacher_chunk_bytes: int = 2**29
    row_block: int = 4096
    row_warps: int = 8
    alternate_passes: bool = False

    def __post_init__(self):
        name = "ChunkedLinearHeuristics"
        if self.weight_grad_accumulator not in ("float32", "weight"):
            raise argument_error(InvalidProblemError, name, "weight_grad_accumulator",
                                 f"is {self.weight_grad_accumulator!r}; expected 'float32' or 'weight'")
        for field in ("chunk_bytes", "teacher_chunk_bytes", "min_rows"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise argument_error(InvalidProblemError, name, field, f"must be an int >= 1, got {value!r}")
        block = self.row_block
        if isinstance(block, bool) or not isinstance(block, int) or block < 16 or block & (block - 1):
            raise argument_error(InvalidProblemError, name, "row_block", f"must be a power of two >= 16, got "
                                 f"{block!r}")
        if isinstance(self.row_warps, bool) or self.row_warps not in (1, 2, 4, 8, 16, 32):
            raise argument_error(InvalidProblemError, name, "row_warps", f"must be 1, 2, 4, 8, 16 or 32, got "
                                 f"{self.row_warps!r}")
        if not isinstance(self.alternate_passes, bool):
            raise argument_error(InvalidProblemError, name, "alternate_passes", f"must be a bool, got "
                                 f"{self.alternate_passes!r}")

    def rows(self, n: int, classes: int) -> int:
        return self._fit(self.chunk_bytes, n, classes)

    def teacher_rows(self, n: int, classes: int) -> int:
        """Rows of distillation's teacher sub-chunk (at most the student chunk's ``rows``)."""
        return min(self._fit(self.teacher_chunk_bytes, n, classes), self.rows(n, classes))

    def _fit(self, budget: int, n: int, classes: int) -> int:
        fit = budget // max(1, classes * 4)
        rows = max(self.min_rows, 1 << (fit.bit_length() - 1) if fit else 0)
        return max(1, min(n, rows))


def weight_dtype_bit() -> int:
    """WEIGHT_DTYPE_DW when the ChunkedLinearHeuristics in force say "weight", else 0 (read at run time)."""
    return WEIGHT_DTYPE_DW if heuristics_for(ChunkedLinearHeuristics).weight_grad_accumulator == "weight" else 0


def heuristic_rows(n: int, classes: int) -> int:
    """Tokens a chunk from the ChunkedLinearHeuristics in force (read at run time, not traced)."""
    return heuristics_for(ChunkedLinearHeuristics).rows(n, classes)


def heuristic_teacher_rows(n: int, classes: int) -> int:
    """Tokens of distillation's teacher sub-chunk from the ChunkedLinearHeuristics in force."""
    return heuristics_for(ChunkedLinearHeuristics).teacher_rows(n, classes)


class ChunkedHead:
    """One LM head over one call's tokens: ``logits(start, stop)`` gives a chunk's transformed
    logits u (float32); a loss's row kernel writes their dlogits into ``gradient_buffer(u)`` (the
    transform's ``chain`` factors and the loss's global normalisation folded in);
    ``backward(start, stop, dlogits)`` accumulates that chunk's gradients; ``finish()`` returns
    (dhidden, dweight, dbias), each rounded once to its tensor's dtype, None where not in ``needs``.

    hidden (N, H) in the matmuls' dtype; weight (V, H) and bias (V,) any float dtype (cast once to
    hidden's). logit_scale multiplies the logits, softcap caps them (None: no cap)."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], logit_scale: float,
                 softcap: Optional[float], needs: int = 0):
        self.x, self.weight, self.bias = hidden, weight, bias
        self.acc = accumulator(hidden.dtype)
        self.w = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
        self.b = None if bias is None else bias if bias.dtype == hidden.dtype else bias.to(hidden.dtype)
        self.logit_scale, self.softcap = logit_scale, softcap
        n, h = hidden.shape
        dev = hidden.device
        self.dx = torch.empty_like(hidden) if needs & NEEDS_HIDDEN else None
        # dW in the accumulator dtype: a float32 weight's gradient itself, else a buffer rounded at the end;
        # or in a half weight's own dtype (WEIGHT_DTYPE_DW) where it is the matmuls' (hidden's) dtype too: the
        # dW matmul adds into its output, which must be its operands' dtype or float32
        dw_dtype = (weight.dtype if needs & WEIGHT_DTYPE_DW and weight.dtype in (torch.float16, torch.bfloat16)
                    and weight.dtype == hidden.dtype else self.acc)
        # the first chunk's dW matmul writes it (no memset of the whole head); finish() zeroes it if none ran
        self.dw = torch.empty(weight.shape, dtype=dw_dtype, device=dev) if needs & NEEDS_WEIGHT else None
        self.db = (torch.zeros(weight.shape[0], dtype=self.acc, device=dev)
                   if bias is not None and needs & NEEDS_BIAS else None)
        self._dx_chunk = self._w_acc = None
        self.b_acc = None if bias is None else bias.to(self.acc)
        self._first = True

    def logits(self, start: int, stop: int, out: Optional[Tensor] = None) -> Tensor:
        """u = softcap(logit_scale * (x W^T + b)) of rows [start, stop) in the accumulator dtype, written
        into ``out`` ((rows, V) contiguous, the accumulator dtype: a buffer a call allocates once and
        reuses chunk after chunk) or a new buffer; the caller may overwrite it. The matmul writes
        float32 itself from half inputs (out_dtype on CUDA; converted operands on the CPU): the logits
        are never rounded to the half dtype."""
        return self.logits_of(self.x[start:stop], out)

    def logits_of(self, xc: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """``logits`` of rows gathered by the caller (xc: (rows, H) in hidden's dtype)."""
        if out is None:
            out = torch.empty(xc.shape[0], self.w.shape[0], dtype=self.acc, device=xc.device)
        u = out
        if self.acc == self.x.dtype:
            if self.b is None:
                torch.mm(xc, self.w.t(), out=u)
            else:
                torch.addmm(self.b, xc, self.w.t(), out=u)
        else:
            if xc.device.type == "cuda":
                torch.mm(xc, self.w.t(), out_dtype=self.acc, out=u)
            else:
                if self._w_acc is None:   # the CPU path: one converted copy of the head a call
                    self._w_acc = self.w.to(self.acc)
                torch.mm(xc.to(self.acc), self._w_acc.t(), out=u)
            if self.b is not None:
                u += self.b_acc
        if self.logit_scale != 1.0:
            u.mul_(self.logit_scale)
        if self.softcap is not None:   # in place: the gradient reads 1 - (u / c)^2 from u itself
            u.div_(self.softcap).tanh_().mul_(self.softcap)
        return u

    def gradient_buffer(self, u: Tensor) -> Tensor:
        """Where a row kernel writes a chunk's dlogits (rows, V) in the matmuls' dtype: u itself when
        that dtype is u's (float32, float64 heads), else a view of u's own storage as the half dtype
        whose row r is the first half of the bytes of u's row r (row stride 2V). A kernel writing
        element j of a row reads u[j] first; its store lands on bytes of u[j / 2], which every thread
        of the program has read once a barrier separates a block's loads from its stores (the Triton
        kernels do). The gradient matmuls read it with leading dimension 2V."""
        if u.dtype == self.x.dtype:
            return u
        return u.view(self.x.dtype)[:, : u.shape[1]]

    @property
    def chain(self) -> tuple[float, float]:
        """(1 / softcap or 0, logit_scale): the row kernels' dlogits = du logit_scale (1 - (u / c)^2)."""
        return (0.0 if self.softcap is None else 1.0 / self.softcap), float(self.logit_scale)

    def backward(self, start: int, stop: int, dlogits: Tensor, scratch: Optional[Tensor] = None) -> None:
        """Accumulate the gradients of rows [start, stop) from their dlogits (``gradient_buffer``:
        d loss / d logits in the matmuls' dtype, the transform's factors and the loss's normalisation
        already in). ``scratch``: a dead buffer in the accumulator dtype whose storage may hold the
        float32 dhidden chunk (distillation's teacher logits), instead of one allocated a call."""
        self.backward_of(self.x[start:stop], dlogits, ((start, stop),), scratch)

    def backward_of(self, xc: Tensor, dlogits: Tensor, parts, scratch: Optional[Tensor] = None) -> None:
        """``backward`` of gathered rows xc: ``parts``, the (start, stop) ranges of x that xc's rows
        are, in order (dhidden's rows are written there)."""
        if self.dx is None and self.dw is None and self.db is None:
            return
        rows = xc.shape[0]
        if self.dx is not None:   # in the accumulator dtype, rounded once into dx's rows
            if self.acc == self.x.dtype and len(parts) == 1:
                torch.mm(dlogits, self.w, out=self.dx[parts[0][0]:parts[0][1]])
            else:
                size = rows * self.x.shape[1]
                if (scratch is not None and scratch.dtype == self.acc and scratch.is_contiguous()
                        and scratch.numel() >= size):
                    chunk = scratch.view(-1)[:size].view(rows, self.x.shape[1])
                else:   # allocated once a call (the first chunk is the largest)
                    if self._dx_chunk is None or self._dx_chunk.shape[0] < rows:
                        self._dx_chunk = torch.empty(rows, self.x.shape[1], dtype=self.acc, device=self.x.device)
                    chunk = self._dx_chunk[:rows]
                matmul_into(chunk, dlogits, self.w, accumulate=False)
                offset = 0
                for start, stop in parts:
                    self.dx[start:stop].copy_(chunk[offset:offset + stop - start])
                    offset += stop - start
        if self.dw is not None:
            matmul_into(self.dw, dlogits.t(), xc, accumulate=not self._first)
        if self.db is not None:
            self.db += dlogits.sum(0, dtype=self.acc)
        self._first = False

    def finish(self) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """(dhidden, dweight, dbias), each in its tensor's dtype (None if not asked)."""
        dx, dw, db = self.dx, self.dw, self.db
        self.dx = self.dw = self.db = self._dx_chunk = self._w_acc = None
        if dw is not None and self._first:   # no chunk (no tokens): a zero gradient
            dw.zero_()
        if dw is not None and self.weight.dtype != dw.dtype:   # rounded once; the float32 buffer freed
            dw = dw.to(self.weight.dtype)
        if db is not None and self.bias.dtype != self.acc:
            db = db.to(self.bias.dtype)
        return dx, dw, db


def store_gradient_torch(out: Tensor, du: Tensor, u: Tensor, cap_inv: float, scale: float) -> None:
    """The torch-op kernels' store: out = du * scale * (1 - (u cap_inv)^2) in out's dtype. ``du`` (a
    buffer of the kernel's own, overwritten) must not share storage with ``out``; ``u`` is read (so
    ``out``, which may alias u, is written last)."""
    if cap_inv:
        du.mul_(torch.mul(u, cap_inv).square_().neg_().add_(1))
    if scale != 1.0:
        du.mul_(scale)
    out.copy_(du)


def save_scaled_gradients(ctx, needs: int, gradients) -> None:
    """A custom op's save for a loss whose gradients its forward computed: (dhidden, dweight, dbias)."""
    ctx.set_materialize_grads(False)
    ctx.needs = needs
    ctx.consumed = False
    ctx.save_for_backward(*gradients)


def scaled_gradients(op: str, ctx, dloss: Tensor, names: tuple[str, str, str]) -> dict:
    """The backward of such a loss: the saved gradients times the upstream gradient, on the device
    (in place in eager mode by cross_entropy's ``scale_unless_one_``, nothing read or written on CUDA
    when dloss is 1;
    a second backward through the same loss raises; out of place while tracing (torch.compile) and
    in float64, any number of times)."""
    if dloss is None:
        return {}
    if torch.is_grad_enabled():
        raise UnsupportedError(f"trainops.{op}: double backward is not supported")
    if ctx.consumed:
        raise UnsupportedError(f"trainops.{op}: a second backward through the same loss (retain_graph=True) is not "
                               "supported: the first one scaled the gradients the forward computed, in place")
    tracing = torch.compiler.is_compiling() or type(dloss) is not torch.Tensor
    out_of_place = tracing or dloss.dtype == torch.float64
    ctx.consumed = not out_of_place
    grads = {}
    for name, g, bit in zip(names, ctx.saved_tensors, (NEEDS_HIDDEN, NEEDS_WEIGHT, NEEDS_BIAS)):
        if ctx.needs & bit:
            grads[name] = ((g.to(accumulator(g.dtype)) * dloss).to(g.dtype) if out_of_place
                           else scale_unless_one_(g, dloss))
    return grads


# ----------------------------------------------------------------------------------------------
# Argument checks both losses share (errors name the op and the argument)
# ----------------------------------------------------------------------------------------------

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_transform(op: str, logit_scale, softcap, temperature) -> None:
    """z = softcap(logit_scale * logits) / temperature: logit_scale and temperature finite > 0 (as
    linear_cross_entropy's), softcap None or finite > 0."""
    if not _number(logit_scale) or not 0.0 < logit_scale < math.inf:
        raise argument_error(InvalidProblemError, op, "logit_scale", f"must be a finite number > 0, got "
                             f"{logit_scale!r}")
    if softcap is not None and (not _number(softcap) or not 0.0 < softcap < math.inf):
        raise argument_error(InvalidProblemError, op, "softcap", f"must be None or a finite number > 0, got "
                             f"{softcap!r}")
    if not _number(temperature) or not 0.0 < temperature < math.inf:
        raise argument_error(InvalidProblemError, op, "temperature", f"must be a finite number > 0, got "
                             f"{temperature!r}")


def check_number(op: str, name: str, value, low: float, high: float = math.inf, *, open_low: bool = False) -> None:
    """A real number in [low, high] ((low, high] with open_low); errors name the argument."""
    if not _number(value) or not math.isfinite(value) or value < low or value > high or open_low and value == low:
        interval = f"{'(' if open_low else '['}{low}, {high}]"
        raise argument_error(InvalidProblemError, op, name, f"must be a finite number in {interval}, got {value!r}")


def check_ignore_index(op: str, ignore_index) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int) or not -2**63 <= ignore_index < 2**63:
        raise argument_error(InvalidProblemError, op, "ignore_index", f"must be an int in the int64 range, got "
                             f"{ignore_index!r}")


def check_head(op: str, names: tuple[str, str, str], hidden, weight, bias) -> None:
    """hidden (..., H) and an LM head weight (V, H), bias (V,) or None: tensors of float dtypes on
    one CPU or CUDA device."""
    for name, t in zip(names, (hidden, weight, bias)):
        if t is None and name == names[2]:
            continue
        if not isinstance(t, Tensor):
            raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise argument_error(UnsupportedError, op, name, f"has dtype {t.dtype}; supported: float32, float16, "
                                 "bfloat16, float64")
    if hidden.device.type not in ("cpu", "cuda"):
        raise argument_error(UnsupportedError, op, names[0], f"is on {hidden.device}; supported: CPU and CUDA tensors")
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise argument_error(InvalidProblemError, op, names[0], f"has shape {tuple(hidden.shape)}; it must be "
                             "(..., H) with H >= 1")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise argument_error(InvalidProblemError, op, names[1], f"has shape {tuple(weight.shape)}; expected (V, "
                             f"{hidden.shape[-1]}) with V >= 1: classes x {names[0]}'s last axis")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise argument_error(InvalidProblemError, op, names[2], f"has shape {tuple(bias.shape)}; expected "
                             f"({weight.shape[0]},)")
    for name, t in zip(names[1:], (weight, bias)):
        if t is not None and t.device != hidden.device:
            raise argument_error(InvalidProblemError, op, name, f"is on {t.device} but {names[0]} is on "
                                 f"{hidden.device}")


def check_labels(op: str, labels, shape, device) -> None:
    if not isinstance(labels, Tensor):
        raise argument_error(InvalidProblemError, op, "labels", f"must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise argument_error(InvalidProblemError, op, "labels", f"has dtype {labels.dtype}; class indices are int64 "
                             "or int32")
    if tuple(labels.shape) != tuple(shape):
        raise argument_error(InvalidProblemError, op, "labels", f"has shape {tuple(labels.shape)}; expected the "
                             f"hidden states' leading axes {tuple(shape)}")
    if labels.device != device:
        raise argument_error(InvalidProblemError, op, "labels", f"is on {labels.device} but the hidden states are on "
                             f"{device}")


def check_label_range(op: str, labels: Tensor, kept: Tensor, classes: int) -> None:
    """Kept labels must be class indices in [0, classes): on the CPU an IndexOutOfRangeError naming
    'labels' (no synchronisation to avoid there); on CUDA a device-side assert queued before the
    kernels (no host sync; as torch's own index kernels, a failure loses the CUDA context)."""
    bad = ((labels < 0) | (labels >= classes)) & kept
    if labels.device.type == "cuda":
        torch._assert_async(~bad.any())
    elif bad.any():
        raise IndexOutOfRangeError(f"trainops.{op}: argument 'labels' holds a class index out of range "
                                   f"[0, {classes - 1}] that is not ignore_index")


def gradient_bits(*pairs) -> int:
    """The NEEDS_* bits of the (tensor, bit) pairs whose tensor requires grad, in grad mode."""
    if not torch.is_grad_enabled():
        return 0
    return sum(bit for t, bit in pairs if t is not None and t.requires_grad)


__all__ = ["ChunkedHead", "ChunkedLinearHeuristics", "GRADIENTS", "NEEDS_BIAS", "NEEDS_HIDDEN", "NEEDS_WEIGHT",
           "WEIGHT_DTYPE_DW", "accumulator", "weight_dtype_bit",
           "check_head", "check_ignore_index", "check_label_range", "check_labels", "check_number", "check_transform",
           "gradient_bits", "heuristic_rows", "heuristic_teacher_rows", "save_scaled_gradients", "scaled_gradients",
           "store_gradient_torch"]
