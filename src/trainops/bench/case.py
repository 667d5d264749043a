"""What a benchmark case is, and the small tools case lists share: the base of ``trainops.bench``.

``Case`` (what ``run_cases`` times), ``Impl`` (an implementation that needs more than a factory),
``Timing`` (how the GPU times a case), the input helpers (``rotate`` / ``rotation_sets``,
``_randn``, ``_dt``), the peer lookup ``_peer`` and ``deterministic_algorithms``. The case lists
(``trainops.bench.cases`` and its family modules ``cases_<family>.py``) and the runner
(``trainops.bench``) import these from here; this module imports nothing of ``trainops.bench``,
so data flows one way: case lists -> this module, runner -> case lists.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from ..plan import heuristics


@dataclass(frozen=True)
class Timing:
    """How a case's implementations are timed on the GPU (the CPU path ignores it: see time_cpu).

    method "do_bench": ``triton.testing.do_bench`` median, ``warmup`` and ``rep`` in ms.
    method "events": ``warmup`` calls, then CUDA events around ``rep`` back-to-back calls, ms per
    call (host launch cost included: for launch-bound cases).
    """

    method: str = "do_bench"
    warmup: int = 25
    rep: int = 200

    def __post_init__(self):
        if self.method not in ("do_bench", "events"):
            raise ValueError(f"Timing.method must be 'do_bench' or 'events', got {self.method!r}")


DEFAULT_TIMING = Timing()


@dataclass
class Impl:
    """An implementation of a case that needs more than a factory.

    factory: as a bare factory, returns the zero-argument call that is checked, then timed.
    nbytes: the bytes this implementation is credited with (default: the case's).
    context: returns a context manager entered around the factory, the check and the timing.
    fields: extra keys of this implementation's row.
    """

    factory: Callable[[], Callable[[], object]]
    nbytes: int | None = None
    context: Callable[[], ContextManager] | None = None
    fields: dict = field(default_factory=dict)


Factory = Callable[[], Callable[[], object]]


@dataclass
class Case:
    op: str                                   # registry op timed (the family's main op)
    label: str                                # shape and dtype
    nbytes: int                               # fewest bytes moved
    # build(peers) -> (impls, reference) or (impls, reference, fields known once the inputs exist);
    # impls: {name: factory or trainops.bench.Impl}
    build: Callable[[bool], tuple]
    fields: dict = field(default_factory=dict)  # extra keys of every row (JSON), e.g. stream, classes
    timing: Timing = DEFAULT_TIMING             # how the GPU times it (do_bench ms, or CUDA events)
    tolerance: float | None = None              # largest relative error a trainops implementation may have


def _peer(module: str, name: str):
    """``module.name`` of a peer library when it is installed and imports, else None."""
    try:
        mod = __import__(module, fromlist=[name])
        return getattr(mod, name)
    except Exception:
        return None


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _randn(shape, dtype, device, seed, scale=1.0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, device=device, generator=gen) * scale).to(dtype)


def rotation_sets(nbytes: int, l2_bytes: int) -> int:
    """Input sets a case rotates among: 4 when the bytes it moves fit in 4x L2 (so that a timed
    call does not find its inputs in L2 from the call before), else 1."""
    return 1 if nbytes > 4 * l2_bytes else 4


def rotate(fn: Callable, sets) -> Callable[[], object]:
    """A zero-argument call of ``fn(*sets[0])``, then ``fn(*sets[1])``, ... in turn, cyclically
    (the first call, the runner's check, uses sets[0])."""
    turn = itertools.cycle(sets)
    return lambda: fn(*next(turn))


@contextlib.contextmanager
def deterministic_algorithms(warn_only: bool = True):
    """``torch.use_deterministic_algorithms(True)`` inside the block, torch's previous mode after."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _heuristics_impls(cls, names, variants, label) -> list[tuple[str, dict]]:
    """Per variant (values of ``names``): its row name ``label(values)`` and Impl keywords: the
    context that puts ``cls(**values)`` in force (trainops.heuristics) around the implementation's
    check and timing, and fields: the values, and ``default`` (they are cls()'s)."""
    default = cls()
    out = []
    for values in variants:
        config = dict(zip(names, values))
        out.append((label(values), dict(context=functools.partial(heuristics, cls(**config)),
                                        fields={"heuristics": config,
                                                "default": all(getattr(default, k) == v for k, v in config.items())})))
    return out
