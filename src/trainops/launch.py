"""Launching a Triton kernel without the JIT's per-call work.

    launch = launcher(_norm_fwd, grid, RMS=True, BLOCK_N=4096, num_warps=8)   # once, in a plan
    launch(x, w, y, ...)                                                       # every call

``kernel[grid](*args, **meta)`` binds the arguments, specialises each one (pointer alignment,
integers equal to 1 or divisible by 16), formats a cache key and looks the compiled kernel up
before it launches: 25-49 us of host time a launch on the H100 machine, three times that on
autograd's CUDA thread, where our backward ops run (benchmarks/NOTES.md, "Host overhead"). A
``launcher`` does that work on the first call of each argument specialisation and keeps the
compiled kernel: later calls compute the specialisation key themselves (each tensor's 16-byte
alignment and dtype, each integer's == 1, % 16 == 0 and 32 / 64-bit range, at the positions the first call
found them) and call the compiled kernel's launcher with the arguments in the kernel's order:
7.9-12.6 us a launch on the same machine. The key is at least as fine as Triton's own
specialisation, so a cached kernel only ever runs on arguments it was compiled for.

Arguments fixed by the plan (strides, sizes, eps: usually every scalar) can be bound once with
``trailing=(...)``: calls then pass only the leading arguments (the tensors), and the key covers
those alone, since the bound ones specialise the same way on every call.

Under torch.compile (custom ops declared with ``inline_triton``, library.py) the kernels are
traced on functional or fake tensors: a call with such tensors goes through
``torch.library.wrap_triton``, so that Inductor sees the kernel and launches it itself. Such a
call must not pass one output tensor for two pointer arguments (functionalization clones each
mutated argument on its own): absent pointers are None.

Launches on the tensors' device (the first tensor argument's), made current for the launch when
another device is current: Triton itself launches on the current device, so a model spread over
several GPUs (Hugging Face's ``device_map="auto"``) would otherwise launch its layers on cuda:1
tensors on cuda:0, which Triton refuses ("cannot be accessed from Triton"), and which a direct
launch must never do.

Falls back to ``kernel[grid]`` (always correct) under Triton's interpreter, when a launch hook is
installed (profilers such as proton), and for argument lists it does not handle (another argument
count, other argument types than the first call's, objects that are neither tensors nor numbers).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from .library import PLAIN_TENSORS
from .registry import triton_interpreting

_I32 = (-(2**31), 2**31 - 1)  # Triton types an int i32 here, i64 past it, u64 from 2^63
_U64 = 2**63


def launcher(kernel, grid: tuple, trailing: tuple = (), **meta) -> Callable[..., Any]:
    """``lambda *args: kernel[grid](*args, *trailing, **meta)``, launching the cached compiled kernel
    directly after the first call of each argument specialisation (see the module docstring).
    ``meta``: the kernel's constexpr arguments and launch options (num_warps, num_stages), fixed for
    this launcher; ``trailing``: the last run-time arguments, fixed for this launcher (numbers, not
    tensors); ``grid``: a tuple of 1 to 3 ints."""
    trailing = tuple(trailing)
    if any(isinstance(a, torch.Tensor) for a in trailing):
        raise TypeError("trainops.launch.launcher: trailing arguments must be numbers (tensors vary by call)")
    if triton_interpreting():
        jit = kernel[grid]
        return lambda *args: jit(*args, *trailing, **meta)
    return _DirectLaunch(kernel, grid, trailing, meta)


def on_device(device: torch.device):
    """A context that makes CUDA ``device`` current for the launches inside it when another device is
    current (Triton launches on the current device); a no-op off CUDA and when it is current already
    (one device query). For launches that do not go through a ``launcher``."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


def _traced(args) -> bool:
    """Whether a call's tensors are torch.compile's (functional or fake tensors), not real ones."""
    return any(isinstance(a, torch.Tensor) and type(a) not in PLAIN_TENSORS for a in args)


class _DirectLaunch:
    __slots__ = ("kernel", "grid", "meta", "trailing", "jit", "compiled", "types", "tensor_at", "int_at", "full",
                 "arg_at", "tail", "grid3", "knobs", "driver")

    def __init__(self, kernel, grid: tuple, trailing: tuple, meta: dict):
        from triton import knobs
        from triton.runtime import driver

        self.kernel, self.meta, self.trailing = kernel, meta, trailing
        self.grid = tuple(grid)
        self.jit = kernel[self.grid]
        self.grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self.compiled: dict = {}
        self.knobs, self.driver = knobs, driver
        self.types = None  # the first call's argument types; () when the direct path does not apply

    def _layout(self, args) -> tuple:
        """On the first call: the kernel's full argument list (constexprs from ``meta``), the slots
        the call's arguments (``trailing`` included) fill, where the call's own tensors and integers
        are. Returns the argument types the direct path then requires, or () when it does not handle
        this argument list."""
        params = self.kernel.params
        positional = [p for p in params if not p.is_constexpr]
        every = args + self.trailing
        if len(positional) != len(every) or any(p.name not in self.meta for p in params if p.is_constexpr):
            return ()
        if any(a is not None and type(a) not in (int, float, bool) and not isinstance(a, torch.Tensor) for a in every):
            return ()
        self.full, self.arg_at = [], []
        for p in params:
            self.arg_at += [] if p.is_constexpr else [len(self.full)]
            self.full.append(self.meta[p.name] if p.is_constexpr else None)
        for slot, a in zip(self.arg_at[len(args):], self.trailing):
            self.full[slot] = a
        self.arg_at = self.arg_at[:len(args)]
        # the usual case, constexprs after every run-time argument: the full list is args + tail
        self.tail = tuple(self.full[len(args):]) if self.arg_at == list(range(len(args))) else None
        self.tensor_at = tuple(k for k, a in enumerate(args) if isinstance(a, torch.Tensor))
        self.int_at = tuple(k for k, a in enumerate(args) if type(a) in (int, bool))
        return tuple(map(type, args))

    def __call__(self, *args):
        if self.types is None:
            if _traced(args):
                return self._traced_launch(args)
            self.types = self._layout(args)
        hooks = self.knobs.runtime
        if (not self.types or tuple(map(type, args)) != self.types
                or _installed(hooks.launch_enter_hook) or _installed(hooks.launch_exit_hook)):
            if _traced(args):
                return self._traced_launch(args)
            device = next((a.get_device() for a in args if isinstance(a, torch.Tensor)), -1)
            if device < 0 or device == self.driver.active.get_current_device():
                return self.jit(*args, *self.trailing, **self.meta)
            with torch.cuda.device(device):
                return self.jit(*args, *self.trailing, **self.meta)
        tensors = [args[k] for k in self.tensor_at]
        device = self.driver.active.get_current_device()
        own = tensors[0].get_device() if tensors else -1
        if own >= 0 and own != device:
            with torch.cuda.device(own):
                return self._launch(args, tensors, own)
        return self._launch(args, tensors, device)

    def _launch(self, args, tensors, device: int):
        """The direct launch on ``device``, the current CUDA device (the tensors' own)."""
        ints = [args[k] for k in self.int_at]
        key = (device, tuple([t.data_ptr() & 15 == 0 for t in tensors]), tuple([t.dtype for t in tensors]),
               tuple([(a == 1, a & 15 == 0, _I32[0] <= a <= _I32[1], a >= _U64, a) if type(a) is bool else
                      (a == 1, a & 15 == 0, _I32[0] <= a <= _I32[1], a >= _U64) for a in ints]))
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiled[key] = self.jit(*args, *self.trailing, **self.meta)  # compiles or loads, launches
            return compiled
        if self.tail is not None:
            full = args + self.tail
        else:
            full = list(self.full)
            for slot, a in zip(self.arg_at, args):
                full[slot] = a
        g0, g1, g2 = self.grid3
        compiled.run(g0, g1, g2, self.driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *full)
        return compiled

    def _traced_launch(self, args):
        from torch.library import wrap_triton

        return wrap_triton(self.kernel)[self.grid](*args, *self.trailing, **self.meta)


def _installed(hook) -> bool:
    """Whether a launch hook would do anything: Triton 3.6+ keeps an empty HookChain there."""
    return bool(getattr(hook, "calls", hook))


__all__ = ["launcher", "on_device"]
