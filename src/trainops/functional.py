"""User-facing functions, with torch.nn.functional's signatures.

Each calls its ``torch.ops.trainops`` custom op (library.py): autograd, torch.compile and the
kernel registry come with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import library
from .errors import InvalidProblemError, argument_error


def _check(op: str, name: str, t, dim) -> None:
    if not isinstance(t, Tensor):
        raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise argument_error(InvalidProblemError, op, "dim", f"must be an int, got {dim!r}")


def softmax(x: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """y = exp(x - max x) / sum exp(x - max x) along ``dim``, as ``torch.softmax(x, dim, dtype)``.

    x: any shape (rank 0..8) and strides; float32/float16/bfloat16/float64. ``dtype`` casts x first
    and is the output's dtype. Accumulates in float32 (float64 for float64). Deterministic,
    bit-identical run to run. Backward: ``softmax_backward``. Errors: InvalidProblemError for a
    bad ``dim``; UnsupportedError for other dtypes or ranks.
    """
    _check("softmax", "x", x, dim)
    return library.softmax(x, dim, dtype)


def log_softmax(x: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """y = (x - max x) - log sum exp(x - max x) along ``dim``, as ``torch.log_softmax(x, dim, dtype)``.

    Shapes, dtypes and guarantees as ``softmax``. Backward: ``log_softmax_backward``.
    """
    _check("log_softmax", "x", x, dim)
    return library.log_softmax(x, dim, dtype)


def softmax_backward(dy: Tensor, y: Tensor, dim: int, input_dtype: torch.dtype | None = None) -> Tensor:
    """dx = y * (dy - sum(y * dy)) along ``dim``, from the saved softmax output ``y``.

    dy and y: the same shape and dtype, any strides. ``input_dtype``: dtype of dx (default y's),
    as in torch's ``_softmax_backward_data``. Accumulates in float32 (float64 for float64).
    """
    _check("softmax_backward", "dy", dy, dim)
    _check("softmax_backward", "y", y, dim)
    return library.softmax_backward(dy, y, dim, input_dtype)


def log_softmax_backward(dy: Tensor, y: Tensor, dim: int, input_dtype: torch.dtype | None = None) -> Tensor:
    """dx = dy - exp(y) * sum(dy) along ``dim``, from the saved log-softmax output ``y``.

    As ``softmax_backward``; the sum reads only dy.
    """
    _check("log_softmax_backward", "dy", dy, dim)
    _check("log_softmax_backward", "y", y, dim)
    return library.log_softmax_backward(dy, y, dim, input_dtype)
