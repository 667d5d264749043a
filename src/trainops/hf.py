"""Hugging Face transformers models in ``trainops.patch``: which of their modules become trainops's.

transformers is never imported here at import time (the core does not depend on it); a model is
recognised by its classes' names and modules. Swapped, by changing the module's class to a
subclass that overrides ``forward`` alone (parameters, buffers, hooks and state_dict keys kept,
as patch.py does for torch's modules). The subclass keeps the transformers class's ``__name__``,
so what reads it sees the model it knows (``config.architectures`` written by save_pretrained,
Trainer's causal-LM label shifting, PEFT); it is importable from this module by its
``__qualname__`` (``Trainops__<transformers module path>__<class>``), so a patched model pickles
(``torch.save(model)``) and loads where trainops and transformers are installed. Subclasses of
these transformers classes (a user's own) are not swapped and are reported.

    RMSNorm    LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm (x_normed * w, in the
               dtype torch's promotion of input and weight gives, as theirs) and GemmaRMSNorm,
               Gemma2RMSNorm ((1 + w), in the input's dtype)       -> trainops.rms_norm
    MLP        LlamaMLP, MistralMLP, Qwen2MLP, Qwen3MLP, GemmaMLP, Gemma2MLP whose activation is
               SiLU (-> trainops.swiglu) or tanh GELU (-> trainops.geglu); down_proj(act(gate) * up)
    GELU       NewGELUActivation, GELUTanh (GPT-2's, Gemma's)      -> trainops.gelu(approximate="tanh")
    embedding  GemmaTextScaledWordEmbedding (and Gemma 2's): trainops.embedding times embed_scale
               (``check_index`` as trainops.nn.Embedding's: set the attribute after patching)
    rotary     LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention, GemmaAttention,
               Gemma2Attention: their own forward, run with ``apply_rotary_pos_emb`` resolved to
               trainops.rotary_embedding (a copy of the forward function whose globals are that
               one name over the module's own namespace, looked up at each call: transformers's
               module and every other model are untouched, and later changes to the module are
               seen, by torch.compile too: ``_OverlayGlobals``). The rotated q and k come out in q's dtype (transformers's in the promotion
               of q's and cos's: float32 under autocast, which the attention then casts back to
               bf16). Decorators on the forward (transformers's deprecate_kwarg) are copied with it.
    the loss   LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
               GemmaForCausalLM, Gemma2ForCausalLM: in training mode with labels, the decoder's
               last hidden states go to trainops.linear_cross_entropy with the LM head's weight
               (the logits are never made: ``output.logits`` is None, so code that reads a
               training step's logits, such as a token-accuracy metric, needs hf=False), labels
               shifted as transformers's ForCausalLMLoss shifts them (or ``shift_labels``),
               ``num_items_in_batch`` passed on, Gemma 2's ``final_logit_softcapping`` as softcap.
               An LM head that FSDP2's ``fully_shard`` made a unit of its own computes the loss
               as one of its FSDP forward methods (the weight gathered by FSDP, not read as a shard).
               The original forward runs without labels, in eval mode, with ``logits_to_keep``,
               ``return_dict=False``, a custom ``model.loss_function`` or another ``loss_type``.

The attention computation itself stays transformers's. torch.nn modules inside (Embedding,
LayerNorm, Dropout, ...) are patch.py's.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch
from torch import Tensor

from .dtensor import fsdp_wrapped_class

LLAMA_STYLE_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
GEMMA_STYLE_NORMS = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm"})
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP"})
TANH_GELUS = frozenset({"NewGELUActivation", "GELUTanh", "PytorchGELUTanh"})
SCALED_EMBEDDINGS = frozenset({"GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding"})
CAUSAL_LMS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                        "GemmaForCausalLM", "Gemma2ForCausalLM"})
ROTARY_ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
                               "GemmaAttention", "Gemma2Attention"})
_SILUS = frozenset({"SiLU", "SiLUActivation"})


def is_transformers_class(cls: type) -> bool:
    return cls.__module__.startswith("transformers.")


# ---- the forwards the swapped classes run -----------------------------------------------------

def _llama_norm_forward(self, hidden_states: Tensor) -> Tensor:
    from . import functional as F

    y = F.rms_norm(hidden_states, self.weight, self.variance_epsilon)
    out_dtype = torch.promote_types(self.weight.dtype, hidden_states.dtype)   # weight * x.to(input dtype)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _gemma_norm_forward(self, x: Tensor) -> Tensor:
    from . import functional as F

    return F.rms_norm(x, self.weight, self.eps, weight_offset=1.0)


def _gated_mlp_forward(self, x: Tensor) -> Tensor:
    from . import functional as F

    gate, up = self.gate_proj(x), self.up_proj(x)
    kind = _activation_kind(self.act_fn)
    return self.down_proj(F.swiglu(gate, up) if kind == "silu" else F.geglu(gate, up, approximate="tanh"))


def _tanh_gelu_forward(self, input: Tensor) -> Tensor:
    from . import functional as F

    return F.gelu(input, approximate="tanh")


def _scaled_embedding_forward(self, input_ids: Tensor) -> Tensor:
    from . import functional as F

    embedded = F.embedding(input_ids, self.weight, self.padding_idx, check_index=getattr(self, "check_index", True))
    return embedded * self.embed_scale.to(self.weight.dtype)


def _trainops_apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
    """transformers's ``apply_rotary_pos_emb(q, k, cos, sin)`` for (batch, heads, seq, head_dim) q and k
    and (batch, seq, head_dim) cos and sin (``unsqueeze_dim=1``), by trainops.rotary_embedding."""
    from . import functional as F

    if unsqueeze_dim != 1:
        raise NotImplementedError("trainops.hf: apply_rotary_pos_emb with unsqueeze_dim != 1 is not swapped")
    return F.rotary_embedding(q, k, cos, sin)


class _OverlayGlobals(dict):
    """A function's globals: the overriding names, then the module's namespace, read at each lookup
    (``self[name]``, which the interpreter uses for globals that are not exactly a dict): what is
    patched into the module after the class was swapped is seen.

    The dict's own entries are a copy of the namespace (taken when the class was first swapped in
    this process), which each lookup brings up to date for the name it reads: torch.compile checks
    and guards names in the plain dict (a name missing there is a graph break), and must find what
    the function read. Names the dict holds that the module does not (Dynamo's generated
    ``__compiled_fn_*`` and ``__resume_at_*`` helpers, a name deleted from the module) come from the
    dict itself."""

    def __init__(self, namespace: dict, overrides: dict):
        super().__init__(namespace)
        super().update(overrides)
        self.namespace, self.overrides = namespace, overrides

    def __getitem__(self, name):
        if name in self.overrides:
            return self.overrides[name]
        if name in self.namespace:
            value = self.namespace[name]
            if dict.get(self, name, _ABSENT) is not value:
                dict.__setitem__(self, name, value)
            return value
        return dict.__getitem__(self, name)


_ABSENT = object()


def _with_globals(function, overlay):
    """A copy of ``function`` whose innermost function (below functools.wraps-style decorators, whose
    closures hold it) reads its globals through ``overlay(namespace)``; None when a decorator does
    not hold the function it wraps in its closure."""
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        copied = types.FunctionType(function.__code__, overlay(function.__globals__), function.__name__,
                                    function.__defaults__, function.__closure__)
    else:
        copied_inner = _with_globals(inner, overlay)
        cells = function.__closure__ or ()
        if copied_inner is None or not any(c.cell_contents is inner for c in cells):
            return None
        cells = tuple(types.CellType(copied_inner) if c.cell_contents is inner else c for c in cells)
        copied = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                    function.__defaults__, cells)
        copied.__dict__.update(function.__dict__)   # functools.wraps's attributes
        copied.__wrapped__ = copied_inner
    copied.__kwdefaults__ = function.__kwdefaults__
    copied.__qualname__ = function.__qualname__
    copied.__doc__ = function.__doc__
    return copied


def _forward_with_trainops_rotary(cls: type):
    """A copy of ``cls.forward`` (decorators included) whose global ``apply_rotary_pos_emb`` is
    trainops's; None when its module has no such global or a decorator cannot be copied."""
    namespace = vars(sys.modules[cls.__module__])
    if not isinstance(cls.forward, types.FunctionType) or "apply_rotary_pos_emb" not in namespace:
        return None

    def overlay(function_globals):
        if function_globals is not namespace:   # a decorator's own module: left as it is
            return function_globals
        return _OverlayGlobals(namespace, {"apply_rotary_pos_emb": _trainops_apply_rotary_pos_emb})

    return _with_globals(cls.forward, overlay)


_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    original = _original_forward(type(self))
    # past_key_values only when given: transformers 5.24 renamed it (to cache) and warns on every pass of the old name
    cache = {} if past_key_values is None else {"past_key_values": past_key_values}
    if (labels is None or not self.training or not isinstance(logits_to_keep, int) or logits_to_keep != 0
            or kwargs.get("return_dict") is False or hasattr(self, "_loss_function")
            or getattr(self, "loss_type", None) not in (None, "ForCausalLM")):
        return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                        logits_to_keep=logits_to_keep, **cache, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    loss_kwargs = {k: kwargs.pop(k) for k in _LOSS_KWARGS if k in kwargs}
    outputs = getattr(self, self.base_model_prefix)(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        inputs_embeds=inputs_embeds, use_cache=use_cache, **cache, **kwargs)
    hidden = outputs.last_hidden_state
    ignore_index = loss_kwargs.get("ignore_index", -100)
    shift_labels = loss_kwargs.get("shift_labels")
    if shift_labels is None:   # tokens < n predict n, as transformers's ForCausalLMLoss
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = _head_loss(self.lm_head, hidden, shift_labels.to(hidden.device), ignore_index=ignore_index,
                      num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
                      softcap=getattr(self.config, "final_logit_softcapping", None))
    cache_field = _CACHE_FIELD[0] or _find_cache_field()
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions, **{cache_field: getattr(outputs, cache_field)})


def _linear_cross_entropy_of_head(head: torch.nn.Linear, hidden: Tensor, labels: Tensor, **options) -> Tensor:
    from .functional import linear_cross_entropy

    return linear_cross_entropy(hidden, head.weight, labels, head.bias, **options)


_HEAD_LOSS = "trainops_linear_cross_entropy"


def _head_loss(head: torch.nn.Linear, hidden: Tensor, labels: Tensor, **options) -> Tensor:
    """The fused loss of the LM head's weight and bias. When FSDP2's ``fully_shard`` made the head a
    unit of its own, the loss runs as a forward method of the head (``register_fsdp_forward_method``):
    FSDP gathers the weight for it and reduce-scatters its gradient, as for ``head(hidden)``;
    outside it the weight would be this rank's shard."""
    if fsdp_wrapped_class(type(head)) is None:
        return _linear_cross_entropy_of_head(head, hidden, labels, **options)
    if _HEAD_LOSS not in vars(head):
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(head, _HEAD_LOSS, types.MethodType(_linear_cross_entropy_of_head, head))
        register_fsdp_forward_method(head, _HEAD_LOSS)
    return getattr(head, _HEAD_LOSS)(hidden, labels, **options)


# The name of transformers's output field holding the cache, found when a causal LM is swapped
# (torch.compile cannot read a dataclass's fields): ``cache`` from 5.24 (whose old name,
# past_key_values, logs a deprecation on every read), ``past_key_values`` before.
_CACHE_FIELD = [None]


def _find_cache_field() -> str:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    _CACHE_FIELD[0] = "cache" if "cache" in names else "past_key_values"
    return _CACHE_FIELD[0]


# ---- the swapped classes -------------------------------------------------------------------------

_SUBCLASSES: dict[type, type] = {}
_SWAPPED: set[type] = set()   # _SUBCLASSES's values


def _original_forward(swapped: type):
    """transformers's forward of a swapped class (or of fully_shard's wrapper around one)."""
    return next(c for c in swapped.__mro__ if c in _SWAPPED).__bases__[0].forward


def _activation_kind(act) -> str | None:
    name = type(act).__name__
    if name in _SILUS:
        return "silu"
    if name in TANH_GELUS:
        return "tanh_gelu"
    return None


_QUALNAME_PREFIX = "Trainops__"


def trainops_class(cls: type, forward) -> type:
    """The subclass of ``cls`` whose forward is ``forward`` (one per class): ``cls``'s ``__name__``,
    importable from this module by its ``__qualname__`` (see the module docstring)."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        qualname = _QUALNAME_PREFIX + cls.__module__.replace(".", "__") + "__" + cls.__name__
        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": forward, "__module__": __name__, "__qualname__": qualname,
            "__doc__": f"transformers's {cls.__name__} computed by trainops (trainops.hf)"})
        _SWAPPED.add(sub)
        globals()[qualname] = sub
    return sub


def __getattr__(name: str):
    """A swapped class by its ``__qualname__``, made on first use (unpickling in a fresh process)."""
    if name.startswith(_QUALNAME_PREFIX):
        import importlib

        *module_parts, class_name = name[len(_QUALNAME_PREFIX):].split("__")
        cls = getattr(importlib.import_module(".".join(module_parts)), class_name, None)
        found = swap_for_class(cls) if isinstance(cls, type) else None
        if found is not None and found[0] is not None and found[0].__qualname__ == name:
            return found[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_swapped(module: torch.nn.Module, cls: type | None = None) -> bool:
    """Whether ``module``'s class (or ``cls``: the class fully_shard wrapped) is a swapped one."""
    return (cls or type(module)) in _SWAPPED


_KNOWN = (LLAMA_STYLE_NORMS | GEMMA_STYLE_NORMS | GATED_MLPS | TANH_GELUS | CAUSAL_LMS | ROTARY_ATTENTIONS
          | SCALED_EMBEDDINGS)


def swap_for(module: torch.nn.Module, cls: type | None = None):
    """(trainops class or None, reasons it cannot be swapped) for a transformers module trainops
    covers or a subclass of one (not swapped: reported), else None. ``cls``: the module's class
    (default its type; the class fully_shard wrapped, for a module it wrapped)."""
    cls = cls or type(module)
    if not is_transformers_class(cls):
        base = next((b for b in cls.__mro__[1:] if is_transformers_class(b) and b.__name__ in _KNOWN), None)
        if base is None or is_swapped(module, cls):
            return None
        return None, [f"a subclass of transformers.{base.__name__}: only exact transformers classes are swapped "
                      "(a subclass may change what the module computes)"]
    found = swap_for_class(cls)
    if found is None:
        return None
    sub, reasons = found
    return sub, reasons + (_instance_reasons(module, cls.__name__) if sub is not None else [])


def _instance_reasons(module: torch.nn.Module, name: str) -> list[str]:
    """What this module instance lacks for its class's swap."""
    reasons = []
    if name in LLAMA_STYLE_NORMS or name in GEMMA_STYLE_NORMS:
        eps = "variance_epsilon" if name in LLAMA_STYLE_NORMS else "eps"
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or not hasattr(module, eps):
            reasons.append(f"it has no 1-D weight and {eps} as {name} has in transformers")
    elif name in GATED_MLPS:
        if not all(isinstance(getattr(module, p, None), torch.nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
            reasons.append("its gate_proj / up_proj / down_proj are not torch.nn.Linear")
        if _activation_kind(getattr(module, "act_fn", None)) is None:
            reasons.append(f"its activation {type(getattr(module, 'act_fn', None)).__name__} is neither SiLU nor "
                           "tanh GELU")
    elif name in SCALED_EMBEDDINGS:
        if module.max_norm is not None or module.sparse or not isinstance(getattr(module, "embed_scale", None), Tensor):
            reasons.append("max_norm, sparse=True or a missing embed_scale buffer (trainops.embedding supports "
                           "neither of the first two)")
    elif name in CAUSAL_LMS:
        if not isinstance(getattr(module, "lm_head", None), torch.nn.Linear):
            reasons.append("its lm_head is not a torch.nn.Linear")
        if not isinstance(getattr(module, getattr(module, "base_model_prefix", ""), None), torch.nn.Module):
            reasons.append("it has no decoder under its base_model_prefix")
    return reasons


def swap_for_class(cls: type):
    """(trainops subclass, reasons no instance of ``cls`` can be swapped) for a transformers class
    trainops covers, else None."""
    name = cls.__name__
    if not is_transformers_class(cls) or name not in _KNOWN:
        return None
    if name in ROTARY_ATTENTIONS:
        forward = _forward_with_trainops_rotary(cls)
        if forward is None:
            return None, ["its forward calls no module-level apply_rotary_pos_emb, or is wrapped by a decorator "
                          "that could not be copied: the rotary embedding stays transformers's"]
    else:
        forward = (_llama_norm_forward if name in LLAMA_STYLE_NORMS else _gemma_norm_forward if name in GEMMA_STYLE_NORMS
                   else _gated_mlp_forward if name in GATED_MLPS else _tanh_gelu_forward if name in TANH_GELUS
                   else _scaled_embedding_forward if name in SCALED_EMBEDDINGS else _causal_lm_forward)
        if forward is _causal_lm_forward:
            _find_cache_field()
    return trainops_class(cls, forward), []


__all__ = ["CAUSAL_LMS", "GATED_MLPS", "GEMMA_STYLE_NORMS", "LLAMA_STYLE_NORMS", "ROTARY_ATTENTIONS",
           "SCALED_EMBEDDINGS", "TANH_GELUS", "swap_for", "swap_for_class"]
