"""Strided layouts of one-axis reductions, seen without copies.

A reduction along ``dim`` of tensors that share a shape (each with its own strides) is viewed as

    element(o0, o1, i, n) at  base + o0*s_o0 + o1*s_o1 + i*s_i + n*s_n      (per operand)

with ``n`` the reduced axis, ``i`` the batch dim of smallest stride in the reference operand
(the one a kernel tiles across: contiguous for a non-last-axis reduction), and ``o0, o1`` the
rest. Batch dims that are contiguous with each other in every operand are merged first, so
every dense layout of any rank needs at most three batch dims. Rarer layouts (four or more
unmergeable batch dims) keep the extra leading dims on the host: one launch per index, with
``base`` offsets given in ``host_bases``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ReductionLayout:
    n: int
    outer0: int
    outer1: int
    inner: int
    stride_n: tuple[int, ...]        # one entry per operand
    stride_outer0: tuple[int, ...]
    stride_outer1: tuple[int, ...]
    stride_inner: tuple[int, ...]
    host_bases: tuple[tuple[int, ...], ...]  # per host launch, one base element offset per operand

    @property
    def rows(self) -> int:
        return self.outer0 * self.outer1 * self.inner


def reduction_layout(shape: Sequence[int], dim: int, strides: Sequence[Sequence[int]],
                     reference: int = -1) -> ReductionLayout:
    """Merge and order the batch dims of ``shape`` (all but ``dim``) jointly for every operand.

    ``strides[k]`` are operand k's strides; dims are ordered by the strides of operand
    ``reference`` (the output, which is always dense), largest first.
    """
    count = len(strides)
    zero = (0,) * count
    batch = [(shape[d], tuple(s[d] for s in strides)) for d in range(len(shape)) if d != dim and shape[d] != 1]
    batch.sort(key=lambda b: -b[1][reference])
    merged: list[tuple[int, tuple[int, ...]]] = []
    for size, st in batch:
        if merged and all(ps == bs * size for ps, bs in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * size, st)
        else:
            merged.append((size, st))
    merged = [(1, zero)] * max(0, 3 - len(merged)) + merged
    host, (o0, s_o0), (o1, s_o1), (inner, s_i) = merged[:-3], merged[-3], merged[-2], merged[-1]
    host_bases = tuple(
        tuple(sum(idx * st[k] for idx, (_, st) in zip(index, host)) for k in range(count))
        for index in itertools.product(*(range(size) for size, _ in host))
    )
    n = shape[dim] if shape else 1
    s_n = tuple(s[dim] if shape else 0 for s in strides)
    return ReductionLayout(n, o0, o1, inner, s_n, s_o0, s_o1, s_i, host_bases)



def merge_dims(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int] | None:
    """(size, stride) of a group of dims walked as one axis, or None when they do not merge."""
    if 0 in shape:
        return 0, 0  # nothing to walk
    size, stride = 1, 0
    for s, st in reversed([(s, st) for s, st in zip(shape, strides) if s != 1]):
        if size == 1:
            size, stride = s, st
        elif st == stride * size:
            size *= s
        else:
            return None
    return size, stride


def next_pow2(v: int) -> int:
    """The smallest power of two >= v (1 for v <= 1): Triton block sizes."""
    return 1 << max(0, int(v) - 1).bit_length()


# Elements of a row (per tensor, by element size in bytes) one program keeps in registers: a fused
# plan up to here, shared by the softmax family and cross-entropy. Measured on the H100
# (benchmarks/NOTES.md): 32768 fp32 or bf16 elements fused beat streaming by 30-40%, forward and
# backward; whole 128K-256K rows in registers spill (7x slower).
REGISTER_TILE = {1: 32768, 2: 32768, 4: 32768, 8: 16384}
