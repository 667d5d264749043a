"""PEFT models in trainops.hf: LoRA-wrapped projections and LM heads (``peft`` is never imported:
its modules are recognised by their class's module and name, as transformers's are).

Projections (attention q/k/v/o, the MLP's gate/up/down or gate_up): a swapped attention or gated
MLP calls its projections as modules, whatever they are, so a PEFT layer there (LoRA, DoRA or any
variant, ModulesToSaveWrapper) runs its own forward: its dropout, scaling and adapters, trained
as without trainops. Only what lies between the projections is trainops's (the rotary embedding,
act(gate) * up). A gated MLP needs each projection to be a torch.nn.Linear or a PEFT layer whose
base layer (``get_base_layer()``) is one (``projection_reasons``).

The LM head of the fused causal-LM loss (``head_operands``), read at every call:
- torch.nn.Linear: its weight and bias, as without PEFT.
- peft's ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``: a trained copy): the copy of
  the active adapter (the original module when adapters are disabled or none is active), as the
  wrapper's forward picks it.
- peft's LoRA ``Linear`` over a torch.nn.Linear: the adapted logits
      z = h W^T + b + sum over the active adapters a of s_a * (dropout_a(h) A_a^T B_a^T + b_Ba)
  (s_a = lora_alpha / r, or alpha / sqrt(r) with rsLoRA; b_Ba: lora_B's bias with lora_bias=True),
  computed exactly, the LoRA dropout included (not a merged weight), as one fused loss over
  concatenated operands:
      hidden' = [h, s_1 * A_1(dropout_1(h)), ...]   (N, H + sum r_a)
      weight' = [W, B_1, ...]                        (V, H + sum r_a)
      bias'   = b + sum s_a b_Ba
  so that hidden' weight'^T = h W^T + sum s_a dropout_a(h) A_a^T B_a^T. Gradients reach A, B (and
  h) through the concatenations. Each adapter's dropout and lora_A run as modules, in peft's
  order (the same random numbers as peft's forward). Memory per call: weight' is a new
  V x (H + sum r_a) tensor in W's dtype, and, because B trains, the fused loss computes the
  gradient of all of weight' (V x (H + sum r_a), float32 for a half weight) and the W columns of
  it are thrown away: about twice the head's size in all, during the step (peft's own forward
  holds the N x V logits instead). hidden' is an N x (H + sum r_a) copy of the hidden states.
  Adapters disabled: the base layer's weight and bias. Merged (``merge_adapter``): the base
  layer's weight and bias, which hold the adapters, as peft computes.
  dtypes: the low-rank activations are computed in lora_A's dtype (peft casts the input to it)
  and rounded to h's dtype for the concatenation; the fused matmuls run in h's dtype (autocast's
  under autocast), where peft adds a separately computed low-rank product: equal in float32, within
  rounding in bf16.

Refused when the model is patched (the causal LM is left as it is, with the reason): a head (or a
LoRA head's base layer, or a modules_to_save copy) whose weight is not a floating (out_features,
in_features) matrix (bitsandbytes's quantized layers subclass torch.nn.Linear), a head of any
other PEFT class (a LoRA layer of another kind, TrainableTokensWrapper, ...), a LoRA head with a
variant on any adapter (DoRA, aLoRA, ...: ``lora_variant``) or ``fan_in_fan_out``, a
ModulesToSaveWrapper whose modules are not torch.nn.Linear. Raised at the call
(UnsupportedError naming ``lm_head``), for states peft only reaches after patching: a variant
adapter added later and active, adapters disabled while merged (peft's forward unmerges the
weight in place), forward hooks on the head or its adapters (peft's per-sample ``adapter_names``
mixed batches run through such hooks), or a head whose modules FSDP2's fully_shard made units of
their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dtensor import fsdp_wrapped_class
from ..errors import UnsupportedError

OP = "trainops.hf causal-LM loss"
_LORA_LINEAR = ("peft.tuners.lora.layer", "Linear")
_MODULES_TO_SAVE = ("peft.utils.other", "ModulesToSaveWrapper")


def _class_id(module) -> tuple[str, str]:
    cls = fsdp_wrapped_class(type(module)) or type(module)
    return cls.__module__, cls.__name__


def is_peft_module(module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def _base_linear(module) -> torch.nn.Linear | None:
    """``module`` if it is a torch.nn.Linear, the base layer of a PEFT layer if that is one, else None."""
    if isinstance(module, torch.nn.Linear):
        return module
    if is_peft_module(module):
        get_base_layer = getattr(module, "get_base_layer", None)
        base = get_base_layer() if callable(get_base_layer) else getattr(module, "original_module", None)
        if isinstance(base, torch.nn.Linear):
            return base
    return None


def projection_reasons(module, names) -> list[str]:
    """Why ``module``'s projections ``names`` cannot be run by a swapped gated MLP (empty: they can):
    each must be a torch.nn.Linear or a PEFT layer over one."""
    if not all(_base_linear(getattr(module, name, None)) is not None for name in names):
        return [f"its {' / '.join(names)} are not torch.nn.Linear (nor PEFT layers over one)"]
    return []


def out_features(projection) -> int:
    return _base_linear(projection).out_features


def _weight_reasons(linear: torch.nn.Linear, what: str) -> list[str]:
    """A Linear whose weight the fused loss cannot read as the layer's (V, H) matrix: a quantized
    layer's packed or integer weight (bitsandbytes's Linear4bit / Linear8bitLt subclass Linear)."""
    weight = getattr(linear, "weight", None)
    shape = (getattr(linear, "out_features", None), getattr(linear, "in_features", None))
    if not isinstance(weight, Tensor) or not weight.is_floating_point() or tuple(weight.shape) != shape:
        held = f"{tuple(weight.shape)} {weight.dtype}" if isinstance(weight, Tensor) else type(weight).__name__
        return [f"its {what} weight is not a floating (out_features, in_features) matrix ({held}: a quantized "
                "layer?)"]
    return []


def head_reasons(head) -> list[str]:
    """Why the fused loss cannot compute the LM head ``head`` (empty: it can; module docstring)."""
    if isinstance(head, torch.nn.Linear):
        return _weight_reasons(head, "lm_head")
    kind = _class_id(head)
    if kind == _MODULES_TO_SAVE:
        modules = [getattr(head, "original_module", None), *getattr(head, "modules_to_save", {}).values()]
        if not all(isinstance(m, torch.nn.Linear) for m in modules):
            return ["its lm_head is a PEFT ModulesToSaveWrapper of modules that are not torch.nn.Linear"]
        return [reason for m in modules for reason in _weight_reasons(m, "lm_head's (modules_to_save)")][:1]
    if kind == _LORA_LINEAR:
        reasons = []
        if not isinstance(head.get_base_layer(), torch.nn.Linear):
            reasons.append(f"its lm_head is a PEFT LoRA layer over a {type(head.get_base_layer()).__name__}, "
                           "not a torch.nn.Linear")
        else:
            reasons += _weight_reasons(head.get_base_layer(), "lm_head's base layer")
        if getattr(head, "fan_in_fan_out", False):
            reasons.append("its lm_head is a PEFT LoRA layer with fan_in_fan_out=True")
        variants = _variants(head, head.lora_A.keys())
        if variants:
            reasons.append(f"its lm_head is a PEFT LoRA layer with {variants}: only plain LoRA is computed by the "
                           "fused loss (the adapted head's logits would need the variant's own forward)")
        if not all(isinstance(head.lora_A[a], torch.nn.Linear) and isinstance(head.lora_B[a], torch.nn.Linear)
                   for a in head.lora_A.keys()):
            reasons.append("its lm_head is a PEFT LoRA layer whose lora_A / lora_B are not torch.nn.Linear")
        return reasons
    if is_peft_module(head):
        return [f"its lm_head is a PEFT {type(head).__name__}: the fused loss computes a torch.nn.Linear, peft's "
                "LoRA Linear over one, or a ModulesToSaveWrapper of one"]
    return ["its lm_head is not a torch.nn.Linear"]


def _variants(head, adapters) -> str:
    variant = getattr(head, "lora_variant", {})
    dora = getattr(head, "use_dora", {})
    found = [f"adapter {a!r}: {type(variant[a]).__name__}" for a in adapters if a in variant]
    found += [f"adapter {a!r}: DoRA" for a in adapters if dora.get(a, False) and a not in variant]
    return ", ".join(found)


def _refuse(reason: str):
    raise UnsupportedError(f"{OP}: lm_head: {reason}; call the model in eval mode or without labels for peft's "
                           "own forward, or trainops.unpatch(model)")


def _hooked(module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


def head_operands(head, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """(hidden', weight', bias') whose fused loss is the head's: (hidden, W, b) for a
    torch.nn.Linear, the concatenations of the module docstring for a LoRA head. Raises
    UnsupportedError (naming lm_head) for the states the docstring lists."""
    if isinstance(head, torch.nn.Linear):
        return hidden, head.weight, head.bias
    kind = _class_id(head)
    if kind not in (_MODULES_TO_SAVE, _LORA_LINEAR):
        _refuse(f"a {type(head).__name__} is not computed by the fused loss")
    parts = list(head.modules())
    if any(fsdp_wrapped_class(type(m)) is not None for m in parts):
        _refuse("a PEFT head with FSDP2 units of its own is not supported")
    if any(_hooked(m) for m in parts):
        _refuse("it has forward hooks (peft's adapter_names mixed batches run through them), which the fused "
                "loss would not run")
    if kind == _MODULES_TO_SAVE:
        active = head.active_adapters
        if head.disable_adapters or not active or any(a not in getattr(head, "_adapters", active) for a in active):
            linear = head.original_module
        else:
            linear = head.modules_to_save[active[0]]
        return hidden, linear.weight, linear.bias
    base = head.get_base_layer()
    if head.disable_adapters:
        if head.merged:
            _refuse("its adapters are disabled while merged (peft's forward would unmerge the weight in place)")
        return hidden, base.weight, base.bias
    if head.merged:
        return hidden, base.weight, base.bias
    adapters = [a for a in head.active_adapters if a in head.lora_A.keys()]
    variants = _variants(head, adapters)
    if variants:
        _refuse(f"its active adapters have LoRA variants ({variants}): only plain LoRA is computed by the fused loss")
    if not adapters:
        return hidden, base.weight, base.bias
    hiddens, weights, bias = [hidden], [base.weight], base.bias
    for a in adapters:
        lora_a, lora_b, scaling = head.lora_A[a], head.lora_B[a], head.scaling[a]
        low_rank = lora_a(head.lora_dropout[a](hidden.to(lora_a.weight.dtype))) * scaling
        hiddens.append(low_rank.to(hidden.dtype))
        weights.append(lora_b.weight.to(base.weight.dtype))
        if lora_b.bias is not None:
            scaled = lora_b.bias * scaling
            bias = scaled if bias is None else bias + scaled.to(bias.dtype)
    return torch.cat(hiddens, dim=-1), torch.cat(weights, dim=1), bias
