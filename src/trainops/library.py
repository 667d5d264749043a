"""PyTorch integration: every trainops op as a ``torch.library`` custom op (namespace ``trainops``).

One pattern for every op: ``_define(name, impl, fake, backward, setup_context)`` registers the
schema (inferred from ``impl``'s annotations), the fake (meta) implementation used by
torch.compile, and the autograd formula. ``impl`` goes through a cached plan, so the registry
picks the kernel and a repeated problem pays no validation or heuristics again.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .ops import softmax as softmax_ops
from .plan import cached_plan


def _define(name: str, impl: Callable, fake: Callable, backward: Callable | None = None,
            setup_context: Callable | None = None):
    op = torch.library.custom_op(f"trainops::{name}", impl, mutates_args=())
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return op


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
