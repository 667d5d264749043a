"""Under torch.compile: our kernel, or Inductor's fusion of the op's decomposition, per problem.

An op family may give its forward custom op a ``Decomposition`` (``library.custom_op(...,
decomposition=...)``): the same outputs written in torch ops, differentiable by autograd. While
torch.compile traces a call of that op on CUDA tensors, the op looks up ``CompiledChoices`` for
(op, dtype, size class) and, where the table says ``"inductor"``, traces the decomposition instead
of the custom op, so Inductor fuses it with what surrounds it (per-head q / k norms with the casts
and the rotary embedding around them: issue 39's compiled Qwen3 profile). Everywhere else (eager
mode, the CPU, a problem the table does not name) the op runs our kernels as before; under torch.compile those are launched by Inductor itself where the op is ``inline_triton``.

The choice is measured, not guessed, and made when the graph is traced, not timed then: the table
is ``python -m trainops bench --compiled-choice``'s output (``compiled_table.py``, generated), one
entry per (op, dtype, size class), ``"inductor"`` only where the compiled decomposition's forward +
backward was faster than the compiled op's by more than the bench's margin. Size classes are
powers of two (a size n falls in the class of the smallest power of two >= n); what a size is, is
the op's (normalizations: the elements of a row; the rotary embedding: the rotated features of a
head). A symbolic size (dynamic shapes) is compared with the classes in the traced code, so
dynamo guards on the answer. Under torch.export, or with a backend pinned (``trainops.backend``),
the op always stays whole.

What the bench measures, and so what the table knows: each op alone, forward + backward, on
static shapes of 32M elements, in its plain form (no residual, weight present); the choice is
applied to every call of that (op, dtype, size class), fused residual adds, forward-only calls and
small problems included. A decomposition runs no trainops kernel: ``track_kernels`` does not see
it, and the op's own checks (DTensor arguments, cos / sin that require grad) are not made there.

Tests and tuned deployments pass their own table through ``trainops.heuristics(CompiledChoices(
table=...))``; a compiled graph keeps the choice it was traced with (dynamo does not guard on the
table: ``torch._dynamo.reset()`` after changing it). ``python -m trainops kernels`` prints the table
in force; a plan's ``compiled`` property says what a compiled graph would run for its problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .errors import InvalidProblemError, argument_error
from .registry import dtype_name

BACKENDS = ("triton", "inductor")


def size_class(size: int) -> int:
    """The smallest power of two >= size (1 for sizes below 2)."""
    return 1 << max(0, int(size) - 1).bit_length()


def _default_table() -> dict:
    from .compiled_table import TABLE
    return dict(TABLE)


@dataclass(frozen=True, eq=False)
class CompiledChoices:
    """table: (device type, op, dtype name, size class) -> "triton" | "inductor". A key it does not
    hold means "triton" (our kernel). The default is the measured table (``compiled_table.py``).
    ``plan.compiled_backend`` reads the one in force."""

    table: Mapping[tuple[str, str, str, int], str] = field(default_factory=_default_table)

    def __post_init__(self):
        for key, backend in self.table.items():
            if (not isinstance(key, tuple) or len(key) != 4 or not all(isinstance(k, str) for k in key[:3])
                    or isinstance(key[3], bool) or not isinstance(key[3], int) or key[3] != size_class(key[3])):
                raise argument_error(InvalidProblemError, "compiled_choices", "table",
                                     f"has key {key!r}; expected (device type, op, dtype name, size class: a "
                                     "power of two)")
            if backend not in BACKENDS:
                raise argument_error(InvalidProblemError, "compiled_choices", "table",
                                     f"maps {key!r} to {backend!r}; expected one of {BACKENDS}")

    def backend(self, device_type: str, op: str, dtype: torch.dtype, size: int) -> str:
        return self.table.get((device_type, op, dtype_name(dtype), size_class(size)), "triton")

    def size_classes(self, device_type: str, op: str, dtype: torch.dtype) -> tuple[int, ...]:
        """The size classes the table hands to Inductor for (device type, op, dtype), ascending."""
        name = dtype_name(dtype)
        return tuple(sorted(c for (d, o, t, c), b in self.table.items()
                            if (d, o, t) == (device_type, op, name) and b == "inductor"))

    def rows(self) -> list[dict]:
        return [dict(device=d, op=o, dtype=t, size_class=s, backend=b)
                for (d, o, t, s), b in sorted(self.table.items())]


@dataclass(frozen=True)
class Decomposition:
    """An op's torch-ops formulation for Inductor: ``function`` takes the custom op's arguments and
    returns its outputs (differentiable by autograd); ``size(arguments)`` is the call's size (an int;
    None where the decomposition does not apply to the call: the op runs) and ``dtype(arguments)``
    its dtype, which with the op's name key CompiledChoices."""

    function: Callable
    size: Callable
    dtype: Callable


__all__ = ["CompiledChoices", "Decomposition", "size_class"]
