"""Parameters sharded over a device mesh (``torch.distributed.tensor.DTensor``: FSDP2's
``fully_shard``, tensor parallelism): what a fused optimizer step needs to run on them.

The multi-tensor kernels run on each rank's local part (``local``): Adam's or SGD's update is
elementwise, so the local shards step exactly as the whole tensor would. What is not elementwise
needs the whole tensor: the global gradient norm (``max_grad_norm``), the inf/NaN flag that every
rank must agree on before it skips a step, LAMB's per-tensor norms of p and u (its trust ratio).
``MeshSums`` sums such per-tensor values over the ranks that hold the parts of each tensor: over
the mesh dimensions where the tensor's placement is ``Shard``. Over a ``Replicate`` dimension every
rank holds the same values, which are not summed. Sums travel in float64 (the caller's dtype is
restored), one ``all_reduce`` per mesh dimension that some value needs.

Errors (UnsupportedError, raised before any collective): DTensors on more than one device mesh in
one step, or with a ``Partial`` placement (a gradient not yet reduced). ``check_ranks_agree``
turns ranks that would run different collectives (another parameter list, a clip on one rank
only) into an InvalidProblemError on every rank instead of a hang.

``fully_shard`` changes a module's class to a subclass of (FSDPModule, its class);
``fsdp_wrapped_class`` and ``fsdp_class`` let trainops.patch swap such a module's class for the
same wrapper around a trainops class, so that a model can be patched after ``fully_shard`` too.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import InvalidProblemError, UnsupportedError

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # a torch built without distributed support
    DTensor = Replicate = Shard = None


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 parameter or gradient, a tensor-parallel one)."""
    return DTensor is not None and isinstance(t, DTensor)


def any_dtensor(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (one pass over their types: cheap for long lists)."""
    return DTensor is not None and any(issubclass(cls, DTensor) for cls in set(map(type, tensors)))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (the tensor itself when it is not a DTensor).

    The DTensor's own local tensor, not a view of it: ``to_local()`` makes a new view of a
    Parameter on every call, and the optimizers key their cached pointer tables on the tensors
    they are given. In-place writes to it are writes to the DTensor.
    """
    return t._local_tensor if is_dtensor(t) else t


def shard_dims(t: torch.Tensor, where: str) -> tuple[int, ...]:
    """The mesh dimensions over which ``t``'s elements are split (its ``Shard`` placements; ()
    for a plain tensor or a replicated DTensor). UnsupportedError for a ``Partial`` placement."""
    if not is_dtensor(t):
        return ()
    dims = []
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard":
            dims.append(dim)
        elif not isinstance(placement, Replicate):
            raise UnsupportedError(f"{where}: a DTensor has placement {placement} on mesh dimension {dim}; only Shard "
                                   "and Replicate placements are supported (reduce a Partial gradient first)")
    return tuple(dims)


class MeshSums:
    """Sums over the ranks of a device mesh for a fixed list of tensors (see the module docstring).

    ``MeshSums.of(tensors, where)`` is None when no tensor is a DTensor (nothing to sum); ``where``
    names the caller in errors. Every rank must build it from the same list of tensors and call
    its methods in the same order: they are collectives.
    """

    def __init__(self, mesh, dims: Sequence[tuple[int, ...]]):
        self.mesh = mesh
        self.dims = tuple(dims)

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], where: str) -> MeshSums | None:
        meshes = {t.device_mesh for t in tensors if is_dtensor(t)}
        if not meshes:
            return None
        if len(meshes) > 1:
            raise UnsupportedError(f"{where}: the parameters are DTensors on {len(meshes)} device meshes; one step "
                                   "supports one mesh (give each mesh's parameters their own optimizer)")
        return cls(meshes.pop(), [shard_dims(t, where) for t in tensors])

    def sum_rows_(self, values: torch.Tensor, row_dims: Sequence[tuple[int, ...]] | None = None) -> torch.Tensor:
        """In place: row i of ``values`` (first dimension) summed over the mesh dimensions
        ``row_dims[i]`` (default: the i-th tensor's shard dimensions). Returns ``values``."""
        row_dims = self.dims if row_dims is None else tuple(row_dims)
        if len(row_dims) != values.shape[0]:
            raise ValueError(f"MeshSums.sum_rows_: {values.shape[0]} rows for {len(row_dims)} row dimensions")
        wide = values.to(torch.float64)
        for dim in range(self.mesh.ndim):
            rows = [i for i, dims in enumerate(row_dims) if dim in dims]
            if not rows:
                continue
            group = self.mesh.get_group(dim)
            if len(rows) == len(row_dims):
                torch.distributed.all_reduce(wide, group=group)
            else:
                index = torch.tensor(rows, device=wide.device)
                part = wide.index_select(0, index)
                torch.distributed.all_reduce(part, group=group)
                wide.index_copy_(0, index, part)
        if wide is not values:
            values.copy_(wide)
        return values

    def every_dim(self) -> tuple[int, ...]:
        """All mesh dimensions: a flag summed over them reaches every rank of the mesh."""
        return tuple(range(self.mesh.ndim))


def check_ranks_agree(mesh, facts: dict, where: str) -> None:
    """InvalidProblemError on every rank of ``mesh`` unless all of its ranks pass equal ``facts``
    (a dict of picklable values: what decides the collectives a step will make, such as the layout
    of the parameters and whether a clip norm is summed). Ranks that disagree would otherwise wait
    in mismatched collectives until the process group's timeout, or sum unrelated values.

    One ``all_gather_object`` per mesh dimension, each passing on what the earlier ones gathered,
    so that every rank ends with every rank's facts and decides alike (a rank that raised early
    would leave the others waiting in the next dimension's gather): a host synchronisation, for
    where a step's layout is settled, not for every step. The message names the first fact (in
    ``facts``' order) on which a rank differs from the mesh's lowest rank, and both values.
    """
    dist = torch.distributed
    known = [(dist.get_rank(), facts)]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, known, group=group)
        known = sorted({rank: value for part in gathered for rank, value in part}.items(), key=lambda kv: kv[0])
    first_rank, first = known[0]
    for rank, other in known[1:]:
        if other == first:
            continue
        key = next((k for k in first if k not in other or other[k] != first[k]),
                   next(iter(k for k in other if k not in first), None))
        raise InvalidProblemError(
            f"{where}: the ranks of the device mesh disagree on {key}: rank {first_rank} has {first.get(key)!r}, "
            f"rank {rank} has {other.get(key)!r}; every rank must step the same parameters with the same options")


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def fsdp_wrapped_class(cls: type) -> type | None:
    """The class ``fully_shard`` wrapped when ``cls`` is its (FSDPModule, class) subclass, else None."""
    fsdp_module = _fsdp_module_class()
    bases = cls.__bases__
    if fsdp_module is None or len(bases) != 2 or bases[0] is not fsdp_module:
        return None
    return bases[1]


def fsdp_class(cls: type) -> type:
    """The (FSDPModule, ``cls``) subclass ``fully_shard`` gives instances of ``cls``: its own when it
    made one, else one made the way it makes them (and recorded where it looks, so both agree)."""
    from torch.distributed.fsdp._fully_shard import _fully_shard as fully_shard_module

    known = fully_shard_module.cls_to_fsdp_cls
    if cls not in known:
        known[cls] = type(f"FSDP{cls.__name__}", (_fsdp_module_class(), cls),
                          {"__deepcopy__": fully_shard_module._unimplemented_deepcopy})
    return known[cls]


__all__ = ["MeshSums", "any_dtensor", "check_ranks_agree", "fsdp_class", "fsdp_wrapped_class", "is_dtensor", "local", "shard_dims"]
