"""Gradient accumulation and zeroing over many tensors (ORT InPlaceAccumulator, ZeroGradient).

    accumulate   dst[i] += scale * src[i]   (float32 math; dst and src dtypes may differ, e.g. a
                                             float32 accumulation buffer fed bfloat16 gradients)
    zero         t[i] = 0

DTensors (FSDP2's sharded gradients) are taken as their local parts; an accumulated pair must be
laid out alike.

One launch per (device, dtype) bucket; see ops/multi_tensor.py. Deterministic (no atomics).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..dtensor import any_dtensor, is_dtensor, local
from ..errors import InvalidProblemError, argument_error
from .multi_tensor import MultiTensorLaunch, TableCache, bucket_by, multi_tensor_describer, prepared_launches
from ..plan import KernelChoice
from ..registry import FLOATS, register, register_op, triton_available
from .amp import TRITON_FLOATS

_TABLES = TableCache()  # tables of calls that bring none (entries check their tensors' addresses)

for _op in ("accumulate", "zero"):
    register_op(_op, multi_tensor_describer(_op))


def _dense_list(op: str, name: str, tensors) -> list:
    """The tensors, checked; a DTensor (FSDP2's sharded gradient) as its local part (trainops.dtensor)."""
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise argument_error(InvalidProblemError, op, f"{name}[{i}]", f"must be a torch.Tensor, got {type(t).__name__}")
        if t.is_sparse:
            raise argument_error(InvalidProblemError, op, f"{name}[{i}]", "is sparse; only dense tensors are supported")
    return tensors


def _locals(op: str, dst: list, src: list | None = None) -> tuple[list, list | None]:
    """Local parts of DTensors; a pair must be laid out alike (same mesh and placements) or both plain."""
    if not any_dtensor(dst) and (src is None or not any_dtensor(src)):
        return dst, src
    if src is not None:
        for i, (d, s) in enumerate(zip(dst, src)):
            if is_dtensor(d) != is_dtensor(s) or (is_dtensor(d) and (d.device_mesh, d.placements)
                                                  != (s.device_mesh, s.placements)):
                raise argument_error(InvalidProblemError, op, f"src[{i}]", f"must be laid out as dst[{i}] (both plain "
                                     "tensors, or DTensors of one mesh and placements)")
    return [local(t) for t in dst], None if src is None else [local(t) for t in src]


def accumulate_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], scale: float = 1.0, *,
                tables: TableCache | None = None) -> None:
    """``dst[i] += scale * src[i]`` for every i, in place (shapes and strides of each pair must match).
    Every (device, dtype) bucket is checked before any is written."""
    dst, src = _dense_list("accumulate", "dst", dst), _dense_list("accumulate", "src", src)
    if len(dst) != len(src):
        raise argument_error(InvalidProblemError, "accumulate", "src", f"has {len(src)} tensors; 'dst' has {len(dst)}")
    dst, src = _locals("accumulate", dst, src)
    buckets = [(device, dtype, dict(src_dtype=src_dtype), [[dst[i] for i in idx], [src[i] for i in idx]])
               for (device, dtype, src_dtype), idx in bucket_by(dst, [s.dtype for s in src]).items()]
    for launch, columns, prepared in prepared_launches("accumulate", ["dst", "src"], buckets, tables or _TABLES):
        launch.run(columns, float(scale), prepared)


def zero_(tensors: Sequence[torch.Tensor], *, tables: TableCache | None = None) -> None:
    """Set every element of every tensor to zero, in place (every bucket checked before any is written)."""
    tensors, _ = _locals("zero", _dense_list("zero", "tensors", tensors))
    buckets = [(device, dtype, {}, [[tensors[i] for i in idx]]) for (device, dtype), idx in bucket_by(tensors).items()]
    for launch, columns, prepared in prepared_launches("zero", ["tensors"], buckets, tables or _TABLES):
        launch.run(columns, prepared)


def _prepare_accumulate_cpu(problem) -> MultiTensorLaunch:
    def run(columns, scale, tables):
        for d, s in zip(*columns):
            d.add_(s.to(d.dtype) if s.dtype != d.dtype else s, alpha=scale)

    return MultiTensorLaunch(run, KernelChoice("accumulate_cpu", "cpu"), problem.dtype)


def _prepare_zero_cpu(problem) -> MultiTensorLaunch:
    def run(columns, tables):
        for t in columns[0]:
            t.zero_()

    return MultiTensorLaunch(run, KernelChoice("zero_cpu", "cpu"), problem.dtype)


register("accumulate", backend="cpu", dtypes=FLOATS, deterministic=True, accumulator="dst dtype",
         name="accumulate_cpu")(_prepare_accumulate_cpu)
register("zero", backend="cpu", dtypes=FLOATS, deterministic=True, accumulator="none (a fill)",
         name="zero_cpu")(_prepare_zero_cpu)

if triton_available():
    import triton
    import triton.language as tl

    from .multi_tensor import TL_DTYPES, block_of_program, column_pointer, load_block, store_block

    @triton.jit
    def _accumulate_block(dst, src, offsets, limit, scale, D_DTYPE: tl.constexpr, MASKED: tl.constexpr):
        total = load_block(dst, offsets, limit, MASKED).to(tl.float32) + \
            scale * load_block(src, offsets, limit, MASKED).to(tl.float32)
        store_block(dst, offsets, limit, total.to(D_DTYPE), MASKED)

    @triton.jit
    def _accumulate_blocks(addresses, n_tensors, block_tensor, first_block, numels, scale,
                           D_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        t, start, limit = block_of_program(block_tensor, first_block, numels, BLOCK)
        dst = column_pointer(addresses, n_tensors, 0, t, D_DTYPE, ALIGNED)
        src = column_pointer(addresses, n_tensors, 1, t, S_DTYPE, ALIGNED)
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= limit:
            _accumulate_block(dst, src, offsets, limit, scale, D_DTYPE, False)
        else:
            _accumulate_block(dst, src, offsets, limit, scale, D_DTYPE, True)

    @triton.jit
    def _zero_blocks(addresses, n_tensors, block_tensor, first_block, numels,
                     DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        t, start, limit = block_of_program(block_tensor, first_block, numels, BLOCK)
        pointer = column_pointer(addresses, n_tensors, 0, t, DTYPE, ALIGNED)
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= limit:
            store_block(pointer, offsets, limit, tl.zeros([BLOCK], dtype=DTYPE), False)
        else:
            store_block(pointer, offsets, limit, tl.zeros([BLOCK], dtype=DTYPE), True)

    def _prepare_accumulate_triton(problem) -> MultiTensorLaunch:
        d_dtype, s_dtype = TL_DTYPES[problem.dtype], TL_DTYPES[problem.option("src_dtype")]

        def run(columns, scale, t):
            if t.n_blocks:
                _accumulate_blocks[(t.n_blocks,)](t.addresses, t.n_tensors, t.block_tensor, t.first_block, t.numels,
                                                  scale, D_DTYPE=d_dtype, S_DTYPE=s_dtype, ALIGNED=t.aligned,
                                                  BLOCK=t.block, num_warps=problem.heuristics.warps)

        return MultiTensorLaunch(run, KernelChoice("accumulate_blocks", "triton", (("BLOCK", problem.heuristics.block), ("num_warps", problem.heuristics.warps))),
                      torch.float32)

    def _prepare_zero_triton(problem) -> MultiTensorLaunch:
        dtype = TL_DTYPES[problem.dtype]

        def run(columns, t):
            if t.n_blocks:
                _zero_blocks[(t.n_blocks,)](t.addresses, t.n_tensors, t.block_tensor, t.first_block, t.numels,
                                            DTYPE=dtype, ALIGNED=t.aligned, BLOCK=t.block, num_warps=problem.heuristics.warps)

        return MultiTensorLaunch(run, KernelChoice("zero_blocks", "triton", (("BLOCK", problem.heuristics.block), ("num_warps", problem.heuristics.warps))),
                      problem.dtype)

    register("accumulate", backend="triton", dtypes=TRITON_FLOATS, deterministic=True, accumulator="float32",
             name="accumulate_triton")(_prepare_accumulate_triton)
    register("zero", backend="triton", dtypes=TRITON_FLOATS, deterministic=True, accumulator="none (a fill)",
             name="zero_triton")(_prepare_zero_triton)
