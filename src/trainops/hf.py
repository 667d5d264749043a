"""Hugging Face transformers models in ``trainops.patch``: which of their modules become trainops's.

transformers is never imported here at import time (the core does not depend on it); a model is
recognised by its classes' names and modules. Swapped, by changing the module's class to a
subclass that overrides ``forward`` alone (parameters, buffers, hooks and state_dict keys kept,
as patch.py does for torch's modules):

    RMSNorm    LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm (x_normed * w, in the
               dtype torch's promotion of input and weight gives, as theirs) and GemmaRMSNorm,
               Gemma2RMSNorm ((1 + w), in the input's dtype)       -> trainops.rms_norm
    MLP        LlamaMLP, MistralMLP, Qwen2MLP, Qwen3MLP, GemmaMLP, Gemma2MLP whose activation is
               SiLU (-> trainops.swiglu) or tanh GELU (-> trainops.geglu); down_proj(act(gate) * up)
    GELU       NewGELUActivation, GELUTanh (GPT-2's, Gemma's)      -> trainops.gelu(approximate="tanh")
    embedding  GemmaTextScaledWordEmbedding (and Gemma 2's): trainops.embedding times embed_scale
               (``check_index`` as trainops.nn.Embedding's: set the attribute after patching)
    the loss   LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
               GemmaForCausalLM, Gemma2ForCausalLM: in training mode with labels, the decoder's last
               hidden states go to trainops.linear_cross_entropy with the LM head's weight (the
               logits are never made: ``output.logits`` is None), labels shifted as transformers's
               ForCausalLMLoss shifts them (or ``shift_labels``), ``num_items_in_batch`` passed on,
               Gemma 2's ``final_logit_softcapping`` as softcap. Without labels, in eval mode, with
               ``logits_to_keep`` or ``return_dict=False``, the original forward runs.

    rotary     LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention, GemmaAttention,
               Gemma2Attention: their own forward, run with ``apply_rotary_pos_emb`` resolved to
               trainops.rotary_embedding (a copy of the forward function with that one global
               replaced: transformers's module and every other model are untouched). The rotated q
               and k come out in q's dtype (transformers's come out in the promotion of q's and
               cos's: float32 under autocast, which the attention then casts back to bf16). Not
               swapped when the forward is wrapped by a decorator (it could not be copied alone).

The attention computation itself stays transformers's. torch.nn modules inside (Embedding,
LayerNorm, Dropout, ...) are patch.py's.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import Tensor

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


def _forward_with_trainops_rotary(cls: type):
    """A copy of ``cls.forward`` whose global ``apply_rotary_pos_emb`` is trainops's; None when the
    forward is decorated or its module has no such global."""
    forward = cls.forward
    namespace = vars(sys.modules[cls.__module__])
    if hasattr(forward, "__wrapped__") or not isinstance(forward, types.FunctionType) \
            or "apply_rotary_pos_emb" not in namespace or forward.__globals__ is not namespace:
        return None
    copied = types.FunctionType(forward.__code__, {**namespace, "apply_rotary_pos_emb": _trainops_apply_rotary_pos_emb},
                                forward.__name__, forward.__defaults__, forward.__closure__)
    copied.__kwdefaults__ = forward.__kwdefaults__
    copied.__qualname__ = forward.__qualname__
    copied.__doc__ = forward.__doc__
    return copied


_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    original = _original_forward(type(self))
    if (labels is None or not self.training or not isinstance(logits_to_keep, int) or logits_to_keep != 0
            or kwargs.get("return_dict") is False):
        return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                        use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from .functional import linear_cross_entropy

    loss_kwargs = {k: kwargs.pop(k) for k in _LOSS_KWARGS if k in kwargs}
    outputs = getattr(self, self.base_model_prefix)(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    ignore_index = loss_kwargs.get("ignore_index", -100)
    shift_labels = loss_kwargs.get("shift_labels")
    if shift_labels is None:   # tokens < n predict n, as transformers's ForCausalLMLoss
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = linear_cross_entropy(hidden, self.lm_head.weight, shift_labels.to(hidden.device), self.lm_head.bias,
                                ignore_index=ignore_index, num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
                                softcap=getattr(self.config, "final_logit_softcapping", None))
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


# ---- the swapped classes -------------------------------------------------------------------------

_SUBCLASSES: dict[type, type] = {}


def _original_forward(swapped: type):
    return swapped.__bases__[0].forward


def _activation_kind(act) -> str | None:
    name = type(act).__name__
    if name in _SILUS:
        return "silu"
    if name in TANH_GELUS:
        return "tanh_gelu"
    return None


def trainops_class(cls: type, forward) -> type:
    """The subclass of ``cls`` whose forward is ``forward`` (one per class)."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = _SUBCLASSES[cls] = type(f"Trainops{cls.__name__}", (cls,), {
            "forward": forward, "__module__": __name__, "__doc__": f"{cls.__name__} computed by trainops (trainops.hf)"})
    return sub


def is_swapped(module: torch.nn.Module) -> bool:
    return type(module) in _SUBCLASSES.values()


def swap_for(module: torch.nn.Module):
    """(trainops class, reasons it cannot be swapped) for a transformers module trainops covers, else None."""
    cls = type(module)
    name = cls.__name__
    if not is_transformers_class(cls):
        return None
    reasons = []
    if name in LLAMA_STYLE_NORMS or name in GEMMA_STYLE_NORMS:
        eps = "variance_epsilon" if name in LLAMA_STYLE_NORMS else "eps"
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or not hasattr(module, eps):
            reasons.append(f"it has no 1-D weight and {eps} as {name} has in transformers")
        forward = _llama_norm_forward if name in LLAMA_STYLE_NORMS else _gemma_norm_forward
    elif name in GATED_MLPS:
        if not all(isinstance(getattr(module, p, None), torch.nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
            reasons.append("its gate_proj / up_proj / down_proj are not torch.nn.Linear")
        if _activation_kind(getattr(module, "act_fn", None)) is None:
            reasons.append(f"its activation {type(getattr(module, 'act_fn', None)).__name__} is neither SiLU nor "
                           "tanh GELU")
        forward = _gated_mlp_forward
    elif name in TANH_GELUS:
        forward = _tanh_gelu_forward
    elif name in ROTARY_ATTENTIONS:
        forward = _forward_with_trainops_rotary(cls)
        if forward is None:
            return trainops_class(cls, cls.forward), [
                "its forward is wrapped by a decorator or calls no module-level apply_rotary_pos_emb: the rotary "
                "embedding stays transformers's"]
    elif name in SCALED_EMBEDDINGS:
        if module.max_norm is not None or module.sparse or not isinstance(getattr(module, "embed_scale", None), Tensor):
            reasons.append("max_norm, sparse=True or a missing embed_scale buffer (trainops.embedding supports "
                           "neither of the first two)")
        forward = _scaled_embedding_forward
    elif name in CAUSAL_LMS:
        if not isinstance(getattr(module, "lm_head", None), torch.nn.Linear):
            reasons.append("its lm_head is not a torch.nn.Linear")
        if not isinstance(getattr(module, getattr(module, "base_model_prefix", ""), None), torch.nn.Module):
            reasons.append("it has no decoder under its base_model_prefix")
        forward = _causal_lm_forward
    else:
        return None
    return trainops_class(cls, forward), reasons


__all__ = ["CAUSAL_LMS", "GATED_MLPS", "GEMMA_STYLE_NORMS", "LLAMA_STYLE_NORMS", "ROTARY_ATTENTIONS",
           "SCALED_EMBEDDINGS", "TANH_GELUS", "swap_for"]
