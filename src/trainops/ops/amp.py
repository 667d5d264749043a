"""Mixed-precision and gradient-norm kernels (ORT IsAllFinite, MixedPrecisionScale, global norm).

    all_finite    found_inf = 1 if any element of any tensor is inf or NaN (read only)
    unscale       t *= inv_scale for every tensor, and found_inf as above (from the values read)
    update_scale  the dynamic loss-scale update of torch.amp.GradScaler (backoff, growth, tracker)
    grad_stats    over all gradients g (times 1/grad_scale when given) in one read:
                      found_inf |= any non-finite g,  norm = ||g||_2 (over every tensor),
                      clip = min(1, max_norm / (norm + 1e-6))          (torch's clip_grad_norm_)

``found_inf`` is a float32 one-element tensor; the kernels only ever set it to 1 (an OR across
calls, as torch's ``_amp_foreach_non_finite_check_and_unscale_``). Nothing here synchronises with
the host. The norm is summed in float32 per block, then the per-block partials in a fixed order
(chunks in parallel, then the chunk sums)
(deterministic, bit-identical run to run); the CPU path computes it as torch's clip_grad_norm_
does (norm of the per-tensor norms), so CPU results match torch bit for bit.

Triton kernels run one program per block of a multi-tensor table (see ops/multi_tensor.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import InvalidProblemError, argument_error
from .multi_tensor import (MultiTensorLaunch, MultiTensorProblem, TableCache, bucket_by, check_columns, check_scalar,
                            multi_tensor_describer, multi_tensor_launch, prepared_launches)
from ..plan import KernelChoice
from ..registry import FLOATS, register, register_op, triton_available

# Triton kernels are registered for the dtypes training keeps gradients in; float64 runs on the CPU path.
TRITON_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
_TABLES = TableCache()  # tables of calls that bring none (entries check their tensors' addresses)
_ACC = "float32 (float64 for float64)"

for _op in ("all_finite", "unscale", "update_scale", "grad_stats"):
    register_op(_op, multi_tensor_describer(_op))


# torch's clip_grad_norm_ epsilon: clip = min(1, max_norm / (norm + CLIP_EPS))
CLIP_EPS = 1e-6


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + CLIP_EPS)), torch's clip_grad_norm_ factor, on the device (no sync);
    the Triton kernel of grad_stats computes the same in float32."""
    return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)


@dataclass
class GradStats:
    """What ``grad_stats`` computed, as device tensors (no host synchronisation)."""

    found_inf: torch.Tensor          # float32 (), 1.0 if any gradient is inf/NaN
    norm: torch.Tensor               # float32 (), global L2 norm of the (unscaled) gradients
    clip: torch.Tensor | None        # float32 (), min(1, max_norm / (norm + 1e-6)); None without max_norm


def _single_device(op: str, name: str, tensors: Sequence[torch.Tensor]) -> torch.device:
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device:
            raise argument_error(InvalidProblemError, op, f"{name}[{i}]", f"is on {t.device}; {name}[0] is on {device}")
        if t.is_sparse:
            raise argument_error(InvalidProblemError, op, f"{name}[{i}]", "is sparse; only dense tensors are supported")
    return device


def all_finite(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, *, tables: TableCache | None = None) -> None:
    """Set ``found_inf`` (float32, one element) to 1 if any element of ``tensors`` is inf or NaN. Read only."""
    if not tensors:
        return
    device = _single_device("all_finite", "tensors", tensors)
    check_scalar("all_finite", "found_inf", found_inf, device)
    buckets = [(dev, dtype, {}, [[tensors[i] for i in idx]]) for (dev, dtype), idx in bucket_by(tensors).items()]
    for launch, columns, prepared in prepared_launches("all_finite", ["tensors"], buckets, tables or _TABLES):
        launch.run(columns, found_inf, prepared)


def unscale_(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor, *,
             tables: TableCache | None = None) -> None:
    """``t *= inv_scale`` in place for each tensor, and ``found_inf = 1`` if any value read was inf/NaN
    (every (device, dtype) bucket checked before any is written)."""
    if not tensors:
        return
    device = _single_device("unscale", "tensors", tensors)
    check_scalar("unscale", "inv_scale", inv_scale, device)
    check_scalar("unscale", "found_inf", found_inf, device)
    buckets = [(dev, dtype, {}, [[tensors[i] for i in idx]]) for (dev, dtype), idx in bucket_by(tensors).items()]
    for launch, columns, prepared in prepared_launches("unscale", ["tensors"], buckets, tables or _TABLES):
        launch.run(columns, inv_scale, found_inf, prepared)


def update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor, growth_factor: float,
                  backoff_factor: float, growth_interval: int) -> None:
    """torch.amp.GradScaler's scale update, in place, on the device (ORT MixedPrecisionScale's role).

    found_inf:  scale *= backoff_factor, growth_tracker = 0.
    otherwise:  growth_tracker += 1; on reaching growth_interval, scale *= growth_factor (if the
                result is finite) and growth_tracker = 0.
    """
    device = scale.device
    check_scalar("update_scale", "scale", scale, device)
    check_scalar("update_scale", "found_inf", found_inf, device)
    if growth_tracker.numel() != 1 or growth_tracker.dtype != torch.int32 or growth_tracker.device != device:
        raise argument_error(InvalidProblemError, "update_scale", "growth_tracker",
                             f"must be a one-element int32 tensor on {device}")
    multi_tensor_launch("update_scale", device, torch.float32).run(scale, growth_tracker, found_inf, float(growth_factor),
                                                       float(backoff_factor), int(growth_interval))


def grad_stats(grads: Sequence[torch.Tensor], *, grad_scale: torch.Tensor | None = None,
               found_inf: torch.Tensor | None = None, max_norm: float | None = None,
               tables: TableCache | None = None) -> GradStats:
    """One read of every gradient: non-finite flag, global L2 norm and clip coefficient (see module doc).

    ``grad_scale`` (the loss scale S) makes the norm that of g / S. ``found_inf`` is OR-ed into
    (created if None). All gradients must be on one device.
    """
    if not grads:
        raise argument_error(InvalidProblemError, "grad_stats", "grads", "is empty")
    device = _single_device("grad_stats", "grads", grads)
    if found_inf is None:
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
    check_scalar("grad_stats", "found_inf", found_inf, device)
    if grad_scale is not None:
        check_scalar("grad_stats", "grad_scale", grad_scale, device)
    if max_norm is not None and not max_norm > 0:
        raise argument_error(InvalidProblemError, "grad_stats", "max_norm", f"is {max_norm}; it must be positive")
    tables = tables or _TABLES
    buckets = bucket_by(grads)
    lead_dtype = torch.float64 if any(dtype == torch.float64 for _, dtype in buckets) else next(iter(buckets))[1]
    launch = multi_tensor_launch("grad_stats", device, lead_dtype)
    norm = torch.empty((), dtype=torch.float32, device=device)
    clip = None if max_norm is None else torch.empty((), dtype=torch.float32, device=device)
    columns = {dtype: [grads[i] for i in idx] for (_, dtype), idx in buckets.items()}
    launch.run(columns, grad_scale, found_inf, norm, clip, max_norm, tables)
    return GradStats(found_inf, norm, clip)


# ----------------------------------------------------------------------------------------------
# CPU path
# ----------------------------------------------------------------------------------------------

def _any_nonfinite(tensors) -> bool:
    return any(not bool(torch.isfinite(t).all()) for t in tensors)


def _prepare_all_finite_cpu(problem: MultiTensorProblem) -> MultiTensorLaunch:
    def run(columns, found_inf, tables):
        if _any_nonfinite(columns[0]):
            found_inf.fill_(1.0)

    return MultiTensorLaunch(run, KernelChoice("all_finite_cpu", "cpu"), torch.float32)


def _prepare_unscale_cpu(problem: MultiTensorProblem) -> MultiTensorLaunch:
    def run(columns, inv_scale, found_inf, tables):
        if _any_nonfinite(columns[0]):
            found_inf.fill_(1.0)
        for t in columns[0]:
            t.mul_(inv_scale)

    return MultiTensorLaunch(run, KernelChoice("unscale_cpu", "cpu"), torch.float32)


def _prepare_update_scale_cpu(problem: MultiTensorProblem) -> MultiTensorLaunch:
    def run(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
        if found_inf.item():
            scale.mul_(backoff_factor)
            growth_tracker.zero_()
            return
        successful = int(growth_tracker.item()) + 1
        if successful == growth_interval:
            grown = scale * growth_factor
            if bool(torch.isfinite(grown)):
                scale.copy_(grown)
            growth_tracker.zero_()
        else:
            growth_tracker.fill_(successful)

    return MultiTensorLaunch(run, KernelChoice("update_scale_cpu", "cpu"), torch.float32)


def unscaled_grads_cpu(grads, grad_scale):
    """g * (1 / S) as torch.amp.GradScaler.unscale_ computes it (reciprocal in float64, then float32)."""
    if grad_scale is None:
        return list(grads)
    inv_scale = grad_scale.double().reciprocal().float()
    return [g * inv_scale for g in grads]


def _prepare_grad_stats_cpu(problem: MultiTensorProblem) -> MultiTensorLaunch:
    def run(columns, grad_scale, found_inf, norm, clip, max_norm, tables):
        grads = unscaled_grads_cpu([g for column in columns.values() for g in column], grad_scale)
        if _any_nonfinite(grads):
            found_inf.fill_(1.0)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
        norm.copy_(total)
        if clip is not None:
            clip.copy_(clip_coefficient(total, max_norm))

    return MultiTensorLaunch(run, KernelChoice("grad_stats_cpu", "cpu"), torch.float32)


register("all_finite", backend="cpu", dtypes=FLOATS, deterministic=True, accumulator="none (a flag)",
         name="all_finite_cpu")(_prepare_all_finite_cpu)
register("unscale", backend="cpu", dtypes=FLOATS, deterministic=True, accumulator="none (elementwise)",
         name="unscale_cpu")(_prepare_unscale_cpu)
register("update_scale", backend="cpu", dtypes=(torch.float32,), deterministic=True, accumulator="none (scalar)",
         name="update_scale_cpu")(_prepare_update_scale_cpu)
register("grad_stats", backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=_ACC,
         name="grad_stats_cpu")(_prepare_grad_stats_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from .multi_tensor import TL_DTYPES, block_of_program, column_pointer, load_block, store_block

    _CLIP_EPS = tl.constexpr(CLIP_EPS)

    def _block_params(problem: MultiTensorProblem) -> tuple:
        return (("BLOCK", problem.heuristics.block), ("num_warps", problem.heuristics.warps))

    @triton.jit
    def _nonfinite(x):
        """1 where x is inf or NaN (x - x is NaN exactly there), else 0."""
        return ((x - x) != 0).to(tl.int32)

    @triton.jit
    def _all_finite_block(x_ptr, offsets, limit, found_inf_ptr, MASKED: tl.constexpr):
        """found_inf = 1 if the block holds a non-finite value (every writer stores the same 1: no race)."""
        bad = tl.sum(_nonfinite(load_block(x_ptr, offsets, limit, MASKED).to(tl.float32)), axis=0)
        tl.store(found_inf_ptr, 1.0, mask=bad > 0)

    @triton.jit
    def _all_finite_blocks(addresses, n_tensors, block_tensor, first_block, numels, found_inf_ptr,
                           DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        t, start, limit = block_of_program(block_tensor, first_block, numels, BLOCK)
        x_ptr = column_pointer(addresses, n_tensors, 0, t, DTYPE, ALIGNED)
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= limit:
            _all_finite_block(x_ptr, offsets, limit, found_inf_ptr, False)
        else:
            _all_finite_block(x_ptr, offsets, limit, found_inf_ptr, True)

    @triton.jit
    def _unscale_block(x_ptr, offsets, limit, inv_scale, found_inf_ptr, DTYPE: tl.constexpr, MASKED: tl.constexpr):
        x = load_block(x_ptr, offsets, limit, MASKED).to(tl.float32)
        bad = tl.sum(_nonfinite(x), axis=0)
        tl.store(found_inf_ptr, 1.0, mask=bad > 0)
        store_block(x_ptr, offsets, limit, (x * inv_scale).to(DTYPE), MASKED)

    @triton.jit
    def _unscale_blocks(addresses, n_tensors, block_tensor, first_block, numels, inv_scale_ptr, found_inf_ptr,
                        DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        """x *= inv_scale in place (float32 math) and found_inf = 1 where a value read was non-finite."""
        t, start, limit = block_of_program(block_tensor, first_block, numels, BLOCK)
        x_ptr = column_pointer(addresses, n_tensors, 0, t, DTYPE, ALIGNED)
        offsets = start + tl.arange(0, BLOCK)
        inv_scale = tl.load(inv_scale_ptr)
        if start + BLOCK <= limit:
            _unscale_block(x_ptr, offsets, limit, inv_scale, found_inf_ptr, DTYPE, False)
        else:
            _unscale_block(x_ptr, offsets, limit, inv_scale, found_inf_ptr, DTYPE, True)

    @triton.jit
    def _update_scale(scale_ptr, tracker_ptr, found_inf_ptr, growth_factor, backoff_factor, growth_interval):
        """One program: torch's _amp_update_scale_ (see update_scale_)."""
        scale = tl.load(scale_ptr)
        tracker = tl.load(tracker_ptr)
        found = tl.load(found_inf_ptr) != 0
        successful = tracker + 1
        grown = scale * growth_factor
        grow = successful == growth_interval
        grown_scale = tl.where((grown - grown) == 0, grown, scale)
        new_scale = tl.where(found, scale * backoff_factor, tl.where(grow, grown_scale, scale))
        new_tracker = tl.where(found | grow, 0, successful)
        tl.store(scale_ptr, new_scale)
        tl.store(tracker_ptr, new_tracker)

    @triton.jit
    def _grad_stats_block(g_ptr, offsets, limit, squares, nonfinite, inv_scale, HAS_SCALE: tl.constexpr,
                          MASKED: tl.constexpr):
        g = load_block(g_ptr, offsets, limit, MASKED).to(tl.float32)
        if HAS_SCALE:
            g = g * inv_scale
        pid = tl.program_id(0)
        tl.store(squares + pid, tl.sum(g * g, axis=0))
        tl.store(nonfinite + pid, tl.sum(_nonfinite(g), axis=0).to(tl.float32))

    @triton.jit
    def _grad_stats_blocks(addresses, n_tensors, block_tensor, first_block, numels, squares, nonfinite,
                           grad_scale_ptr, DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr,
                           BLOCK: tl.constexpr):
        """squares[block] = sum((g / S)^2) over the block, nonfinite[block] = its count of inf/NaN."""
        t, start, limit = block_of_program(block_tensor, first_block, numels, BLOCK)
        g_ptr = column_pointer(addresses, n_tensors, 0, t, DTYPE, ALIGNED)
        offsets = start + tl.arange(0, BLOCK)
        inv_scale = 1.0
        if HAS_SCALE:
            inv_scale = 1.0 / tl.load(grad_scale_ptr)
        if start + BLOCK <= limit:
            _grad_stats_block(g_ptr, offsets, limit, squares, nonfinite, inv_scale, HAS_SCALE, False)
        else:
            _grad_stats_block(g_ptr, offsets, limit, squares, nonfinite, inv_scale, HAS_SCALE, True)

    @triton.jit
    def _sum_partials(partials, n, sums, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program j of row r: sums[r, j] = sum(partials[r, j * CHUNK : (j + 1) * CHUNK]), in a fixed order."""
        j = tl.program_id(0)
        row = tl.program_id(1)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        end = tl.minimum((j + 1) * CHUNK, n)
        for start in range(j * CHUNK, end, BLOCK):
            i = start + tl.arange(0, BLOCK)
            total += tl.load(partials + row * n + i, mask=i < end, other=0.0)
        tl.store(sums + row * tl.num_programs(0) + j, tl.sum(total, axis=0))

    @triton.jit
    def _grad_stats_finish(sums, n, found_inf_ptr, norm_ptr, clip_ptr, max_norm, HAS_CLIP: tl.constexpr,
                           BLOCK: tl.constexpr):
        """One program: total the per-chunk sums; write found_inf (OR), norm and clip."""
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        bad = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            i = start + tl.arange(0, BLOCK)
            squares += tl.load(sums + i, mask=i < n, other=0.0)
            bad += tl.load(sums + n + i, mask=i < n, other=0.0)
        norm = tl.sqrt_rn(tl.sum(squares, axis=0))
        tl.store(found_inf_ptr, 1.0, mask=tl.sum(bad, axis=0) > 0)
        tl.store(norm_ptr, norm)
        if HAS_CLIP:
            tl.store(clip_ptr, tl.minimum(max_norm / (norm + _CLIP_EPS), 1.0))  # clip_coefficient

    def _grid(tables):
        return (tables.n_blocks,)

    def _prepare_all_finite_triton(problem: MultiTensorProblem) -> MultiTensorLaunch:
        dtype = TL_DTYPES[problem.dtype]

        def run(columns, found_inf, tables):
            if tables.n_blocks:
                _all_finite_blocks[_grid(tables)](tables.addresses, tables.n_tensors, tables.block_tensor,
                                                  tables.first_block, tables.numels, found_inf, DTYPE=dtype,
                                                  ALIGNED=tables.aligned, BLOCK=tables.block, num_warps=problem.heuristics.warps)

        return MultiTensorLaunch(run, KernelChoice("all_finite_blocks", "triton", _block_params(problem)),
                      torch.float32)

    def _prepare_unscale_triton(problem: MultiTensorProblem) -> MultiTensorLaunch:
        dtype = TL_DTYPES[problem.dtype]

        def run(columns, inv_scale, found_inf, tables):
            if tables.n_blocks:
                _unscale_blocks[_grid(tables)](tables.addresses, tables.n_tensors, tables.block_tensor,
                                               tables.first_block, tables.numels, inv_scale, found_inf, DTYPE=dtype,
                                               ALIGNED=tables.aligned, BLOCK=tables.block, num_warps=problem.heuristics.warps)

        return MultiTensorLaunch(run, KernelChoice("unscale_blocks", "triton", _block_params(problem)),
                      torch.float32)

    def _prepare_update_scale_triton(problem: MultiTensorProblem) -> MultiTensorLaunch:
        def run(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
            _update_scale[(1,)](scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)

        return MultiTensorLaunch(run, KernelChoice("update_scale", "triton"), torch.float32)

    def _prepare_grad_stats_triton(problem: MultiTensorProblem) -> MultiTensorLaunch:
        def run(columns, grad_scale, found_inf, norm, clip, max_norm, tables):
            all_tables = []
            for dtype, column in columns.items():
                t = tables.get(("grad_stats", dtype)).tables(
                    [column], validate=lambda column=column: check_columns("grad_stats", ["grads"], [column]),
                    gradient_column=0)
                all_tables.append((dtype, column, t))
            n_blocks = sum(t.n_blocks for _, _, t in all_tables)
            partials = torch.empty(2, max(1, n_blocks), dtype=torch.float32, device=problem.device)
            offset = 0
            for dtype, column, t in all_tables:
                if t.n_blocks:
                    _grad_stats_blocks[_grid(t)](
                        t.addresses, t.n_tensors, t.block_tensor, t.first_block, t.numels, partials[0, offset:],
                        partials[1, offset:], grad_scale if grad_scale is not None else partials,
                        DTYPE=TL_DTYPES[dtype], HAS_SCALE=grad_scale is not None, ALIGNED=t.aligned, BLOCK=t.block,
                        num_warps=problem.heuristics.warps)
                offset += t.n_blocks
            # Two fixed-order reduction stages: chunks of sum_chunk partials in parallel, then one program.
            sum_chunk = problem.heuristics.sum_chunk
            chunks = max(1, -(-n_blocks // sum_chunk))
            sums = torch.empty(2, chunks, dtype=torch.float32, device=problem.device)
            _sum_partials[(chunks, 2)](partials, n_blocks, sums, CHUNK=sum_chunk, BLOCK=1024, num_warps=4)
            _grad_stats_finish[(1,)](sums, chunks, found_inf, norm, clip if clip is not None else norm,
                                     1.0 if max_norm is None else float(max_norm), HAS_CLIP=clip is not None,
                                     BLOCK=1024, num_warps=4)

        return MultiTensorLaunch(run, KernelChoice("grad_stats_blocks+finish", "triton", _block_params(problem)),
                      torch.float32)

    register("all_finite", backend="triton", dtypes=TRITON_FLOATS, deterministic=True, accumulator="none (a flag)",
             name="all_finite_triton")(_prepare_all_finite_triton)
    register("unscale", backend="triton", dtypes=TRITON_FLOATS, deterministic=True,
             accumulator="float32 (elementwise)", name="unscale_triton")(_prepare_unscale_triton)
    register("update_scale", backend="triton", dtypes=(torch.float32,), deterministic=True,
             accumulator="none (scalar)", name="update_scale_triton")(_prepare_update_scale_triton)
    register("grad_stats", backend="triton", dtypes=TRITON_FLOATS, deterministic=True, accumulator="float32",
             name="grad_stats_triton")(_prepare_grad_stats_triton)
