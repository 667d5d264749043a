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
accumulation: this micro-batch's sum over the whole batch's tokens). No T^2 factor (TRL's). The
teacher takes no gradient.

Chunks of ``rows`` tokens (ChunkedLinearHeuristics) go through ops/chunked_linear.ChunkedHead:
per chunk one student matmul (float32 logits from the matmul) and, for each teacher sub-chunk
(ChunkedLinearHeuristics.teacher_chunk_bytes: half the student's chunk by default), one teacher
matmul and the row kernel on those rows, which writes their loss terms and dlogits (in the
matmuls' dtype, the transform's factors and the count folded in) over the student's logits'
storage (op "linear_distillation_rows": Triton on the GPU, torch ops on the CPU; its passes and
bytes in its docstring), then the student's two gradient matmuls. The gradients (for an upstream
gradient of 1, normalised by the count, known on the device before the loop) are computed in the
forward pass: four matmuls in all, as an unfused student + teacher forward and student backward.
The backward scales them by the upstream gradient on the device (in place in eager mode: a second
backward through the same loss raises; out of place under torch.compile and in float64). Without
grad mode, or when no student tensor requires grad, no gradient work is done (two matmuls).

d jsd / d (zs / T) = p (g - <p, g>) with g = ls - lt (beta = 1) or (1 - beta)(ls - lm) (0 < beta < 1),
and p - q for beta = 0; the hard loss's gradient softmax(zs) - onehot(label).

Dtypes: each model's hidden float32 / float16 / bfloat16 / float64 sets its matmuls' dtype (under
autocast the autocast dtype); weights and biases any float dtype (cast once). Math in float32
(float64 for a float64 student); dW accumulates across chunks in a half head's own dtype (the
default, ChunkedLinearHeuristics.weight_grad_accumulator; "float32": a float32 buffer rounded once). The
loss is float32 (float64). Deterministic: fixed chunk order, no atomics, no host syncs. With the
hard loss, a label out of [0, V) that is not ignore_index raises IndexOutOfRangeError on the CPU
and is a device-side assert on CUDA (chunked_linear.check_label_range).

Memory beyond inputs and gradients, allocated once a call and reused by every chunk: the
student's chunk of float32 logits and the teacher's sub-chunk, 4 V (rows + teacher_rows) bytes
(1503 MiB at V 128256 with the default 2048 and 1024 rows; the row kernel writes the student's
dlogits in the matmuls' dtype over its logits' own storage; the CPU kernel's torch ops take about
three more chunk-sized buffers), the float32 dhidden chunk (inside the teacher's buffer, dead by
then, where it fits), per-token vectors (about 24 N bytes), and with
weight_grad_accumulator="float32" (not the default) a float32 dW buffer of a half weight.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..errors import InvalidProblemError, argument_error
from ..launch import launcher
from ..library import custom_op
from ..plan import KernelChoice, heuristics_for
from ..registry import ACCUMULATOR, register, register_op, triton_available
from .multi_tensor import MultiTensorLaunch, multi_tensor_describer, multi_tensor_launch
from .chunked_linear import (GRADIENTS, NEEDS_BIAS, NEEDS_HIDDEN, NEEDS_WEIGHT, ChunkedHead, ChunkedLinearHeuristics,
                             accumulator, check_head, check_ignore_index, check_label_range, check_labels,
                             check_number, check_transform, gradient_bits, heuristic_rows, heuristic_teacher_rows,
                             save_scaled_gradients, scaled_gradients, store_gradient_torch, weight_dtype_bit)

OP = "linear_distillation"


# ----------------------------------------------------------------------------------------------
# The per-chunk math: op "linear_distillation_rows" (a Triton kernel on the GPU, torch ops on the CPU)
# ----------------------------------------------------------------------------------------------

ROWS_OP = "linear_distillation_rows"
register_op(ROWS_OP, multi_tensor_describer(ROWS_OP),
            doc="per row of student / teacher logits u (before the temperature): the generalised JSD and the hard "
                "cross-entropy, and their weighted gradient written over the student's row")


def _mode(beta: float) -> int:
    """0: forward KL (beta 0), 1: reverse KL (beta 1), 2: the mixture's JSD."""
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


def distillation_rows(us: Tensor, ut: Optional[Tensor], labels: Tensor, soft_weight: Optional[Tensor],
                      hard_weight: Optional[Tensor], beta: float, temperature: float, *, hard: bool,
                      grad: bool, du: Optional[Tensor] = None, chain: tuple[float, float] = (0.0, 1.0),
                      soft_out: Optional[Tensor] = None, hard_out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(jsd_beta per row (zeros without ``ut``), -log_softmax(us)[label] per row (zeros unless
    ``hard``)) of a chunk's rows. us, ut: (rows, V) contiguous float32 / float64, the student's and
    the teacher's logits before the temperature; ut None: no soft loss. labels (rows,): class indices
    in range (ignored rows: any, e.g. 0). grad: dlogits = (soft_weight * d jsd / d us + hard_weight *
    d hard / d us) * scale * (1 - (us cap_inv)^2), (soft_weight, hard_weight (rows,); chain =
    (cap_inv, scale): ChunkedHead.chain) written into ``du`` (rows, V), unit stride along V, in the
    matmuls' dtype: ``us`` itself or ChunkedHead.gradient_buffer(us) (default: us). ``ut`` may be
    overwritten. soft_out, hard_out: (rows,) buffers the per-row values are written into (default:
    new zeros; one a call does not compute is left as it is). Float32 runs the registry's kernel
    (Triton on the GPU, torch ops on the CPU; its block, warps and pass order from
    ChunkedLinearHeuristics); float64 (gradcheck's dtype) the torch ops everywhere (the Triton kernel
    is float32 only)."""
    tuning = heuristics_for(ChunkedLinearHeuristics)
    options = dict(mode=_mode(beta), soft=ut is not None, hard=hard, grad=grad, block=tuning.row_block,
                   warps=tuning.row_warps, alternate=tuning.alternate_passes)
    if soft_out is None:
        soft_out = torch.zeros(us.shape[0], dtype=us.dtype, device=us.device)
    if hard_out is None:
        hard_out = torch.zeros(us.shape[0], dtype=us.dtype, device=us.device)
    du = us if du is None else du
    cap_inv, scale = float(chain[0]), float(chain[1])
    if us.dtype == torch.float64:
        _rows_torch(options, us, ut, labels, soft_weight, hard_weight, soft_out, hard_out, du, beta, temperature,
                    cap_inv, scale)
    else:
        launch = multi_tensor_launch(ROWS_OP, us.device, us.dtype, **options)
        launch.run(us, ut, labels, soft_weight, hard_weight, soft_out, hard_out, du, float(beta), float(temperature),
                   cap_inv, scale)
    return soft_out, hard_out


def _soft_rows(us: Tensor, ut: Tensor, beta: float, temperature: float, grad: bool):
    """The CPU path's soft half: (per-row jsd_beta, its gradient w.r.t. us / T or None); ``ut`` is
    overwritten."""
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


def _rows_torch(opts: dict, us, ut, labels, soft_weight, hard_weight, soft_out, hard_out, du_out, beta, temperature,
                cap_inv, scale) -> None:
    """distillation_rows in torch ops (the CPU kernel; float64 everywhere). ``us`` is read to the
    end (du_out may alias it): the gradients are built in buffers of their own."""
    grad = opts["grad"]
    du = None
    if opts["soft"]:
        row, g = _soft_rows(us, ut, beta, temperature, grad)
        soft_out.copy_(row)
        if grad:
            du = g.mul_((soft_weight / temperature)[:, None])
    if opts["hard"]:
        lse = torch.logsumexp(us, -1, keepdim=True)
        index = labels[:, None]
        hard_out.copy_((lse - us.gather(1, index)).squeeze(1))
        if grad:
            probs = torch.sub(us, lse).exp_()
            probs.scatter_(1, index, probs.gather(1, index) - 1)   # one index a row: no collision
            probs.mul_(hard_weight[:, None])
            du = probs if du is None else du.add_(probs)
    if grad:
        if du is None:
            du_out.zero_()
        else:
            store_gradient_torch(du_out, du, us, cap_inv, scale)


def _prepare_rows_cpu(problem) -> MultiTensorLaunch:
    opts = dict(problem.options)

    def run(*args):
        _rows_torch(opts, *args)

    return MultiTensorLaunch(run, KernelChoice(f"{ROWS_OP}_cpu", "cpu"), problem.dtype)


register(ROWS_OP, backend="cpu", dtypes=(torch.float32,), deterministic=True, accumulator=ACCUMULATOR,
         name=f"{ROWS_OP}_cpu")(_prepare_rows_cpu)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _log_mixture(a, c):
        """log(e^a + e^c) without overflow: with a = log p + log(1 - beta), c = log q + log beta, the
        log of the beta-mixture (1 - beta) p + beta q."""
        hi = tl.maximum(a, c)
        return hi + tl.log(1 + tl.exp(tl.minimum(a, c) - hi))

    @triton.jit
    def _store_gradient(d_row, du, u, cols, mask, scale, cap_inv):
        """du times the transform's factor scale (1 - (u cap_inv)^2), stored at d_row[cols] in its
        dtype after a barrier (d_row may alias the logits every thread has read: see
        _distillation_rows)."""
        cap = u * cap_inv
        du = du * (scale * (1 - cap * cap))
        tl.debug_barrier()
        tl.store(d_row + cols, du.to(d_row.dtype.element_ty), mask=mask)

    @triton.jit
    def _distillation_rows(
        us_ptr,              # (rows, V) student logits before the temperature
        ut_ptr,              # (rows, V) teacher logits before the temperature (SOFT)
        labels_ptr,          # (rows,) class indices in range (HARD)
        soft_weight_ptr,     # (rows,) each row's factor of d soft / d us (GRAD and SOFT)
        hard_weight_ptr,     # (rows,) each row's factor of d hard / d us (GRAD and HARD)
        soft_out_ptr,        # (rows,) jsd_beta of each row
        hard_out_ptr,        # (rows,) -log_softmax(us)[label] of each row
        du_ptr,              # (rows, V) dlogits in the matmuls' dtype (GRAD); may alias us (gradient_buffer)
        V, stride_s, stride_t, stride_d,
        inv_t, beta, log_1mb, log_b, cap_inv, scale,
        MODE: tl.constexpr, SOFT: tl.constexpr, HARD: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr,
        ALTERNATE: tl.constexpr,
    ):
        """One row a program, in blocks of BLOCK entries. Pass 1: the logsumexps of us / T, ut / T (and
        of us, the hard loss's), online (running max and sum); MODE 1 also sum p (zs - zt) online, which
        gives its loss KL(p || q) = that / l_s - lse_s + lse_t without another pass. Pass 2 (MODE 0, 2):
        the loss sums (MODE 0 writes its gradient there too: p - q needs no sum). Pass 3 (MODE 1, MODE 2
        with GRAD, the hard loss alone): the gradient, p (g - <p, g>). So with GRAD two passes (MODE 0,
        MODE 1, hard only) or three (MODE 2, whose <p, g> needs both logsumexps first and then a whole
        row). Bytes an entry of each (rows, V) pair of logits from memory at most: MODE 0 / 1 8 + 8 read
        + 2 written (du in bf16), MODE 2 24 + 2; without GRAD 16, 8 (MODE 1) and 16; hard only 4 + 4 + 2.
        With ALTERNATE (ChunkedLinearHeuristics.alternate_passes, off by default until timed), passes
        that only read alternate direction with the pass before (the first pass runs backwards
        when a writing pass follows it, MODE 2's second pass runs backwards): the blocks a pass starts
        with are the ones the previous pass read last, still in L2. The gradient pass runs forwards:
        its store of block k lands on us[kB / 2, (k + 1)B / 2), entries the pass has read already. The
        gradient is stored times the transform's factor scale (1 - (u cap_inv)^2) in du's dtype, after
        a barrier: du may alias the row, its element j landing on bytes of us[j / 2], which every
        thread has then read."""
        row = tl.program_id(0).to(tl.int64)
        s_row = us_ptr + row * stride_s
        t_row = ut_ptr + row * stride_t
        d_row = du_ptr + row * stride_d
        offs = tl.arange(0, BLOCK)
        last = ((V - 1) // BLOCK) * BLOCK   # the last block's start
        neg_inf = float("-inf")
        m_s = neg_inf
        l_s = 0.0
        m_t = neg_inf
        l_t = 0.0
        m_1 = neg_inf
        l_1 = 0.0
        w_s = 0.0    # MODE 1: sum exp(zs - m_s) (zs - zt), rescaled with l_s
        for forward_start in range(0, V, BLOCK):
            if (SOFT and MODE == 2) or not ALTERNATE:
                start = forward_start
            else:
                start = last - forward_start
            mask = start + offs < V
            u = tl.load(s_row + start + offs, mask=mask, other=neg_inf)
            if SOFT:
                zs = u * inv_t
                new = tl.maximum(m_s, tl.max(zs, 0))
                alpha = tl.exp(m_s - new)
                e = tl.exp(zs - new)
                l_s = l_s * alpha + tl.sum(e, 0)
                zt = tl.load(t_row + start + offs, mask=mask, other=neg_inf) * inv_t
                if MODE == 1:
                    w_s = w_s * alpha + tl.sum(tl.where(mask, e * (zs - zt), 0.0), 0)
                m_s = new
                new = tl.maximum(m_t, tl.max(zt, 0))
                l_t = l_t * tl.exp(m_t - new) + tl.sum(tl.exp(zt - new), 0)
                m_t = new
            if HARD:
                new = tl.maximum(m_1, tl.max(u, 0))
                l_1 = l_1 * tl.exp(m_1 - new) + tl.sum(tl.exp(u - new), 0)
                m_1 = new
        if SOFT:
            lse_s = m_s + tl.log(l_s)
            lse_t = m_t + tl.log(l_t)
        if HARD:
            lse_1 = m_1 + tl.log(l_1)
        hard_w = 0.0
        soft_w = 0.0
        if HARD:
            label = tl.load(labels_ptr + row)
            tl.store(hard_out_ptr + row, lse_1 - tl.load(s_row + label))
            if GRAD:
                hard_w = tl.load(hard_weight_ptr + row)
        if GRAD:
            if SOFT:
                soft_w = tl.load(soft_weight_ptr + row) * inv_t
        teacher_term = 0.0
        student_term = 0.0
        if SOFT:
            if MODE == 1:
                student_term = w_s / l_s - lse_s + lse_t
            else:
                for forward_start in range(0, V, BLOCK):
                    if MODE == 2 and ALTERNATE:
                        start = last - forward_start
                    else:
                        start = forward_start
                    mask = start + offs < V
                    u = tl.load(s_row + start + offs, mask=mask, other=0.0)
                    ls = u * inv_t - lse_s
                    lt = tl.load(t_row + start + offs, mask=mask, other=0.0) * inv_t - lse_t
                    p = tl.exp(ls)
                    q = tl.exp(lt)
                    if MODE == 0:
                        teacher_term += tl.sum(tl.where(mask, q * (lt - ls), 0.0), 0)
                        if GRAD:
                            du = soft_w * (p - q)
                            if HARD:
                                du += hard_w * (tl.exp(u - lse_1) - tl.where(start + offs == label, 1.0, 0.0))
                            _store_gradient(d_row, du, u, start + offs, mask, scale, cap_inv)
                    else:
                        lm = _log_mixture(ls + log_1mb, lt + log_b)
                        teacher_term += tl.sum(tl.where(mask, q * (lt - lm), 0.0), 0)
                        student_term += tl.sum(tl.where(mask, p * (ls - lm), 0.0), 0)
            if MODE == 0:
                tl.store(soft_out_ptr + row, teacher_term)
            elif MODE == 1:
                tl.store(soft_out_ptr + row, student_term)
            else:
                tl.store(soft_out_ptr + row, beta * teacher_term + (1 - beta) * student_term)
        if GRAD and (MODE != 0 or not SOFT):
            for start in range(0, V, BLOCK):
                mask = start + offs < V
                u = tl.load(s_row + start + offs, mask=mask, other=0.0)
                du = tl.zeros([BLOCK], dtype=u.dtype)
                if SOFT:
                    ls = u * inv_t - lse_s
                    lt = tl.load(t_row + start + offs, mask=mask, other=0.0) * inv_t - lse_t
                    p = tl.exp(ls)
                    if MODE == 1:
                        du = soft_w * p * ((ls - lt) - student_term)
                    else:
                        lm = _log_mixture(ls + log_1mb, lt + log_b)
                        du = (soft_w * (1 - beta)) * p * ((ls - lm) - student_term)
                if HARD:
                    du += hard_w * (tl.exp(u - lse_1) - tl.where(start + offs == label, 1.0, 0.0))
                _store_gradient(d_row, du, u, start + offs, mask, scale, cap_inv)

    def _prepare_rows_triton(problem) -> MultiTensorLaunch:
        opts = dict(problem.options)
        meta = dict(MODE=opts["mode"], SOFT=opts["soft"], HARD=opts["hard"], GRAD=opts["grad"],
                    BLOCK=opts["block"], ALTERNATE=opts["alternate"], num_warps=opts["warps"])
        launches: dict[int, object] = {}

        def run(us, ut, labels, soft_weight, hard_weight, soft_out, hard_out, du, beta, temperature, cap_inv, scale):
            rows = us.shape[0]
            if not rows:
                return
            launch = launches.get(rows)
            if launch is None:
                launch = launches[rows] = launcher(_distillation_rows, (rows,), **meta)
            mixture = 0.0 < beta < 1.0
            # an operand a variant does not read gets ``us`` (any pointer): no None specialisations
            launch(us, us if ut is None else ut, us if labels is None else labels,
                   us if soft_weight is None else soft_weight,
                   us if hard_weight is None else hard_weight, soft_out, hard_out, du, us.shape[1], us.stride(0),
                   us.stride(0) if ut is None else ut.stride(0), du.stride(0), 1.0 / temperature, beta,
                   math.log1p(-beta) if mixture else 0.0, math.log(beta) if mixture else 0.0, cap_inv, scale)

        return MultiTensorLaunch(run, KernelChoice("distillation_rows", "triton",
                                                   (("BLOCK", opts["block"]), ("num_warps", opts["warps"]),
                                                    ("ALTERNATE", opts["alternate"]))),
                                 problem.dtype)

    register(ROWS_OP, backend="triton", dtypes=(torch.float32,), deterministic=True,
             accumulator=ACCUMULATOR, name=f"{ROWS_OP}_triton")(_prepare_rows_triton)


# Block of vocabulary entries a program reads at a time, and its warps: ChunkedLinearHeuristics.row_block and
# row_warps (unmeasured; bench_linear_post_training.py times other pairs). The default block, for tests:
_ROWS_BLOCK = ChunkedLinearHeuristics.row_block


def _impl(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
          labels: Optional[Tensor], student_bias: Optional[Tensor], teacher_bias: Optional[Tensor],
          num_items: Optional[Tensor], beta: float, temperature: float, weight_soft: float, weight_hard: float,
          ignore_index: int, logit_scale: float, softcap: Optional[float], needs: int,
          rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, soft, hard, dstudent_hidden, dstudent_weight, dstudent_bias): the losses in the
    accumulator dtype, the gradients (of an upstream gradient of 1) in their tensors' dtypes, an
    empty tensor where not in ``needs``. rows: tokens a chunk, 0 for ChunkedLinearHeuristics'.

    Buffers, allocated once a call and reused by every chunk: the student's float32 logits
    (rows, V), the teacher's (teacher_rows, V) (ChunkedLinearHeuristics.teacher_rows: the teacher's
    logits are computed in sub-chunks of the student's chunk, each followed by the row kernel on
    those rows), the float32 dhidden chunk inside the teacher's buffer (dead by then) where it fits,
    and per-token vectors (N,). Per chunk: the student matmul, a teacher matmul and a row-kernel
    launch a sub-chunk, the dX matmul (+ its rounding copy for a half student) and the dW matmul."""
    x, xt = student_hidden, teacher_hidden
    n, v = x.shape[0], student_weight.shape[0]
    acc = accumulator(x.dtype)
    dev = x.device
    rows = rows or heuristic_rows(n, v)
    teacher_rows = min(rows, heuristic_teacher_rows(n, v))
    with torch.autocast(dev.type, enabled=False):
        kept = None if labels is None else labels != ignore_index
        if weight_hard:
            check_label_range(OP, labels, kept, v)
        if num_items is not None:   # the tokens of the whole (accumulated) batch
            count = num_items.to(acc)
        elif labels is None:
            count = torch.full((), max(n, 1), dtype=acc, device=dev)
        else:
            count = kept.sum().to(acc).clamp_min(1)
        inv_count = 1 / count
        grad = needs & GRADIENTS != 0
        if needs & NEEDS_WEIGHT:
            needs |= weight_dtype_bit()
        student = ChunkedHead(x, student_weight, student_bias, logit_scale, softcap, needs)
        teacher = ChunkedHead(xt, teacher_weight, teacher_bias, logit_scale, softcap) if weight_soft else None
        # per token, once a call: 1 / 0 for kept / ignored rows, the labels (ignored: 0), each row's factors of the
        # two gradients (d / d us = d / d (us / T) / T: the kernel's 1 / T), normalised by the count
        keep = torch.ones(n, dtype=acc, device=dev) if kept is None else kept.to(acc)
        index = torch.where(kept, labels, 0) if weight_hard else None
        soft_weight = keep * (inv_count * weight_soft) if grad and weight_soft else None
        hard_weight = keep * (inv_count * weight_hard) if grad and weight_hard else None
        soft_rows = torch.zeros(n, dtype=acc, device=dev)
        hard_rows = torch.zeros(n, dtype=acc, device=dev)
        first = min(n, rows)
        us_buffer = torch.empty(first, v, dtype=acc, device=dev)
        ut_buffer = torch.empty(min(first, teacher_rows), v, dtype=acc, device=dev) if weight_soft else None
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            us = student.logits(start, stop, us_buffer[: stop - start])
            dlogits = student.gradient_buffer(us) if grad else None
            step = teacher_rows if weight_soft else stop - start
            for a in range(0, stop - start, step):   # the teacher's sub-chunks, each then the row kernel
                b = min(stop - start, a + step)
                ut = teacher.logits(start + a, start + b, ut_buffer[: b - a]) if weight_soft else None
                distillation_rows(us[a:b], ut, None if index is None else index[start + a:start + b],
                                  None if soft_weight is None else soft_weight[start + a:start + b],
                                  None if hard_weight is None else hard_weight[start + a:start + b], beta,
                                  temperature, hard=bool(weight_hard), grad=grad,
                                  du=None if dlogits is None else dlogits[a:b], chain=student.chain,
                                  soft_out=soft_rows[start + a:start + b], hard_out=hard_rows[start + a:start + b])
            if grad:   # the kernel wrote dlogits over us's storage
                student.backward(start, stop, dlogits, ut_buffer)
            del us, dlogits
        del us_buffer, ut_buffer
        soft = (soft_rows * keep).sum() * inv_count
        hard = (hard_rows * keep).sum() * inv_count
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
                             teacher_weight: Tensor, labels: Tensor | None = None, *,
                             student_bias: Tensor | None = None, teacher_bias: Tensor | None = None,
                             beta: float = 0.5, temperature: float = 1.0, weight_soft_loss: float = 1.0,
                             weight_hard_loss: float = 0.0, ignore_index: int = -100,
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
