"""The kernel registry: the one place that maps (op, device type, dtype, index dtype) to a kernel.

Each op family registers its kernels next to their launchers (``ops/<family>.py``)::

    @register("softmax", backend="triton", dtypes=FLOATS, deterministic=True, accumulator="float32")
    def _prepare_softmax_triton(problem): ...   # returns a callable that launches the kernel

Dispatch (``lookup``) picks the kernel of the pinned backend (``with trainops.backend("cpu"):``),
or else the default backend of the device type: ``triton`` on CUDA, ``cpu`` on the CPU. There is
no fallback: if the chosen backend has no kernel for the combination, ``UnsupportedError`` says so.
A backend may register two kernels for one op, a deterministic one and a non-deterministic one
(atomics); ``lookup(..., deterministic=False)`` asks for the latter where it exists.

Running Triton kernels on CPU tensors: set ``TRITON_INTERPRET=1`` before importing trainops and
pin the backend with ``trainops.backend("triton")``; Triton's interpreter then runs the GPU code.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import torch

from .errors import InvalidProblemError, UnsupportedError

# cudnn: torch's own CUDA kernels (its convolutions: cuDNN); quack: quack-kernels' CUDA kernels, registered
# only where the optional extra trainops[quack] imports (ops/softmax.py)
BACKENDS = ("triton", "cudnn", "quack", "cpu")
DEFAULT_BACKEND = {"cuda": "triton", "cpu": "cpu"}
FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
INDEX_DTYPES = frozenset({torch.int32, torch.int64})
# Every float kernel sums in float32, or in float64 when it computes in float64.
ACCUMULATOR = "float32 (float64 for float64)"


def accumulator_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and running maxima are kept in (see ACCUMULATOR)."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def triton_available() -> bool:
    """True when Triton imports (it is optional: the CPU path works without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """True when Triton's interpreter is on (``TRITON_INTERPRET=1``): Triton kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def normalize_device(device) -> torch.device:
    """torch.device(device), with "cuda" resolved to the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter: it only shapes grids)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def dtype_name(dtype: torch.dtype | None) -> str:
    """``float32`` for torch.float32; ``-`` for None."""
    return "-" if dtype is None else str(dtype).replace("torch.", "")


@dataclass(frozen=True, eq=False)
class KernelInfo:
    """One registered kernel.

    ``prepare(problem)`` turns a validated problem into a ``Launch`` (see plan.py); it is called
    once per plan, so heuristics and layout work are paid once.
    """

    op: str
    backend: str
    name: str
    device_types: tuple[str, ...]
    dtypes: frozenset
    deterministic: bool
    accumulator: str
    prepare: Callable
    index_dtypes: frozenset = field(default_factory=frozenset)

    def supports(self, device_type: str, dtype: torch.dtype, index_dtype: torch.dtype | None) -> bool:
        if device_type not in self.device_types or dtype not in self.dtypes:
            return False
        return index_dtype is None or index_dtype in self.index_dtypes

    def row(self) -> dict:
        """A printable summary (``python -m trainops kernels``)."""
        order = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64]
        return {
            "op": self.op,
            "backend": self.backend,
            "kernel": self.name,
            "devices": ",".join(self.device_types),
            "dtypes": ",".join(dtype_name(d) for d in order if d in self.dtypes),
            "index dtypes": ",".join(dtype_name(d) for d in order if d in self.index_dtypes) or "-",
            "deterministic": "yes" if self.deterministic else "no",
            "accumulator": self.accumulator,
        }


@dataclass(frozen=True)
class OpSpec:
    """What the plan API needs to know about an op: how to validate a problem descriptor.

    ``describe(**fields) -> problem`` raises InvalidProblemError / UnsupportedError.
    ``descriptor``: a NamedTuple class with ``describe``'s arguments as its fields (and defaults),
    made from its signature: a call site fills it once, and it is both the plan-cache key
    (``plan.cached_plan``) and what ``describe`` validates when the cache has no plan for it.
    """

    name: str
    describe: Callable
    descriptor: type
    doc: str = ""
    choose_backend: Callable | None = None


_KERNELS: dict[tuple[str, str, bool], KernelInfo] = {}
_OPS: dict[str, OpSpec] = {}
_LOADERS: dict[str, list[Callable[[], object]]] = {}
_BACKEND_NOTES: dict[str, str] = {}
_pinned_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("trainops_backend", default=None)


def descriptor_type(op: str, describe: Callable) -> type:
    """A NamedTuple class whose fields are ``describe``'s arguments, with the same defaults (class
    attribute ``op`` names the op)."""
    fields, defaults = [], []
    for param in inspect.signature(describe).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"trainops.registry: describe of {op!r} takes *{param.name}; a descriptor needs named "
                            "arguments")
        if param.default is param.empty and defaults:
            raise TypeError(f"trainops.registry: describe of {op!r}: argument {param.name!r} without a default "
                            "follows arguments with one")
        fields.append((param.name, object))
        if param.default is not param.empty:
            defaults.append(param.default)
    cls = NamedTuple("".join(part.title() for part in op.split("_")) + "Descriptor", fields)
    cls.__new__.__defaults__ = tuple(defaults)
    cls.op = op
    cls.__doc__ = f"The descriptor of {op!r}: the arguments of its describe, {describe.__qualname__}."
    return cls


def register_op(name: str, describe: Callable, doc: str = "", *, choose_backend: Callable | None = None) -> type:
    """Declare an op and the function that validates its problem descriptors; returns the op's
    descriptor class (see OpSpec).

    ``choose_backend(problem) -> backend name``: the backend a problem runs on when none is pinned,
    for an op whose best kernel depends on the problem (a convolution: cuDNN, or Triton on the
    shapes where it was measured to win); without it, the device type's DEFAULT_BACKEND."""
    descriptor = descriptor_type(name, describe)
    _OPS[name] = OpSpec(name, describe, descriptor, doc or describe.__doc__ or "", choose_backend)
    return descriptor


def register(op: str, *, backend: str, dtypes, deterministic: bool, accumulator: str,
             name: str | None = None, index_dtypes=(), device_types: tuple[str, ...] | None = None):
    """Decorator: register ``prepare`` as the ``backend`` kernel of ``op``.

    ``device_types`` defaults to ``("cuda",)`` for Triton (plus ``"cpu"`` under the interpreter),
    cuDNN and quack, and ``("cpu",)`` for the CPU backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if device_types is None:
        if backend == "triton":
            device_types = ("cuda", "cpu") if triton_interpreting() else ("cuda",)
        elif backend in ("cudnn", "quack"):
            device_types = ("cuda",)
        else:
            device_types = ("cpu",)

    def decorate(prepare: Callable) -> Callable:
        key = (op, backend, deterministic)
        if key in _KERNELS:
            kind = "deterministic" if deterministic else "non-deterministic"
            raise ValueError(f"a {kind} {backend} kernel for {op!r} is registered already")
        _KERNELS[key] = KernelInfo(
            op=op, backend=backend, name=name or prepare.__name__.lstrip("_"),
            device_types=tuple(device_types), dtypes=frozenset(dtypes), deterministic=deterministic,
            accumulator=accumulator, prepare=prepare, index_dtypes=frozenset(index_dtypes),
        )
        return prepare

    return decorate


def register_loader(backend: str, load: Callable[[], object]) -> None:
    """Defer the registration of ``backend``'s kernels that need an optional package costly to import
    (quack: ops/softmax.py): the registry calls ``load()`` once, before the first listing
    (``kernels()``) and before the first look-up of that backend (pinned, or chosen by an op's
    ``choose_backend``, which may call it itself). ``load`` registers nothing where the package does
    not import, and raises nothing: the registry is then as it would be without the package."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _LOADERS.setdefault(backend, []).append(load)


def note_backend(backend: str, note: str | None) -> None:
    """Record (or clear, with None) why a deferred backend registered nothing: a loader whose package is
    on the path but did not import says so here, and ``python -m trainops kernels`` / ``env`` print it."""
    if note is None:
        _BACKEND_NOTES.pop(backend, None)
    else:
        _BACKEND_NOTES[backend] = note


def backend_notes() -> dict[str, str]:
    """{backend: why it registered nothing} for the deferred backends that were tried and failed
    (their loaders run first)."""
    if _LOADERS:
        _run_loaders()
    return dict(_BACKEND_NOTES)


def _run_loaders(backend: str | None = None) -> None:
    """Call (once) the pending loaders of ``backend``, or of every backend."""
    for name in [backend] if backend is not None else list(_LOADERS):
        for load in _LOADERS.pop(name, ()):
            load()


def kernels() -> list[KernelInfo]:
    """Every registered kernel, sorted by op and backend (deferred registrations made first)."""
    if _LOADERS:
        _run_loaders()
    return sorted(_KERNELS.values(), key=lambda k: (k.op, BACKENDS.index(k.backend), not k.deterministic))


def ops() -> list[str]:
    return sorted(_OPS)


def op_spec(op: str) -> OpSpec:
    try:
        return _OPS[op]
    except KeyError:
        raise UnsupportedError(f"trainops: unknown op {op!r}; known ops: {', '.join(ops())}") from None


def pinned_backend() -> str | None:
    """The backend pinned by the innermost ``trainops.backend(...)`` block, or None."""
    return _pinned_backend.get()


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Pin the backend (``"triton"``, ``"cudnn"``, ``"quack"`` or ``"cpu"``) for every trainops op
    run inside the block (an op with no kernel of that backend then raises UnsupportedError; quack
    has kernels only where trainops[quack] is installed and imports).

    Pinning ``"triton"`` on CPU tensors works only with ``TRITON_INTERPRET=1`` set before import.
    """
    if name not in BACKENDS:
        raise InvalidProblemError(f"trainops.backend: argument 'name' is {name!r}; expected one of {BACKENDS}")
    token = _pinned_backend.set(name)
    try:
        yield
    finally:
        _pinned_backend.reset(token)


def lookup(op: str, device_type: str, dtype: torch.dtype, index_dtype: torch.dtype | None = None,
           *, backend: str | None = None, deterministic: bool = True) -> KernelInfo:
    """The kernel that runs ``op`` for this device type and dtype, or ``UnsupportedError``.

    ``backend`` defaults to the pinned one, else to the device type's default backend.
    ``deterministic=True`` (the default) takes the backend's deterministic kernel; ``False``
    takes its non-deterministic one where it registers one (atomics: faster, not bit-stable),
    else the deterministic one.
    """
    op_spec(op)
    chosen = backend or pinned_backend() or DEFAULT_BACKEND.get(device_type)
    where = f"device '{device_type}', dtype {dtype_name(dtype)}"
    if index_dtype is not None:
        where += f", index dtype {dtype_name(index_dtype)}"
    if chosen is None:
        raise UnsupportedError(f"trainops.{op}: no backend runs on {where}")
    if chosen in _LOADERS:
        _run_loaders(chosen)
    info = _KERNELS.get((op, chosen, True))
    if not deterministic:
        info = _KERNELS.get((op, chosen, False), info)
    if info is None and deterministic and (op, chosen, False) in _KERNELS:
        raise UnsupportedError(f"trainops.{op}: the {chosen} backend has no deterministic kernel; asked for {where}")
    if info is None:
        hint = " (is triton installed?)" if chosen == "triton" and not triton_available() else ""
        if chosen == "quack":
            hint = " (the quack backend registers kernels only where quack-kernels imports: pip install 'trainops[quack]')"
        raise UnsupportedError(f"trainops.{op}: no {chosen} kernel is registered{hint}; asked for {where}")
    if not info.supports(device_type, dtype, index_dtype):
        hint = ""
        if chosen == "triton" and device_type == "cpu" and not triton_interpreting():
            hint = " (Triton kernels run on CPU tensors only with TRITON_INTERPRET=1 set before import)"
        raise UnsupportedError(f"trainops.{op}: the {chosen} kernel does not support {where}{hint}")
    return info
