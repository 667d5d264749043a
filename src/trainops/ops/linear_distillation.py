"""Fused linear distillation: TRL's generalised Jensen-Shannon loss between a student's and a
teacher's LM heads (plus an optional hard cross-entropy), never holding more than one chunk of
either model's logits.

    zs = softcap(logit_scale * (student_hidden Ws^T + bs)),  zt likewise with the teacher's head
    ls = log_softmax(zs / T), lt = log_softmax(zt / T),  p = exp(ls), q = exp(lt)
    jsd_beta(t) = KL(q || p)                                        beta = 0 (forward KL)
                = KL(p || q)                                        beta = 1 (reverse KL)
                = beta KL(q || m) + (1 - beta) KL(p || m),          otherwise, m = (1 - beta) p + beta q
    soft = sum over kept tokens of jsd / count,   hard = sum over kept tokens of -log_softmax(zs)[label] / count
    loss = weight_soft_loss * soft + weight_hard_loss * hard

Kept tokens: label != ignore_index (every token when labels is None); count = max(1, kept tokens)
(TRL's ``generalized_jsd_loss`` with reduction "batchmean": an all-ignored batch gives 0, with zero
gradients); ``num_items_in_batch`` replaces count (TRL's and Hugging Face's loss under gradient
accumulation: this micro-batch's sum over the whole batch's tokens). No T^2 factor (TRL's). The teacher takes no gradient.

Chunks of ``rows`` tokens (ChunkedLinearHeuristics) go through ops/chunked_linear.ChunkedHead:
per chunk one teacher matmul, one student matmul, the chunk's loss terms and d loss / d zs in
float32 torch ops, then the student's two gradient matmuls. The gradients (for an upstream
gradient of 1, normalised by the count, known on the device before the loop) are computed in the
forward pass: four matmuls in all, as an unfused student + teacher forward and student backward.
The backward scales them by the upstream gradient on the device (in place in eager mode: a second
backward through the same loss raises; out of place under torch.compile and in float64). Without
grad mode, or when no student tensor requires grad, no gradient work is done (two matmuls).

d jsd / d (zs / T) = p (g - <p, g>) with g = ls - lt (beta = 1) or (1 - beta)(ls - lm) (0 < beta < 1),
and p - q for beta = 0; the hard loss's gradient softmax(zs) - onehot(label).

Dtypes: each model's hidden float32 / float16 / bfloat16 / float64 sets its matmuls' dtype (under
autocast the autocast dtype); weights and biases any float dtype (cast once). Math in float32
(float64 for a float64 student); dW accumulates in float32 across chunks and is rounded once. The
loss is float32 (float64). Deterministic: fixed chunk order, no atomics, no host syncs. A label
out of [0, V) that is not ignore_index makes torch's gather raise (a device-side assert on the GPU).

Memory beyond inputs and gradients: one chunk's logits of each model in float32 and about three
more float32 chunk-sized buffers of the per-chunk math, the float32 dW accumulator of a half
weight, a float32 dhidden chunk.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..errors import InvalidProblemError, argument_error
from ..library import custom_op
from .chunked_linear import (NEEDS_BIAS, NEEDS_HIDDEN, NEEDS_WEIGHT, ChunkedHead, accumulator, check_head,
                             check_ignore_index, check_labels, check_number, check_transform, gradient_bits,
                             heuristic_rows, save_scaled_gradients, scaled_gradients)

OP = "linear_distillation"


def _soft_chunk(us: Tensor, ut: Tensor, beta: float, temperature: float, grad: bool):
    """(per-row jsd_beta, its gradient w.r.t. us / T or None) of one chunk; ``ut`` is overwritten."""
    zs = us / temperature if temperature != 1.0 else us
    ls = torch.log_softmax(zs, -1)
    del zs
    if temperature != 1.0:
        ut.div_(temperature)
    lt = ut.sub_(torch.logsumexp(ut, -1, keepdim=True))   # the teacher's log-probabilities, in place
    if beta == 0.0:    # KL(q || p) = sum q (lt - ls); gradient p - q
        q = lt.exp()
        row = (q * lt.sub_(ls)).sum(-1)
        return row, ls.exp_().sub_(q) if grad else None
    if beta == 1.0:    # KL(p || q) = sum p (ls - lt); gradient p (d - <p, d>), d = ls - lt, <p, d> = KL
        p = ls.exp()
        d = ls.sub_(lt)
        row = (p * d).sum(-1)
        return row, p.mul_(d.sub_(row[:, None])) if grad else None
    # m = (1 - beta) p + beta q, in log space; jsd = beta sum q (lt - lm) + (1 - beta) sum p (ls - lm);
    # d jsd / d p = (1 - beta)(ls - lm) (the terms of m's own derivative cancel), through the softmax
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    q, p = lt.exp(), ls.exp()
    teacher_term = (q * lt.sub_(lm)).sum(-1)
    del q
    b = ls.sub_(lm)
    del lm
    student_term = (p * b).sum(-1)
    row = beta * teacher_term + (1 - beta) * student_term
    return row, p.mul_(b.sub_(student_term[:, None])).mul_(1 - beta) if grad else None


def _hard_chunk(us: Tensor, labels: Tensor, grad: bool):
    """(per-row -log_softmax(us)[label], its gradient softmax(us) - onehot(label) or None); ``us`` is
    overwritten. labels: ignored rows already replaced by 0."""
    lse = torch.logsumexp(us, -1, keepdim=True)
    index = labels[:, None]
    row = (lse - us.gather(1, index)).squeeze(1)
    if not grad:
        return row, None
    probs = us.sub_(lse).exp_()
    return row, probs.scatter_(1, index, probs.gather(1, index) - 1)   # one index a row: no collision


def _impl(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
          labels: Optional[Tensor], student_bias: Optional[Tensor], teacher_bias: Optional[Tensor],
          num_items: Optional[Tensor], beta: float, temperature: float, weight_soft: float, weight_hard: float,
          ignore_index: int, logit_scale: float, softcap: Optional[float], needs: int, rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, soft, hard, dstudent_hidden, dstudent_weight, dstudent_bias): the losses in the
    accumulator dtype, the gradients (of an upstream gradient of 1) in their tensors' dtypes, an
    empty tensor where not in ``needs``. rows: tokens a chunk, 0 for ChunkedLinearHeuristics'."""
    x, xt = student_hidden, teacher_hidden
    n, v = x.shape[0], student_weight.shape[0]
    acc = accumulator(x.dtype)
    dev = x.device
    rows = rows or heuristic_rows(n, v)
    with torch.autocast(dev.type, enabled=False):
        kept = None if labels is None else labels != ignore_index
        if num_items is not None:   # the tokens of the whole (accumulated) batch
            count = num_items.to(acc)
        elif labels is None:
            count = torch.full((), max(n, 1), dtype=acc, device=dev)
        else:
            count = kept.sum().to(acc).clamp_min(1)
        inv_count = 1 / count
        student = ChunkedHead(x, student_weight, student_bias, logit_scale, softcap, needs)
        teacher = ChunkedHead(xt, teacher_weight, teacher_bias, logit_scale, softcap) if weight_soft else None
        soft = torch.zeros((), dtype=acc, device=dev)
        hard = torch.zeros((), dtype=acc, device=dev)
        grad = needs != 0
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            us, t = student.logits(start, stop)
            keep = None if kept is None else kept[start:stop].to(acc)
            du = None
            if weight_soft:
                ut, _ = teacher.logits(start, stop)
                row, g = _soft_chunk(us, ut.to(acc), beta, temperature, grad)
                del ut
                soft += row.sum() if keep is None else (row * keep).sum()
                if grad:   # d / d us = d / d (us / T) / T, normalised by the count
                    factor = inv_count * (weight_soft / temperature)
                    du = g.mul_(factor if keep is None else (keep * factor)[:, None])
            if weight_hard:
                chunk_labels = torch.where(kept[start:stop], labels[start:stop], 0)
                row, g = _hard_chunk(us, chunk_labels, grad)
                hard += (row * keep).sum()
                if grad:
                    g.mul_((keep * (inv_count * weight_hard))[:, None])
                    du = g if du is None else du.add_(g)
            del us
            if grad:
                student.backward(start, stop, du, t)
            del du, t
        soft, hard = soft * inv_count, hard * inv_count
        loss = weight_soft * soft + weight_hard * hard
        dx, dw, db = student.finish()
    empty = x.new_empty(0)
    return (loss, soft, hard, empty if dx is None else dx, student_weight.new_empty(0) if dw is None else dw,
            empty if db is None else db)


def _fake(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, student_bias, teacher_bias, num_items,
          beta, temperature, weight_soft, weight_hard, ignore_index, logit_scale, softcap, needs, rows):
    acc = accumulator(student_hidden.dtype)
    loss = student_hidden.new_empty((), dtype=acc)
    return (loss, torch.empty_like(loss), torch.empty_like(loss),
            student_hidden.new_empty(student_hidden.shape if needs & NEEDS_HIDDEN else 0),
            student_weight.new_empty(student_weight.shape if needs & NEEDS_WEIGHT else 0),
            student_bias.new_empty(student_bias.shape) if student_bias is not None and needs & NEEDS_BIAS
            else student_hidden.new_empty(0))


def _save(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output[1:])
    save_scaled_gradients(ctx, inputs.needs, output[3:])


def _grad(ctx, dloss: Tensor, *unused) -> dict:
    return scaled_gradients(OP, ctx, dloss, ("student_hidden", "student_weight", "student_bias"))


linear_distillation_op = custom_op(OP, _impl, _fake, backward=_grad, save=_save)


# ----------------------------------------------------------------------------------------------
# The call: checks, autocast, flattening
# ----------------------------------------------------------------------------------------------

def check_settings(beta, temperature, weight_soft_loss, weight_hard_loss, ignore_index, logit_scale, softcap) -> None:
    """The loss's settings (what trainops.nn.LinearDistillationLoss's constructor takes)."""
    check_number(OP, "beta", beta, 0.0, 1.0)
    check_number(OP, "weight_soft_loss", weight_soft_loss, 0.0)
    check_number(OP, "weight_hard_loss", weight_hard_loss, 0.0)
    check_ignore_index(OP, ignore_index)
    check_transform(OP, logit_scale, softcap, temperature)


def linear_distillation_loss(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                             teacher_weight: Tensor, labels: Tensor | None = None, *, student_bias: Tensor | None = None,
                             teacher_bias: Tensor | None = None, beta: float = 0.5, temperature: float = 1.0,
                             weight_soft_loss: float = 1.0, weight_hard_loss: float = 0.0, ignore_index: int = -100,
                             logit_scale: float = 1.0, softcap: float | None = None,
                             num_items_in_batch: int | Tensor | None = None) -> Tensor:
    """See trainops.functional.linear_distillation_loss."""
    check_settings(beta, temperature, weight_soft_loss, weight_hard_loss, ignore_index, logit_scale, softcap)
    check_head(OP, ("student_hidden", "student_weight", "student_bias"), student_hidden, student_weight, student_bias)
    check_head(OP, ("teacher_hidden", "teacher_weight", "teacher_bias"), teacher_hidden, teacher_weight, teacher_bias)
    lead = tuple(student_hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != lead:
        raise argument_error(InvalidProblemError, OP, "teacher_hidden", f"has shape {tuple(teacher_hidden.shape)}; "
                             f"its leading axes must be student_hidden's {lead} (one row a token)")
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise argument_error(InvalidProblemError, OP, "teacher_weight", f"has {teacher_weight.shape[0]} classes; "
                             f"student_weight has {student_weight.shape[0]}: one vocabulary is needed")
    if teacher_hidden.device != student_hidden.device:
        raise argument_error(InvalidProblemError, OP, "teacher_hidden", f"is on {teacher_hidden.device} but "
                             f"student_hidden is on {student_hidden.device}")
    if labels is not None:
        check_labels(OP, labels, lead, student_hidden.device)
    elif weight_hard_loss:
        raise argument_error(InvalidProblemError, OP, "labels", "is None, but weight_hard_loss > 0 needs them (the "
                             "hard loss is the student's cross-entropy against the labels)")
    num_items = None
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, Tensor)) or (
                isinstance(num_items_in_batch, Tensor) and (num_items_in_batch.numel() != 1
                                                            or num_items_in_batch.dtype == torch.bool
                                                            or num_items_in_batch.is_complex())):
            raise argument_error(InvalidProblemError, OP, "num_items_in_batch", "must be an int or a one-element "
                                 f"real tensor, got {num_items_in_batch!r}")
        if isinstance(num_items_in_batch, int) and num_items_in_batch <= 0:
            raise argument_error(InvalidProblemError, OP, "num_items_in_batch", f"must be > 0, got "
                                 f"{num_items_in_batch}")
        # an int is filled on the device: a copy from pageable host memory would wait for the GPU's queue
        num_items = (num_items_in_batch.reshape(()).to(student_hidden.device, non_blocking=True)
                     if isinstance(num_items_in_batch, Tensor)
                     else torch.full((), num_items_in_batch, dtype=torch.int64, device=student_hidden.device))
    device = student_hidden.device.type
    if torch.is_autocast_enabled(device):   # the matmuls in autocast's dtype, as F.linear under autocast
        dtype = torch.get_autocast_dtype(device)
        if student_hidden.dtype != torch.float64:
            student_hidden = student_hidden.to(dtype)
        if teacher_hidden.dtype != torch.float64:
            teacher_hidden = teacher_hidden.to(dtype)
    needs = gradient_bits((student_hidden, NEEDS_HIDDEN), (student_weight, NEEDS_WEIGHT), (student_bias, NEEDS_BIAS))
    x = student_hidden.reshape(-1, student_hidden.shape[-1])
    xt = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    return linear_distillation_op(x, student_weight, xt.detach(), teacher_weight.detach(),
                                  None if labels is None else labels.reshape(-1), student_bias,
                                  None if teacher_bias is None else teacher_bias.detach(), num_items, float(beta),
                                  float(temperature), float(weight_soft_loss), float(weight_hard_loss), ignore_index,
                                  float(logit_scale), None if softcap is None else float(softcap), needs, 0)[0]


__all__ = ["check_settings", "linear_distillation_loss", "linear_distillation_op"]
