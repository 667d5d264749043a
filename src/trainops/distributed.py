"""Data-parallel training on torch.distributed (NCCL on GPUs, gloo on CPUs).

    torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))

    # plain data parallelism: gradients averaged in large buckets while backward runs
    sync = trainops.distributed.GradientSync(model.parameters())
    loss.backward(); sync.wait(); opt.step(); opt.zero_grad()

    # ZeRO stage 1: each rank keeps and steps 1/world of the optimizer state
    opt = trainops.distributed.ShardedOptimizer(model.parameters(), trainops.optim.AdamW, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Buckets. Parameters that require grad are taken in reverse registration order (backward produces
their gradients roughly in that order), grouped by dtype (and param group), and cut into buckets
of about ``bucket_mb`` MiB. Post-accumulate-grad hooks count each bucket's gradients in; when a
bucket is complete its gradients are copied into its flat buffer (one multi-tensor copy; none
for gradients that already are views of it) and its collective starts at once (async), so
communication overlaps the rest of the backward. Parameters that got no gradient count as zeros.

Communication. ``GradientSync`` all-reduces each bucket and divides by the world size.
``ShardedOptimizer`` reduce-scatters each bucket (every rank receives the sum of its 1/world
slice), steps only its slices with the fused multi-tensor optimizer, then all-gathers the updated
parameters into the flat parameter buffers the model's parameters now view. With
``comm_dtype=torch.bfloat16`` the buckets travel in bfloat16 but are summed in float32: an
all-to-all in bfloat16, a float32 sum of the received slices on each rank (then, for
GradientSync, an all-gather in bfloat16).

Mixed precision and clipping. Under ``trainops.amp.GradScaler`` the ShardedOptimizer checks its
slices for inf/NaN, and the decision is agreed across ranks (an all-reduce MAX of the flag) before
anyone steps; ``max_grad_norm`` clips by the global norm (an all-reduce of the squared norms).

Bad input. At construction every rank compares the parameter list (count, shapes, dtypes), the
bucket size and the comm dtype with rank 0's and raises ``InvalidProblemError`` naming the first
difference, instead of hanging in a mismatched collective. Collectives use the process group's
timeout (set it in ``init_process_group``). World size 1 runs without communication. LAMB's
per-tensor trust ratio cannot be computed on flat shards: ShardedOptimizer refuses it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist

from .errors import InvalidProblemError, UnsupportedError
from .ops import amp as amp_ops
from .optim import LAMB, AdamW, FusedOptimizer


# torch 2.13 renames the tensor collectives (the old names warn); older torch has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(eq=False)
class _Bucket:
    params: list                       # the parameters whose gradients this bucket carries
    offsets: list                      # their element offsets in the flat buffers
    numel: int                         # padded to a multiple of the world size
    grad: torch.Tensor                 # flat gradient buffer
    group_index: int = 0
    ready: set = field(default_factory=set)
    work: object = None                # the pending collective
    received: torch.Tensor | None = None   # bf16 all-to-all receive buffer
    views: list = field(init=False)    # each parameter's slice of ``grad``, shaped like it (made once)

    def __post_init__(self):
        self.views = [self.grad[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidProblemError("trainops.distributed: torch.distributed is not initialised "
                                  "(call torch.distributed.init_process_group first)")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_same_everywhere(what: dict, group) -> None:
    """Every rank's ``what`` must equal rank 0's; raise naming the first field that differs."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, what, group=group)
    for rank, theirs in enumerate(gathered):
        for key in what:
            if theirs[key] != gathered[0][key]:
                raise InvalidProblemError(
                    f"trainops.distributed: rank {rank} has {key} = {theirs[key]!r} but rank 0 has "
                    f"{gathered[0][key]!r}; every rank must pass the same model and settings")


def _make_buckets(groups: list[list], bucket_mb: float, world: int, pad: bool) -> list[_Bucket]:
    """Cut each group's parameters (in reverse order) into buckets of about ``bucket_mb`` MiB.

    Every parameter starts at a 16-byte aligned offset, so gradient views and shards keep the
    fused kernels' vector path; with ``pad`` the bucket length is a multiple of world x 16 bytes,
    so each rank's slice is aligned too. The gaps stay zero.
    """
    buckets = []
    limit = max(1, int(bucket_mb * 2**20))
    for group_index, params in enumerate(groups):
        current, offsets, size, dtype = [], [], 0, None
        for p in reversed(params):
            align = max(1, 16 // p.element_size())
            if current and (p.dtype != dtype or (size + p.numel()) * p.element_size() > limit):
                buckets.append((group_index, current, offsets, size, dtype))
                current, offsets, size = [], [], 0
            current.append(p)
            offsets.append(size)
            size = -(-(size + p.numel()) // align) * align
            dtype = p.dtype
        if current:
            buckets.append((group_index, current, offsets, size, dtype))
    out = []
    for group_index, params, offsets, size, dtype in buckets:
        unit = world * max(1, 16 // params[0].element_size()) if pad else 1
        numel = -(-size // unit) * unit
        grad = torch.zeros(numel, dtype=dtype, device=params[0].device)
        out.append(_Bucket(params, offsets, numel, grad, group_index))
    return out


class _BucketedGrads:
    """Hooks that count each bucket's gradients in; the last one copies them into the bucket (one
    multi-tensor copy, not one launch per parameter) and starts the bucket's collective."""

    def __init__(self, buckets: list[_Bucket], launch, set_grad_to_none: bool):
        self.buckets, self._launch, self._set_none = buckets, launch, set_grad_to_none
        self._handles = []
        for bucket in buckets:
            for p in bucket.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(bucket)))

    def _hook(self, bucket: _Bucket):
        # The hook lives on the parameter: weak references, or parameter -> hook -> bucket ->
        # parameter would be a cycle through torch's hook table that Python's collector cannot
        # see, and a dropped GradientSync / ShardedOptimizer would keep its buffers for good.
        owner, bucket_ref = weakref.ref(self), weakref.ref(bucket)

        def hook(param):
            grads, bucket = owner(), bucket_ref()
            if grads is None or bucket is None:
                return
            bucket.ready.add(id(param))
            if len(bucket.ready) == len(bucket.params) and bucket.work is None:
                grads._complete(bucket)
        return hook

    def _complete(self, bucket: _Bucket) -> None:
        """Gather the bucket's gradients (zeros for parameters that got none) and start its collective."""
        dst, src = [], []
        for p, view in zip(bucket.params, bucket.views):
            if id(p) not in bucket.ready or p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                dst.append(view)
                src.append(p.grad)
        if dst:
            torch._foreach_copy_(dst, src)
        for p, view in zip(bucket.params, bucket.views):
            if id(p) not in bucket.ready:
                continue
            if self._set_none:
                p.grad = None
            elif p.grad is not None and p.grad.data_ptr() != view.data_ptr() and p.grad.stride() == view.stride():
                p.grad = view  # the gradient now lives in the bucket: no copy back after the reduction
        self._launch(bucket)

    def finish(self) -> None:
        """Start the buckets some of whose parameters got no gradient (their slices count as zeros)."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._complete(bucket)

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
            bucket.received = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __del__(self):
        self.remove()


def _start_reduce(bucket: _Bucket, out_shard: torch.Tensor | None, comm_dtype, group, world: int) -> None:
    """Sum ``bucket.grad`` over ranks: into ``out_shard`` (reduce-scatter) or in place (all-reduce).
    With a comm dtype, an all-to-all of ``comm_dtype`` slices (summed in float32 in ``_finish_reduce``)."""
    if comm_dtype is not None and comm_dtype != bucket.grad.dtype:
        sent = bucket.grad.to(comm_dtype)
        bucket.received = torch.empty_like(sent)
        bucket.work = dist.all_to_all_single(bucket.received, sent, group=group, async_op=True)
    elif out_shard is not None:
        bucket.work = _reduce_scatter(out_shard, bucket.grad, group=group, async_op=True)
    else:
        bucket.work = dist.all_reduce(bucket.grad, group=group, async_op=True)


def _finish_reduce(bucket: _Bucket, out_shard: torch.Tensor, world: int) -> None:
    """Wait for the bucket; leave the averaged slice in ``out_shard``."""
    bucket.work.wait()
    if bucket.received is not None:
        summed = bucket.received.view(world, -1).to(torch.float32).sum(0)
        out_shard.copy_(summed)
    out_shard.div_(world)


class GradientSync:
    """Average gradients over the ranks of ``process_group`` in buckets, overlapped with backward.

    ``wait()`` after ``backward()``: every parameter's ``.grad`` then holds the average over ranks
    (parameters without a gradient on any rank get zeros). Works with any optimizer. Gradients
    become views of the bucket buffers (as DDP's ``gradient_as_bucket_view``): a gradient that
    autograd accumulates into them is copied once, and nothing is copied back after the reduction.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, process_group=None, bucket_mb: float = 25.0,
                 comm_dtype: torch.dtype | None = None):
        self.group = process_group
        self.rank, self.world = _world(process_group)
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise InvalidProblemError("trainops.distributed.GradientSync: no parameter requires grad")
        self.comm_dtype = comm_dtype
        _check_same_everywhere(dict(parameters=[(tuple(p.shape), str(p.dtype)) for p in self.params],
                                    bucket_mb=bucket_mb, comm_dtype=str(comm_dtype)), process_group)
        self.buckets = _make_buckets([self.params], bucket_mb, self.world, pad=comm_dtype is not None)
        self._grads = _BucketedGrads(self.buckets, self._launch, set_grad_to_none=False)

    def _launch(self, bucket: _Bucket) -> None:
        if self.world > 1:
            _start_reduce(bucket, None, self.comm_dtype, self.group, self.world)
        else:
            bucket.work = _Done()

    def wait(self) -> None:
        """Finish every bucket's reduction and write the averaged gradients into ``.grad``."""
        self._grads.finish()
        for bucket in self.buckets:
            if self.world == 1:
                pass
            elif bucket.received is not None:
                shard = torch.empty(bucket.numel // self.world, dtype=torch.float32, device=bucket.grad.device)
                _finish_reduce(bucket, shard, self.world)
                gathered = torch.empty(bucket.numel, dtype=self.comm_dtype, device=bucket.grad.device)
                _all_gather(gathered, shard.to(self.comm_dtype), group=self.group)
                bucket.grad.copy_(gathered)
            else:
                bucket.work.wait()
                bucket.grad.div_(self.world)
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    p.grad = view
                elif p.grad.data_ptr() != view.data_ptr():
                    p.grad.copy_(view)
        self._grads.reset()

    def remove(self) -> None:
        """Remove the gradient hooks."""
        self._grads.remove()


class _Done:
    def wait(self):
        return None


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 over a trainops fused optimizer (see the module docstring).

    ``optimizer_class``: trainops.optim.AdamW, Adam or SGD (elementwise updates shard exactly);
    ``**defaults`` go to it (lr, betas, weight_decay, ...), per-group options as in torch.
    ``max_grad_norm`` clips by the global norm over all ranks. The model's parameters become views
    of flat per-bucket buffers (their ``.data`` is replaced; shapes and values are unchanged), and
    their ``.grad`` is None after backward: the gradients live in the buckets.

    ``state_dict()`` (a collective: every rank must call it) returns the full, unsharded state in
    the layout of ``optimizer_class``'s own state_dict, so it loads into a single-process optimizer
    (and back, with ``load_state_dict``). ``sharded_state_dict()`` / ``load_sharded_state_dict()``
    save and restore only this rank's slices, for the same world size and model.
    """

    _step_supports_amp_scaling = True
    _trainops_checks_finite = True

    def __init__(self, params, optimizer_class=AdamW, *, process_group=None, bucket_mb: float = 25.0,
                 comm_dtype: torch.dtype | None = None, max_grad_norm: float | None = None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, FusedOptimizer)):
            raise UnsupportedError("trainops.distributed.ShardedOptimizer: optimizer_class must be a trainops.optim "
                                   f"optimizer, got {optimizer_class!r}")
        if issubclass(optimizer_class, LAMB):
            raise UnsupportedError("trainops.distributed.ShardedOptimizer: LAMB's per-tensor trust ratio cannot be "
                                   "computed on flat shards; use LAMB with GradientSync")
        super().__init__(params, defaults)
        self.group = process_group
        self.rank, self.world = _world(process_group)
        self.max_grad_norm = max_grad_norm
        self.comm_dtype = comm_dtype
        self.grad_norm: torch.Tensor | None = None
        groups = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        _check_same_everywhere(dict(parameters=[[(tuple(p.shape), str(p.dtype)) for p in g] for g in groups],
                                    bucket_mb=bucket_mb, comm_dtype=str(comm_dtype),
                                    optimizer=optimizer_class.__name__), process_group)
        self.buckets = _make_buckets(groups, bucket_mb, self.world, pad=True)
        self._shards = []        # per bucket: (parameter shard view, gradient shard)
        for bucket in self.buckets:
            flat = torch.zeros(bucket.numel, dtype=bucket.grad.dtype, device=bucket.grad.device)
            for p, offset in zip(bucket.params, bucket.offsets):
                flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                p.data = flat[offset:offset + p.numel()].view_as(p)
            size = bucket.numel // self.world
            shard = torch.nn.Parameter(flat[self.rank * size:(self.rank + 1) * size])
            grad_dtype = torch.float32 if comm_dtype is not None else bucket.grad.dtype
            self._shards.append((flat, shard, torch.zeros(size, dtype=grad_dtype, device=flat.device)))
        inner_groups = []
        for index, group in enumerate(self.param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            shards = [shard for bucket, (_, shard, _) in zip(self.buckets, self._shards) if bucket.group_index == index]
            if shards:
                inner_groups.append(dict(options, params=shards))
        self.inner = optimizer_class(inner_groups)
        self._grads = _BucketedGrads(self.buckets, self._launch, set_grad_to_none=True)

    def _launch(self, bucket: _Bucket) -> None:
        _, _, grad_shard = self._shards[self.buckets.index(bucket)]
        if self.world > 1:
            _start_reduce(bucket, grad_shard, self.comm_dtype, self.group, self.world)
        else:
            grad_shard.copy_(bucket.grad)
            bucket.work = _Done()

    @torch.no_grad()
    def step(self, closure=None):
        """Finish the gradient reduce-scatters, step this rank's slices, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._grads.finish()
        for bucket, (_, shard, grad_shard) in zip(self.buckets, self._shards):
            if self.world > 1:
                _finish_reduce(bucket, grad_shard, self.world)
            shard.grad = grad_shard if grad_shard.dtype == shard.dtype else grad_shard.to(shard.dtype)
        self._grads.reset()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        clip = None
        if self.max_grad_norm is not None or getattr(self, "_trainops_check_finite", False):
            grads = [shard.grad for _, shard, _ in self._shards]
            stats = amp_ops.grad_stats(grads, grad_scale=grad_scale, found_inf=found_inf)
            squares = stats.norm.square()
            if self.world > 1:
                dist.all_reduce(stats.found_inf, op=dist.ReduceOp.MAX, group=self.group)
                dist.all_reduce(squares, group=self.group)
            found_inf, self.grad_norm = stats.found_inf, squares.sqrt()
            if self.max_grad_norm is not None:
                clip = torch.clamp(self.max_grad_norm / (self.grad_norm + 1e-6), max=1.0)
        self.inner.grad_scale, self.inner.found_inf, self.inner._trainops_clip = grad_scale, found_inf, clip
        try:
            self.inner.step()
        finally:
            del self.inner.grad_scale, self.inner.found_inf, self.inner._trainops_clip
        if self.world > 1:
            # NCCL gathers in place (this rank's slice of the output is the input); other backends get a copy.
            in_place = dist.get_backend(self.group) == "nccl"
            works = [_all_gather(flat, shard.detach() if in_place else shard.detach().clone(),
                                                 group=self.group, async_op=True)
                     for flat, shard, _ in self._shards]
            for work in works:
                work.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, shard, _ in self._shards:
            shard.grad = None
        super().zero_grad(set_to_none)

    # -- state ------------------------------------------------------------------------------------

    def _param_slices(self):
        """(outer param index, bucket index, offset, numel) for every parameter with a bucket."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for b, bucket in enumerate(self.buckets):
            for p, offset in zip(bucket.params, bucket.offsets):
                yield index[id(p)], b, offset, p

    def state_dict(self) -> dict:
        """Full (unsharded) state in ``optimizer_class``'s layout. Collective: call on every rank."""
        inner_state = self.inner.state
        keys = sorted({k for s in inner_state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() == 1})
        full: dict[int, dict[str, torch.Tensor]] = {}
        for b, (flat, shard, _) in enumerate(self._shards):
            state = inner_state.get(shard, {})
            gathered = {}
            for key in keys:
                local = state[key] if key in state else torch.zeros_like(shard, dtype=torch.float32)
                out = torch.empty(self.buckets[b].numel, dtype=local.dtype, device=local.device)
                if self.world > 1:
                    _all_gather(out, local.contiguous(), group=self.group)
                else:
                    out.copy_(local)
                gathered[key] = out
            for i, bucket_index, offset, p in self._param_slices():
                if bucket_index != b:
                    continue
                entry = full.setdefault(i, {})
                if "step" in state:
                    entry["step"] = state["step"].detach().clone()
                for key in keys:
                    entry[key] = gathered[key][offset:offset + p.numel()].view_as(p).clone()
        groups = []
        start = 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        return {"state": full, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (from ``state_dict()`` or a single-process optimizer of the same class)."""
        saved = state_dict["state"]
        inner_state: dict[int, dict] = {}
        for b, (flat, shard, _) in enumerate(self._shards):
            size = shard.numel()
            entry: dict = {}
            for i, bucket_index, offset, p in self._param_slices():
                if bucket_index != b or i not in saved:
                    continue
                for key, value in saved[i].items():
                    if key == "step":
                        entry["step"] = value
                        continue
                    if not torch.is_tensor(value) or value.shape != p.shape:
                        raise InvalidProblemError(f"trainops.distributed.ShardedOptimizer.load_state_dict: state "
                                                  f"'{key}' of parameter {i} does not match its shape {tuple(p.shape)}")
                    full = entry.setdefault(key, torch.zeros(self.buckets[b].numel, dtype=torch.float32,
                                                             device=flat.device))
                    full[offset:offset + p.numel()].copy_(value.reshape(-1))
            if entry:
                inner_state[b] = {k: (v if k == "step" else v[self.rank * size:(self.rank + 1) * size].clone())
                                  for k, v in entry.items()}
        inner_sd = self.inner.state_dict()
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_sd["param_groups"]})
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            for key, value in saved_group.items():
                if key != "params":
                    group[key] = value
        for group, inner_group in zip(self.param_groups, self.inner.param_groups):
            for key, value in group.items():
                if key != "params":
                    inner_group[key] = value

    def sharded_state_dict(self) -> dict:
        """This rank's slices of the state (no communication)."""
        return {"world_size": self.world, "rank": self.rank, "bucket_numels": [b.numel for b in self.buckets],
                "inner": self.inner.state_dict()}

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        layout = (state_dict["world_size"], state_dict["rank"], state_dict["bucket_numels"])
        if layout != (self.world, self.rank, [b.numel for b in self.buckets]):
            raise InvalidProblemError("trainops.distributed.ShardedOptimizer.load_sharded_state_dict: the state was "
                                      f"saved for (world size, rank, buckets) = {layout[:2]}, this optimizer is "
                                      f"{(self.world, self.rank)} with its own buckets; load the full state_dict instead")
        self.inner.load_state_dict(state_dict["inner"])


__all__ = ["GradientSync", "ShardedOptimizer"]
