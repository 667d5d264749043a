"""Record the distinct Triton launches that run under the interpreter (for benchmarks/compile_for_gpu.py).

As a pytest plugin, over the test suite (TRITON_INTERPRET=1 must be set before pytest starts):

    TRITON_INTERPRET=1 PYTHONPATH=benchmarks python -m pytest -q -k triton -p record_triton_launches \\
        --record-launches launches.pkl [--record-dtype float64]
    python benchmarks/compile_for_gpu.py --compile launches.pkl

A launch is recorded as (kernel's module, kernel's name, its arguments' kinds): pointer dtypes,
run-time integers by width (i32 / i64), constexprs by value. ``only_dtype``: keep only launches
with a pointer of that torch dtype.
"""

from __future__ import annotations

import inspect
import pickle


def _kind(value, constexpr: bool):
    import torch
    import triton.language as tl

    if isinstance(value, torch.Tensor):
        return ("ptr", str(value.dtype))
    if value is None:
        return ("none",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", "i64" if not (-2**31 <= value < 2**31) else "i32", value if constexpr else 0)
    if isinstance(value, float):
        return ("float", value if constexpr else 0.0)
    if isinstance(value, tl.dtype):
        return ("dtype", str(value))
    if isinstance(value, str):
        return ("str", value)
    return ("other", repr(value)[:80])


def install(launches: dict, only_dtype: str | None = None) -> None:
    """Count every interpreted launch into ``launches`` from now on (Triton's interpreter must be on)."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted_run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args))
        bound.update({k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages", "num_ctas", "maxnreg")})
        kinds = tuple((k, _kind(v, k in params and "constexpr" in str(params[k].annotation)))
                      for k, v in sorted(bound.items()))
        if only_dtype is None or ("ptr", f"torch.{only_dtype}") in (kind for _, kind in kinds):
            key = (self.fn.__module__, self.fn.__name__, kinds)
            launches[key] = launches.get(key, 0) + 1
        return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


_LAUNCHES: dict = {}


def pytest_addoption(parser):
    parser.addoption("--record-launches", metavar="PATH", help="write the recorded Triton launches here")
    parser.addoption("--record-dtype", default=None, help="keep launches with a pointer of this torch dtype")


def pytest_configure(config):
    if config.getoption("--record-launches"):
        install(_LAUNCHES, config.getoption("--record-dtype"))


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--record-launches")
    if path:
        with open(path, "wb") as f:
            pickle.dump(_LAUNCHES, f)
        print(f"\nrecorded {len(_LAUNCHES)} distinct Triton launches -> {path}")
