"""PyTorch integration: the one helper that declares a trainops op as a ``torch.library`` custom op.

    norm_op = custom_op("rms_norm", impl, fake, backward=backward, save=save)   # in ops/<family>.py
    y = norm_op(x, weight, eps)              # torch.ops.trainops.rms_norm, or its impl in plain eager mode

``custom_op`` registers ``torch.ops.trainops.<name>``: the schema (inferred from ``impl``'s
annotations), the fake (meta) implementation torch.compile traces with, and the autograd formula.
Each op family declares its ops in its own module (``ops/<family>.py``); this module names none.

Autograd, by name rather than by position: ``save(ctx, inputs, output)`` receives the call's
arguments as attributes (``inputs.dim``), and ``backward(ctx, *grad_outputs)`` returns a dict
``{argument name: gradient}``; arguments it leaves out get None. ``ctx.needs_grad.<name>`` is
``ctx.needs_input_grad``'s flag of that argument.

Calls in plain eager mode (plain tensors, no torch.compile, no functorch transform) skip the
dispatcher: the same ``impl``, ``save`` and ``backward`` run through a ``torch.autograd.Function``
(or ``impl`` alone when no input needs a gradient). The custom op's dispatch, schema and aliasing
checks cost 100-250 us of host time a call on the H100 machine, more than many of these kernels
take (benchmarks/NOTES.md). Everything else goes through the op, whose CPU and CUDA kernels are
``impl`` itself, registered with the dispatcher directly: custom_op's own backend wrapper (its
aliasing check included) took 155 us a call inside a torch.compile graph on that machine. So
``impl`` must return new tensors, never its inputs or views of them: custom_op's aliasing check
no longer runs on these calls.
"""

from __future__ import annotations

import inspect
from collections import namedtuple
from typing import Callable

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.overrides import has_torch_function

from .compiled import Decomposition
from .dtensor import is_dtensor
from .errors import UnsupportedError
from .plan import traced_inductor_size_classes
from .registry import triton_available, triton_interpreting

PLAIN_TENSORS = (Tensor, torch.nn.Parameter)  # real tensors (not subclasses, fake or functional ones)
_KERNELS = torch.library.Library("trainops", "IMPL")  # the ops' CPU and CUDA kernels (CustomOp.__init__)


class CustomOp:
    """A trainops custom op (``.op`` is ``torch.ops.trainops.<name>``); call it like ``impl``."""

    def __init__(self, name: str, impl: Callable, fake: Callable, backward: Callable | None = None,
                 save: Callable | None = None, mutates_args: tuple[str, ...] = (),
                 inline_triton: bool | Callable = False, tags: tuple = (), decomposition: Decomposition | None = None):
        if (backward is None) != (save is None):
            raise TypeError(f"trainops.library.custom_op({name!r}): pass both backward and save, or neither")
        params = list(inspect.signature(impl).parameters.values())
        self.name = name
        self.arguments = tuple(p.name for p in params)
        self._argument_set = frozenset(self.arguments)
        # the call's arguments by name (the dispatcher may leave defaulted ones out)
        self._by_name = namedtuple(f"{name}_arguments", self.arguments,
                                   defaults=[p.default for p in params if p.default is not inspect.Parameter.empty])
        self._impl, self._backward, self._save = impl, backward, save
        self._decomposition = decomposition
        self._defaults = tuple(p.default for p in params)
        self._required = sum(p.default is inspect.Parameter.empty for p in params)
        self._arity = len(params)
        self._mutated = tuple(i for i, p in enumerate(params) if p.name in mutates_args)
        self.op = torch.library.custom_op(f"trainops::{name}", impl, mutates_args=mutates_args, tags=tags)
        self.op.register_fake(fake)
        # impl as the CPU and CUDA kernels themselves: the dispatcher then calls it directly instead of
        # through custom_op's backend wrapper, which took 155 us of host time a call inside a
        # torch.compile graph on the H100 machine (benchmarks/NOTES.md, "custom_op's backend wrapper")
        for key in ("CPU", "CUDA"):
            _KERNELS.impl(name, impl, key)
        self._inline_when = inline_triton if callable(inline_triton) else None
        if inline_triton:
            self.op.register_torch_dispatch(FunctionalTensorMode, self._decompose)
        self._function = None
        if backward is not None:
            self.op.register_autograd(self._gradients, setup_context=self._setup_context)
            self._function = type(f"{name}_function", (torch.autograd.Function,), {
                "forward": staticmethod(self._eager_forward), "backward": staticmethod(self._gradients)})

    def _decompose(self, mode, op, types, args, kwargs):
        """Under torch.compile's functionalization (AOTAutograd): on CUDA tensors of static sizes
        with compiled Triton, run ``impl`` itself, so that its kernels reach the graph
        (trainops.launch traces them with ``wrap_triton``) and Inductor launches them. The op stays
        whole under torch.export (as triton_op's), with symbolic sizes (plans are made for concrete
        shapes), off CUDA, under the interpreter, and where ``inline_triton(arguments)`` says no;
        tensor subclasses other than fake and functional ones get NotImplemented (theirs to handle)."""
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if any(not issubclass(t, FakeTensor) and t not in (Tensor, FunctionalTensor) for t in types):
            return NotImplemented
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        if (custom_triton_ops_decomposition_disabled() or not tensors or triton_interpreting()
                or not triton_available() or any(t.device.type != "cuda" or _symbolic(t) for t in tensors)
                or (self._inline_when is not None and not self._inline_when(self._by_name(*args, **kwargs)))):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            return self._impl(*args, **kwargs)

    def _setup_context(self, ctx, inputs, output) -> None:
        self._save(ctx, self._by_name(*inputs), output)

    def _eager_forward(self, ctx, *args):
        output = self._impl(*args)
        self._setup_context(ctx, args, output)
        return output

    def _gradients(self, ctx, *grad_outputs) -> tuple:
        ctx.needs_grad = self._by_name(*ctx.needs_input_grad)
        by_name = self._backward(ctx, *grad_outputs)
        if not by_name.keys() <= self._argument_set:
            unknown = sorted(set(by_name).difference(self.arguments))
            raise TypeError(f"trainops.{self.name}: backward returned gradients for {unknown}, which are not "
                            f"arguments ({', '.join(self.arguments)})")
        return tuple(map(by_name.get, self.arguments))

    def _refuse_dtensors(self, args, kwargs) -> None:
        """UnsupportedError naming the first DTensor argument: the ops have no sharding rules, and a
        sharded parameter read outside its module's forward is only this rank's shard."""
        for name, value in (*zip(self.arguments, args), *kwargs.items()):
            if is_dtensor(value):
                raise UnsupportedError(
                    f"trainops.{self.name}: argument '{name}' is a DTensor (a parameter sharded by FSDP2's "
                    "fully_shard, or by tensor parallelism); trainops ops take plain tensors: call them inside "
                    "the module's forward, where FSDP2 has gathered its parameters (or from a method registered "
                    "with torch.distributed.fsdp.register_fsdp_forward_method)")

    def _traced_decomposition(self, args, kwargs):
        """While dynamo traces a call on tensors of one device type: the decomposition's outputs
        where the CompiledChoices in force hand the call's (device type, op, dtype, size class) to
        Inductor, else None (the op). The measured table names CUDA problems only. The look-up
        takes constants only; the size, symbolic under dynamic shapes, is compared with the
        classes here, in traced code (dynamo guards on it)."""
        arguments = self._by_name(*args, **kwargs)
        tensors = [a for a in arguments if isinstance(a, Tensor)]
        if not tensors or len({t.device.type for t in tensors}) != 1:
            return None
        classes = traced_inductor_size_classes(self.name, tensors[0].device.type,
                                               self._decomposition.dtype(arguments))
        if not classes:
            return None
        size = self._decomposition.size(arguments)
        if size is None or not any(c // 2 < size <= c for c in classes):
            return None
        return self._decomposition.function(*arguments)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            if self._decomposition is not None:
                outputs = self._traced_decomposition(args, kwargs)
                if outputs is not None:
                    return outputs
            return self._dispatch(args, kwargs)
        if (kwargs or len(args) < self._required or torch._C._are_functorch_transforms_active()
                or has_torch_function(args)):
            return self._dispatch(args, kwargs)
        # one pass over the arguments: tensor subclasses (fake, functional, DTensor...) go through the op
        requires_grad = False
        for a in args:
            if isinstance(a, Tensor):
                if type(a) not in PLAIN_TENSORS:
                    return self._dispatch(args, kwargs)
                requires_grad = requires_grad or a.requires_grad
        if len(args) < self._arity:
            args += self._defaults[len(args):]
        if requires_grad and self._function is not None and torch.is_grad_enabled():
            return self._function.apply(*args)
        output = self._impl(*args)
        for i in self._mutated:  # an in-place write bumps the version, as torch's in-place ops
            if args[i] is not None:
                torch.autograd.graph.increment_version(args[i])
        return output

    def _dispatch(self, args, kwargs):
        """Through the dispatcher (torch.ops.trainops.<name>): traced, transformed or subclass calls."""
        self._refuse_dtensors(args, kwargs)
        return self.op(*args, **kwargs)


def _symbolic(t: Tensor) -> bool:
    """Whether a traced tensor has a symbolic size, stride or offset (torch.compile's dynamic shapes)."""
    return any(isinstance(d, torch.SymInt) for d in (*t.shape, *t.stride(), t.storage_offset()))


def custom_op(name: str, impl: Callable, fake: Callable, *, backward: Callable | None = None,
              save: Callable | None = None, mutates_args: tuple[str, ...] = (),
              inline_triton: bool | Callable = False, tags: tuple = (),
              decomposition: Decomposition | None = None) -> CustomOp:
    """Declare ``torch.ops.trainops.<name>`` (see the module docstring).

    impl(*args): the op (annotated arguments: the schema). fake(*args): outputs of the right
    shapes, dtypes and devices, computing nothing. save(ctx, inputs, output): what backward
    needs. backward(ctx, *grad_outputs) -> {argument name: gradient}. mutates_args: names of the
    arguments the op writes into. inline_triton: under torch.compile on CUDA, trace ``impl`` into
    the graph (its Triton kernels launched by Inductor, no custom-op call at run time), as
    ``torch.library.triton_op`` does; ``impl`` must then be traceable (no host synchronisation,
    no data-dependent Python), launch through trainops.launch.launcher, and never pass one output
    tensor for two pointer arguments; a callable ``inline_triton(arguments)`` (the call's
    arguments by name) decides per call. Calls with a CPU tensor among their arguments (a dropout
    seed) stay whole. tags: torch.Tag values of the op (``needs_exact_strides`` where the outputs'
    layout follows the inputs' strides, so that Inductor passes the inputs as traced).
    decomposition: the op in torch ops (trainops.compiled.Decomposition), traced instead of the op
    under torch.compile on CUDA where the CompiledChoices in force say Inductor's fusion of it is
    faster (trainops.compiled); a forward op's decomposition is differentiated by autograd.
    """
    return CustomOp(name, impl, fake, backward, save, mutates_args, inline_triton, tags, decomposition)


__all__ = ["CustomOp", "custom_op"]
