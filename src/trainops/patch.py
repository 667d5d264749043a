"""``trainops.patch(model)``: turn the torch.nn modules trainops covers into trainops's, in place.

    model = torch.nn.Transformer(...)            # or any nn.Module
    report = trainops.patch(model)
    print(report)                                # what was swapped, and what was left and why

Swapped (exact torch classes only; subclasses are left alone and reported, they may override forward):
    torch.nn.Softmax -> trainops.nn.Softmax            torch.nn.LogSoftmax -> trainops.nn.LogSoftmax
    torch.nn.Embedding -> trainops.nn.Embedding        torch.nn.CrossEntropyLoss -> trainops.nn.CrossEntropyLoss

A module is swapped by changing its class, not by putting a new object in its place: it stays
the same Python object, so everything attached to it is kept as it is: its parameters (the very
same Parameter objects: weight tying and optimizers built before the patch keep working, with
their dtype, device and requires_grad), buffers, ``training`` flag, every hook (forward, forward
pre, full backward, backward pre, state_dict and load_state_dict hooks, and the RemovableHandles
that remove them) and any attribute set on it. A module reachable under several names (shared in
two places, in a ModuleList, ...) stays one module, and every reference to it, inside ``model``
or not, sees the trainops class. ``state_dict()`` keys do not change, so checkpoints load either
way. The root module itself is swapped too when it is one of these classes. A swapped
CrossEntropyLoss gets trainops's extra settings at their defaults (``z_loss=0.0``, ``loss_dtype=None``).

With ``block_ops=True``, the transformer block's modules are swapped too:
    torch.nn.RMSNorm -> trainops.nn.RMSNorm            torch.nn.LayerNorm -> trainops.nn.LayerNorm
    torch.nn.GELU -> trainops.nn.GELU                  torch.nn.SiLU -> trainops.nn.SiLU
    torch.nn.Dropout -> trainops.nn.Dropout
(a swapped RMSNorm gets ``weight_offset=0.0``, a swapped Dropout ``mask_mode="regenerate"``). They
are not swapped by default: their kernels move fewer bytes than torch's, but each call costs more
host time than one of torch's ATen kernels, so a model whose step the host bounds (small hidden
sizes, small batches) gets slower, as the training demo's 128-wide model did on the H100
(benchmarks/NOTES.md, "Host overhead"). Swap them where the GPU bounds the step, or under
torch.compile, where their kernels are launched from the compiled graph. With ``block_ops=False``
these modules are neither swapped nor listed in the report.

``block_ops=True`` also fuses each torch.nn.BatchNorm2d followed by a torch.nn.ReLU in a
torch.nn.Sequential (exact classes, e.g. a stem ``Sequential(conv, bn, relu)``): the batch norm
becomes a trainops.nn.BatchNormReLU2d (batch norm and ReLU in one pass) and the ReLU a
trainops.nn.FusedReLU (returns its input), both listed in the report with what they were fused
with. Only where the pair is certain to be back to back: two neighbours of a plain Sequential (its
forward feeds one's output to the next and nothing else), each reachable under that one name
(a ReLU shared with another place keeps working there), neither with a hook (a hook would see the
fused values) nor anything else that stops a swap. Calls inside a module's own forward (torchvision's
BasicBlock calls ``self.bn1`` then ``self.relu``, a ReLU it uses twice) are not visible to patch and
are not fused: build such blocks with BatchNormReLU2d.

With ``batch_norm=True``, the batch norms are swapped too:
    torch.nn.BatchNorm1d -> trainops.nn.BatchNorm1d    torch.nn.BatchNorm2d -> trainops.nn.BatchNorm2d
    torch.nn.BatchNorm3d -> trainops.nn.BatchNorm3d    torch.nn.SyncBatchNorm -> trainops.nn.SyncBatchNorm
They are not swapped by default, for the same reason: their kernels take less GPU time than
torch's at ResNet-50's large shapes, but each eager training call costs more host time than
torch's, so eager steps were slower at every ResNet-50 shape on the H100 (benchmarks/NOTES.md,
"Batch normalization"). SyncBatchNorm follows BatchNorm's policy (its forward and backward are
batch norm's kernels around one collective each). With ``batch_norm=False`` these modules are
neither swapped nor listed in the report.

With ``convolution=True``, torch.nn.Conv2d -> trainops.nn.Conv2d (the convolution registry:
cuDNN on CUDA as torch's, except the bf16 and float32 depthwise convolutions of contiguous (NCHW)
input where its Triton kernels were measured faster; ``ops/convolution.py``, ``choose_backend``).
Not swapped by default: it adds a call's host time to torch's and has no double backward
(gradient penalties).

A module is left as it is, and reported with the reason, when swapping it could change what it
does: an Embedding with ``max_norm`` or ``sparse=True`` (trainops does not support them), a module
with a non-full backward hook (``register_backward_hook``: it sees the gradients of the module's
last autograd node, and that node becomes trainops's, with other inputs), a module compiled in place by
``Module.compile()``, and a module with an instance attribute that would override what the trainops
class defines (its own ``forward``, or e.g. ``check_index`` or ``z_loss``: set those after
patching). Every module is checked before any is changed, and if changing one raises, those
already changed are changed back: ``patch`` swaps all the modules it reports as swapped, or none.

Models wrapped by FSDP2's ``fully_shard`` are patched the same, before or after it: a wrapped
module (whose class ``fully_shard`` made a subclass of (FSDPModule, its class)) becomes the same
wrapper around the trainops class, keeping its FSDP state and hooks (trainops.dtensor).

Softmax computed inside other modules' forward (torch.nn.MultiheadAttention calls
``scaled_dot_product_attention``) is not a module and is not touched.

A swapped Hugging Face decoder layer's pre-norm whose output only the layer's projections read gets
the instance attribute ``autocast_output = True`` (``autocast_norms=False``: none does): under bf16 /
fp16 autocast it writes that dtype where it would return float32, instead of each projection
casting it (trainops.hf, "Pre-norms under autocast"; the report's description of it says so).

``patch(model, dry_run=True)`` returns the report of what it would do and changes nothing.
``unpatch(model)`` undoes it: every module patch swapped gets its class back (the attributes patch
added removed, everything else kept), and every module of a swapped Hugging Face class returns to
its transformers class (trainops.hf). Nothing global is replaced, by either: no torch or
transformers function, no class attribute, with one exception: while a patched Hugging Face model
with SDPA attention is alive, transformers's registered SDPA mask function and its
``masking_utils.find_packed_sequence_indices`` are wrapped, so that inside a patched training
forward (on its thread) the causal mask is skipped where transformers's own eager rule skips it,
also under torch.compile and CUDA-graph capture (``trainops.hf``: ``_causal_mask.py``); every other
call passes through unchanged, and unpatching the last such model puts both functions back.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from . import hf as trainops_hf
from . import nn as trainops_nn
from .dtensor import fsdp_class, fsdp_wrapped_class
from .errors import InvalidProblemError, argument_error


@dataclass
class PatchReport:
    """What ``trainops.patch`` did, one entry per module object (a shared module is listed once).

    ``swapped``: (qualified name, torch class, trainops class) of each module whose class changed.
    ``skipped``: (qualified name, class name, reason) of each module left as it is.
    ``other_names``: for a listed module reachable under several names, its first name (the one
    used in ``swapped`` / ``skipped``, in ``named_modules()`` order) -> its other names.
    ``descriptions``: for a swapped Hugging Face module, its name -> what its swap computes
    (trainops.hf's words: "norm", "attention: fused q/k norm + rotary", ...).
    ``causal_masks``: how many transformers configs (SDPA attention) of the model's swapped modules
    ``patch`` started tracking for the causal mask (``trainops.hf``: SDPA's is_causal where
    transformers's eager rule skips the mask, also while torch.compile traces and a CUDA graph
    captures); by ``unpatch``: how many it stopped tracking.
    The root module's name is ``""`` (printed ``<root>``).
    """

    swapped: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    other_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
    causal_masks: int = 0

    def __str__(self) -> str:
        lines = [f"trainops.patch: {len(self.swapped)} module(s) swapped, {len(self.skipped)} left as they are"]
        lines += [f"  {self._label(name)}: {old} -> {new}"
                  + (f" [{self.descriptions[name]}]" if name in self.descriptions else "")
                  for name, old, new in self.swapped]
        lines += [f"  {self._label(name)}: {cls} kept ({why})" for name, cls, why in self.skipped]
        if self.causal_masks:
            lines.append(f"  causal mask: SDPA's is_causal where transformers's eager rule skips the mask, also under "
                         f"torch.compile and CUDA-graph capture ({self.causal_masks} config(s); trainops.hf)")
        return "\n".join(lines)

    def _label(self, name: str) -> str:
        label = name or "<root>"
        if name in self.other_names:
            label += f" (same module as {', '.join(self.other_names[name])})"
        return label


@dataclass(frozen=True)
class _Swap:
    """A module of exactly ``torch_class`` becomes a ``trainops_class``; ``added_attributes``: the
    instance attributes ``trainops_class.__init__`` sets and ``torch_class``'s does not, with their
    defaults; ``unsupported_settings(module)``: the module's settings trainops_class cannot run."""

    torch_class: type[torch.nn.Module]
    trainops_class: type[torch.nn.Module]
    added_attributes: Mapping[str, object] = field(default_factory=dict)
    unsupported_settings: Callable[[torch.nn.Module], list[str]] = lambda module: []


def _embedding_unsupported_settings(module: torch.nn.Embedding) -> list[str]:
    unsupported = []
    if module.max_norm is not None:
        unsupported.append("max_norm is not supported by trainops.nn.Embedding")
    if module.sparse:
        unsupported.append("sparse=True is not supported by trainops.nn.Embedding")
    return unsupported


_SWAPS = {swap.torch_class: swap for swap in (
    _Swap(torch.nn.Softmax, trainops_nn.Softmax),
    _Swap(torch.nn.LogSoftmax, trainops_nn.LogSoftmax),
    _Swap(torch.nn.Embedding, trainops_nn.Embedding, unsupported_settings=_embedding_unsupported_settings),
    _Swap(torch.nn.CrossEntropyLoss, trainops_nn.CrossEntropyLoss,
          added_attributes={"z_loss": 0.0, "loss_dtype": None}),
)}
_BLOCK_SWAPS = {swap.torch_class: swap for swap in (
    _Swap(torch.nn.RMSNorm, trainops_nn.RMSNorm, added_attributes={"weight_offset": 0.0}),
    _Swap(torch.nn.LayerNorm, trainops_nn.LayerNorm),
    _Swap(torch.nn.GELU, trainops_nn.GELU),
    _Swap(torch.nn.SiLU, trainops_nn.SiLU),
    _Swap(torch.nn.Dropout, trainops_nn.Dropout, added_attributes={"mask_mode": "regenerate"}),
)}
_BATCH_NORM_SWAPS = {swap.torch_class: swap for swap in (
    _Swap(torch.nn.BatchNorm1d, trainops_nn.BatchNorm1d),
    _Swap(torch.nn.BatchNorm2d, trainops_nn.BatchNorm2d),
    _Swap(torch.nn.BatchNorm3d, trainops_nn.BatchNorm3d),
    _Swap(torch.nn.SyncBatchNorm, trainops_nn.SyncBatchNorm),
)}


_CONVOLUTION_SWAPS = {torch.nn.Conv2d: _Swap(torch.nn.Conv2d, trainops_nn.Conv2d)}
_BATCH_NORM_RELU = _Swap(torch.nn.BatchNorm2d, trainops_nn.BatchNormReLU2d)
_FUSED_RELU = _Swap(torch.nn.ReLU, trainops_nn.FusedReLU)


def _public_name(cls: type) -> str:
    """``torch.nn.Embedding`` / ``trainops.nn.Embedding`` for the classes in ``_SWAPS`` / ``_BLOCK_SWAPS``,
    ``transformers.LlamaRMSNorm`` / ``trainops.hf.LlamaRMSNorm`` for Hugging Face's."""
    if (cls in _SWAPS or cls in _BLOCK_SWAPS or cls in _BATCH_NORM_SWAPS or cls in _CONVOLUTION_SWAPS
            or cls is torch.nn.ReLU):
        return f"torch.nn.{cls.__name__}"
    if trainops_hf.is_transformers_class(cls):
        return f"transformers.{cls.__name__}"
    return f"trainops.{cls.__module__.removeprefix('trainops.')}.{cls.__name__}"


def _every_path(module: torch.nn.Module, name: str = "", on_path: frozenset[int] = frozenset()
                ) -> Iterator[tuple[str, torch.nn.Module]]:
    """(qualified name, module) for every path from ``module`` down, in ``named_modules()`` order.

    Unlike ``named_modules()``, a module reachable along several paths is yielded once per path;
    a path that would enter a module already on it (a cycle) is not followed.
    """
    yield name, module
    on_path = on_path | {id(module)}
    for child_name, child in module._modules.items():
        if child is not None and id(child) not in on_path:
            yield from _every_path(child, f"{name}.{child_name}" if name else child_name, on_path)


_NOT_DEFINED = object()


def _reasons_not_to_swap(module: torch.nn.Module, swap: _Swap) -> list[str]:
    """Why changing ``module``'s class to ``swap.trainops_class`` could change what it does (empty: it cannot)."""
    reasons = swap.unsupported_settings(module)
    new_name = _public_name(swap.trainops_class)
    if module._backward_hooks and module._is_full_backward_hook is False:
        reasons.append("it has a non-full backward hook (register_backward_hook), which sees the gradients of the "
                       f"module's last autograd node, and {new_name}'s differs: use register_full_backward_hook")
    for attribute in vars(module):
        if attribute == "_compiled_call_impl":
            reasons.append("it was compiled in place by Module.compile(); patch it before compiling")
        elif attribute == "forward":
            reasons.append(f"its instance attribute 'forward' would still run instead of {new_name}.forward")
        elif (attribute in swap.added_attributes or getattr(swap.trainops_class, attribute, _NOT_DEFINED)
              is not getattr(swap.torch_class, attribute, _NOT_DEFINED)):
            reasons.append(f"its instance attribute {attribute!r} would be taken as {new_name}.{attribute}; "
                           "set it after patching")
    return reasons


# module -> (its class before patch changed it, the attributes patch added): what unpatch restores
_PATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def patch(model: torch.nn.Module, *, block_ops: bool = False, hf: bool = True, batch_norm: bool = False,
          convolution: bool = False, autocast_norms: bool = True, dry_run: bool = False) -> PatchReport:
    """Swap, in place, every exact torch.nn.Softmax / LogSoftmax / Embedding / CrossEntropyLoss in
    ``model`` (``model`` included) for trainops.nn's class; with ``block_ops=True`` also every exact
    RMSNorm / LayerNorm / GELU / SiLU / Dropout (and each BatchNorm2d + ReLU pair of a Sequential
    fused into one BatchNormReLU2d, the ReLU becoming a FusedReLU), with ``batch_norm=True`` every exact BatchNorm1d /
    2d / 3d / SyncBatchNorm, with ``convolution=True`` every exact Conv2d (all three off by default:
    see the module docstring); with ``hf`` (the
    default) the Hugging Face transformers modules trainops.hf lists (the norms, gated MLPs,
    attention rotary embedding, tanh GELUs, Gemma's scaled embedding, MoE routers and experts and
    the causal-LM loss path of Llama, Mistral, Qwen2, Qwen3, SmolLM3, Gemma, Gemma 2, Gemma 3,
    Phi-3, OLMo 2, GLM-4, Granite, Mixtral, Qwen3-MoE and GPT-2: ``trainops.hf.ARCHITECTURES``);
    return the report. ``autocast_norms`` (with ``hf``): the swapped decoder-layer pre-norms whose
    output only the layer's projections read write the autocast dtype under autocast (bf16 / fp16)
    where they would return float32, instead of each projection casting it: the same forward values,
    no casts; the projections' input gradients are then summed in that dtype (trainops.hf,
    "Pre-norms under autocast"); the report's description of each says so. A norm with hooks on it,
    on its reader or on a projection is not marked. The marks are made with the swap: to change
    ``autocast_norms`` on a patched model, ``trainops.unpatch`` it first. ``dry_run=True``: the
    same report, nothing changed. ``trainops.unpatch`` changes the swapped modules back.

    Each swapped module keeps its identity and all its state (see the module docstring). Modules
    that cannot be swapped without changing what they do, and subclasses of those torch classes,
    are left as they are and listed in ``report.skipped`` with the reason; modules that already
    are trainops.nn modules are not listed, so patching twice swaps nothing the second time.
    Raises InvalidProblemError when ``model`` is not a torch.nn.Module or ``block_ops``, ``hf``,
    ``batch_norm``, ``convolution``, ``autocast_norms`` or ``dry_run`` not a bool.
    """
    if not isinstance(model, torch.nn.Module):
        raise argument_error(InvalidProblemError, "patch", "model",
                             f"must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("block_ops", block_ops), ("hf", hf), ("batch_norm", batch_norm), ("convolution", convolution),
                        ("autocast_norms", autocast_norms), ("dry_run", dry_run)):
        if not isinstance(value, bool):
            raise argument_error(InvalidProblemError, "patch", name, f"must be a bool, got {value!r}")
    swaps = {**_SWAPS, **(_BLOCK_SWAPS if block_ops else {}), **(_BATCH_NORM_SWAPS if batch_norm else {}),
             **(_CONVOLUTION_SWAPS if convolution else {})}
    trainops_classes = tuple(swap.trainops_class for swap in swaps.values())
    torch_classes = tuple(swaps)

    modules, names_by_module = _modules_and_names(model)
    # norms whose output only projections read: autocast's dtype out under autocast (trainops.hf)
    into_projections = trainops_hf.norms_into_projections(modules) if hf and autocast_norms else {}
    report = PatchReport()
    to_swap: list[tuple[torch.nn.Module, _Swap, type]] = []
    fused: set[int] = set()
    for norm, relu in _batch_norm_relu_pairs(modules, names_by_module) if block_ops else ():
        norm_name, relu_name = names_by_module[id(norm)][0], names_by_module[id(relu)][0]
        for module, swap, description in ((norm, _BATCH_NORM_RELU, f"fused with the ReLU {relu_name}"),
                                          (relu, _FUSED_RELU, f"fused into {norm_name}")):
            fused.add(id(module))
            to_swap.append((module, swap, swap.trainops_class))
            name = names_by_module[id(module)][0]
            report.swapped.append((name, _public_name(swap.torch_class), _public_name(swap.trainops_class)))
            report.descriptions[name] = description
    for module in modules:
        if id(module) in fused:
            continue
        wrapped = fsdp_wrapped_class(type(module))   # the class fully_shard wrapped, if it did
        cls = wrapped or type(module)
        if isinstance(module, trainops_classes) or trainops_hf.is_swapped(module, cls):
            continue
        swap = swaps.get(cls)
        found = trainops_hf.swap_for(module, cls) if hf and swap is None else None
        if found is not None and found[0] is None:   # a transformers module trainops cannot take (reasons given)
            reasons = found[1]
        elif found is not None:
            projections = into_projections.get(id(module))
            swap = _Swap(type(module), found[0], {trainops_hf.AUTOCAST_OUTPUT: True} if projections else {})
            reasons = found[1] + _reasons_not_to_swap(module, swap)
        elif swap is not None:
            reasons = _reasons_not_to_swap(module, swap)
        elif isinstance(module, torch_classes):
            base = next(cls for cls in torch_classes if isinstance(module, cls))
            reasons = [f"a subclass of {_public_name(base)}: only exact torch classes are swapped "
                       "(a subclass may change what the module computes)"]
        else:
            continue
        first_name, *other_names = names_by_module[id(module)]
        if other_names:
            report.other_names[first_name] = tuple(other_names)
        if reasons:
            report.skipped.append((first_name, type(module).__name__, "; ".join(reasons)))
        else:
            to_swap.append((module, swap, swap.trainops_class if wrapped is None else fsdp_class(swap.trainops_class)))
            report.swapped.append((first_name, _public_name(swap.torch_class), _public_name(swap.trainops_class)))
            if found is not None:
                report.descriptions[first_name] = trainops_hf.description(cls) + (
                    f": autocast's dtype out, for {', '.join(projections)}" if projections else "")
    if not dry_run:
        _change_classes([(module, new_class, dict(swap.added_attributes)) for module, swap, new_class in to_swap])
        swapped = (m for m in modules if trainops_hf.is_swapped(m, fsdp_wrapped_class(type(m)) or type(m)))
        report.causal_masks = sum(map(trainops_hf.track_causal_mask, _configs(swapped)))
    return report


def _configs(modules) -> list:
    """The distinct transformers configs (``module.config``) of Hugging Face modules."""
    found = {}
    for module in modules:
        config = getattr(module, "config", None)
        if config is not None and trainops_hf.is_transformers_class(type(config)):
            found.setdefault(id(config), config)
    return list(found.values())


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _batch_norm_relu_pairs(modules, names_by_module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(BatchNorm2d, ReLU) neighbours of plain Sequentials that are certain to run back to back and
    can be swapped (see the module docstring), each module in one pair at most."""
    pairs, taken = [], set()
    for module in modules:
        if type(module) is not torch.nn.Sequential:
            continue
        children = [child for child in module._modules.values()]
        for norm, relu in zip(children, children[1:]):
            if (type(norm) is not torch.nn.BatchNorm2d or type(relu) is not torch.nn.ReLU
                    or id(norm) in taken or id(relu) in taken or norm is relu
                    or len(names_by_module[id(norm)]) != 1 or len(names_by_module[id(relu)]) != 1
                    or _has_hooks(norm) or _has_hooks(relu) or _reasons_not_to_swap(norm, _BATCH_NORM_RELU)
                    or _reasons_not_to_swap(relu, _FUSED_RELU)):
                continue
            taken.update((id(norm), id(relu)))
            pairs.append((norm, relu))
    return pairs


def _modules_and_names(model: torch.nn.Module) -> tuple[list[torch.nn.Module], dict[int, list[str]]]:
    """Every module under ``model`` once, in ``named_modules()`` order, and id(module) -> all its names."""
    names_by_module: dict[int, list[str]] = {}
    modules: list[torch.nn.Module] = []
    for name, module in _every_path(model):
        if id(module) not in names_by_module:
            names_by_module[id(module)] = []
            modules.append(module)
        names_by_module[id(module)].append(name)
    return modules, names_by_module


def _change_classes(changes: list[tuple[torch.nn.Module, type, dict | tuple]]) -> None:
    """Give each module its new class and set the instance attributes given (a dict: name -> value;
    patch) or delete them (a tuple of names; unpatch); every change, or, if one raises, none."""
    done: list[tuple[torch.nn.Module, type, dict, object]] = []
    try:
        for module, new_class, attributes in changes:
            before = {name: module.__dict__[name] for name in attributes if name in module.__dict__}
            done.append((module, type(module), before, _PATCHED.get(module)))
            module.__class__ = new_class
            if isinstance(attributes, dict):
                module.__dict__.update(attributes)
                _PATCHED[module] = (done[-1][1], tuple(attributes))
            else:
                for name in attributes:
                    module.__dict__.pop(name, None)
                _PATCHED.pop(module, None)
    except BaseException:
        undone = zip(reversed(done), reversed(changes[:len(done)]))
        for (module, old_class, before, record), (_, _, attributes) in undone:
            for name in attributes:
                module.__dict__.pop(name, None)
            module.__dict__.update(before)
            module.__class__ = old_class
            if record is None:
                _PATCHED.pop(module, None)
            else:
                _PATCHED[module] = record
        raise


def unpatch(model: torch.nn.Module) -> PatchReport:
    """Undo ``trainops.patch`` on ``model`` (``model`` included), in place: every module patch
    swapped gets its class back (the attributes patch added are removed; the module stays the same
    object with its parameters, buffers, hooks and other state), and every module of a swapped
    transformers class (trainops.hf's, also one unpickled from a patched model) becomes its
    transformers class again. Modules built as trainops.nn modules, not by patch, stay. Returns the
    report: ``swapped`` lists (name, trainops class, restored class). All modules or none (as
    patch). Raises InvalidProblemError when ``model`` is not a torch.nn.Module."""
    if not isinstance(model, torch.nn.Module):
        raise argument_error(InvalidProblemError, "unpatch", "model",
                             f"must be a torch.nn.Module, got {type(model).__name__}")
    modules, names_by_module = _modules_and_names(model)
    report = PatchReport()
    changes: list[tuple[torch.nn.Module, type, tuple]] = []
    for module in modules:
        record = _PATCHED.get(module)
        wrapped = fsdp_wrapped_class(type(module))
        current = wrapped or type(module)
        if record is not None:
            old, added = fsdp_wrapped_class(record[0]) or record[0], record[1]
        elif trainops_hf.is_swapped(module, current):   # unpickled or copied: no record, its attributes named
            old, added = trainops_hf.original_class(current), tuple(a for a in trainops_hf.INSTANCE_ATTRIBUTES
                                                                    if a in vars(module))
        else:
            continue
        old_class = old if wrapped is None else fsdp_class(old)   # fully_shard's wrapper kept, before or after patch
        first_name, *other_names = names_by_module[id(module)]
        if other_names:
            report.other_names[first_name] = tuple(other_names)
        changes.append((module, old_class, added))
        report.swapped.append((first_name, _public_name(current), _public_name(old)))
    _change_classes(changes)
    for config in _configs(module for module, _, _ in changes):
        report.causal_masks += trainops_hf.untrack_causal_mask(config)
    return report


__all__ = ["PatchReport", "patch", "unpatch"]
