"""Data-parallel training on torch.distributed (NCCL on GPUs, gloo on CPUs).

    torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))

    # plain data parallelism: gradients averaged in large buckets while backward runs
    sync = trainops.distributed.GradientSync(model.parameters())
    loss.backward(); sync.wait(); opt.step(); opt.zero_grad()

    # ZeRO stage 1: each rank keeps and steps 1/world of the optimizer state
    opt = trainops.distributed.ShardedOptimizer(model.parameters(), trainops.optim.AdamW, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

    # gradient accumulation (either class): only the last micro-batch's backward communicates
    for x in micro_batches[:-1]:
        with sync.no_sync():                     # opt.no_sync() for a ShardedOptimizer
            loss_of(x).backward()                # .grad accumulates locally, nothing is sent
    loss_of(micro_batches[-1]).backward()        # the buckets carry the accumulated sums
    sync.wait(); opt.step(); opt.zero_grad()

What is reduced. ``GradientSync.wait()`` and ``ShardedOptimizer.step()`` reduce what every
parameter's ``.grad`` holds (a ``.grad`` of None counts as zeros): whatever the backwards since the
gradients were last zeroed or reduced accumulated, as in one process. The gradient hooks only start
the work early, while backward still runs.

Buckets. Parameters that require grad are taken in reverse registration order (backward produces
their gradients roughly in that order), grouped by dtype (and param group), and cut into buckets
of about ``bucket_mb`` MiB. Post-accumulate-grad hooks count each bucket's gradients in; when a
bucket is complete its gradients are copied into its flat buffer (one multi-tensor copy; none
for gradients that already are views of it) and its collective starts (async), so communication
overlaps the rest of the backward. Collectives start in one fixed bucket order (a bucket completed
early waits for the ones before it, as in DDP): ranks whose backwards leave different parameters
without a gradient, or complete buckets in another order, still pair the same buckets. A bucket
that a backward did not complete (a parameter got no gradient) starts in ``wait()`` / ``step()``,
and the buckets after it with it: parameters that never get a gradient cost the overlap, so leave
them out or freeze them before construction.

Accumulation. A backward inside ``no_sync()`` leaves the hooks idle: gradients accumulate in
``.grad`` and nothing is copied or sent. The first backward outside it counts in as usual, and its
buckets carry the accumulated sums: the result is that of DDP's ``no_sync``, the average over ranks
of each rank's summed micro-batch gradients. (All backwards may run inside ``no_sync()``: then
``wait()`` / ``step()`` sends everything, without overlap.) ``no_sync()`` governs the backward
passes run inside the ``with`` block (the hooks run during backward), not the forwards as in DDP.
A bucket in flight must not change, so a second backward outside ``no_sync()`` before
``wait()`` / ``step()``, or a backward inside it after one outside it, raises InvalidProblemError
from that backward, naming the parameter. ``ShardedOptimizer.zero_grad()`` drops a backward's
gradients that no ``step()`` used (it finishes their collectives first, so call it on every rank).

Ranks must make the same calls: the same backwards outside ``no_sync()``, and ``wait()``,
``step()``, ``zero_grad()``, ``state_dict()``, ``add_param_group()`` together. If they disagree
about ``no_sync()``, a rank that ran a backward inside it where the others ran it outside still
meets their collectives (its buckets start at its ``wait()`` / ``step()``, in the same order), so
every rank reduces what all ranks' ``.grad`` held, the same result; a rank that thereby runs a
second backward outside ``no_sync()`` raises as above. When ranks make the same calls the errors
here are raised by all of them alike; a rank that raises alone leaves the others waiting in their
collectives until the process group's timeout, then failing.

Communication. ``GradientSync`` all-reduces each bucket and divides by the world size.
``ShardedOptimizer`` reduce-scatters each bucket (every rank receives the sum of its 1/world
slice), steps only its slices with the fused multi-tensor optimizer, then all-gathers the updated
parameters into the flat parameter buffers the model's parameters now view. With
``comm_dtype=torch.bfloat16`` the buckets travel in bfloat16 but are summed in float32: an
all-to-all in bfloat16, a float32 sum of the received slices on each rank (then, for
GradientSync, an all-gather in bfloat16).

Hyper-parameters. ``ShardedOptimizer.param_groups`` is the interface, as in torch: its groups hold
every option of ``optimizer_class`` (its defaults filled in, so OneCycleLR finds ``betas``), and
every ``step()`` hands their current values (lr, betas, weight_decay, eps, ... whatever a user or an
LR scheduler set) to the inner optimizer that steps the slices, which checks them before writing
anything. ``max_grad_norm`` and ``skip_nonfinite`` are attributes, read at every step as well.

Mixed precision and clipping. Under ``trainops.amp.GradScaler`` (or with ``skip_nonfinite``) the
ShardedOptimizer checks its slices for inf/NaN, and the decision is agreed across ranks (an
all-reduce MAX of the flag) before anyone steps; ``max_grad_norm`` clips by the global norm (an
all-reduce of the squared norms).

Frozen parameters. A parameter that does not require grad at construction gets no bucket. If it
requires grad later, ``wait()`` / ``step()`` raise UnsupportedError (its gradient would never be
reduced); build a new GradientSync / ShardedOptimizer (``ShardedOptimizer.add_param_group`` takes
parameters that are in no group yet). A parameter frozen after construction: GradientSync still
sends its slot (as zeros while its ``.grad`` is None) and leaves its ``.grad`` None, so an optimizer
skips it as in one process; ShardedOptimizer cannot leave part of a flat slice unstepped (weight
decay and momentum would move it), so ``step()`` raises UnsupportedError naming it.

Bad input. At construction every rank compares the parameter list (count, shapes, dtypes), the
bucket size and the comm dtype with rank 0's and raises ``InvalidProblemError`` naming the first
difference, instead of hanging in a mismatched collective. Collectives use the process group's
timeout (set it in ``init_process_group``). World size 1 runs without communication. LAMB's
per-tensor trust ratio cannot be computed on flat shards: ShardedOptimizer refuses it.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from .dtensor import is_dtensor
from .errors import InvalidProblemError, UnsupportedError
from .ops import amp as amp_ops
from .optim import LAMB, AdamW, FusedOptimizer, FusedStep


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
    ready: set = field(default_factory=set)   # ids of the parameters whose gradient a hook counted
    filled: bool = False               # the gradients are in ``grad`` (the collective may still wait its turn)
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


def _check_same_everywhere(what: dict, group, where: str = "trainops.distributed") -> None:
    """Every rank's ``what`` must equal rank 0's; raise naming the first field that differs."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, what, group=group)
    for rank, theirs in enumerate(gathered):
        for key in what:
            if theirs[key] != gathered[0][key]:
                raise InvalidProblemError(
                    f"{where}: rank {rank} has {key} = {theirs[key]!r} but rank 0 has "
                    f"{gathered[0][key]!r}; every rank must pass the same model and settings")


def _shapes(params) -> list:
    return [(tuple(p.shape), str(p.dtype)) for p in params]


def _make_buckets(groups: list[list], bucket_mb: float, world: int, pad: bool,
                  first_group_index: int = 0) -> list[_Bucket]:
    """Cut each group's parameters (in reverse order) into buckets of about ``bucket_mb`` MiB.

    Every parameter starts at a 16-byte aligned offset, so gradient views and shards keep the
    fused kernels' vector path; with ``pad`` the bucket length is a multiple of world x 16 bytes,
    so each rank's slice is aligned too. The gaps stay zero.
    """
    buckets = []
    limit = max(1, int(bucket_mb * 2**20))
    for group_index, params in enumerate(groups, start=first_group_index):
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
    """The gradient hooks of a GradientSync or ShardedOptimizer (see the module docstring).

    A hook counts its parameter into its bucket; the last one copies the bucket's gradients into
    its flat buffer (one multi-tensor copy, not one launch per parameter), and the buckets' collectives
    start in ``order``: a filled bucket waits for the buckets before it. ``syncing`` is False inside
    ``no_sync()``. ``owner`` and ``finish_call`` name the owner's class and its finishing call
    (``"wait()"`` / ``"step()"``), ``describe`` a parameter, for error messages.
    """

    def __init__(self, order: list[_Bucket], launch, *, set_grad_to_none: bool, owner: str, finish_call: str,
                 describe: Callable[[torch.Tensor], str]):
        self.order = []
        self._launch, self._set_none = launch, set_grad_to_none
        self._owner, self._finish_call, self._describe = owner, finish_call, describe
        self.syncing = True
        self.counted = False               # a hook counted a gradient since the last reset()
        self._next = 0                     # the position in ``order`` of the next collective to start
        self._handles = []
        self.add(order, order)

    def add(self, buckets: list[_Bucket], order: list[_Bucket]) -> None:
        """Hook ``buckets``; ``order`` is the new launch order of all buckets (call between steps)."""
        for bucket in buckets:
            for p in bucket.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(bucket)))
        self.order = order

    def _hook(self, bucket: _Bucket):
        # The hook lives on the parameter: weak references, or parameter -> hook -> bucket ->
        # parameter would be a cycle through torch's hook table that Python's collector cannot
        # see, and a dropped GradientSync / ShardedOptimizer would keep its buffers for good.
        owner, bucket_ref = weakref.ref(self), weakref.ref(bucket)

        def hook(param):
            grads, bucket = owner(), bucket_ref()
            if grads is not None and bucket is not None:
                grads._count(bucket, param)
        return hook

    def _count(self, bucket: _Bucket, param: torch.Tensor) -> None:
        if not self.syncing:
            if self.counted:
                raise InvalidProblemError(
                    f"trainops.distributed.{self._owner}.no_sync: a backward inside no_sync() reached "
                    f"{self._describe(param)} after a backward outside it whose {self._finish_call} has not "
                    f"run; its bucket may be in flight, and this gradient would miss the reduction. Run the "
                    f"no_sync() backwards first and the synchronised one last, or call {self._finish_call} "
                    "in between")
            return
        if id(param) in bucket.ready:
            raise InvalidProblemError(
                f"trainops.distributed.{self._owner}: a second backward reached {self._describe(param)} "
                f"before {self._finish_call}; its bucket is already being reduced and must not change. "
                f"To accumulate gradients, run all but the last backward inside {self._owner}.no_sync(), "
                f"and call {self._finish_call} after the last one")
        self.counted = True
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._fill(bucket)
            self._launch_filled()

    def _fill(self, bucket: _Bucket) -> None:
        """Copy the bucket's parameters' ``.grad`` into its buffer (zeros where None)."""
        dst, src = [], []
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                dst.append(view)
                src.append(p.grad)
        if dst:
            torch._foreach_copy_(dst, src)
        for p, view in zip(bucket.params, bucket.views):
            if self._set_none:
                p.grad = None
            elif p.grad is not None and p.grad.data_ptr() != view.data_ptr() and p.grad.stride() == view.stride():
                p.grad = view  # the gradient now lives in the bucket: no copy back after the reduction
        bucket.filled = True

    def _launch_filled(self) -> None:
        while self._next < len(self.order) and self.order[self._next].filled:
            self._launch(self.order[self._next])
            self._next += 1

    def finish(self) -> None:
        """Fill the buckets no backward completed (from the current ``.grad``) and start every collective left."""
        for bucket in self.order[self._next:]:
            if not bucket.filled:
                self._fill(bucket)
        self._launch_filled()

    def discard(self) -> None:
        """Drop what the backwards since the last reset() started: every bucket's collective is
        started (as every rank does the same, none is left waiting) and waited for, then forgotten."""
        if not self.counted:
            return
        self.finish()
        for bucket in self.order:
            bucket.work.wait()
        self.reset()

    def unfinished(self) -> list[_Bucket]:
        """The buckets whose hooks have not all fired since the last reset()."""
        return [bucket for bucket in self.order if len(bucket.ready) < len(bucket.params)]

    def reset(self) -> None:
        for bucket in self.order:
            bucket.ready.clear()
            bucket.filled = False
            bucket.work = None
            bucket.received = None
        self.counted = False
        self._next = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __del__(self):
        self.remove()


@contextlib.contextmanager
def _hooks_idle(grads: _BucketedGrads):
    previous = grads.syncing
    grads.syncing = False
    try:
        yield
    finally:
        grads.syncing = previous


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


def _refuse_dtensors(where: str, params) -> None:
    """UnsupportedError for DTensor parameters (FSDP2 already syncs and shards them)."""
    if any(is_dtensor(p) for p in params):
        raise UnsupportedError(f"{where}: argument 'params' holds DTensors (a model wrapped by FSDP2's fully_shard "
                               "or tensor parallelism), whose gradients FSDP2 already reduces; step them with a "
                               "trainops.optim optimizer directly")


class GradientSync:
    """Average gradients over the ranks of ``process_group`` in buckets, overlapped with backward.

    ``wait()`` after ``backward()``: every parameter's ``.grad`` then holds the average over ranks
    of what the ranks' ``.grad`` held (a ``.grad`` of None counts as zeros and becomes the average,
    except on a parameter that no longer requires grad, which keeps None). Works with any optimizer.
    Gradients become views of the bucket buffers (as DDP's ``gradient_as_bucket_view``): a gradient
    that autograd accumulates into them is copied once, and nothing is copied back after the
    reduction. Accumulation: backwards inside ``no_sync()`` only accumulate into ``.grad``; the next
    backward outside it reduces the sums (see the module docstring).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, process_group=None, bucket_mb: float = 25.0,
                 comm_dtype: torch.dtype | None = None):
        where = "trainops.distributed.GradientSync"
        if isinstance(params, torch.Tensor):
            raise InvalidProblemError(f"{where}: argument 'params' is a tensor; pass an iterable of parameters "
                                      "(e.g. model.parameters() or [tensor])")
        self.group = process_group
        self.rank, self.world = _world(process_group)
        given = list(params)
        self._positions = {}
        for i, p in enumerate(given):
            if id(p) in self._positions:
                raise InvalidProblemError(f"{where}: argument 'params' holds parameter {self._positions[id(p)]} "
                                          f"again at position {i}; pass each parameter once")
            self._positions[id(p)] = i
        _refuse_dtensors(where, given)
        self.params = [p for p in given if p.requires_grad]
        self._without_bucket = [p for p in given if not p.requires_grad]
        if not self.params:
            raise InvalidProblemError(f"{where}: no parameter in argument 'params' requires grad")
        self.comm_dtype = comm_dtype
        _check_same_everywhere(dict(parameters=_shapes(self.params), bucket_mb=bucket_mb,
                                    comm_dtype=str(comm_dtype)), process_group, where)
        self.buckets = _make_buckets([self.params], bucket_mb, self.world, pad=comm_dtype is not None)
        self._grads = _BucketedGrads(list(self.buckets), self._launch, set_grad_to_none=False,
                                     owner="GradientSync", finish_call="wait()", describe=self._describe)

    def _describe(self, param: torch.Tensor) -> str:
        return f"parameter {self._positions[id(param)]} (shape {tuple(param.shape)})"

    def _launch(self, bucket: _Bucket) -> None:
        if self.world > 1:
            _start_reduce(bucket, None, self.comm_dtype, self.group, self.world)
        else:
            bucket.work = _Done()

    def no_sync(self):
        """Context manager: backwards run inside it only accumulate into ``.grad`` (no communication).

        Run all but the last micro-batch's backward inside it; the last backward, outside, reduces
        the accumulated gradients while it runs, and ``wait()`` finishes as usual. A backward inside
        it after a backward outside it whose ``wait()`` has not run raises InvalidProblemError.
        """
        return _hooks_idle(self._grads)

    def wait(self) -> None:
        """Finish every bucket's reduction and leave the averaged gradients in ``.grad``.

        A collective (every rank calls it): it reduces whatever ``.grad`` holds, so after no backward
        it averages the gradients as they are (None as zeros), and a second call averages the already
        equal gradients again (unchanged up to rounding, or to ``comm_dtype``'s rounding).
        """
        for p in self._without_bucket:
            if p.requires_grad:
                raise UnsupportedError(
                    f"trainops.distributed.GradientSync.wait: {self._describe(p)} did not require grad when "
                    "this GradientSync was built, so it has no bucket and its gradient would not be averaged; "
                    "build a new GradientSync after unfreezing parameters")
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
                    if p.requires_grad:
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


def _options(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


def _launch_order(buckets: list[_Bucket], param_groups: list[dict]) -> list[_Bucket]:
    """Buckets in the order backward roughly completes them: the one whose earliest parameter (in
    ``param_groups`` order) comes latest first. Within a group that is the order they were cut in."""
    position = {id(p): i for i, p in enumerate(p for g in param_groups for p in g["params"])}
    return sorted(buckets, key=lambda bucket: -min(position[id(p)] for p in bucket.params))


class ShardedOptimizer(FusedStep, torch.optim.Optimizer):
    """ZeRO stage 1 over a trainops fused optimizer (see the module docstring).

    ``optimizer_class``: trainops.optim.AdamW, Adam or SGD (elementwise updates shard exactly);
    ``**defaults`` are its options (lr, betas, weight_decay, ..., validated by it), per-group options
    as in torch. ``max_grad_norm`` clips by the global norm over all ranks; ``skip_nonfinite`` skips
    the step on every rank when any rank's gradients hold inf/NaN (as trainops.optim's option); both
    are attributes that may change between steps. ``param_groups`` are read at every ``step()``, so
    LR schedulers and hand-set options take effect; ``add_param_group`` adds parameters that are in
    no group yet (a collective). The model's parameters become views of flat per-bucket buffers
    (their ``.data`` is replaced; shapes and values are unchanged), and a backward outside
    ``no_sync()`` sets their ``.grad`` to None as it copies them into a complete bucket: the gradients
    live in the buckets, and never carry over from one ``step()`` to the next. A parameter without a
    gradient on every rank is stepped with zeros (weight decay and momentum still apply), where a
    one-process optimizer would skip it.

    Accumulation: backwards inside ``no_sync()`` accumulate into ``.grad``; the next backward outside
    it reduces the sums, and ``step()`` steps on them. ``zero_grad()`` also drops the gradients of a
    backward whose ``step()`` is skipped (a collective then: call it on every rank).

    ``state_dict()`` (a collective: every rank must call it) returns the full, unsharded state in
    the layout of ``optimizer_class``'s own state_dict, so it loads into a single-process optimizer
    (and back, with ``load_state_dict``). ``sharded_state_dict()`` / ``load_sharded_state_dict()``
    save and restore only this rank's slices (and the groups' options), for the same world size and
    model.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, optimizer_class=AdamW, *, process_group=None, bucket_mb: float = 25.0,
                 comm_dtype: torch.dtype | None = None, max_grad_norm: float | None = None,
                 skip_nonfinite: bool = False, **defaults):
        where = "trainops.distributed.ShardedOptimizer"
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, FusedOptimizer)):
            raise UnsupportedError(f"{where}: optimizer_class must be a trainops.optim optimizer, "
                                   f"got {optimizer_class!r}")
        if issubclass(optimizer_class, LAMB):
            raise UnsupportedError(f"{where}: LAMB's per-tensor trust ratio cannot be computed on flat shards; "
                                   "use LAMB with GradientSync")
        accepted = inspect.signature(optimizer_class).parameters
        open_ended = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())
        for key in defaults:
            if not open_ended and key not in accepted:
                raise InvalidProblemError(f"{where}: argument '{key}' is not an option of "
                                          f"trainops.optim.{optimizer_class.__name__}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InvalidProblemError(f"{where}: argument 'max_grad_norm' is {max_grad_norm}; it must be positive "
                                      "(or None)")
        super().__init__(params, defaults)
        self.group = process_group
        self.rank, self.world = _world(process_group)
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = bool(skip_nonfinite)
        self.comm_dtype = comm_dtype
        self.bucket_mb = bucket_mb
        self.grad_norm: torch.Tensor | None = None
        _refuse_dtensors(where, [p for g in self.param_groups for p in g["params"]])
        groups = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        if not any(groups):
            raise InvalidProblemError(f"{where}: no parameter in argument 'params' requires grad")
        _check_same_everywhere(dict(parameters=[_shapes(g) for g in groups], bucket_mb=bucket_mb,
                                    comm_dtype=str(comm_dtype), optimizer=optimizer_class.__name__),
                               process_group, where)
        buckets = _make_buckets(groups, bucket_mb, self.world, pad=True)
        shards = self._make_shards(buckets)
        # One inner group per outer group (possibly without slices), so options map one to one.
        # The inner optimizer validates ``defaults`` before anything of the model changes.
        self.inner = optimizer_class(
            [dict(_options(g), params=[s for b, (_, s, _) in zip(buckets, shards) if b.group_index == index])
             for index, g in enumerate(self.param_groups)], **defaults)
        self.defaults = dict(self.inner.defaults)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.buckets: list[_Bucket] = []
        self._shards = []        # per bucket: (flat parameter buffer, this rank's slice of it, gradient slice)
        self._adopt(buckets, shards)
        self._group_sizes = [len(g["params"]) for g in self.param_groups]
        self._without_bucket = [p for g in self.param_groups for p in g["params"] if not p.requires_grad]
        self._grads = _BucketedGrads(_launch_order(self.buckets, self.param_groups), self._launch,
                                     set_grad_to_none=True, owner="ShardedOptimizer", finish_call="step()",
                                     describe=self._describe)

    def _make_shards(self, buckets: list[_Bucket]) -> list[tuple]:
        """Per bucket: a flat buffer holding its parameters' values, this rank's slice of it (the
        parameter the inner optimizer steps) and a gradient slice. The model is not touched."""
        out = []
        for bucket in buckets:
            flat = torch.zeros(bucket.numel, dtype=bucket.grad.dtype, device=bucket.grad.device)
            for p, offset in zip(bucket.params, bucket.offsets):
                flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            size = bucket.numel // self.world
            shard = torch.nn.Parameter(flat[self.rank * size:(self.rank + 1) * size])
            # float32 where the all-to-all path sums the received comm_dtype slices (see _start_reduce)
            summed_in_float32 = self.comm_dtype is not None and self.comm_dtype != bucket.grad.dtype
            grad_dtype = torch.float32 if summed_in_float32 else bucket.grad.dtype
            out.append((flat, shard, torch.zeros(size, dtype=grad_dtype, device=flat.device)))
        return out

    def _adopt(self, buckets: list[_Bucket], shards: list[tuple]) -> None:
        """Make the buckets' parameters views of their flat buffers."""
        for bucket, (flat, _, _) in zip(buckets, shards):
            for p, offset in zip(bucket.params, bucket.offsets):
                p.data = flat[offset:offset + p.numel()].view_as(p)
        self.buckets.extend(buckets)
        self._shards.extend(shards)

    def _describe(self, param: torch.Tensor) -> str:
        for g, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p is param:
                    return f"parameter {j} of param group {g} (shape {tuple(p.shape)})"
        return f"a parameter of shape {tuple(param.shape)}"

    def _launch(self, bucket: _Bucket) -> None:
        _, _, grad_shard = self._shards[self.buckets.index(bucket)]
        if self.world > 1:
            _start_reduce(bucket, grad_shard, self.comm_dtype, self.group, self.world)
        else:
            grad_shard.copy_(bucket.grad)
            bucket.work = _Done()

    def no_sync(self):
        """Context manager: backwards run inside it only accumulate into ``.grad`` (no communication).

        Run all but the last micro-batch's backward inside it; the last backward, outside, reduces
        the accumulated gradients while it runs, and ``step()`` steps on them. A backward inside it
        after a backward outside it whose ``step()`` has not run raises InvalidProblemError.
        """
        return _hooks_idle(self._grads)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's: a group of parameters that are in no group yet, with its own options (the
        defaults fill the rest). A collective (every rank adds the same shapes), between ``step()``
        and the next backward; the new parameters get buckets and become views of flat buffers, as
        at construction, and are stepped from the next ``step()`` on."""
        if "inner" not in self.__dict__:
            return super().add_param_group(param_group)  # torch.optim.Optimizer.__init__ adding the given groups
        where = "trainops.distributed.ShardedOptimizer.add_param_group"
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise InvalidProblemError(f"{where}: argument 'param_group' must be a dict with a 'params' entry, "
                                      f"got {type(param_group).__name__}")
        if self._grads.counted:
            raise InvalidProblemError(f"{where}: a backward ran since the last step(); add param groups between "
                                      "step() (or zero_grad()) and the next backward")
        group = dict(param_group)
        group["params"] = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        known = {id(p) for g in self.param_groups for p in g["params"]}
        for j, p in enumerate(group["params"]):
            if id(p) in known:
                raise InvalidProblemError(f"{where}: parameter {j} of argument 'param_group' (shape "
                                          f"{tuple(p.shape)}) is already in a param group of this optimizer")
        trainable = [p for p in group["params"] if p.requires_grad]
        _check_same_everywhere(dict(parameters=_shapes(trainable)), self.group, where)
        super().add_param_group(group)
        index = len(self.param_groups) - 1
        buckets = _make_buckets([trainable], self.bucket_mb, self.world, pad=True, first_group_index=index)
        shards = self._make_shards(buckets)
        self.inner.add_param_group(dict(_options(self.param_groups[index]), params=[s for _, s, _ in shards]))
        self._adopt(buckets, shards)
        self._group_sizes.append(len(group["params"]))
        self._without_bucket.extend(p for p in group["params"] if not p.requires_grad)
        self._grads.add(buckets, _launch_order(self.buckets, self.param_groups))

    def _check_parameters(self) -> None:
        """The parameters still are those the buckets were made for (raise naming the first that is not)."""
        where = "trainops.distributed.ShardedOptimizer.step"
        sizes = [len(g["params"]) for g in self.param_groups]
        if sizes != self._group_sizes:
            raise InvalidProblemError(f"{where}: param_groups now hold {sizes} parameters, but {self._group_sizes} "
                                      "when their buckets were made; add groups with add_param_group, and do not "
                                      "change a group's 'params'")
        for p in self._without_bucket:
            if p.requires_grad:
                raise UnsupportedError(
                    f"{where}: {self._describe(p)} did not require grad when it was given to this ShardedOptimizer, "
                    "so it has no bucket and would never be stepped; build a new ShardedOptimizer after unfreezing "
                    "(state_dict() / load_state_dict() carry the state over)")
        for bucket in self._grads.unfinished():
            for p in bucket.params:
                if not p.requires_grad:
                    raise UnsupportedError(
                        f"{where}: {self._describe(p)} no longer requires grad, but it shares a flat slice that is "
                        "stepped as a whole (weight decay and momentum would still move it); freeze parameters "
                        "before building the ShardedOptimizer, or build a new one (state_dict() / load_state_dict() "
                        "carry the state over)")

    def _push_options(self) -> None:
        """Give the inner optimizer's groups the current options of ``param_groups``."""
        for group, inner_group in zip(self.param_groups, self.inner.param_groups):
            for key, value in group.items():
                if key != "params":
                    inner_group[key] = value

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
             check_finite: bool = False):
        """Finish the gradient reduce-scatters, step this rank's slices with the current options of
        ``param_groups``, all-gather the parameters. ``grad_scale``, ``found_inf`` and
        ``check_finite`` as FusedOptimizer.step (trainops.amp.GradScaler passes them); the inf/NaN
        decision and the global norm are agreed across ranks before the slices step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_parameters()
        self._grads.finish()
        for bucket, (_, shard, grad_shard) in zip(self.buckets, self._shards):
            if self.world > 1:
                _finish_reduce(bucket, grad_shard, self.world)
            shard.grad = grad_shard if grad_shard.dtype == shard.dtype else grad_shard.to(shard.dtype)
        self._grads.reset()
        if grad_scale is None:  # torch.amp.GradScaler's protocol: attributes set before step()
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        clip = None
        if self.max_grad_norm is not None or self.skip_nonfinite or check_finite:
            grads = [shard.grad for _, shard, _ in self._shards]
            stats = amp_ops.grad_stats(grads, grad_scale=grad_scale, found_inf=found_inf)
            squares = stats.norm.square()
            if self.world > 1:
                dist.all_reduce(stats.found_inf, op=dist.ReduceOp.MAX, group=self.group)
                dist.all_reduce(squares, group=self.group)
            found_inf, self.grad_norm = stats.found_inf, squares.sqrt()
            if self.max_grad_norm is not None:
                clip = amp_ops.clip_coefficient(self.grad_norm, self.max_grad_norm)
        self._push_options()
        self.inner.step(grad_scale=grad_scale, found_inf=found_inf, clip=clip)
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
        """As torch's. After a backward whose ``step()`` is skipped, also drops the gradients already
        in the buckets: it finishes their collectives first, so then every rank must call it."""
        self._grads.discard()
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
            groups.append({**_options(group), "params": list(range(start, start + n))})
            start += n
        return {"state": full, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (from ``state_dict()`` or a single-process optimizer of the same class):
        the moments and step counts, and every group's options (lr, betas, ... as an LR scheduler left them)."""
        saved_sizes = [len(g["params"]) for g in state_dict["param_groups"]]
        sizes = [len(g["params"]) for g in self.param_groups]
        if saved_sizes != sizes:
            raise InvalidProblemError("trainops.distributed.ShardedOptimizer.load_state_dict: argument 'state_dict' "
                                      f"has param groups of {saved_sizes} parameters, this optimizer {sizes}")
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
            group.update(_options(saved_group))
        self._push_options()

    def sharded_state_dict(self) -> dict:
        """This rank's slices of the state and the groups' options (no communication)."""
        self._push_options()
        return {"world_size": self.world, "rank": self.rank, "bucket_numels": [b.numel for b in self.buckets],
                "inner": self.inner.state_dict()}

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        layout = (state_dict["world_size"], state_dict["rank"], state_dict["bucket_numels"])
        if layout != (self.world, self.rank, [b.numel for b in self.buckets]):
            raise InvalidProblemError("trainops.distributed.ShardedOptimizer.load_sharded_state_dict: the state was "
                                      f"saved for (world size, rank, buckets) = {layout[:2]}, this optimizer is "
                                      f"{(self.world, self.rank)} with its own buckets; load the full state_dict instead")
        self.inner.load_state_dict(state_dict["inner"])
        for group, inner_group in zip(self.param_groups, self.inner.param_groups):
            group.update(_options(inner_group))


__all__ = ["GradientSync", "ShardedOptimizer"]
