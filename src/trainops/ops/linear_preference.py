"""Fused linear preference losses (DPO, IPO, SimPO, CPO, ORPO) from the last hidden states and the
LM head, never holding more than one chunk of logits.

A preference loss is a nonlinear function of whole sequences' log-probabilities, so a chunk's
dlogits (d loss / d logp_seq times d logp_seq / d logits) is known only once every token of the
chunk's sequences has been seen. Storing per-token factors instead would take a V-sized softmax a
token (the logits themselves). But the loss is separable by pairs (a mean over the pairs plus an
NLL linear in the tokens over a count known up front), hence two paths, chosen by the chunk size
(ChunkedLinearHeuristics):

1. Whole pairs a chunk (``linear_preference_pairs``, a custom op), when a pair's 2T tokens fit a
   chunk: chosen rows i.. and rejected rows P + i.. gathered, their logits (one matmul), the row
   kernel's logsumexp / label log-probability / logits sum, the pairs' losses and their gradients
   w.r.t. the sequence log-probabilities (written out: ``_pair_gradients``), dlogits written in the
   matmuls' dtype over the logits' storage by the row kernel, dX and dW: three policy matmuls (the
   unfused formulation's count), gradients computed in the forward and scaled by the upstream
   gradient in the backward. Liger's
   chunking by pairs, kept to pairs that fit the token budget.
2. Two passes otherwise (``linear_token_logprobs``, a custom op): per token log_softmax(z)[label]
   and sum_v z_v, one matmul a chunk, the logsumexp kept; the losses are torch ops on the
   (B,)-sized sequence log-probabilities differentiated by autograd into a per-token dlogp, and the
   op's backward runs the chunks again (logits, du = dlogp (onehot - softmax), dX, dW): four policy
   matmuls.

z = softcap(logit_scale * (hidden W^T + b)) / temperature (ops/chunked_linear.ChunkedHead). The
reference costs one matmul a chunk (no gradient), and without gradients (evaluation) the policy one.
The row kernels (op "linear_token_rows") are Triton on the GPU, torch ops on the CPU.

Conventions (TRL's trainers): the batch is the P chosen rows, then the P rejected rows; labels are
aligned with the hidden states (the caller shifts) and ``ignore_index`` tokens count for nothing.
Sequence log-probabilities are summed over the kept tokens for DPO and CPO, averaged (divided by
max(1, kept tokens)) for IPO, SimPO and ORPO. With delta = (c - c_ref) - (r - r_ref) (c, r: the
chosen and rejected sequence log-probabilities), sigma_ls(x) = -(1 - ls) log sigmoid(x) - ls log sigmoid(-x):

    dpo    sigma_ls(beta delta)                      TRL's DPO "sigmoid" loss (ls: cDPO's label smoothing,
                                                     TRL < 1.0's DPO and TRL's CPO trainer)
    ipo    (delta - 1 / (2 beta))^2                  TRL's DPO "ipo" (its log-ratios over the completion's tokens)
    simpo  sigma_ls(beta (c - r) - gamma)            TRL's CPO trainer, loss_type "simpo" (gamma: simpo_gamma)
    cpo    sigma_ls(beta (c - r)) + nll_weight NLL   TRL's CPO trainer, loss_type "sigmoid" (nll_weight: cpo_alpha)
    orpo   NLL - beta log sigmoid(log_odds)          TRL's ORPO trainer;
                                                     log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))

each the mean over the pairs (plus nll_weight times the chosen rows' NLL: -sum of their kept
tokens' log-probabilities / max(1, their count); its weight is 1 for CPO and ORPO, 0 otherwise by
default). Rewards: beta (logps - ref_logps) with a reference, beta logps without (TRL's CPO and
ORPO); ``chosen_logits_mean`` / ``rejected_logits_mean``: the mean over the vocabulary of z,
averaged over the kept tokens of the chosen / rejected rows (TRL's ``logits/chosen`` metric).
ORPO's log(1 - e^x) reads min(x, -1e-7) (a row with no kept token has log-probability 0, whose odds
are infinite; the clamp keeps its loss and gradients finite).

Dtypes: hidden float32 / float16 / bfloat16 / float64 (the matmuls' dtype; under autocast its
dtype); weight and bias any float dtype; log-probabilities, losses and rewards float32 (float64).
Deterministic: fixed chunk order, no atomics; no host syncs. A kept label out of [0, V) raises
IndexOutOfRangeError on the CPU, a device-side assert on CUDA.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InvalidProblemError, UnsupportedError, argument_error
from ..launch import launcher
from ..library import custom_op
from ..plan import KernelChoice
from ..registry import ACCUMULATOR, register, register_op, triton_available
from .multi_tensor import MultiTensorLaunch, multi_tensor_describer, multi_tensor_launch
from .chunked_linear import (GRADIENTS, NEEDS_BIAS, NEEDS_HIDDEN, NEEDS_WEIGHT, ChunkedHead, accumulator, check_head,
                             check_ignore_index, check_label_range, check_labels, check_number, check_transform,
                             gradient_bits, heuristic_rows, save_scaled_gradients, scaled_gradients,
                             store_gradient_torch, weight_dtype_bit)

OP = "linear_preference_loss"
TOKENS_OP = "linear_token_logprobs"
PAIRS_OP = "linear_preference_pairs"
KINDS = ("dpo", "ipo", "orpo", "simpo", "cpo")
_NEEDS_REFERENCE = ("dpo", "ipo")
_AVERAGED = ("ipo", "simpo", "orpo")


# ----------------------------------------------------------------------------------------------
# The per-chunk math: op "linear_token_rows" (a Triton kernel on the GPU, torch ops on the CPU)
# ----------------------------------------------------------------------------------------------

ROWS_OP = "linear_token_rows"
register_op(ROWS_OP, multi_tensor_describer(ROWS_OP),
            doc="per row of logits u (before the temperature): logsumexp, the label's log-probability and the "
                "logits' sum (stage forward); dlogp (onehot - softmax) written over the row (stage backward)")


def token_rows_forward(u: Tensor, index: Tensor, keep: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(lse, logp, logit_sum) (rows,) of z = u / T: logsumexp(z), (z[label] - lse) keep,
    sum(z) keep. u (rows, V) contiguous float32 / float64; index (rows,) labels in range (ignored:
    0); keep (rows,) 1 / 0 in u's dtype. Float64 runs the torch ops everywhere (the Triton kernel is
    float32 only)."""
    outs = tuple(torch.empty(u.shape[0], dtype=u.dtype, device=u.device) for _ in range(3))
    if u.dtype == torch.float64:
        _rows_torch("forward", u, index, keep, *outs, temperature, None, 0.0, 1.0)
    else:
        multi_tensor_launch(ROWS_OP, u.device, u.dtype, stage="forward").run(u, index, keep, *outs, temperature, None,
                                                                            0.0, 1.0)
    return outs


def token_rows_backward_(u: Tensor, index: Tensor, lse: Tensor, factor: Tensor, temperature: float,
                         du: Optional[Tensor] = None, chain: tuple[float, float] = (0.0, 1.0)) -> Tensor:
    """dlogits = factor (onehot(label) - exp(u / T - lse)) / T * scale (1 - (u cap_inv)^2) (the
    gradient of sum factor * logp w.r.t. the logits before the transform; chain = (cap_inv, scale):
    ChunkedHead.chain) written into ``du`` (returned): (rows, V), unit stride along V, in the
    matmuls' dtype, ``u`` itself or ChunkedHead.gradient_buffer(u) (default: u). factor (rows,):
    dlogp, 0 on ignored rows."""
    du = u if du is None else du
    cap_inv, scale = float(chain[0]), float(chain[1])
    if u.dtype == torch.float64:
        _rows_torch("backward", u, index, factor, lse, None, None, temperature, du, cap_inv, scale)
    else:
        multi_tensor_launch(ROWS_OP, u.device, u.dtype, stage="backward").run(u, index, factor, lse, None, None,
                                                                             temperature, du, cap_inv, scale)
    return du


def _rows_torch(stage: str, u, index, weights, lse, logp, logit_sum, temperature, du_out, cap_inv, scale) -> None:
    """Both stages in torch ops (the CPU kernel; float64 everywhere). forward: weights = keep, writes
    lse, logp, logit_sum, ``u`` kept; backward: weights = factor, reads lse, writes dlogits into
    du_out (which may alias u: the gradient is built in a buffer of its own first)."""
    index = index[:, None]
    if stage == "forward":
        z = u / temperature if temperature != 1.0 else u
        torch.logsumexp(z, -1, out=lse)
        torch.mul(z.gather(1, index).squeeze(1) - lse, weights, out=logp)
        torch.mul(z.sum(-1), weights, out=logit_sum)
        return
    f = (weights / temperature)[:, None]
    dz = torch.sub(u / temperature if temperature != 1.0 else u, lse[:, None]).exp_().mul_(-f)   # -dlogp softmax(z)
    dz.scatter_(1, index, dz.gather(1, index) + f)         # + dlogp onehot(label): one index a row
    store_gradient_torch(du_out, dz, u, cap_inv, scale)


def _prepare_rows_cpu(problem) -> MultiTensorLaunch:
    stage = dict(problem.options)["stage"]

    def run(*args):
        _rows_torch(stage, *args)

    return MultiTensorLaunch(run, KernelChoice(f"{ROWS_OP}_cpu", "cpu"), problem.dtype)


register(ROWS_OP, backend="cpu", dtypes=(torch.float32,), deterministic=True, accumulator=ACCUMULATOR,
         name=f"{ROWS_OP}_cpu")(_prepare_rows_cpu)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _token_rows_forward(
        u_ptr,           # (rows, V) logits before the temperature
        index_ptr,       # (rows,) labels in range
        keep_ptr,        # (rows,) 1 for kept rows, 0 for ignored ones
        lse_ptr,         # (rows,) out: logsumexp(u / T)
        logp_ptr,        # (rows,) out: (u[label] / T - lse) keep
        sum_ptr,         # (rows,) out: sum(u / T) keep
        V, stride, inv_t,
        BLOCK: tl.constexpr,
    ):
        """One row a program, one pass: online logsumexp and sum of z = u / T by blocks."""
        row = tl.program_id(0).to(tl.int64)
        base = u_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        m = float("-inf")
        s = 0.0
        total = 0.0
        for start in range(0, V, BLOCK):
            mask = start + offs < V
            z = tl.load(base + start + offs, mask=mask, other=float("-inf")) * inv_t
            new = tl.maximum(m, tl.max(z, 0))
            s = s * tl.exp(m - new) + tl.sum(tl.exp(z - new), 0)
            m = new
            total += tl.sum(tl.where(mask, z, 0.0), 0)
        lse = m + tl.log(s)
        keep = tl.load(keep_ptr + row)
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, (tl.load(base + tl.load(index_ptr + row)) * inv_t - lse) * keep)
        tl.store(sum_ptr + row, total * keep)

    @triton.jit
    def _token_rows_backward(
        u_ptr,           # (rows, V) logits before the temperature
        index_ptr,       # (rows,) labels in range
        factor_ptr,      # (rows,) dlogp (0 on ignored rows)
        lse_ptr,         # (rows,) logsumexp(u / T) of the forward
        du_ptr,          # (rows, V) dlogits in the matmuls' dtype; may alias u (ChunkedHead.gradient_buffer)
        V, stride, stride_d, inv_t, cap_inv, scale,
        BLOCK: tl.constexpr,
    ):
        """One row a program, one pass: dlogits = dlogp (onehot(label) - exp(u / T - lse)) / T times
        the transform's factor scale (1 - (u cap_inv)^2), stored in du's dtype after a barrier: du may
        alias the row, its element j landing on bytes of u[j / 2], which every thread has then read."""
        row = tl.program_id(0).to(tl.int64)
        base = u_ptr + row * stride
        d_row = du_ptr + row * stride_d
        offs = tl.arange(0, BLOCK)
        f = tl.load(factor_ptr + row) * inv_t
        lse = tl.load(lse_ptr + row)
        label = tl.load(index_ptr + row)
        for start in range(0, V, BLOCK):
            mask = start + offs < V
            u = tl.load(base + start + offs, mask=mask, other=0.0)
            du = f * (tl.where(start + offs == label, 1.0, 0.0) - tl.exp(u * inv_t - lse))
            cap = u * cap_inv
            du = du * (scale * (1 - cap * cap))
            tl.debug_barrier()
            tl.store(d_row + start + offs, du.to(du_ptr.dtype.element_ty), mask=mask)

    def _prepare_rows_triton(problem) -> MultiTensorLaunch:
        forward = dict(problem.options)["stage"] == "forward"
        kernel = _token_rows_forward if forward else _token_rows_backward
        launches: dict[int, object] = {}

        def run(u, index, weights, lse, logp, logit_sum, temperature, du, cap_inv, scale):
            rows = u.shape[0]
            if not rows:
                return
            launch = launches.get(rows)
            if launch is None:
                launch = launches[rows] = launcher(kernel, (rows,), BLOCK=_ROWS_BLOCK, num_warps=_ROWS_WARPS)
            if forward:
                launch(u, index, weights, lse, logp, logit_sum, u.shape[1], u.stride(0), 1.0 / temperature)
            else:
                launch(u, index, weights, lse, du, u.shape[1], u.stride(0), du.stride(0), 1.0 / temperature, cap_inv,
                       scale)

        return MultiTensorLaunch(run, KernelChoice(kernel.__name__.lstrip("_"), "triton", (("BLOCK", _ROWS_BLOCK),)),
                                 problem.dtype)

    register(ROWS_OP, backend="triton", dtypes=(torch.float32,), deterministic=True, accumulator=ACCUMULATOR,
             name=f"{ROWS_OP}_triton")(_prepare_rows_triton)


# Vocabulary entries a program reads at a time, and its warps: unmeasured (as linear_distillation_rows').
_ROWS_BLOCK = 4096
_ROWS_WARPS = 8


# ----------------------------------------------------------------------------------------------
# Per-token log-probabilities: torch.ops.trainops.linear_token_logprobs (+ its backward op)
# ----------------------------------------------------------------------------------------------

def _tokens_impl(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ignore_index: int,
                 logit_scale: float, softcap: Optional[float], temperature: float,
                 rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, logit_sum, lse), each (N,) in the accumulator dtype; ignored tokens: 0, 0 and their lse."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = accumulator(hidden.dtype)
    rows = rows or heuristic_rows(n, v)
    logp = torch.empty(n, dtype=acc, device=hidden.device)
    logit_sum = torch.empty(n, dtype=acc, device=hidden.device)
    lse = torch.empty(n, dtype=acc, device=hidden.device)
    kept = labels != ignore_index
    check_label_range(TOKENS_OP, labels, kept, v)
    index = torch.where(kept, labels, 0)
    keep_f = kept.to(acc)
    with torch.autocast(hidden.device.type, enabled=False):
        head = ChunkedHead(hidden, weight, bias, logit_scale, softcap)
        u_buffer = torch.empty(min(n, rows), weight.shape[0], dtype=acc, device=hidden.device)   # once a call
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            u = head.logits(start, stop, u_buffer[: stop - start])
            lse[start:stop], logp[start:stop], logit_sum[start:stop] = token_rows_forward(
                u, index[start:stop], keep_f[start:stop], temperature)
            del u
    return logp, logit_sum, lse


def _tokens_fake(hidden, weight, labels, bias, ignore_index, logit_scale, softcap, temperature, rows):
    out = hidden.new_empty(hidden.shape[0], dtype=accumulator(hidden.dtype))
    return out, torch.empty_like(out), torch.empty_like(out)


def _tokens_save(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(inputs.hidden, inputs.weight, inputs.labels, inputs.bias, output[2])
    # the forward's chunk size: the backward may run on another thread, outside its heuristics block
    ctx.arguments = (inputs.ignore_index, inputs.logit_scale, inputs.softcap, inputs.temperature,
                     inputs.rows or heuristic_rows(inputs.hidden.shape[0], inputs.weight.shape[0]))
    ctx.weight_bit = weight_dtype_bit()


def _tokens_grad(ctx, dlogp: Tensor, *unused) -> dict:
    if dlogp is None:
        return {}
    if torch.is_grad_enabled():
        raise UnsupportedError(f"trainops.{TOKENS_OP}: double backward is not supported")
    hidden, weight, labels, bias, lse = ctx.saved_tensors
    need = ctx.needs_grad
    needs = NEEDS_HIDDEN * need.hidden + NEEDS_WEIGHT * need.weight + NEEDS_BIAS * (bias is not None and need.bias)
    if not needs:
        return {}
    if needs & NEEDS_WEIGHT:
        needs |= ctx.weight_bit
    dx, dw, db = tokens_backward_op(dlogp, hidden, weight, labels, bias, lse, *ctx.arguments, needs)
    return {name: g for name, g, bit in (("hidden", dx, NEEDS_HIDDEN), ("weight", dw, NEEDS_WEIGHT),
                                         ("bias", db, NEEDS_BIAS)) if needs & bit}


def _tokens_backward_impl(dlogp: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor],
                          lse: Tensor, ignore_index: int, logit_scale: float, softcap: Optional[float],
                          temperature: float, rows: int, needs: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dhidden, dweight, dbias) of per-token upstream gradients dlogp; one not in ``needs`` is an
    empty tensor. The chunks again: dz = dlogp (onehot - exp(z - lse)) on kept tokens, / temperature."""
    n = hidden.shape[0]
    acc = accumulator(hidden.dtype)
    kept = labels != ignore_index
    index = torch.where(kept, labels, 0)
    factor = torch.where(kept, dlogp.to(acc), 0)   # ignored tokens get no gradient whatever their upstream one
    with torch.autocast(hidden.device.type, enabled=False):
        head = ChunkedHead(hidden, weight, bias, logit_scale, softcap, needs)
        u_buffer = torch.empty(min(n, rows), weight.shape[0], dtype=acc, device=hidden.device)   # once a call
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            u = head.logits(start, stop, u_buffer[: stop - start])
            dlogits = token_rows_backward_(u, index[start:stop], lse[start:stop], factor[start:stop], temperature,
                                           head.gradient_buffer(u), head.chain)
            head.backward(start, stop, dlogits)
            del u, dlogits
        dx, dw, db = head.finish()
    return tuple(hidden.new_empty(0) if g is None else g for g in (dx, dw, db))


def _tokens_backward_fake(dlogp, hidden, weight, labels, bias, lse, ignore_index, logit_scale, softcap, temperature,
                          rows, needs):
    return (hidden.new_empty(hidden.shape if needs & NEEDS_HIDDEN else 0),
            weight.new_empty(weight.shape if needs & NEEDS_WEIGHT else 0),
            hidden.new_empty(0) if bias is None or not needs & NEEDS_BIAS else bias.new_empty(bias.shape))


tokens_backward_op = custom_op(f"{TOKENS_OP}_backward", _tokens_backward_impl, _tokens_backward_fake)
linear_token_logprobs_op = custom_op(TOKENS_OP, _tokens_impl, _tokens_fake, backward=_tokens_grad,
                                     save=_tokens_save)


def linear_token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None, *,
                          ignore_index: int = -100, logit_scale: float = 1.0, softcap: float | None = None,
                          temperature: float = 1.0, op: str = TOKENS_OP) -> tuple[Tensor, Tensor]:
    """(log_softmax(z)[label], sum_v z_v) of each token, hidden's leading shape, float32 (float64);
    ignored tokens 0. Differentiable in the log-probabilities (hidden, weight, bias)."""
    check_ignore_index(op, ignore_index)
    check_transform(op, logit_scale, softcap, temperature)
    check_head(op, ("hidden", "weight", "bias"), hidden, weight, bias)
    check_labels(op, labels, hidden.shape[:-1], hidden.device)
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype != torch.float64:
        hidden = hidden.to(torch.get_autocast_dtype(device))
    x = hidden.reshape(-1, hidden.shape[-1])
    logp, logit_sum, _ = linear_token_logprobs_op(x, weight, labels.reshape(-1), bias, ignore_index,
                                                  float(logit_scale), None if softcap is None else float(softcap),
                                                  float(temperature), 0)
    return logp.reshape(labels.shape), logit_sum.reshape(labels.shape)


# ----------------------------------------------------------------------------------------------
# The losses
# ----------------------------------------------------------------------------------------------

class PreferenceOutput(NamedTuple):
    """What trainops.linear_preference_loss returns: the loss (a scalar) and, per pair (P,), the
    sequence log-probabilities and rewards (no gradient), and the two logits means (scalars)."""
    loss: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    chosen_logits_mean: Tensor
    rejected_logits_mean: Tensor


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x) for x <= 0, accurate on both sides of -log 2; x clamped to <= -1e-7 (module docstring)."""
    x = x.clamp(max=-1e-7)
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _sigmoid_ls(x: Tensor, label_smoothing: float) -> Tensor:
    loss = -F.logsigmoid(x)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-x)
    return loss


def check_settings(kind, beta, gamma, label_smoothing, nll_weight, ignore_index, logit_scale, softcap,
                   temperature) -> None:
    """The loss's settings (what trainops.nn.LinearPreferenceLoss's constructor takes)."""
    if kind not in KINDS:
        raise argument_error(InvalidProblemError, OP, "kind", f"is {kind!r}; expected one of {KINDS}")
    check_number(OP, "beta", beta, 0.0, open_low=True)
    check_number(OP, "gamma", gamma, -float("inf"))
    check_number(OP, "label_smoothing", label_smoothing, 0.0, 0.5)
    if label_smoothing and kind in ("ipo", "orpo"):
        raise argument_error(InvalidProblemError, OP, "label_smoothing", f"applies to the sigmoid losses (dpo, simpo, "
                             f"cpo), not to kind={kind!r}")
    if nll_weight is not None:
        check_number(OP, "nll_weight", nll_weight, 0.0)
    check_ignore_index(OP, ignore_index)
    check_transform(OP, logit_scale, softcap, temperature)


def _sequence(logp: Tensor, logit_sum: Tensor, kept: Tensor, averaged: bool):
    """(sequence log-probabilities (B,), kept tokens a row (B,)) from per-token values (B, T)."""
    count = kept.sum(-1).to(logp.dtype)
    seq = logp.sum(-1)
    return (seq / count.clamp_min(1) if averaged else seq), count


def linear_preference_loss(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                           kind: str = "dpo", beta: float = 0.1, ref_hidden: Tensor | None = None,
                           ref_weight: Tensor | None = None, ref_bias: Tensor | None = None,
                           ref_chosen_logps: Tensor | None = None, ref_rejected_logps: Tensor | None = None,
                           gamma: float = 0.5, label_smoothing: float = 0.0, nll_weight: float | None = None,
                           ignore_index: int = -100, logit_scale: float = 1.0, softcap: float | None = None,
                           temperature: float = 1.0) -> PreferenceOutput:
    """See trainops.functional.linear_preference_loss."""
    check_settings(kind, beta, gamma, label_smoothing, nll_weight, ignore_index, logit_scale, softcap, temperature)
    check_head(OP, ("hidden", "weight", "bias"), hidden, weight, bias)
    if hidden.dim() != 3 or hidden.shape[0] % 2:
        raise argument_error(InvalidProblemError, OP, "hidden", f"has shape {tuple(hidden.shape)}; expected (B, T, H) "
                             "with B even: the chosen rows, then the rejected rows")
    check_labels(OP, labels, hidden.shape[:-1], hidden.device)
    pairs = hidden.shape[0] // 2
    by_head = ref_hidden is not None or ref_weight is not None or ref_bias is not None
    by_logps = ref_chosen_logps is not None or ref_rejected_logps is not None
    if by_head and by_logps:
        raise argument_error(InvalidProblemError, OP, "ref_chosen_logps", "and ref_hidden / ref_weight were both "
                             "given: pass the reference as hidden states and head, or as log-probabilities")
    if by_head:
        if ref_hidden is None or ref_weight is None:
            name = "ref_hidden" if ref_hidden is None else "ref_weight"
            raise argument_error(InvalidProblemError, OP, name, "is None: a reference given as hidden states and "
                                 "head needs both ref_hidden and ref_weight")
        check_head(OP, ("ref_hidden", "ref_weight", "ref_bias"), ref_hidden, ref_weight, ref_bias)
        if tuple(ref_hidden.shape[:-1]) != tuple(hidden.shape[:-1]) or ref_weight.shape[0] != weight.shape[0]:
            raise argument_error(InvalidProblemError, OP, "ref_hidden", f"has shape {tuple(ref_hidden.shape)} with a "
                                 f"{ref_weight.shape[0]}-class head; expected leading axes {tuple(hidden.shape[:-1])} "
                                 f"and {weight.shape[0]} classes (the policy's tokens and vocabulary)")
        if ref_hidden.device != hidden.device:
            raise argument_error(InvalidProblemError, OP, "ref_hidden", f"is on {ref_hidden.device} but hidden is on "
                                 f"{hidden.device}")
    if by_logps:
        for name, t in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
            if not isinstance(t, Tensor) or tuple(t.shape) != (pairs,) or not t.is_floating_point():
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise argument_error(InvalidProblemError, OP, name, f"must be a float tensor of shape ({pairs},) "
                                     f"(one log-probability a pair, as this kind's sequence log-probabilities), got "
                                     f"{shape}")
            if t.device != hidden.device:
                raise argument_error(InvalidProblemError, OP, name, f"is on {t.device} but hidden is on "
                                     f"{hidden.device}")
    has_reference = by_head or by_logps
    if kind in _NEEDS_REFERENCE and not has_reference:
        raise argument_error(InvalidProblemError, OP, "ref_hidden", f"is None: kind={kind!r} needs a reference (as "
                             "ref_hidden and ref_weight, or ref_chosen_logps and ref_rejected_logps)")
    if kind not in _NEEDS_REFERENCE and has_reference:
        raise argument_error(InvalidProblemError, OP, "ref_hidden" if by_head else "ref_chosen_logps",
                             f"was given, but kind={kind!r} uses no reference model")

    transform = dict(ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap, temperature=temperature,
                     op=OP)
    averaged = kind in _AVERAGED
    kept = labels != ignore_index
    count = kept.sum(-1)
    ref_logps = None
    if by_head:
        with torch.no_grad():
            ref_logp, _ = linear_token_logprobs(ref_hidden, ref_weight, labels, ref_bias, **transform)
            ref_logps, _ = _sequence(ref_logp, ref_logp, kept, averaged)
    elif by_logps:
        ref_logps = torch.cat([ref_chosen_logps.detach(), ref_rejected_logps.detach()])
    weight_nll = (1.0 if kind in ("cpo", "orpo") else 0.0) if nll_weight is None else float(nll_weight)
    settings = (kind, float(beta), float(gamma), float(label_smoothing), weight_nll)
    steps, length = hidden.shape[0], hidden.shape[1]
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype != torch.float64:
        hidden = hidden.to(torch.get_autocast_dtype(device))
    per_chunk = _pairs_per_chunk(hidden.shape[0] * length, weight.shape[0], length) if pairs and length else 0
    if per_chunk:   # whole pairs fit a chunk: gradients in the forward
        acc = accumulator(hidden.dtype)
        needs = gradient_bits((hidden, NEEDS_HIDDEN), (weight, NEEDS_WEIGHT), (bias, NEEDS_BIAS))
        loss, seq, logit_sum, *_ = linear_preference_pairs_op(
            hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), bias,
            None if ref_logps is None else ref_logps.to(acc), length, *settings, ignore_index, float(logit_scale),
            None if softcap is None else float(softcap), float(temperature), needs, per_chunk)
    else:   # the two passes: per-token log-probabilities (a custom op), the loss by autograd
        logp, logit_sum = linear_token_logprobs(hidden, weight, labels, bias, **transform)
        seq, _ = _sequence(logp, logit_sum, kept, averaged)
        logit_sum = logit_sum.sum(-1)
        per_pair = _pair_losses(seq[:pairs], seq[pairs:], None if ref_logps is None else ref_logps.to(seq.dtype),
                                *settings[:4])
        loss = per_pair.mean() if pairs else per_pair.sum()
        if weight_nll:
            loss = loss + weight_nll * (-logp[:pairs].sum() / count[:pairs].sum().clamp_min(1))
    del steps
    with torch.no_grad():
        chosen, rejected = seq[:pairs].detach(), seq[pairs:].detach()
        if ref_logps is not None:
            ref_logps = ref_logps.to(seq.dtype)
            chosen_ratio, rejected_ratio = chosen - ref_logps[:pairs], rejected - ref_logps[pairs:]
        else:
            chosen_ratio, rejected_ratio = chosen, rejected
        classes = weight.shape[0]
        chosen_logits_mean = logit_sum[:pairs].sum() / classes / count[:pairs].sum().clamp_min(1)
        rejected_logits_mean = logit_sum[pairs:].sum() / classes / count[pairs:].sum().clamp_min(1)
        return PreferenceOutput(loss, chosen, rejected, beta * chosen_ratio, beta * rejected_ratio,
                                chosen_logits_mean, rejected_logits_mean)


@torch.compiler.assume_constant_result
def _pairs_per_chunk(tokens: int, classes: int, length: int) -> int:
    """Whole pairs a chunk of ChunkedLinearHeuristics' size holds (0: a pair does not fit, the two
    passes). Read when the call is traced: torch.compile keeps the path of its first call's
    heuristics (the chunk size itself is read again in each call)."""
    return heuristic_rows(tokens, classes) // (2 * length)


def _pair_losses(chosen: Tensor, rejected: Tensor, ref_logps: Optional[Tensor], kind: str, beta: float, gamma: float,
                 label_smoothing: float) -> Tensor:
    """Each pair's loss (P,) from its sequence log-probabilities (the module docstring's table);
    ref_logps (2P,): the reference's, chosen then rejected, or None."""
    p = chosen.shape[0]
    if ref_logps is not None:
        chosen_ratio, rejected_ratio = chosen - ref_logps[:p], rejected - ref_logps[p:]
    if kind == "dpo":
        return _sigmoid_ls(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    if kind == "ipo":
        return (chosen_ratio - rejected_ratio - 1 / (2 * beta)) ** 2
    if kind == "simpo":
        return _sigmoid_ls(beta * (chosen - rejected) - gamma, label_smoothing)
    if kind == "cpo":
        return _sigmoid_ls(beta * (chosen - rejected), label_smoothing)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))   # orpo
    return -beta * F.logsigmoid(log_odds)


def _pair_gradients(chosen: Tensor, rejected: Tensor, ref_logps: Optional[Tensor], kind: str, beta: float,
                    gamma: float, label_smoothing: float) -> Tensor:
    """d _pair_losses / d (chosen, rejected), concatenated (2P,): written out, since a custom op's
    kernel runs below autograd (torch.autograd.grad cannot trace it there). With
    sigma_ls'(x) = -(1 - ls) sigmoid(-x) + ls sigmoid(x):
    dpo, simpo, cpo: +-beta sigma_ls'(x); ipo: +-2 (delta - 1 / (2 beta)); orpo:
    -beta sigmoid(-log_odds) times d log_odds / dc = 1 / (1 - e^c) (1 where the clamp holds c),
    d log_odds / dr = -1 / (1 - e^r) likewise."""
    p = chosen.shape[0]
    if kind == "ipo":
        delta = (chosen - ref_logps[:p]) - (rejected - ref_logps[p:])
        d = 2 * (delta - 1 / (2 * beta))
        return torch.cat([d, -d])
    if kind == "orpo":
        def dlog_odds(x):   # d (x - log(1 - e^x)) / dx on the clamped argument
            return torch.where(x < -1e-7, -1 / torch.expm1(x.clamp(max=-1e-7)), 1.0)
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        outer = -beta * torch.sigmoid(-log_odds)
        return torch.cat([outer * dlog_odds(chosen), -outer * dlog_odds(rejected)])
    if kind == "dpo":
        x = beta * ((chosen - ref_logps[:p]) - (rejected - ref_logps[p:]))
    elif kind == "simpo":
        x = beta * (chosen - rejected) - gamma
    else:   # cpo
        x = beta * (chosen - rejected)
    d = beta * (-(1 - label_smoothing) * torch.sigmoid(-x) + label_smoothing * torch.sigmoid(x))
    return torch.cat([d, -d])


# ----------------------------------------------------------------------------------------------
# Whole pairs a chunk: torch.ops.trainops.linear_preference_pairs (gradients in the forward)
# ----------------------------------------------------------------------------------------------

def _pairs_impl(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ref_logps: Optional[Tensor],
                length: int, kind: str, beta: float, gamma: float, label_smoothing: float, nll_weight: float,
                ignore_index: int, logit_scale: float, softcap: Optional[float], temperature: float, needs: int,
                pairs_per_chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, sequence logps (B,), summed logits of the kept tokens (B,), dhidden, dweight, dbias).

    hidden (B * T, H) with B = 2P rows of ``length`` T tokens, chosen then rejected. A chunk is
    ``pairs_per_chunk`` pairs: chosen rows i0..i1 and rejected rows P + i0..P + i1, gathered (one
    copy of 2 (i1 - i0) T hidden rows). Its sequences are whole, so its pairs' losses and their
    gradients d loss / d logp_seq (_pair_gradients) are known in the chunk:
    dz = dlogp (onehot - softmax(z)) / T with dlogp = d loss / d logp_seq (/ the row's count when
    averaged) plus the NLL's -nll_weight / (the chosen rows' kept tokens), then dX and dW: three
    matmuls, as the unfused formulation."""
    n = hidden.shape[0]
    rows_total = n // length
    pairs = rows_total // 2
    acc = accumulator(hidden.dtype)
    dev = hidden.device
    averaged = kind in _AVERAGED
    grad = needs & GRADIENTS != 0
    if needs & NEEDS_WEIGHT:
        needs |= weight_dtype_bit()
    kept = labels != ignore_index
    check_label_range(OP, labels, kept, weight.shape[0])
    count = kept.view(rows_total, length).sum(-1).to(acc)
    norm = 1 / count.clamp_min(1) if averaged else torch.ones_like(count)
    nll_scale = -nll_weight / count[:pairs].sum().clamp_min(1)
    seq = torch.empty(rows_total, dtype=acc, device=dev)
    logit_sum = torch.empty(rows_total, dtype=acc, device=dev)
    pair_sum = torch.zeros((), dtype=acc, device=dev)
    nll_sum = torch.zeros((), dtype=acc, device=dev)
    with torch.autocast(dev.type, enabled=False):
        head = ChunkedHead(hidden, weight, bias, logit_scale, softcap, needs)
        # the logits' buffer, once a call (the first chunk is the largest), reused by every chunk
        u_buffer = torch.empty(2 * min(pairs, pairs_per_chunk) * length, weight.shape[0], dtype=acc, device=dev)
        for i0 in range(0, pairs, pairs_per_chunk):
            i1 = min(pairs, i0 + pairs_per_chunk)
            m = i1 - i0
            parts = ((i0 * length, i1 * length), ((pairs + i0) * length, (pairs + i1) * length))
            xc = torch.cat([hidden[a:b] for a, b in parts])
            keep = torch.cat([kept[a:b] for a, b in parts])
            index = torch.where(keep, torch.cat([labels[a:b] for a, b in parts]), 0)
            row_index = torch.cat([torch.arange(i0, i1, device=dev), torch.arange(pairs + i0, pairs + i1, device=dev)])
            u = head.logits_of(xc, u_buffer[: 2 * m * length])
            keep_f = keep.to(acc)
            lse, tokens, token_sums = token_rows_forward(u, index, keep_f, temperature)
            logit_sum[row_index] = token_sums.view(2 * m, length).sum(-1)
            chunk_seq = tokens.view(2 * m, length).sum(-1) * norm[row_index]
            seq[row_index] = chunk_seq
            nll_sum += tokens[: m * length].sum()
            ref = None if ref_logps is None else torch.cat([ref_logps[i0:i1], ref_logps[pairs + i0:pairs + i1]])
            per_pair = _pair_losses(chunk_seq[:m], chunk_seq[m:], ref, kind, beta, gamma, label_smoothing)
            pair_sum += per_pair.sum()
            if grad:
                dseq = _pair_gradients(chunk_seq[:m], chunk_seq[m:], ref, kind, beta, gamma, label_smoothing)
                dlogp = (dseq * norm[row_index] / pairs).repeat_interleave(length)
                if nll_weight:
                    dlogp[: m * length] += nll_scale
                dlogits = token_rows_backward_(u, index, lse, dlogp * keep_f, temperature, head.gradient_buffer(u),
                                               head.chain)
                head.backward_of(xc, dlogits, parts)
                del dlogits
            del u, xc
        del u_buffer
        dx, dw, db = head.finish()
    loss = pair_sum / pairs
    if nll_weight:
        loss = loss + nll_scale * nll_sum
    empty = hidden.new_empty(0)
    return (loss, seq, logit_sum, empty if dx is None else dx, weight.new_empty(0) if dw is None else dw,
            empty if db is None else db)


def _pairs_fake(hidden, weight, labels, bias, ref_logps, length, kind, beta, gamma, label_smoothing, nll_weight,
                ignore_index, logit_scale, softcap, temperature, needs, pairs_per_chunk):
    acc = accumulator(hidden.dtype)
    rows = hidden.shape[0] // length
    return (hidden.new_empty((), dtype=acc), hidden.new_empty(rows, dtype=acc), hidden.new_empty(rows, dtype=acc),
            hidden.new_empty(hidden.shape if needs & NEEDS_HIDDEN else 0),
            weight.new_empty(weight.shape if needs & NEEDS_WEIGHT else 0),
            bias.new_empty(bias.shape) if bias is not None and needs & NEEDS_BIAS else hidden.new_empty(0))


def _pairs_save(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output[1:])
    save_scaled_gradients(ctx, inputs.needs, output[3:])


def _pairs_grad(ctx, dloss: Tensor, *unused) -> dict:
    return scaled_gradients(PAIRS_OP, ctx, dloss, ("hidden", "weight", "bias"))


linear_preference_pairs_op = custom_op(PAIRS_OP, _pairs_impl, _pairs_fake, backward=_pairs_grad, save=_pairs_save)


__all__ = ["KINDS", "PreferenceOutput", "check_settings", "linear_preference_loss", "linear_token_logprobs",
           "linear_token_logprobs_op"]
