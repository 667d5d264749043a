"""Modules, drop-in for torch.nn's."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from . import functional as F


def _legacy_softmax_dim(name: str, ndim: int) -> int:
    # torch.nn's rule for dim=None, with torch's warning
    warnings.warn(f"Implicit dimension choice for {name} has been deprecated. "
                  "Change the call to include dim=X as an argument.", stacklevel=3)
    return 0 if ndim in (0, 1, 3) else 1


class Softmax(torch.nn.Module):
    """``trainops.functional.softmax`` along ``dim``; drop-in for ``torch.nn.Softmax``."""

    __constants__ = ["dim"]

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: Tensor) -> Tensor:
        dim = self.dim if self.dim is not None else _legacy_softmax_dim("softmax", input.dim())
        return F.softmax(input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(torch.nn.Module):
    """``trainops.functional.log_softmax`` along ``dim``; drop-in for ``torch.nn.LogSoftmax``."""

    __constants__ = ["dim"]

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: Tensor) -> Tensor:
        dim = self.dim if self.dim is not None else _legacy_softmax_dim("log_softmax", input.dim())
        return F.log_softmax(input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
