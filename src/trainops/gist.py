"""trainops.gist: activations stored for the backward pass in compressed form (GIST; ONNX Runtime's
Gist encoders and decoders), opt-in per model.

    y = trainops.gist.relu(x)                  # torch.relu; its backward keeps 1 bit an element
    z = trainops.gist.relu_max_pool2d(x, 3, 2, 1)          # max_pool2d(relu(x)); keeps 1 byte a window
    handle = trainops.gist.compress(model, stash="e4m3")   # every nn.ReLU -> gist.ReLU, and the
                                                           # model's other stashed activations 1 byte
    with trainops.gist.saved_tensors("bf16") as stats:     # or around any forward
        loss = model(x)
    loss.backward(); print(stats.stored_bytes / stats.original_bytes)

Three savings, which add up:

- **Exact.** ``relu`` / ``ReLU`` save ceil(numel / 8) bytes of bits (where the output is not <= 0)
  instead of the output: torch's ReLU backward needs nothing else, so the gradient is torch's bit
  for bit. The output itself is freed unless another node saves it too (a following convolution or
  linear layer saves its input: pair with ``stash`` to pack that one).
- **Exact, pooled.** ``relu_max_pool2d`` / ``ReLUMaxPool2d`` (a ReLU then a 2-D max pooling, as
  in ResNet's stem) save one byte a window (where its maximum was, or that it was <= 0) instead
  of the ReLU's output (which the pooling would save as its input) and the pooling's int64
  indices; the gradient is torch's.
- **Lossy.** ``saved_tensors(format)`` packs every float tensor the autograd graph saves while it is
  active, for the backward pass to unpack: "e4m3" / "e5m2" (float8, 1 byte, a power-of-two scale
  per tensor), "fp16" / "bf16" (2 bytes); the formats and their rounding are in
  trainops.ops.gist. Only activations are packed: tensors computed from something that needs a
  gradient (a ``grad_fn``), other than views and casts of leaves (a parameter, its transpose that a
  linear layer saves, its autocast copy, the model's inputs stay as they are: they are alive
  anyway, and a packed copy would add memory and error), dense (an expanded or sliced view stays:
  packing it would copy it whole), of at least ``min_numel`` elements, wider than the format, plain
  tensors (not DTensors or other subclasses). A tensor saved by several nodes is packed once (the
  same tensor object at the same version; a write through ``.data``, which bumps no version, is
  not seen: do not write saved activations through ``.data`` inside the context). The gradients
  change by the format's rounding of what the backward reads: measured in benchmarks/NOTES.md
  ("GIST").

``compress(model, relu=True, stash=None)`` turns every ``torch.nn.ReLU`` module of ``model`` (the
model itself included; also ``inplace=True`` ones, computed out of place: the bits replace the
saved output, so the input is freed as before) into a ``trainops.gist.ReLU`` in place (its class
is swapped: the same object, so its hooks and a module shared by several parents stay as they
are) and, with ``stash``, runs every forward of ``model`` inside ``saved_tensors`` (forward hooks
that also close it when the forward raises). It returns a ``GistHandle``: the swapped modules'
names, ``left`` (subclasses of ``torch.nn.ReLU`` it does not swap: their forward is their own),
the last forward's ``StashStats``, and ``remove()`` to take the hooks off. A plain
``torch.nn.Sequential`` holding a ReLU followed by a ``torch.nn.MaxPool2d`` becomes a
``FusingSequential`` (its class swapped in place), whose forward runs such pairs as one
``relu_max_pool2d`` when neither module is hooked and the pooling's options are ones it takes;
the modules stay as they are (iterating or slicing the Sequential, or calling a module, does what
it did); ``GistHandle.fused`` lists the pairs found.
ReLUs called as functions (``F.relu``, ``torch.relu``) and pairs outside a Sequential (a forward
that calls ``self.relu`` then ``self.maxpool``) are not swapped and not seen; call
``trainops.gist.relu`` / ``relu_max_pool2d`` there.

Eager mode: under torch.compile, ``relu`` is a custom op like the others; ``saved_tensors`` is a
``torch.autograd.graph.saved_tensors_hooks`` context, which torch.compile handles (or refuses) as
it does any such hooks.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from .dtensor import is_dtensor
from .errors import InvalidProblemError, UnsupportedError, argument_error
from .ops import gist as gist_ops
from .ops.gist import STASH_FORMATS, Stashed, pack_stash, unpack_stash

MIN_NUMEL = 4096   # smaller saved tensors (biases' inputs, statistics) are not worth a scale and a launch


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """``torch.nn.functional.relu(input)``, saving 1 bit an element for its backward.

    input: float32, float16, bfloat16 or float64, any shape; a dense layout (contiguous,
    channels_last, a permutation) is read in place and kept by the output, any other is copied
    first. Returns a new tensor (``inplace=True`` raises UnsupportedError: the op does not write
    its input). Gradient: dy where the output is positive, else 0, exactly torch's. Errors:
    UnsupportedError for other dtypes or a DTensor, InvalidProblemError for a non-tensor.
    """
    op = "gist.relu"
    _check_float_input(op, input)
    if inplace:
        raise argument_error(UnsupportedError, op, "inplace", "is True; trainops.gist.relu returns a new tensor "
                             "(its saved state is the bits, so the input is freed as after an in-place ReLU)")
    y = gist_ops.eager_relu(input)   # plain eager: the plans made once per layout
    if y is None:
        y, _ = gist_ops.gist_relu_op(input)
    return y


def _check_float_input(op: str, input) -> None:
    """``input`` a plain (not D-) tensor of float32, float16, bfloat16 or float64, else the error
    naming it."""
    if not isinstance(input, Tensor):
        raise argument_error(InvalidProblemError, op, "input", f"must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in gist_ops.FLOATS:
        raise argument_error(UnsupportedError, op, "input", f"has dtype {input.dtype}; supported: float32, float16, "
                             "bfloat16, float64")
    if is_dtensor(input):
        raise argument_error(UnsupportedError, op, "input", "is a DTensor; call it on the local tensor")


def relu_max_pool2d(input: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    """``F.max_pool2d(F.relu(input), kernel_size, stride, padding)`` saving one byte a window for
    the backward (the position of its maximum, or none where it is <= 0) instead of the ReLU's
    output and the pooling's int64 indices (GIST's Binarize pair: ResNet's stem).

    input: (N, C, H, W), float32, float16, bfloat16 or float64; a dense layout (contiguous,
    channels_last) is read in place and kept by the output, any other is copied first. kernel_size,
    stride (default kernel_size), padding: an int or two, as torch's max_pool2d with dilation 1 and
    ceil_mode False; windows of at most 254 positions, padding at most half the kernel. Values are
    torch's (the first maximum of a window in row-major order, or its last NaN; a zero's sign as
    torch's relu on the device: see ``relu``); the gradient is torch's (dz to the window's
    maximum, summed where windows overlap: in a fixed order, float32, no atomics). Errors:
    InvalidProblemError for a non-tensor, another rank, bad sizes; UnsupportedError for other
    dtypes, a DTensor, or a larger window.
    """
    op = "gist.relu_max_pool2d"
    _check_float_input(op, input)
    if input.dim() != 4:
        raise argument_error(InvalidProblemError, op, "input", f"has shape {tuple(input.shape)}; expected (N, C, H, W)")
    kernel, stride, padding = gist_ops.pool_window(op, input.shape, kernel_size, stride, padding)
    z, _ = gist_ops.gist_relu_max_pool2d_op(input, list(kernel), list(stride), list(padding))
    return z


class ReLU(torch.nn.ReLU):
    """Drop-in for ``torch.nn.ReLU``: ``trainops.gist.relu`` (1 bit an element saved). ``inplace``
    is kept as an attribute (state and repr as torch's) but the output is always a new tensor."""

    def forward(self, input: Tensor) -> Tensor:
        return relu(input)


class ReLUMaxPool2d(torch.nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` applied after a ReLU, fused: ``relu_max_pool2d`` (one byte a window
    saved). Same constructor and state as torch's MaxPool2d, with dilation 1, ``return_indices``
    and ``ceil_mode`` False (others raise UnsupportedError at construction)."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False, ceil_mode=False):
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        problem = _pool_problem(self)
        if problem is not None:
            raise problem

    def forward(self, input: Tensor) -> Tensor:
        return relu_max_pool2d(input, self.kernel_size, self.stride, self.padding)


class FusingSequential(torch.nn.Sequential):
    """A ``torch.nn.Sequential`` (``compress`` swaps the class of one in place) whose forward runs
    each ``trainops.gist.ReLU`` followed by a ``torch.nn.MaxPool2d`` as one ``relu_max_pool2d``
    (on (N, C, H, W) inputs, neither module hooked, the pooling's options ones it takes; checked
    at every call). The modules themselves are unchanged: called on their own, or by other code
    iterating the Sequential, each still does its own work."""

    def forward(self, input):
        modules = list(self._modules.values())
        i = 0
        while i < len(modules):
            module = modules[i]
            following = modules[i + 1] if i + 1 < len(modules) else None
            if (type(module) is ReLU and type(following) is torch.nn.MaxPool2d and isinstance(input, Tensor)
                    and input.dim() == 4 and not _has_hooks(module) and not _has_hooks(following)
                    and _pool_problem(following) is None):
                input = relu_max_pool2d(input, following.kernel_size, following.stride, following.padding)
                i += 2
                continue
            input = module(input)
            i += 1
        return input


def _pool_problem(pool: torch.nn.MaxPool2d):
    """The error ``relu_max_pool2d`` gives for ``pool``'s options (its own window checks, and the
    options it does not take), or None."""
    op = "gist.ReLUMaxPool2d"
    dilation = (pool.dilation,) * 2 if isinstance(pool.dilation, int) else tuple(pool.dilation)
    for name, refused, why in (("dilation", dilation != (1, 1), f"is {pool.dilation}; only 1 is supported"),
                               ("return_indices", pool.return_indices,
                                "is True; the fused op keeps one byte a window, not torch's indices"),
                               ("ceil_mode", pool.ceil_mode, "is True; only False is supported")):
        if refused:
            return argument_error(UnsupportedError, op, name, why)
    try:
        gist_ops.pool_window(op, None, pool.kernel_size, pool.stride, pool.padding)
    except (InvalidProblemError, UnsupportedError) as error:
        return error
    return None


def _has_hooks(module: torch.nn.Module) -> bool:
    return any(getattr(module, name, None) for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                       "_backward_pre_hooks"))


@dataclass
class StashStats:
    """What ``saved_tensors`` packed: how many tensors, their bytes before and after, and how many
    saves reused an earlier packed copy of the same tensor."""

    packed: int = 0
    original_bytes: int = 0
    stored_bytes: int = 0
    reused: int = 0


_PASS_THROUGH = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                           "ReshapeAliasBackward0", "UnsafeViewBackward0", "ExpandBackward0", "ToCopyBackward0",
                           "AliasBackward0", "DetachBackward0"})


def _is_activation(t: Tensor) -> bool:
    """Whether ``t`` was computed from something that needs a gradient, other than a view or cast
    chain ending at a leaf (a parameter, its transpose, its autocast copy)."""
    fn = (t._base if t._is_view() else t).grad_fn
    while fn is not None and type(fn).__name__ in _PASS_THROUGH:
        sources = [f for f, _ in fn.next_functions if f is not None]
        if len(sources) != 1:
            break
        fn = sources[0]
    return fn is not None and type(fn).__name__ != "AccumulateGrad"


def _check_min_numel(op: str, min_numel) -> int:
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise argument_error(InvalidProblemError, op, "min_numel", f"is {min_numel!r}; it must be an int >= 0")
    return min_numel


@contextlib.contextmanager
def saved_tensors(format: str = "e4m3", *, min_numel: int = MIN_NUMEL) -> Iterator[StashStats]:
    """Pack the activations the autograd graph saves while active (see the module docstring).

    format: "e4m3", "e5m2", "fp16" or "bf16". min_numel: smaller tensors stay as they are. Yields
    the StashStats of this context. Errors (InvalidProblemError, before anything is hooked): an
    unknown format, a negative min_numel.
    """
    op = "gist.saved_tensors"
    spec = gist_ops.check_stash_format(op, "format", format)
    min_numel = _check_min_numel(op, min_numel)
    stats = StashStats()
    # id(tensor) -> (the tensor, its version, its packed copy), all weak: an entry lives while both
    # the tensor and the graph's packed copy do, and goes with the tensor
    packed: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
    width = spec.dtype.itemsize

    def pack(t: Tensor):
        if (type(t) not in (Tensor, torch.nn.Parameter) or t.dtype not in gist_ops.FLOATS
                or t.element_size() <= width or t.numel() < min_numel
                or not gist_ops.dense_strides(t.shape, t.stride()) or not _is_activation(t)):
            return t
        key = id(t)
        known = packed.get(key)
        if known is not None and known[0]() is t and known[1] == t._version:
            stashed = known[2]()
            if stashed is not None:
                stats.reused += 1
                return stashed
        stashed = pack_stash(t, format)
        packed[key] = (weakref.ref(t, lambda _, key=key: packed.pop(key, None)), t._version, weakref.ref(stashed))
        stats.packed += 1
        stats.original_bytes += t.numel() * t.element_size()
        stats.stored_bytes += stashed.data.numel() * stashed.data.element_size()
        return stashed

    def unpack(saved):
        return unpack_stash(saved) if isinstance(saved, Stashed) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield stats


@dataclass
class GistHandle:
    """What ``compress`` did to a model: the swapped ReLUs' names ("" for the model itself), the
    ReLU subclasses ``left`` as they are, the stash format (None: none), ``stats`` of the last
    forward (None before one, or without a stash), the (ReLU, MaxPool2d) pairs ``fused``, and
    ``remove()``."""

    swapped: list[str]
    left: list[str]
    stash: str | None
    stats: StashStats | None = None
    fused: list = field(default_factory=list)   # (ReLU, MaxPool2d) name pairs a FusingSequential runs as one op
    _hooks: list = field(default_factory=list, repr=False)
    _model: weakref.ref | None = field(default=None, repr=False)

    def remove(self) -> None:
        """Take the stash hooks off the model (the swapped ReLUs stay: they compute torch's ReLU)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        model = self._model() if self._model is not None else None
        if model is not None:
            _COMPRESSED.pop(model, None)


_COMPRESSED: "weakref.WeakKeyDictionary[torch.nn.Module, GistHandle]" = weakref.WeakKeyDictionary()


def compress(model: torch.nn.Module, *, relu: bool = True, stash: str | None = None,
             min_numel: int = MIN_NUMEL) -> GistHandle:
    """Opt ``model`` into GIST (see the module docstring): ``relu`` swaps its ``torch.nn.ReLU``
    modules for ``trainops.gist.ReLU``; ``stash`` (a format of ``saved_tensors``, or None) packs
    the activations every forward saves. Returns a GistHandle. Errors (before anything changes):
    InvalidProblemError for a non-module, an unknown stash format, a negative min_numel, or a
    model whose stash hooks are on already (``remove()`` them first).
    """
    op = "gist.compress"
    if not isinstance(model, torch.nn.Module):
        raise argument_error(InvalidProblemError, op, "model", f"must be a torch.nn.Module, got {type(model).__name__}")
    if stash is not None:
        gist_ops.check_stash_format(op, "stash", stash)
    min_numel = _check_min_numel(op, min_numel)
    if stash is not None and model in _COMPRESSED:
        raise argument_error(InvalidProblemError, op, "model", "has GIST stash hooks already; call remove() on the "
                             "handle compress returned first")
    swapped, left, fused = [], [], []
    if relu:
        for name, module in model.named_modules():   # each module once, shared ones too
            if type(module) is torch.nn.ReLU:
                module.__class__ = ReLU   # the same object: hooks, sharing and state stay
                swapped.append(name)
            elif isinstance(module, torch.nn.ReLU) and not isinstance(module, ReLU):
                left.append(name)
        # a ReLU followed by a MaxPool2d in a plain Sequential: its forward fuses them (its class
        # swapped; the modules stay as they are, so code calling them on their own is unchanged)
        for name, module in model.named_modules():
            if type(module) not in (torch.nn.Sequential, FusingSequential):
                continue
            children = list(module.named_children())
            pairs = [(first_name, second_name) for (first_name, first), (second_name, second) in zip(children, children[1:])
                     if type(first) is ReLU and type(second) is torch.nn.MaxPool2d and not _has_hooks(first)
                     and not _has_hooks(second) and _pool_problem(second) is None]
            if pairs:
                module.__class__ = FusingSequential
                prefix = f"{name}." if name else ""
                fused += [(prefix + a, prefix + b) for a, b in pairs if (prefix + a, prefix + b) not in fused]
    handle = GistHandle(swapped, left, stash, fused=fused, _model=weakref.ref(model))
    if stash is None:
        return handle
    active: list = []

    def enter(module, args):
        context = saved_tensors(stash, min_numel=min_numel)
        handle.stats = context.__enter__()
        active.append(context)

    def leave(module, args, output):
        if active:
            active.pop().__exit__(None, None, None)

    handle._hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
    _COMPRESSED[model] = handle
    return handle


__all__ = ["FusingSequential", "GistHandle", "MIN_NUMEL", "ReLU", "ReLUMaxPool2d", "STASH_FORMATS", "StashStats", "compress",
           "relu", "relu_max_pool2d", "saved_tensors"]
