"""Plans: validate a problem once, pick its kernel once, then run it many times.

    p = trainops.plan("softmax", shape=(4096, 32768), dim=-1, dtype=torch.bfloat16, device="cuda")
    p.can_implement(x)      # True / False for these concrete tensors
    y = p.run(x)            # cheap checks only, then launch
    p.kernel                # KernelChoice(name, backend, params)
    p.precision             # Precision(accumulator, deterministic, bitwise_reproducible)
    p.workspace_bytes

``plan`` = ``select`` (the op's ``describe`` validates the descriptor into a problem; the registry
picks the kernel) then the kernel's ``prepare`` (heuristics, layout) into a ``Launch``.
The functional ops go through ``cached_plan`` so a repeated problem pays none of that again.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from .compiled import CompiledChoices
from .errors import InvalidProblemError, TrainopsError, UnsupportedError, argument_error
from .registry import KernelInfo, lookup, op_spec, pinned_backend


@dataclass(frozen=True)
class KernelChoice:
    """Which kernel a plan launches and with what compile-time parameters (block sizes, warps, grid)."""

    name: str
    backend: str
    params: tuple[tuple[str, Any], ...] = ()

    def __getitem__(self, key: str) -> Any:
        return dict(self.params)[key]

    def __str__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.backend}:{self.name}({params})"


@dataclass(frozen=True)
class Precision:
    """Numerical guarantees of a plan.

    accumulator: dtype of sums and running maxima. deterministic: no order-dependent atomics.
    bitwise_reproducible: the same inputs give the same bits on every run on the same device.
    """

    accumulator: torch.dtype
    deterministic: bool
    bitwise_reproducible: bool


@dataclass(frozen=True)
class Launch:
    """What a kernel's ``prepare(problem)`` returns: how to run it, and what it will do."""

    run: Callable[[Sequence[torch.Tensor], torch.Tensor], None]
    kernel: KernelChoice
    accumulator: torch.dtype
    workspace_bytes: int = 0
    bitwise_reproducible: bool = True
    # run(tensors, None) returns the outputs it made: a kernel of torch's own (cuDNN's convolutions)
    # allocates them, and a copy into outputs made beforehand would move them twice
    allocates: bool = False


class Problem(Protocol):
    """What every op family's problem descriptor provides to ``Plan``."""

    op: str
    device: torch.device
    dtype: torch.dtype
    index_dtype: torch.dtype | None

    def check(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None) -> None: ...

    def new_output(self) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class Plan:
    """A validated problem bound to one kernel. Build with ``trainops.plan(op, **descriptor)``."""

    problem: Any
    info: KernelInfo
    launch: Any = field(repr=False)  # a Launch, or a MultiTensorLaunch for multi-tensor ops (ops/multi_tensor.py)

    @property
    def kernel(self) -> KernelChoice:
        return self.launch.kernel

    @property
    def precision(self) -> Precision:
        return Precision(self.launch.accumulator, self.info.deterministic,
                         self.info.deterministic and self.launch.bitwise_reproducible)

    @property
    def workspace_bytes(self) -> int:
        return self.launch.workspace_bytes

    @cached_property
    def usage(self) -> tuple[str, str, str, str]:
        """(op, backend, kernel name, dtype name): what ``track_kernels`` counts (made once: the
        functional ops look plans up on every call)."""
        return (self.info.op, self.info.backend, self.kernel.name, str(self.problem.dtype).replace("torch.", ""))

    @property
    def compiled(self) -> str | None:
        """What a torch.compile graph runs for this problem: "triton" (this plan's kernels, launched
        by Inductor or through the op) or "inductor" (the op's decomposition, fused by Inductor:
        trainops.compiled); None for an op without a decomposition (always this plan)."""
        size = getattr(self.problem, "compiled_size", None)
        if size is None:
            return None
        return compiled_backend(self.problem.op, self.problem.device.type, self.problem.dtype, size)

    def can_implement(self, *tensors: torch.Tensor, out: torch.Tensor | None = None) -> bool:
        """True when ``run(*tensors, out=out)`` would accept these tensors."""
        try:
            self.problem.check(tensors, out)
        except TrainopsError:
            return False
        return True

    def run(self, *tensors: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Launch on ``tensors`` (shapes, strides, dtypes and device as planned); returns the output."""
        self.problem.check(tensors, out)
        return self.run_unchecked(tensors, out)

    def run_unchecked(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` without the checks, for callers whose plan came from these very tensors."""
        if self.launch.allocates:
            return self.launch.run(tensors, out)
        if out is None:
            out = self.problem.new_output()
        self.launch.run(tensors, out)
        return out


def check_tensor(op: str, name: str, t, shape, dtype, device, strides=None) -> None:
    """The cheap check of one concrete tensor against a plan: type, shape, dtype, device, strides."""
    if not isinstance(t, torch.Tensor):
        raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise argument_error(InvalidProblemError, op, name, f"has shape {tuple(t.shape)}; the plan is for {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise argument_error(InvalidProblemError, op, name, f"has dtype {t.dtype}; the plan is for {dtype}")
    if t.device != device:
        raise argument_error(InvalidProblemError, op, name, f"is on device {t.device}; the plan is for {device}")
    if strides is not None and t.stride() != tuple(strides):
        raise argument_error(InvalidProblemError, op, name,
                             f"has strides {t.stride()}; the plan is for {tuple(strides)} (make a plan for this layout)")


def checked_shape(op: str, name: str, shape) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, or InvalidProblemError naming ``name`` (not ints, a negative size)."""
    try:
        shape = tuple(operator.index(s) for s in shape)   # ints only: not 2.5, not "2"
    except TypeError:
        raise argument_error(InvalidProblemError, op, name, f"must be a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise argument_error(InvalidProblemError, op, name, f"has a negative size: {shape}")
    return shape


def select(problem) -> Plan:
    """Bind a validated problem to the registry's kernel for its device and dtype."""
    spec = op_spec(problem.op)
    chosen = spec.choose_backend(problem) if spec.choose_backend is not None and pinned_backend() is None else None
    info = lookup(problem.op, problem.device.type, problem.dtype, problem.index_dtype, backend=chosen,
                  deterministic=getattr(problem, "deterministic", True))
    return Plan(problem, info, info.prepare(problem))


def plan(op: str, **descriptor) -> Plan:
    """Validate a problem descriptor for ``op`` and return its plan (see the op's ``describe``).

    Raises InvalidProblemError (bad axis, shapes, device) or UnsupportedError (dtype, rank, backend).
    """
    return select(op_spec(op).describe(**descriptor))


# ----------------------------------------------------------------------------------------------
# Heuristics: each op family's tunable tables (tile sizes, warps, programs per SM...) are one
# frozen config object, its class's defaults the measured choices (ops/<family>.py says what
# measured them). A family reads the object in force when it builds a descriptor or launches;
# a plan keeps the one it was made with, and its descriptor (the cache key) carries it.
# ----------------------------------------------------------------------------------------------

_overrides: contextvars.ContextVar[dict] = contextvars.ContextVar("trainops_heuristics", default={})
_defaults: dict[type, Any] = {}


@contextlib.contextmanager
def heuristics(*configs) -> Iterator[None]:
    """Plan and launch the ops run inside the block with ``configs`` (instances of op families'
    heuristics classes, e.g. ``ops.softmax.SoftmaxHeuristics(register_tile=...)``) instead of the
    families' defaults: a sweep, a test that forces a plan on small shapes, a tuned deployment.

        with trainops.heuristics(SoftmaxHeuristics(register_tile=(64, 64, 32, 16))):
            y = trainops.softmax(x, -1)

    Under torch.compile the plans are made when a graph is traced (inside the block, where the
    compiled function is first called in it). torch.compile's caches (AOTAutograd's and
    Inductor's, in memory and on disk) key on the graph, not on these objects: a graph compiled
    under other heuristics is reused as it was. To compare heuristics under compile, turn the
    caches off (``torch._inductor.config.force_disable_caches = True``) or use fresh processes
    with ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``.
    """
    merged = dict(_overrides.get())
    for config in configs:
        merged[type(config)] = config
    token = _overrides.set(merged)
    try:
        yield
    finally:
        _overrides.reset(token)


def keep_heuristics(config):
    """``heuristics(config)``, or a no-op context when ``config`` is the one in force already (a
    backward replanning with its forward's heuristics, the usual case: the block's context variable
    and generator cost 1.4 us of host time on the CPU host)."""
    return contextlib.nullcontext() if heuristics_for(type(config)) is config else heuristics(config)


def heuristics_for(cls: type):
    """The ``cls`` heuristics in force: the innermost ``heuristics(...)`` block's, else ``cls()``."""
    found = _overrides.get().get(cls)
    if found is None:
        found = _defaults.get(cls)
        if found is None:
            found = _defaults[cls] = cls()
    return found


def compiled_backend(op: str, device_type: str, dtype: torch.dtype, size: int) -> str:
    """The backend the CompiledChoices in force name for this problem: "triton" or "inductor"."""
    return heuristics_for(CompiledChoices).backend(device_type, op, dtype, size)


def _inductor_size_classes(op: str, device_type: str, dtype: torch.dtype) -> tuple[int, ...]:
    """The size classes whose problems of (op, device type, dtype) a traced graph hands to Inductor:
    none under torch.export (the op stays whole in an exported program) or with a backend pinned
    (trainops.backend: the pinned kernels run)."""
    if torch.compiler.is_exporting() or pinned_backend() is not None:
        return ()
    return heuristics_for(CompiledChoices).size_classes(device_type, op, dtype)


# dynamo calls it while it traces and bakes the answer into the graph (no trace of the look-up); its
# arguments are constants, so symbolic sizes are compared with the classes in traced code (guarded)
traced_inductor_size_classes = torch.compiler.assume_constant_result(_inductor_size_classes)


_PLANS: dict[tuple, Plan] = {}
_PLAN_CACHE_SIZE = 4096
_stats = {"hits": 0, "misses": 0}


def cached_plan(descriptor: tuple, *, count: bool = True) -> Plan:
    """The plan for ``descriptor`` (an instance of its op's descriptor class, ``register_op``'s
    return), made once by ``plan(descriptor.op, **descriptor._asdict())``.

    The descriptor is the key, with the pinned backend. The functional ops call this on every
    launch, so the hit path is the descriptor's build and one dict look-up. ``count=False``: not
    counted by ``track_kernels`` (an eager path that keeps the plan counts its runs, ``record_use``).
    """
    op = descriptor.op
    key = (op, pinned_backend(), descriptor)
    found = _PLANS.get(key)
    if found is not None:
        _stats["hits"] += 1
    else:
        _stats["misses"] += 1
        found = plan(op, **descriptor._asdict())
        if len(_PLANS) >= _PLAN_CACHE_SIZE:
            _PLANS.clear()
        _PLANS[key] = found
    if _tracked and count:
        record_use(found)
    return found


def record_use(found: Plan) -> None:
    """Count one run of ``found`` in every ``track_kernels`` block open (``cached_plan`` does it for
    the plans it hands out; an eager path running plans it keeps calls it itself)."""
    usage = found.usage
    for counts in _tracked:
        counts[usage] = counts.get(usage, 0) + 1


_tracked: list[dict] = []


@contextlib.contextmanager
def track_kernels() -> Iterator[dict]:
    """Count the kernels trainops dispatches inside the block.

        with trainops.track_kernels() as used:
            train_step()
        used  # {(op, backend, kernel name, dtype): calls}
    """
    counts: dict = {}
    _tracked.append(counts)
    try:
        yield counts
    finally:
        _tracked.remove(counts)


def plan_cache_info() -> dict:
    return {**_stats, "size": len(_PLANS)}


def clear_plan_cache() -> None:
    _PLANS.clear()
    for clear in _KEPT_PLANS:
        clear()


_KEPT_PLANS: list = []   # the ``clear`` of each cache of plans an eager path keeps (``keeps_plans``)


def keeps_plans(cache: dict) -> dict:
    """Register ``cache``, a dict of plans (or of records holding plans) kept by an op family's eager
    path, to be emptied with the plan cache (``clear_plan_cache``); returns it."""
    _KEPT_PLANS.append(cache.clear)
    return cache


__all__ = ["check_tensor", "checked_shape", "compiled_backend", "KernelChoice", "Launch", "Plan", "Precision", "Problem", "cached_plan", "clear_plan_cache",
           "heuristics", "heuristics_for", "plan", "plan_cache_info", "select", "track_kernels", "InvalidProblemError",
           "UnsupportedError"]
__all__ += ["keep_heuristics", "keeps_plans", "record_use"]
