"""PyTorch integration: every trainops op as a ``torch.library`` custom op (namespace ``trainops``).

One pattern for every op: ``_define(name, impl, fake, backward, setup_context)`` registers the
schema (inferred from ``impl``'s annotations), the fake (meta) implementation used by
torch.compile, and the autograd formula. ``impl`` goes through a cached plan, so the registry
picks the kernel and a repeated problem pays no validation or heuristics again.

Calls in plain eager mode (plain tensors, no torch.compile, no functorch transform) skip the
dispatcher: the same ``impl``, ``setup_context`` and ``backward`` run through a
``torch.autograd.Function`` (or ``impl`` alone when no input needs a gradient). The custom op's
dispatch, schema and aliasing checks cost 100-250 us of host time a call on the H100 machine,
more than many of these kernels take (benchmarks/NOTES.md). Everything else goes through the op.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.overrides import has_torch_function

from .errors import UnsupportedError
from .multi_tensor import is_dense
from .ops import cross_entropy as ce_ops
from .ops import gather as gather_ops
from .ops import softmax as softmax_ops
from .plan import cached_plan


class TrainopsOp:
    """A trainops custom op (``.op``), called directly in plain eager mode (see the module docstring)."""

    def __init__(self, name: str, op, impl: Callable, backward: Callable | None, setup_context: Callable | None,
                 mutates_args: tuple[str, ...]):
        params = list(inspect.signature(impl).parameters.values())
        self.op, self._impl = op, impl
        self._defaults = tuple(p.default for p in params)
        self._required = sum(p.default is inspect.Parameter.empty for p in params)
        self._mutated = tuple(i for i, p in enumerate(params) if p.name in mutates_args)
        self._function = None
        if backward is not None:
            def forward(ctx, *args):
                output = impl(*args)
                setup_context(ctx, args, output)
                return output
            self._function = type(f"{name}_function", (torch.autograd.Function,),
                                  {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def __call__(self, *args, **kwargs):
        if (kwargs or len(args) < self._required or torch.compiler.is_compiling()
                or torch._C._are_functorch_transforms_active() or has_torch_function(args)
                or any(type(a) not in _PLAIN for a in args if isinstance(a, Tensor))):
            return self.op(*args, **kwargs)
        args += self._defaults[len(args):]
        if (self._function is not None and torch.is_grad_enabled()
                and any(a.requires_grad for a in args if isinstance(a, Tensor))):
            return self._function.apply(*args)
        output = self._impl(*args)
        for i in self._mutated:
            torch.autograd.graph.increment_version(args[i])
        return output


_PLAIN = (Tensor, torch.nn.Parameter)


def _define(name: str, impl: Callable, fake: Callable, backward: Callable | None = None,
            setup_context: Callable | None = None, mutates_args: tuple[str, ...] = ()) -> TrainopsOp:
    op = torch.library.custom_op(f"trainops::{name}", impl, mutates_args=mutates_args)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return TrainopsOp(name, op, impl, backward, setup_context, mutates_args)


def _run_softmax_family(op: str, tensors: tuple[Tensor, ...], dim: int, out_dtype) -> Tensor:
    key = (dim, out_dtype, *[(t.shape, t.stride(), t.dtype, t.device) for t in tensors])
    plan = cached_plan(op, key, lambda: softmax_ops.descriptor_from_tensors(op, tensors, dim, out_dtype))
    return plan.run_unchecked(tensors)


# ---- forward ops: y = softmax(x) / log_softmax(x); backward from the saved output y -----------

def _softmax_impl(x: Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    return _run_softmax_family("softmax", (x,), dim, dtype)


def _log_softmax_impl(x: Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    return _run_softmax_family("log_softmax", (x,), dim, dtype)


def _forward_fake(x: Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty_like(x, dtype=dtype or x.dtype)


def _save_output(ctx, inputs, output) -> None:
    x, dim, _ = inputs
    ctx.save_for_backward(output)
    ctx.dim, ctx.x_dtype = dim, x.dtype


def _softmax_grad(ctx, dy: Tensor):
    (y,) = ctx.saved_tensors
    return softmax_backward(dy, y, ctx.dim, ctx.x_dtype), None, None


def _log_softmax_grad(ctx, dy: Tensor):
    (y,) = ctx.saved_tensors
    return log_softmax_backward(dy, y, ctx.dim, ctx.x_dtype), None, None


# ---- backward ops: dx from (dy, y); their own gradients (double backward) in torch ops -------

def _softmax_backward_impl(dy: Tensor, y: Tensor, dim: int, input_dtype: Optional[torch.dtype] = None) -> Tensor:
    return _run_softmax_family("softmax_backward", (dy, y), dim, input_dtype)


def _log_softmax_backward_impl(dy: Tensor, y: Tensor, dim: int,
                               input_dtype: Optional[torch.dtype] = None) -> Tensor:
    return _run_softmax_family("log_softmax_backward", (dy, y), dim, input_dtype)


def _backward_fake(dy: Tensor, y: Tensor, dim: int, input_dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty_like(y, dtype=input_dtype or y.dtype)


def _save_backward_inputs(ctx, inputs, output) -> None:
    dy, y, dim, _ = inputs
    ctx.save_for_backward(dy, y)
    ctx.dim = dim


def _softmax_backward_grad(ctx, g: Tensor):
    # dx = y * (dy - sum(y*dy)):  d/d dy = softmax_backward(g, y);  d/dy = g*(dy - sum(y*dy)) - dy*sum(g*y)
    dy, y = ctx.saved_tensors
    g = g.to(y.dtype)
    grad_dy = softmax_backward(g, y, ctx.dim) if ctx.needs_input_grad[0] else None
    grad_y = None
    if ctx.needs_input_grad[1]:
        grad_y = g * (dy - (y * dy).sum(ctx.dim, keepdim=True)) - dy * (g * y).sum(ctx.dim, keepdim=True)
    return grad_dy, grad_y, None, None


def _log_softmax_backward_grad(ctx, g: Tensor):
    # dx = dy - exp(y) * sum(dy):  d/d dy = g - sum(g*exp(y));  d/dy = -g * exp(y) * sum(dy)
    dy, y = ctx.saved_tensors
    g = g.to(y.dtype)
    p = y.exp()
    grad_dy = g - (g * p).sum(ctx.dim, keepdim=True) if ctx.needs_input_grad[0] else None
    grad_y = -g * p * dy.sum(ctx.dim, keepdim=True) if ctx.needs_input_grad[1] else None
    return grad_dy, grad_y, None, None


softmax = _define("softmax", _softmax_impl, _forward_fake, _softmax_grad, _save_output)
log_softmax = _define("log_softmax", _log_softmax_impl, _forward_fake, _log_softmax_grad, _save_output)
softmax_backward = _define("softmax_backward", _softmax_backward_impl, _backward_fake,
                           _softmax_backward_grad, _save_backward_inputs)
log_softmax_backward = _define("log_softmax_backward", _log_softmax_backward_impl, _backward_fake,
                               _log_softmax_backward_grad, _save_backward_inputs)


# ---- gather family: gather / embedding forward, gather_backward (GatherGrad) -----------------

def _run_gather(x: Tensor, index: Tensor, dim: int, negative_indices: bool, check_index: bool) -> Tensor:
    if x.dim() and gather_ops.three_axis_strides(x.shape, x.stride(), dim % x.dim(), dim % x.dim() + 1) is None:
        x = x.contiguous()  # rare layouts whose dims around ``dim`` do not merge: one copy of x
    key = (x.shape, x.stride(), x.dtype, x.device, index.shape, index.dtype, index.device, dim,
           negative_indices, check_index)
    plan = cached_plan("gather", key, lambda: dict(
        x_shape=tuple(x.shape), x_strides=x.stride(), negative_indices=negative_indices, check_index=check_index,
        **gather_ops.gather_descriptor("gather", "x", x, index, dim)))
    return plan.run_unchecked((x, index))


def _gather_shape(x_shape: Sequence[int], index: Tensor, dim: int) -> list[int]:
    dim %= len(x_shape)
    return [*x_shape[:dim], *index.shape, *x_shape[dim + 1:]]


def _gather_impl(x: Tensor, index: Tensor, dim: int, negative_indices: bool = True,
                 check_index: bool = True) -> Tensor:
    return _run_gather(x, index, dim, negative_indices, check_index)


def _gather_fake(x: Tensor, index: Tensor, dim: int, negative_indices: bool = True,
                 check_index: bool = True) -> Tensor:
    return x.new_empty(_gather_shape(x.shape, index, dim))


def _save_gather(ctx, inputs, output) -> None:
    x, index, dim, negative_indices, _ = inputs
    ctx.save_for_backward(index)
    ctx.dim, ctx.input_shape, ctx.negative_indices = dim, list(x.shape), negative_indices


def _gather_grad(ctx, dy: Tensor):
    (index,) = ctx.saved_tensors
    dx = gather_backward(dy, index, ctx.dim, ctx.input_shape, True, None, False, ctx.negative_indices, False)
    return dx, None, None, None, None


def _gather_backward_impl(dy: Tensor, index: Tensor, dim: int, input_shape: Sequence[int],
                          deterministic: bool = True, padding_idx: Optional[int] = None,
                          scale_grad_by_freq: bool = False, negative_indices: bool = True,
                          check_index: bool = True) -> Tensor:
    input_shape, rank = tuple(input_shape), len(input_shape)
    if rank and -rank <= dim < rank and gather_ops.three_axis_strides(
            dy.shape, dy.stride(), dim % rank, dim % rank + index.dim()) is None:
        dy = dy.contiguous()  # rare layouts whose batch / index / inner dims do not merge: one copy of dy
    key = (dy.shape, dy.stride(), dy.dtype, dy.device, index.shape, index.dtype, index.device, dim, input_shape,
           deterministic, padding_idx, scale_grad_by_freq, negative_indices, check_index)
    plan = cached_plan("gather_backward", key, lambda: dict(
        input_shape=input_shape, dy_shape=tuple(dy.shape), dy_strides=dy.stride(), deterministic=deterministic,
        padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq, negative_indices=negative_indices, check_index=check_index,
        **gather_ops.gather_descriptor("gather_backward", "dy", dy, index, dim)))
    return plan.run_unchecked((dy, index))


def _gather_backward_fake(dy: Tensor, index: Tensor, dim: int, input_shape: Sequence[int],
                          deterministic: bool = True, padding_idx: Optional[int] = None,
                          scale_grad_by_freq: bool = False, negative_indices: bool = True,
                          check_index: bool = True) -> Tensor:
    return dy.new_empty(input_shape)


def _save_gather_backward(ctx, inputs, output) -> None:
    _, index, dim, input_shape, _, padding_idx, scale_grad_by_freq, negative_indices, _ = inputs
    ctx.save_for_backward(index)
    ctx.dim, ctx.size = dim, input_shape[dim]
    ctx.padding_idx, ctx.scale_grad_by_freq, ctx.negative_indices = padding_idx, scale_grad_by_freq, negative_indices


def _gather_backward_grad(ctx, g: Tensor):
    # dx[s] = f(s) * sum_{index[n] = s} dy[n]  =>  d/d dy[n] = f(index[n]) * g[index[n]]
    (index,) = ctx.saved_tensors
    dim = ctx.dim % g.dim()
    if ctx.padding_idx is not None or ctx.scale_grad_by_freq:
        rows = index.reshape(-1).long()
        rows = torch.where(rows < 0, rows + ctx.size, rows)
        factor = torch.ones(ctx.size, dtype=g.dtype, device=g.device)
        if ctx.scale_grad_by_freq:
            counts = torch.zeros(ctx.size, dtype=g.dtype, device=g.device)
            counts.index_add_(0, rows.clamp(0, ctx.size - 1), ((rows >= 0) & (rows < ctx.size)).to(g.dtype))
            factor = factor / counts.clamp(min=1)
        if ctx.padding_idx is not None:
            factor[ctx.padding_idx % ctx.size] = 0
        g = g * factor.view([-1 if d == dim else 1 for d in range(g.dim())])
    return gather(g, index, ctx.dim, ctx.negative_indices, False), None, None, None, None, None, None, None, None


def _embedding_impl(index: Tensor, weight: Tensor, padding_idx: Optional[int] = None,
                    scale_grad_by_freq: bool = False, check_index: bool = True) -> Tensor:
    return _run_gather(weight, index, 0, False, check_index)


def _embedding_fake(index: Tensor, weight: Tensor, padding_idx: Optional[int] = None,
                    scale_grad_by_freq: bool = False, check_index: bool = True) -> Tensor:
    return weight.new_empty([*index.shape, *weight.shape[1:]])


def _save_embedding(ctx, inputs, output) -> None:
    index, weight, padding_idx, scale_grad_by_freq, _ = inputs
    ctx.save_for_backward(index)
    ctx.weight_shape, ctx.padding_idx, ctx.scale_grad_by_freq = list(weight.shape), padding_idx, scale_grad_by_freq


def _embedding_grad(ctx, dy: Tensor):
    (index,) = ctx.saved_tensors
    dw = gather_backward(dy, index, 0, ctx.weight_shape, True, ctx.padding_idx, ctx.scale_grad_by_freq, False, False)
    return None, dw, None, None, None


gather = _define("gather", _gather_impl, _gather_fake, _gather_grad, _save_gather)
gather_backward = _define("gather_backward", _gather_backward_impl, _gather_backward_fake,
                          _gather_backward_grad, _save_gather_backward)
embedding = _define("embedding", _embedding_impl, _embedding_fake, _embedding_grad, _save_embedding)


# ---- cross-entropy: loss and gradient in one pass; the backward scales the saved gradient ----

def _cross_entropy_impl(logits: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int,
                        reduction: str, label_smoothing: float, z_loss: float, loss_dtype: Optional[torch.dtype],
                        compute_grad: bool, check_target: bool,
                        deferred_check: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, loss_dtype,
                              compute_grad, check_target, False)


def _run_cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, loss_dtype,
                       compute_grad, check_target, grad_into_input):
    if ce_ops.row_strides(logits.shape, logits.stride()) is None:  # rare layouts whose d1..dk do not merge
        if grad_into_input:
            raise UnsupportedError("trainops.cross_entropy: inplace_backward needs logits whose d1..dk merge")
        logits = logits.contiguous()  # one copy
    if target.is_floating_point():
        target = target if ce_ops.row_strides(target.shape, target.stride()) is not None else target.contiguous()
    else:
        target = target.contiguous()
    tensors = (logits, target) if weight is None else (logits, target, weight)
    key = (*[(t.shape, t.stride(), t.dtype, t.device) for t in tensors], ignore_index, reduction, label_smoothing,
           z_loss, loss_dtype, compute_grad, check_target, grad_into_input)
    plan = cached_plan("cross_entropy", key, lambda: ce_ops.descriptor_from_tensors(
        logits, target, weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        z_loss=z_loss, loss_dtype=loss_dtype, compute_grad=compute_grad, check_target=check_target,
        grad_into_input=grad_into_input))
    return plan.run_unchecked(tensors)


def _cross_entropy_fake(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, loss_dtype,
                        compute_grad, check_target, deferred_check):
    batch = [] if logits.dim() == 1 else [logits.shape[0], *logits.shape[2:]]
    loss = logits.new_empty(batch if reduction == "none" else [], dtype=loss_dtype or logits.dtype)
    lse = logits.new_empty(batch, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    grad = logits.new_empty(list(logits.shape) if compute_grad else [0])
    return loss, lse, grad, logits.new_empty([2], dtype=torch.int32)


def _save_cross_entropy(ctx, inputs, output) -> None:
    logits, *_, reduction, _, _, _, compute_grad, _, deferred_check = inputs
    ctx.reduction, ctx.ndim, ctx.deferred_check = reduction, logits.dim(), deferred_check
    ctx.compute_grad = compute_grad
    ctx.save_for_backward(output[2], output[3])
    ctx.consumed = False
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero-filled logits-sized gradient for the unused grad output


_NO_GRADS = (None,) * 10


def _cross_entropy_grad(ctx, dloss: Tensor, dlse, dgrad, dbad):
    if dloss is None:
        return None, *_NO_GRADS
    return scale_fused_gradient(ctx, dloss, in_place=False), *_NO_GRADS


# Bad-target flags of eager CUDA calls, copied to pinned memory without waiting: (flag, copy done);
# checked pairs are reused (an event costs ~10 us to create).
_PENDING_TARGET_FLAGS: list[tuple[Tensor, torch.cuda.Event]] = []
_FREE_TARGET_FLAGS: list[tuple[Tensor, torch.cuda.Event]] = []
_BAD_TARGET_MESSAGE = ("trainops.cross_entropy: argument 'target' holds a class index out of range [0, C) that is not "
                       "ignore_index (found by the fused kernel{}; such rows were left out of the loss)")


def note_target_flag(flags: Tensor) -> None:
    """Remember a CUDA call's bad-target flag (flags[0]) for a later check that does not wait for the GPU."""
    if flags.device.type == "cuda":
        if _FREE_TARGET_FLAGS:
            host, done = _FREE_TARGET_FLAGS.pop()
        else:
            host, done = torch.empty(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event()
        host.copy_(flags[:1], non_blocking=True)
        done.record()
        _PENDING_TARGET_FLAGS.append((host, done))


def raise_flagged_targets() -> None:
    """Raise IndexOutOfRangeError for the first remembered flag that the GPU has set by now (never waits)."""
    while _PENDING_TARGET_FLAGS and _PENDING_TARGET_FLAGS[0][1].query():
        entry = _PENDING_TARGET_FLAGS.pop(0)
        _FREE_TARGET_FLAGS.append(entry)
        if entry[0][0]:
            raise ce_ops.IndexOutOfRangeError(_BAD_TARGET_MESSAGE.format(" of a call on the GPU, reported once the "
                                                                         "GPU had run it"))


def scale_fused_gradient(ctx, dloss: Tensor, in_place: bool) -> Tensor:
    """dloss/dlogits from the gradient the forward kernel wrote for an upstream gradient of 2^k,
    saved with its flags [bad target, k] as ``ctx.saved_tensors`` (k = 0 but for float16 logits:
    ops/cross_entropy.py gradient_exponent).

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
                raise ce_ops.IndexOutOfRangeError(_BAD_TARGET_MESSAGE.format(""))
        else:
            raise_flagged_targets()
    if not tracing and grad.dtype != torch.float64:
        ctx.consumed = True  # the buffer is handed over
        if dloss.numel() == 1 and is_dense(grad):
            ce_ops.scale_gradient_(grad, dloss, flags)
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
                                loss_dtype: Optional[torch.dtype], check_target: bool) -> tuple[Tensor, Tensor, Tensor]:
    loss, lse, _, flags = _run_cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing,
                                             z_loss, loss_dtype, True, check_target, True)
    return loss, lse, flags


def _cross_entropy_inplace_fake(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                loss_dtype, check_target):
    loss, lse, _, flags = _cross_entropy_fake(logits, target, weight, ignore_index, reduction, label_smoothing,
                                              z_loss, loss_dtype, False, check_target, False)
    return loss, lse, flags


# The gradient written over the logits (no autograd of its own: functional.py wraps it).
cross_entropy_inplace = _define("cross_entropy_inplace", _cross_entropy_inplace_impl, _cross_entropy_inplace_fake,
                                mutates_args=("logits",))


cross_entropy = _define("cross_entropy", _cross_entropy_impl, _cross_entropy_fake, _cross_entropy_grad,
                        _save_cross_entropy)
