"""Fused linear cross-entropy: the loss of an LM head without its N x V logits held whole.

    z = softcap(logit_scale * (hidden @ weight^T + bias)) / temperature
    loss = cross_entropy(z, target)                                      # reductions as cross_entropy

hidden (N, H) (leading axes flattened), weight (V, H), bias (V,), target (N,) class indices with
ignore_index rows counting for nothing; class weights, label smoothing and z-loss as
``trainops.cross_entropy`` (z-loss on z); softcap(u) = c * tanh(u / c) (Gemma 2), none when c is
None; logit_scale (Granite's 1 / logits_scaling) and temperature are positive numbers, 1 by default.
The logit scale rides on the logits matmul (its alpha) and, with the temperature, on the one
scalar that scales each gradient when it is rounded (dz/dl = logit_scale / temperature, times
1 - tanh^2 under a softcap), so neither costs a pass over the logits.

Aligned logits rows: a vocabulary V that is not a multiple of ``vocab_align`` (8 by default) is
padded with zero weight rows to the next multiple, Vp, so that every chunk's logits rows start on
16-byte boundaries and cuBLAS takes its fast kernels for all three matmuls (GPT-2's 50257 words
took its ``align1`` kernels: 30.6 ms of an 80.7 ms step on the H200, issue 39). The loss kernel
reads and writes the first V columns of each (rows, Vp) chunk in place; the pad columns hold
exact zeros (zero weight rows, zero bias), so they add nothing to dhidden, and dweight's pad rows
are dropped. The cost: the weight copied once into the padded buffer (fused with the dtype cast
that a float32 master weight under autocast needs anyway), Vp / V more matmul columns.

The rows go through in chunks of ``rows`` tokens (LinearCrossEntropyHeuristics: the chunk's
logits stay under ``chunk_bytes``). For each chunk:
    logits = hidden_c @ W^T (+ b)                  one matmul, the chunk's logits
    loss, dlogits written over the logits          trainops's fused cross-entropy kernel, reduction "sum"
    dhidden_c = dlogits @ W / divisor              float32 matmul output, rounded once into dhidden's rows
    dW (+)= dlogits^T @ hidden_c                   a float32 accumulator the matmul reads and writes itself
    db += column sums of dlogits                   float32
and after the last chunk dW and db are divided by the divisor and rounded once to their dtypes
(the float32 buffer of a half weight freed). So the gradients of an upstream gradient of 1 are
computed in the forward pass (three matmuls in all, as an unfused linear + cross-entropy's forward
and backward); the backward scales them in place by the upstream gradient, with a kernel that
reads it on the device and does nothing when it is exactly 1 (``loss.backward()``). Reduction
"none" cannot do that (its upstream gradient is per row and dW mixes the rows): its forward
computes the losses alone and its backward runs the chunks again, each row's dlogits times its
upstream gradient (four matmuls).

Reduction "mean" divides by the summed class weights of the non-ignored rows, as torch (the z-loss
term by their count, as trainops.cross_entropy); ``num_items_in_batch`` replaces that divisor by
its value (Hugging Face's loss under gradient accumulation: the sum over this micro-batch divided
by the tokens of the whole batch). The divisors stay on the device: with class weights and z-loss
the chunks' class weights are scaled by count / weight sum, so that one division by the count gives
both terms their own divisor. No host synchronisation, but for the target check with
check_target="immediate" (as trainops.cross_entropy).

Dtypes: hidden float32 / float16 / bfloat16 / float64 (the matmuls' dtype; under autocast the
autocast dtype, as torch.nn.functional.linear); weight and bias any float dtype (cast once to the
matmuls' dtype; their gradients come back in their own dtype). Accumulation in float32 (float64
for float64): the matmuls accumulate in float32, dW and db across chunks in float32 (for a
float32 weight, its gradient itself; for a half weight, a buffer of twice its size during the
forward). The loss is float32 (float64 for float64) unless ``loss_dtype`` says otherwise.
Deterministic: fixed chunk order, no atomics.

Memory beyond the inputs and the gradients: one chunk's logits (with softcap, also their tanh),
a float32 chunk of dhidden, the float32 dW accumulator of a half weight (Vp rows), and a copy of
the weight (and bias) in hidden's dtype when theirs differs (a float32 master weight under bf16
autocast: the copy torch's autocast makes too) or when the vocabulary is padded (then on every
call, eval and no_grad forwards too, and twice with reduction "none": Vp x H elements of hidden's
dtype, +127 MiB at 32001 x 2048 in bf16). A float32 weight's gradient is the first V rows of the
(Vp, H) accumulator: its storage holds the pad rows too. A hidden whose leading axes do not merge
(a transposed batch) is copied once by the reshape to (N, H).

Metrics (token_accuracy / entropy, trainops.functional.linear_cross_entropy): each chunk's z is
read by torch ops (_chunk_metrics) before the loss kernel writes the gradients over it, the sums
kept in a 3-element device buffer and divided after the last chunk. A separate custom op,
linear_cross_entropy_metrics (the same impl, a sixth output), so that the plain call's op, schema
and graph are unchanged.

A composite op: its kernels are torch's matmuls and the cross-entropy family's registered kernels
(each chunk's cross-entropy call plans through that family), so it registers none of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError, argument_error
from ..library import custom_op
from ..plan import heuristics_for
from ._common import capturing, check_mode, matmul_into, raise_flagged
from .cross_entropy import (REDUCTIONS, check_class_indices, cross_entropy_inplace_op, cross_entropy_op,
                            note_target_flag, scale_unless_one_)

OP = "linear_cross_entropy"


class LinearCrossEntropyOutput(NamedTuple):
    """linear_cross_entropy's result when token_accuracy or entropy is asked for: the loss and the
    two metrics (float32 scalars without gradient; the one not asked for None)."""
    loss: Tensor
    token_accuracy: Optional[Tensor]
    entropy: Optional[Tensor]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True, eq=False)
class LinearCrossEntropyHeuristics:
    """chunk_bytes: the most bytes one chunk's logits may take; a chunk's rows are the largest power
    of two that fits (at least ``min_rows``). Each chunk after the first rereads and
    rewrites the float32 dW accumulator (8 bytes per weight element), so fewer, larger chunks are
    faster and hold more memory. The default, 512 MiB, is 2048 rows of a bf16 128256-class
    vocabulary: on the H100 (H = 4096) 41.6 ms at 8192 tokens against 40.2 for 4096-row chunks, 165.4
    at 32768 against 164.2, half a GiB less at the peak; in a Llama-3.2-1B-shaped training step it
    kept trainops's peak at Liger's (29.6 GiB against 30.1 with 4096-row chunks; benchmarks/NOTES.md,
    "Fused linear cross-entropy" and "Hugging Face models").

    min_chunks: a chunk's rows at most the tokens / min_chunks, rounded up to a multiple of 64
    (min_rows and the tokens themselves win over it), so the tokens go in about min_chunks chunks
    (fewer where the rounding or min_rows wins: 128 tokens with min_chunks 3 make 2): one chunk holds the whole logits, which the fused loss exists to avoid. At a small
    vocabulary the whole batch fit one chunk: Phi-3-mini's step (32064 words, 4096 tokens, one 250
    MiB chunk) peaked at 65.53 GiB against Liger's 65.45; in two chunks of 2048 rows, 65.38 (H200,
    benchmarks/NOTES.md, "Issue 40's families on the H200"). A cap of 2048 rows, tried first, also
    split GPT-2's 16384 tokens into eight chunks instead of four: 49.6 ms a step against 44.4
    measured earlier (another machine session, so not separated from its variance).

    vocab_align: the logits chunks' row length is the vocabulary rounded up to a multiple of this
    (module docstring, "Aligned logits rows"); 1 turns the padding off. 8 (16-byte rows in bf16),
    measured on the H200 at GPT-2's 16384 x 768 x 50257: 7.73 ms of GPU time a forward + backward
    against 10.56 at 64 (the three matmuls alike; the loss kernel 2.39 against 5.39 ms over rows
    50304 elements apart; benchmarks/results/probe-lce-align-h200-20261129.txt) and 34.2 ms of
    wall time unpadded (cuBLAS's align1 kernels). The loss kernel reads a strided view of the
    chunk, slower than the contiguous rows of an aligned vocabulary: one row of padding more on
    Qwen3's 151936 took it from 5.39 to 11.6 ms (benchmarks/NOTES.md)."""

    chunk_bytes: int = 512 * 2**20
    min_rows: int = 64
    min_chunks: int = 2
    vocab_align: int = 8

    def __post_init__(self):
        for name in ("chunk_bytes", "min_rows", "min_chunks", "vocab_align"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise argument_error(InvalidProblemError, OP, f"heuristics.{name}",
                                     f"must be an int >= 1, got {value!r}")

    def padded_classes(self, classes: int) -> int:
        """The vocabulary rounded up to a multiple of vocab_align (itself when it is one)."""
        return -(-classes // self.vocab_align) * self.vocab_align

    def rows(self, n: int, classes: int, itemsize: int) -> int:
        fit = self.chunk_bytes // max(1, classes * itemsize)
        share = -(-(-(-n // self.min_chunks)) // 64) * 64   # n / min_chunks rows, up to a multiple of 64
        rows = max(self.min_rows, min(share, 1 << (fit.bit_length() - 1) if fit else 0))
        return max(1, min(n, rows))


# ----------------------------------------------------------------------------------------------
# The chunked computation (the custom ops' impl, CPU and CUDA alike)
# ----------------------------------------------------------------------------------------------

def _chunk_logits(x: Tensor, w: Tensor, b: Optional[Tensor], softcap: Optional[float], logit_scale: float,
                  temperature: float):
    """(z, tanh of the capped logits or None) of one chunk, in the matmuls' dtype: z =
    softcap(logit_scale * (x w^T + b)) / temperature, the scale applied by the matmul (alpha)."""
    alpha = logit_scale if softcap is not None else logit_scale / temperature
    if alpha == 1.0:
        logits = torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())
    elif b is None:   # beta 0: the input is ignored, nothing is copied into the output first
        logits = torch.addmm(x.new_zeros(()), x, w.t(), beta=0, alpha=alpha)
    else:
        logits = torch.addmm(b, x, w.t(), beta=alpha, alpha=alpha)
    if softcap is None:
        return logits, None
    t = torch.div(logits, softcap).tanh_()   # kept for the gradient: one more chunk-sized buffer
    torch.mul(t, softcap / temperature, out=logits)
    return logits, t


def _class_weight_and_divisor(target: Tensor, class_weight: Optional[Tensor], ignore_index: int, reduction: str,
                              num_items: Optional[Tensor], classes: int, acc: torch.dtype):
    """(class weights for the chunks' "sum", the loss's divisor, on the device; 1 for "sum").

    "mean": the cross-entropy terms are divided by the summed class weights of the kept rows and the
    z-loss term by their count (trainops.cross_entropy's "mean"); scaling the class weights by
    count / weight sum lets one division by the count do both. num_items_in_batch: divide the sum by it."""
    one = torch.ones((), dtype=acc, device=target.device)
    if reduction != "mean":
        return class_weight, one
    if num_items is not None:
        return class_weight, num_items.to(acc)
    # rows with an out-of-range index (left unchecked) count for nothing, as in trainops.cross_entropy
    kept = (target != ignore_index) & (target >= 0) & (target < classes)
    count = kept.sum().to(acc)
    if class_weight is not None:
        weight_sum = torch.where(kept, class_weight.to(acc)[torch.where(kept, target, 0)], 0).sum()
        # no kept row: zero weights (the loss 0 / 0 = NaN below); kept rows of zero total weight: the
        # cross-entropy terms are 0 / 0, NaN as torch's
        ratio = torch.where(count != 0, count / weight_sum, 0)
        class_weight = class_weight.to(acc) * ratio   # kept in the accumulator dtype: no second rounding
    return class_weight, count   # an all-ignored batch: the loss is 0 / 0 = NaN (torch's), the gradients zero


def _padded_operands(x: Tensor, weight: Tensor, bias: Optional[Tensor], padded: int):
    """(w, b) in the matmuls' dtype with ``padded`` rows, the rows past the vocabulary zero: one
    copy, the dtype cast included (none when the dtype matches and no row is added)."""
    classes = weight.shape[0]
    if padded == classes:
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        b = None if bias is None else bias if bias.dtype == x.dtype else bias.to(x.dtype)
        return w, b
    w = torch.empty(padded, weight.shape[1], dtype=x.dtype, device=x.device)
    w[:classes].copy_(weight)
    w[classes:].zero_()
    b = None
    if bias is not None:
        b = torch.zeros(padded, dtype=x.dtype, device=x.device)
        b[:classes].copy_(bias)
    return w, b


def _chunks(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], class_weight: Optional[Tensor],
            ignore_index: int, reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float],
            logit_scale: float, temperature: float, needs: int, rows: int, padded: int, row_grad: Optional[Tensor],
            scale: Tensor, metrics: int = 0, stats: Optional[Tensor] = None):
    """The chunk loop, ``rows`` tokens a chunk, each chunk's logits ``padded`` columns wide (the
    vocabulary rounded up; module docstring). Returns (row losses (reduction "none" without
    gradients) or their sum, float32 (float64); dhidden, dweight, dbias in their tensors' dtypes
    (each None unless ``needs`` has its bit: NEEDS_HIDDEN, NEEDS_WEIGHT, NEEDS_BIAS); flags [bad
    target, k]). The gradients are those of the summed loss (each row's times row_grad when given)
    times ``scale`` (a device scalar: 1 / the divisor). The kernel stores dz times 2^k (k =
    flags[1], cross_entropy's float16 headroom, the same for every chunk of a call), divided out
    with ``scale`` and dz/dl's constant factor logit_scale / temperature when each gradient is
    rounded to its dtype (once). ``metrics`` (bits METRIC_ACCURACY, METRIC_ENTROPY): each chunk's
    z read by _chunk_metrics before the loss kernel overwrites it, its sums added into ``stats``."""
    n, h = x.shape
    classes = weight.shape[0]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w, b = _padded_operands(x, weight, bias, padded)
    compute_grad = needs != 0
    per_row = reduction == "none" and not compute_grad
    losses = torch.empty(n, dtype=acc, device=x.device) if per_row else torch.zeros((), dtype=acc, device=x.device)
    flags = torch.zeros(2, dtype=torch.int32, device=x.device)
    dx = torch.empty_like(x) if needs & NEEDS_HIDDEN else None
    # dW accumulates in float32 over the padded rows: a float32 weight's gradient itself (its first
    # rows), else a buffer converted at the end
    dw = (torch.empty((padded, h), dtype=acc, device=x.device) if needs & NEEDS_WEIGHT and n else
          torch.zeros((padded, h), dtype=acc, device=x.device) if needs & NEEDS_WEIGHT else None)
    db = torch.zeros(classes, dtype=acc, device=x.device) if bias is not None and needs & NEEDS_BIAS else None
    dx_chunk = None
    unit = None   # scale * 2^-k * logit_scale / temperature, once the first chunk's kernel has written k
    factor = logit_scale / temperature   # dz/dl, but for the softcap's 1 - tanh^2
    for start in range(0, n, max(1, rows)):
        stop = min(n, start + rows)
        xc, tc = x[start:stop], target[start:stop]
        padded_logits, t = _chunk_logits(xc, w, b, softcap, logit_scale, temperature)
        logits = padded_logits[:, :classes]   # the loss kernel reads (and writes) the vocabulary's columns
        if metrics:   # before the loss kernel writes the gradients over the logits
            _chunk_metrics(logits, tc, ignore_index, metrics, stats)
        if not compute_grad:
            loss, _, _, chunk_flags = cross_entropy_op(logits, tc, class_weight, ignore_index,
                                                       "none" if per_row else "sum", label_smoothing, z_loss, acc,
                                                       False, False, False)
            if per_row:
                losses[start:stop] = loss
            else:
                losses += loss
            torch.maximum(flags, chunk_flags, out=flags)
            del logits, padded_logits, t
            continue
        loss, _, chunk_flags = cross_entropy_inplace_op(logits, tc, class_weight, ignore_index, "sum",
                                                        label_smoothing, z_loss, acc, False)
        losses += loss
        torch.maximum(flags, chunk_flags, out=flags)
        if unit is None:
            unit = torch.ldexp(scale, -chunk_flags[1].to(acc))
            if row_grad is not None:   # 2^-k goes with each row's upstream gradient instead (below)
                row_unit, unit = unit, scale
            if factor != 1.0:   # dz/dl's constant in the float32 scalar, never in the half dlogits
                unit = unit * factor
        # the kernel wrote dz over the logits; the pad columns still hold the zero logits of zero rows
        dlogits = padded_logits
        if t is not None:  # d softcap(u) / du = 1 - tanh^2
            dlogits.mul_(t.square_().neg_().add_(1))
        if row_grad is not None:   # times each row's upstream gradient and 2^-k, multiplied in float32 first
            dlogits.mul_((row_grad[start:stop].to(acc) * row_unit).to(dlogits.dtype)[:, None])
        if dx is not None:   # in the accumulator dtype, then scaled and rounded once into dx's rows
            if dx_chunk is None or dx_chunk.shape[0] != stop - start:
                dx_chunk = torch.empty(stop - start, h, dtype=acc, device=x.device)
            matmul_into(dx_chunk, dlogits, w, accumulate=False)
            torch.mul(dx_chunk, unit, out=dx[start:stop])
        if dw is not None:
            matmul_into(dw, dlogits.t(), xc, accumulate=start > 0)
        if db is not None:
            db += dlogits[:, :classes].sum(0, dtype=acc)
        del logits, padded_logits, dlogits, t   # before the next chunk's logits: one chunk's buffers alive at a time
    if unit is None:   # no rows: zero gradients whatever the factor
        unit = scale
    if dw is not None:
        if weight.dtype == acc:   # the first rows of the padded buffer: a contiguous view
            dw = dw[:classes].mul_(unit)
        else:   # scaled in float32 and rounded once; the float32 buffer is freed here
            dw = torch.mul(dw[:classes], unit, out=torch.empty(weight.shape, dtype=weight.dtype, device=x.device))
    if db is not None:
        db = torch.mul(db, unit, out=torch.empty(classes, dtype=bias.dtype, device=x.device))
    return losses, dx, dw, db, flags


NEEDS_HIDDEN, NEEDS_WEIGHT, NEEDS_BIAS = 1, 2, 4   # the gradients a call computes, as bits
METRIC_ACCURACY, METRIC_ENTROPY = 1, 2   # the metrics a call computes, as bits


def _chunk_metrics(z: Tensor, target: Tensor, ignore_index: int, metrics: int, stats: Tensor) -> None:
    """Adds one chunk's [rows whose argmax is the target, summed entropy, kept rows] into ``stats``
    (the accumulator dtype, on the device): over the rows whose target is a class index that is not
    ignore_index (the rows the loss counts). Entropy per row, in the accumulator dtype, from the
    row's maximum m: H = log(s) - sum(e * d) / s with d = z - m, e = exp(d), s = sum(e) (no
    cancellation between logsumexp and the mean logit). Passes over the chunk: one argmax; for the
    entropy one max, then d, exp, and e * d with the two sums, in row blocks whose two float32
    (float64) temporaries together take at most the chunk's own bytes."""
    rows, classes = z.shape
    kept = (target != ignore_index) & (target >= 0) & (target < classes)
    stats[2] += kept.sum()
    if metrics & METRIC_ACCURACY:
        stats[0] += ((z.argmax(-1) == target) & kept).sum()
    if metrics & METRIC_ENTROPY:
        block = max(1, min(rows, rows * z.element_size() // (2 * stats.element_size())))
        # the two temporaries allocated once, for every block (a block's own would outlive it into the next)
        d_buffer = z.new_empty((block, classes), dtype=stats.dtype)
        e_buffer = torch.empty_like(d_buffer)
        for start in range(0, rows, block):
            zb = z[start:start + block]
            d, e = d_buffer[:zb.shape[0]], e_buffer[:zb.shape[0]]
            torch.sub(zb, zb.amax(-1, keepdim=True).to(stats.dtype), out=d)   # promoted, z untouched
            torch.exp(d, out=e)
            s = e.sum(-1)
            entropy = s.log() - e.mul_(d).sum(-1) / s
            stats[1] += torch.where(kept[start:start + block], entropy, 0).sum()


def _heuristic_rows(hidden: Tensor, weight: Tensor) -> int:
    """Tokens a chunk, from the LinearCrossEntropyHeuristics in force (read at run time, not traced)."""
    return heuristics_for(LinearCrossEntropyHeuristics).rows(hidden.shape[0], weight.shape[0], hidden.element_size())


def _heuristic_padded(classes: int) -> int:
    """The logits chunks' row length, from the LinearCrossEntropyHeuristics in force."""
    return heuristics_for(LinearCrossEntropyHeuristics).padded_classes(classes)


# ----------------------------------------------------------------------------------------------
# Custom ops: torch.ops.trainops.linear_cross_entropy (reductions "mean" / "sum": gradients in the
# forward) and linear_cross_entropy_none_backward (reduction "none": the chunks again)
# ----------------------------------------------------------------------------------------------

def _impl(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], class_weight: Optional[Tensor],
          num_items: Optional[Tensor], ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
          softcap: Optional[float], logit_scale: float, temperature: float, needs: int, rows: int,
          check_target: bool, deferred_check: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss in float32 / float64, dhidden, dweight, dbias, flags): the gradients of the loss (for
    an upstream gradient of 1) in their tensors' dtypes; one not in ``needs`` (all of them for
    reduction "none") is an empty tensor. rows: tokens a chunk, 0 for LinearCrossEntropyHeuristics'.
    check_target: check the indices before any work (one host sync on the GPU). deferred_check (a
    CUDA call): an earlier flagged error raised first, then the kernels' flag remembered for a
    later call (cross_entropy.note_target_flag), without waiting for the GPU."""
    return _run(hidden, weight, target, bias, class_weight, num_items, ignore_index, reduction, label_smoothing,
                z_loss, softcap, logit_scale, temperature, needs, rows, check_target, deferred_check, 0)


def _run(hidden, weight, target, bias, class_weight, num_items, ignore_index, reduction, label_smoothing, z_loss,
         softcap, logit_scale, temperature, needs, rows, check_target, deferred_check, metrics) -> tuple:
    """_impl and _metrics_impl: the target check, the call, the deferred flag."""
    if check_target:
        check_class_indices(OP, target, weight.shape[0], ignore_index)
    deferred = deferred_check and hidden.device.type == "cuda"
    in_capture = deferred and capturing(hidden.device)
    if hidden.device.type == "cuda":   # an earlier call's flagged error first, checked or not
        raise_flagged(in_capture if deferred else None)
    outputs = _compute(hidden, weight, target, bias, class_weight, num_items, ignore_index, reduction,
                       label_smoothing, z_loss, softcap, logit_scale, temperature, needs, rows, metrics)
    if deferred:
        note_target_flag(outputs[4], OP, in_capture)
    return outputs if metrics else outputs[:5]


def _metrics_impl(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                  class_weight: Optional[Tensor], num_items: Optional[Tensor], ignore_index: int, reduction: str,
                  label_smoothing: float, z_loss: float, softcap: Optional[float], logit_scale: float,
                  temperature: float, needs: int, rows: int, check_target: bool, deferred_check: bool,
                  metrics: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """_impl's outputs and a sixth, float32 [token accuracy, entropy] (the metrics not in
    ``metrics`` 0): linear_cross_entropy(..., token_accuracy=True / entropy=True). Its own op, so
    that the plain loss's op, graph and cost stay as they are."""
    return _run(hidden, weight, target, bias, class_weight, num_items, ignore_index, reduction, label_smoothing,
                z_loss, softcap, logit_scale, temperature, needs, rows, check_target, deferred_check, metrics)


def _compute(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], class_weight: Optional[Tensor],
             num_items: Optional[Tensor], ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
             softcap: Optional[float], logit_scale: float, temperature: float, needs: int,
             rows: int, metrics: int = 0) -> tuple:
    """_impl's work after the checks, and the metrics (float32 [accuracy, entropy], None without)."""
    rows = rows or _heuristic_rows(hidden, weight)
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    with torch.autocast(hidden.device.type, enabled=False):
        chunk_weight, divisor = _class_weight_and_divisor(target, class_weight, ignore_index, reduction, num_items,
                                                          weight.shape[0], acc)
        scale = torch.where(divisor != 0, 1 / divisor, 0)   # no row counted: zero gradients
        stats = torch.zeros(3, dtype=acc, device=hidden.device) if metrics else None
        losses, dx, dw, db, flags = _chunks(hidden, weight, target, bias, chunk_weight, ignore_index, reduction,
                                            label_smoothing, z_loss, softcap, logit_scale, temperature, needs, rows,
                                            _heuristic_padded(weight.shape[0]), None, scale, metrics, stats)
    loss = losses if reduction == "none" else losses / divisor
    # means over the kept rows; none kept: 0 (TRL's SFTTrainer logs 0.0 then), never NaN
    means = None if stats is None else (stats[:2] / stats[2].clamp(min=1)).to(torch.float32)
    return (loss, dx if dx is not None else hidden.new_empty(0), dw if dw is not None else weight.new_empty(0),
            db if db is not None else hidden.new_empty(0), flags, means)


def _fake(hidden, weight, target, bias, class_weight, num_items, ignore_index, reduction, label_smoothing, z_loss,
          softcap, logit_scale, temperature, needs, rows, check_target, deferred_check=False):
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    loss = hidden.new_empty((hidden.shape[0],) if reduction == "none" else (), dtype=acc)
    dx = hidden.new_empty(hidden.shape if needs & NEEDS_HIDDEN else 0)
    dw = weight.new_empty(weight.shape if needs & NEEDS_WEIGHT else 0)
    db = bias.new_empty(bias.shape) if bias is not None and needs & NEEDS_BIAS else hidden.new_empty(0)
    return loss, dx, dw, db, hidden.new_empty(2, dtype=torch.int32)


def _metrics_fake(hidden, weight, target, bias, class_weight, num_items, ignore_index, reduction, label_smoothing,
                  z_loss, softcap, logit_scale, temperature, needs, rows, check_target, deferred_check, metrics):
    return (*_fake(hidden, weight, target, bias, class_weight, num_items, ignore_index, reduction, label_smoothing,
                   z_loss, softcap, logit_scale, temperature, needs, rows, check_target, deferred_check),
            hidden.new_empty(2, dtype=torch.float32))


def _save(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])
    ctx.reduction = inputs.reduction
    ctx.consumed = False
    if inputs.reduction == "none":  # the backward runs the chunks again
        ctx.save_for_backward(inputs.hidden, inputs.weight, inputs.target, inputs.bias, inputs.class_weight)
        # the forward's chunk size: the backward may run on another thread, outside its heuristics block
        ctx.arguments = (inputs.ignore_index, inputs.label_smoothing, inputs.z_loss, inputs.softcap,
                         inputs.logit_scale, inputs.temperature,
                         inputs.rows or _heuristic_rows(inputs.hidden, inputs.weight))
    else:
        ctx.needs = inputs.needs
        ctx.save_for_backward(*output[1:4])


def _grad(ctx, dloss: Tensor, *unused) -> dict:
    if dloss is None:
        return {}
    if torch.is_grad_enabled():
        raise UnsupportedError(f"trainops.{OP}: double backward is not supported")
    if ctx.reduction == "none":
        hidden, weight, target, bias, class_weight = ctx.saved_tensors
        need = ctx.needs_grad
        needs = NEEDS_HIDDEN * need.hidden + NEEDS_WEIGHT * need.weight + NEEDS_BIAS * (bias is not None and need.bias)
        dx, dw, db = none_backward_op(dloss, hidden, weight, target, bias, class_weight, *ctx.arguments, needs)
        return {name: g for name, g, bit in (("hidden", dx, NEEDS_HIDDEN), ("weight", dw, NEEDS_WEIGHT),
                                             ("bias", db, NEEDS_BIAS)) if needs & bit}
    if ctx.consumed:
        raise UnsupportedError(f"trainops.{OP}: a second backward through the same loss (retain_graph=True) is "
                               "not supported: the first one scaled the gradients the forward computed, in place")
    saved = ctx.saved_tensors
    # fake / functional tensors: AOTAutograd tracing the backward (is_compiling() may be False there)
    tracing = torch.compiler.is_compiling() or type(dloss) is not torch.Tensor
    if not tracing:
        raise_flagged()
    # In eager mode the forward's buffers are scaled in place by the upstream gradient (a kernel that
    # reads it on the device and does nothing when it is exactly 1: no host sync) and handed over;
    # out of place (any number of backwards) while tracing and in float64 (gradcheck's dtype).
    out_of_place = tracing or dloss.dtype == torch.float64 or dloss.numel() != 1
    ctx.consumed = not out_of_place
    grads = {}
    for name, g, bit in zip(("hidden", "weight", "bias"), saved, (NEEDS_HIDDEN, NEEDS_WEIGHT, NEEDS_BIAS)):
        if not ctx.needs & bit or g.numel() == 0 and name == "bias":
            continue
        if out_of_place:
            grads[name] = (g.to(torch.float64 if g.dtype == torch.float64 else torch.float32) * dloss).to(g.dtype)
        else:
            grads[name] = scale_unless_one_(g, dloss)
    return grads


def _none_backward_impl(dloss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                        class_weight: Optional[Tensor], ignore_index: int, label_smoothing: float, z_loss: float,
                        softcap: Optional[float], logit_scale: float, temperature: float, rows: int,
                        needs: int) -> tuple[Tensor, Tensor, Tensor]:
    """Reduction "none"'s backward: (dhidden, dweight, dbias), each row's dlogits times its
    upstream gradient; a gradient not in ``needs`` is an empty tensor."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    with torch.autocast(hidden.device.type, enabled=False):
        _, dx, dw, db, _ = _chunks(hidden, weight, target, bias, class_weight, ignore_index, "none", label_smoothing,
                                   z_loss, softcap, logit_scale, temperature, needs, rows,
                                   _heuristic_padded(weight.shape[0]), dloss,
                                   torch.ones((), dtype=acc, device=hidden.device))
    return tuple(hidden.new_empty(0) if g is None else g for g in (dx, dw, db))


def _none_backward_fake(dloss, hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, z_loss,
                        softcap, logit_scale, temperature, rows, needs):
    return (hidden.new_empty(hidden.shape if needs & NEEDS_HIDDEN else 0),
            weight.new_empty(weight.shape if needs & NEEDS_WEIGHT else 0),
            hidden.new_empty(0) if bias is None or not needs & NEEDS_BIAS else bias.new_empty(bias.shape))


none_backward_op = custom_op(f"{OP}_none_backward", _none_backward_impl, _none_backward_fake)
linear_cross_entropy_op = custom_op(OP, _impl, _fake, backward=_grad, save=_save)
linear_cross_entropy_metrics_op = custom_op(f"{OP}_metrics", _metrics_impl, _metrics_fake, backward=_grad, save=_save)


# ----------------------------------------------------------------------------------------------
# The call: argument checks, autocast, the target check (deferred in eager training)
# ----------------------------------------------------------------------------------------------

def _error(cls, name: str, message: str):
    return argument_error(cls, OP, name, message)


def check_settings(class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap, loss_dtype,
                   logit_scale=1.0, temperature=1.0) -> None:
    """The loss's settings (what trainops.nn.LinearCrossEntropyLoss's constructor takes); errors name the argument."""
    if class_weight is not None and (not isinstance(class_weight, Tensor) or class_weight.dim() != 1
                                     or not class_weight.is_floating_point()):
        shape = tuple(class_weight.shape) if isinstance(class_weight, Tensor) else type(class_weight).__name__
        raise _error(InvalidProblemError, "class_weight", f"must be a 1-D float tensor (one weight per class), got "
                     f"{shape}")
    if reduction not in REDUCTIONS:
        raise _error(InvalidProblemError, "reduction", f"is {reduction!r}; expected one of {REDUCTIONS}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int) or not -2**63 <= ignore_index < 2**63:
        raise _error(InvalidProblemError, "ignore_index", f"must be an int in the int64 range, got {ignore_index!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise _error(InvalidProblemError, "label_smoothing", f"must be a number in [0, 1], got {label_smoothing!r}")
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or not 0.0 <= z_loss < math.inf:
        raise _error(InvalidProblemError, "z_loss", f"must be a finite number >= 0, got {z_loss!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not 0.0 < softcap < math.inf):
        raise _error(InvalidProblemError, "softcap", f"must be None or a finite number > 0, got {softcap!r}")
    for name, value in (("logit_scale", logit_scale), ("temperature", temperature)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
            raise _error(InvalidProblemError, name, f"must be a finite number > 0, got {value!r}")
    if loss_dtype is not None and loss_dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise _error(InvalidProblemError, "loss_dtype", f"must be None or a float dtype, got {loss_dtype!r}")


def _check(hidden, weight, target, bias, class_weight, num_items, ignore_index, reduction, label_smoothing, z_loss,
           softcap, loss_dtype, logit_scale, temperature):
    """Every argument, before any work; errors name the argument."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, Tensor):
            raise _error(InvalidProblemError, name, f"must be a torch.Tensor, got {type(t).__name__}")
    check_settings(class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap, loss_dtype, logit_scale,
                   temperature)
    if hidden.device.type not in ("cpu", "cuda"):
        raise _error(UnsupportedError, "hidden", f"is on {hidden.device}; supported: CPU and CUDA tensors")
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias), ("class_weight", class_weight)):
        if isinstance(t, Tensor) and t.dtype not in _FLOATS:
            raise _error(UnsupportedError, name, f"has dtype {t.dtype}; supported: float32, float16, bfloat16, "
                         "float64")
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise _error(InvalidProblemError, "hidden", f"has shape {tuple(hidden.shape)}; it must be (..., H) with H >= 1")
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise _error(UnsupportedError, "class_weight", "requires grad, but the loss is not differentiable with "
                     "respect to the class weights (as torch's cross_entropy)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise _error(InvalidProblemError, "weight", f"has shape {tuple(weight.shape)}; expected (V, "
                     f"{hidden.shape[-1]}): classes x hidden's last axis")
    if weight.shape[0] == 0:
        raise _error(InvalidProblemError, "weight", "has no rows: at least one class is needed")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise _error(InvalidProblemError, "target", f"has shape {tuple(target.shape)}; expected hidden's leading "
                     f"axes {tuple(hidden.shape[:-1])} (class indices)")
    if target.dtype not in (torch.int64, torch.int32):
        raise _error(InvalidProblemError, "target", f"has dtype {target.dtype}; class indices are int64 or int32")
    classes = weight.shape[0]
    for name, t in (("bias", bias), ("class_weight", class_weight)):
        if t is not None and (not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] != classes
                              or not t.is_floating_point()):
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise _error(InvalidProblemError, name, f"must be a float tensor of shape ({classes},), got {shape}")
    for name, t in (("weight", weight), ("target", target), ("bias", bias), ("class_weight", class_weight)):
        if t is not None and t.device != hidden.device:
            raise _error(InvalidProblemError, name, f"is on {t.device} but hidden is on {hidden.device}")
    if num_items is not None:
        if reduction != "mean":
            raise _error(InvalidProblemError, "num_items_in_batch", "divides the summed loss (reduction 'mean'); it "
                         f"cannot be used with reduction={reduction!r}")
        if isinstance(num_items, bool) or not isinstance(num_items, (int, Tensor)) or (
                isinstance(num_items, Tensor) and (num_items.numel() != 1 or num_items.is_floating_point()
                                                   or num_items.is_complex() or num_items.dtype == torch.bool)):
            raise _error(InvalidProblemError, "num_items_in_batch", "must be an int or a one-element integer tensor, "
                         f"got {num_items!r}")
        if isinstance(num_items, int) and not 0 < num_items < 2**63:
            raise _error(InvalidProblemError, "num_items_in_batch", f"must be in [1, 2**63), got {num_items}")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
                         class_weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                         logit_scale: float = 1.0, temperature: float = 1.0,
                         num_items_in_batch: int | Tensor | None = None, loss_dtype: torch.dtype | None = None,
                         check_target: bool | str = True, token_accuracy: bool = False,
                         entropy: bool = False) -> Tensor | LinearCrossEntropyOutput:
    """See trainops.functional.linear_cross_entropy."""
    check, immediate = check_mode(OP, "check_target", check_target)
    for name, value in (("token_accuracy", token_accuracy), ("entropy", entropy)):
        if not isinstance(value, bool):
            raise _error(InvalidProblemError, name, f"must be a bool, got {value!r}")
        if value and reduction == "none":
            raise _error(UnsupportedError, name, "is a mean over the batch's rows: it needs reduction 'mean' or "
                         "'sum', not 'none'")
    metrics = METRIC_ACCURACY * token_accuracy + METRIC_ENTROPY * entropy
    _check(hidden, weight, target, bias, class_weight, num_items_in_batch, ignore_index, reduction, label_smoothing,
           z_loss, softcap, loss_dtype, logit_scale, temperature)
    autocast = torch.is_autocast_enabled(hidden.device.type) and hidden.dtype != torch.float64
    if autocast:  # the matmuls in autocast's dtype, as torch.nn.functional.linear under autocast
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    out_dtype = loss_dtype or (torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    shape = hidden.shape[:-1]
    x = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    num_items = None
    if num_items_in_batch is not None:
        if (isinstance(num_items_in_batch, Tensor) and num_items_in_batch.device.type == "cpu"
                and capturing(x.device)):
            raise argument_error(UnsupportedError, OP, "num_items_in_batch", "is a CPU tensor inside a CUDA graph "
                                 "capture: pass it on the GPU (a copy from the host cannot be captured; an int "
                                 "would be captured as a constant)")
        # an int is filled on the device: a copy from pageable host memory would wait for the GPU's queue
        num_items = (num_items_in_batch.reshape(()).to(x.device, non_blocking=True)
                     if isinstance(num_items_in_batch, Tensor)
                     else torch.full((), num_items_in_batch, dtype=torch.int64, device=x.device))
    grad_mode = torch.is_grad_enabled()
    needs = sum(bit for p, bit in ((hidden, NEEDS_HIDDEN), (weight, NEEDS_WEIGHT), (bias, NEEDS_BIAS))
                if grad_mode and p is not None and p.requires_grad)
    compiling = torch.compiler.is_compiling()
    if not compiling:
        raise_flagged()
    # the kernels flag bad targets: on the GPU (eager or compiled) the op remembers the flag for a later
    # call (no host sync); in eager mode on the CPU it is read right after the call; immediate, or
    # compiled on the CPU: checked before any work
    on_device = hidden.device.type == "cuda"
    deferred = check and not immediate and (on_device or not compiling)
    arguments = (x, weight, t, bias, class_weight, num_items, ignore_index, reduction, float(label_smoothing),
                 float(z_loss), None if softcap is None else float(softcap), float(logit_scale), float(temperature),
                 0 if reduction == "none" else needs, 0, check and not deferred, deferred and on_device)
    if metrics:
        loss, *_, flags, means = linear_cross_entropy_metrics_op(*arguments, metrics)
    else:
        loss, *_, flags = linear_cross_entropy_op(*arguments)
    if deferred and not on_device and flags[0]:
        raise IndexOutOfRangeError(f"trainops.{OP}: argument 'target' holds a class index out of range "
                                   f"[0, {weight.shape[0] - 1}] that is not ignore_index ({ignore_index})")
    if reduction == "none":
        loss = loss.reshape(shape)
    if not metrics:
        return loss.to(out_dtype)
    return LinearCrossEntropyOutput(loss.to(out_dtype), means[0] if token_accuracy else None,
                                    means[1] if entropy else None)


__all__ = ["LinearCrossEntropyHeuristics", "LinearCrossEntropyOutput", "check_settings", "linear_cross_entropy",
           "linear_cross_entropy_metrics_op", "linear_cross_entropy_op"]
