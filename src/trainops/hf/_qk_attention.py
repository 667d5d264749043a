"""The attention of the models with q / k norms (Qwen3, Qwen3-MoE, Gemma 3, OLMo 2), with their
query / key RMSNorm and rotary embedding in one trainops.qk_norm_rotary pass.

transformers's forward (5.17 to 5.24, one body for the four families) runs

    q = rotary(q_norm(q_proj(x) as (b, s, hq, d)))     k = rotary(k_norm(k_proj(x) as (b, s, hk, d)))
    v = v_proj(x);  cache update;  attention interface (SDPA / eager / ...);  o_proj

whose norms are module calls (``self.q_norm(...)``), not a global that could be resolved elsewhere
as ``apply_rotary_pos_emb`` is (_common.RotaryAttention): fusing them takes a forward of our own.
This is it, the same statements around one ``qk_norm_rotary`` call: the projections and o_proj
called as modules (LoRA wrappers included), the cache updated as transformers does (5.24's
``cache.update(..., kwargs=kwargs)``, 5.17's ``past_key_values.update(...)``), the attention
function looked up at each call in the model's module (``ALL_ATTENTION_FUNCTIONS.get_interface(
config._attn_implementation, eager_attention_forward)``) with the same dropout, scaling and (Qwen3,
Qwen3-MoE, Gemma 3) sliding window, and the same return value ``(attn_output, attn_weights)``.
Gemma 3's attention passes no soft-capping to the attention function (transformers's does not
either: ``attn_logit_softcapping`` is unused by Gemma3Attention).

The norm per family: Qwen3's ``w * x_normed.to(dtype)`` (output in torch's promotion of the
weight's and q's dtypes), Gemma 3's ``x_normed * (1 + w)`` (``weight_offset=1.0``, q's dtype),
OLMo 2's ``w * x_normed`` over the whole projection (``across_heads=True``: weights of shape
(heads * head_dim,), the statistic over a token's heads * head_dim features; q's dtype). The
rotated q and k come out in that dtype, as from the unfused trainops path (transformers's own
rotation promotes them with cos's dtype); under autocast, in q's dtype (the autocast dtype the
attention casts them to anyway: the same values without a cast each way; a KV cache then holds
them in that dtype). benchmarks/bench_qk_wiring.py on the H200 (8 Qwen3-0.6B-shaped layers, 8 x
2048 tokens): GPU time 73.6 ms a step fused against 74.3 unfused, 1037 launches against 1149 (the
wall times, 76.9 against 84.7 ms, move by 5 % between runs of the same code).

What is refused (the attention left as transformers's, the reason in the patch report): a class
whose forward is not this one (its signature, or any name it reads, differs from transformers
5.17 to 5.24's: another version may compute something else); an instance whose q_norm / k_norm is
not the family's RMSNorm (a subclass, another module), has hooks (the fused pass would skip them),
differs in eps from the other, or has weights of another shape; an odd head_dim; OLMo 2 heads
wider than one program holds (``QKNormRotaryHeuristics.across_max``).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from ._common import _SWAPPED, Kind, original_class

# The names transformers 5.17 to 5.24's q/k-norm attention forwards read (their code objects'
# co_names); families passing a sliding window read "sliding_window" too.
_FORWARD_NAMES = frozenset({
    "ALL_ATTENTION_FUNCTIONS", "_attn_implementation", "apply_rotary_pos_emb", "attention_dropout", "config",
    "contiguous", "eager_attention_forward", "get_interface", "head_dim", "k_norm", "k_proj", "layer_idx", "o_proj",
    "q_norm", "q_proj", "reshape", "scaling", "shape", "training", "transpose", "update", "v_proj", "view"})
# the cache argument's name -> the transformers versions using it
_CACHE_NAMES = {"cache": "5.24", "past_key_values": "5.17"}


@dataclass(frozen=True)
class QKNormAttention(Kind):
    """The attention forward with q_norm, k_norm and the rotary embedding in one
    trainops.qk_norm_rotary (module docstring). ``norm_class``: the family's RMSNorm class name;
    ``eps_attribute``: its eps; ``weight_offset``: 1.0 for (1 + w); ``across_heads``: norms over the
    whole projection (OLMo 2); ``promote``: the norm's output in the promotion of weight and input
    dtypes (Qwen3), else the input's; ``sliding_window``: the forward passes
    ``sliding_window=self.sliding_window`` to the attention function."""

    group: str = "attention"
    norm_class: str = ""
    eps_attribute: str = "variance_epsilon"
    weight_offset: float = 0.0
    across_heads: bool = False
    promote: bool = True
    sliding_window: bool = True
    input_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")

    @property
    def description(self) -> str:
        return "attention: fused q/k norm + rotary"

    def make(self, cls):
        modeling = sys.modules[cls.__module__]
        namespace = vars(modeling)
        missing = [name for name in ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward", self.norm_class)
                   if name not in namespace]
        if missing:
            return None, [f"its module has no {', '.join(missing)}: not the transformers 5.17 to 5.24 module the "
                          "fused q/k norm + rotary attention was written against"]
        original = inspect.unwrap(cls.forward)
        parameters = list(inspect.signature(original).parameters.values())
        names = [p.name for p in parameters]
        if (names[:4] != ["self", "hidden_states", "position_embeddings", "attention_mask"] or len(names) != 6
                or names[4] not in _CACHE_NAMES or parameters[5].kind is not inspect.Parameter.VAR_KEYWORD):
            return None, [f"its forward's signature ({', '.join(names)}) is not transformers 5.17's or 5.24's "
                          "(self, hidden_states, position_embeddings, attention_mask, past_key_values | cache, "
                          "**kwargs), which the fused q/k norm + rotary attention was written against"]
        expected = _FORWARD_NAMES | ({"sliding_window"} if self.sliding_window else set())
        read = set(original.__code__.co_names)
        if read != expected:
            changes = [f"reads {', '.join(sorted(read - expected))}" if read - expected else "",
                       f"no longer reads {', '.join(sorted(expected - read))}" if expected - read else ""]
            return None, [f"its forward {' and '.join(c for c in changes if c)} (not transformers 5.17 to 5.24's "
                          f"{cls.__name__}.forward, which the fused q/k norm + rotary attention was written against)"]
        return {"forward": _forward(self, modeling, names[4])}, []

    def instance_reasons(self, module):
        needed = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        if not all(isinstance(getattr(module, name, None), torch.nn.Module) for name in needed):
            return [f"its {' / '.join(needed)} are not all modules"]
        head_dim, config = getattr(module, "head_dim", None), getattr(module, "config", None)
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            return [f"its head_dim {head_dim!r} is not even (qk_norm_rotary's rotate_half needs it even)"]
        norm_class = getattr(sys.modules[type(module).__module__], self.norm_class, None)
        reasons = []
        for name in ("q_norm", "k_norm"):
            norm = getattr(module, name)
            cls = type(norm)
            if not (cls is norm_class or (cls in _SWAPPED and original_class(cls) is norm_class)):
                reasons.append(f"its {name} is a {cls.__name__}, not transformers's {self.norm_class} (the fused "
                               "q/k norm + rotary computes that norm only)")
            elif norm._forward_hooks or norm._forward_pre_hooks or norm._backward_hooks or norm._backward_pre_hooks:
                reasons.append(f"its {name} has hooks, which the fused q/k norm + rotary would not run")
            elif not isinstance(getattr(norm, "weight", None), torch.nn.Parameter):
                reasons.append(f"its {name} has no weight parameter")
        if reasons:
            return reasons
        if self.across_heads:
            heads = {"q_norm": getattr(config, "num_attention_heads", None),
                     "k_norm": getattr(config, "num_key_value_heads", None)}
            if not all(isinstance(h, int) for h in heads.values()):
                return ["its config has no num_attention_heads / num_key_value_heads"]
            shapes = {name: (h * head_dim,) for name, h in heads.items()}
        else:
            shapes = {"q_norm": (head_dim,), "k_norm": (head_dim,)}
        for name, shape in shapes.items():
            weight = getattr(module, name).weight
            if tuple(weight.shape) != shape:
                reasons.append(f"its {name}.weight has shape {tuple(weight.shape)}, not {shape} "
                               f"({'heads * head_dim' if self.across_heads else 'head_dim'})")
        eps = [getattr(module, name).__dict__.get(self.eps_attribute) for name in ("q_norm", "k_norm")]
        if not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in eps):
            reasons.append(f"its q_norm / k_norm have no numeric {self.eps_attribute}")
        elif eps[0] != eps[1]:
            reasons.append(f"its q_norm's eps ({eps[0]}) and k_norm's ({eps[1]}) differ (qk_norm_rotary takes one)")
        if self.across_heads and not reasons:
            from ..layout import next_pow2
            from ..ops.qk_norm_rotary import QKNormRotaryHeuristics
            from ..plan import heuristics_for

            held = next_pow2(max(config.num_attention_heads, config.num_key_value_heads)) * 2 * next_pow2(head_dim // 2)
            limit = heuristics_for(QKNormRotaryHeuristics).across_max
            if held > limit:
                reasons.append(f"its norms over all heads hold {held} padded elements, more than qk_norm_rotary's "
                               f"across_max ({limit})")
        if self.sliding_window and not hasattr(module, "sliding_window"):
            reasons.append("it has no sliding_window attribute")
        return reasons


def _forward(kind: QKNormAttention, modeling, cache_name: str):
    """The forward of ``kind``'s attention class in module ``modeling``, whose cache argument is
    ``cache_name`` (5.24's ``cache``, whose update also takes the call's kwargs; 5.17's
    ``past_key_values``)."""
    new_cache = cache_name == "cache"

    def attend(self, hidden_states: Tensor, position_embeddings, attention_mask, cache, kwargs):
        from .. import functional as F

        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)   # (batch, seq, heads, head_dim), read in place
        k = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q_weight, k_weight = self.q_norm.weight, self.k_norm.weight
        # under autocast the attention reads q and k in the autocast dtype (q's, from the projection):
        # written in it, they skip a cast each way (the values are the same; a KV cache holds them so)
        promote = kind.promote and not torch.is_autocast_enabled(q.device.type)
        out_dtype = torch.promote_types(q.dtype, q_weight.dtype) if promote else None
        q, k = F.qk_norm_rotary(q, k, q_weight, k_weight, cos, sin, getattr(self.q_norm, kind.eps_attribute),
                                weight_offset=kind.weight_offset, across_heads=kind.across_heads, out_dtype=out_dtype)
        query_states, key_states = q.transpose(1, 2), k.transpose(1, 2)
        if cache is not None:
            if new_cache:
                key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
            else:
                key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        attention_interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling.eager_attention_forward)
        extra = {"sliding_window": self.sliding_window} if kind.sliding_window else {}
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **extra, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    if new_cache:
        def forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
            if cache is None:   # the old name (transformers 5.24's forward renames it, with a warning)
                cache = kwargs.pop("past_key_values", None)
            return attend(self, hidden_states, position_embeddings, attention_mask, cache, kwargs)
    else:
        def forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask=None, past_key_values=None,
                    **kwargs):
            return attend(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs)

    forward.__doc__ = __doc__
    return forward


QWEN3_ATTENTION = QKNormAttention(norm_class="Qwen3RMSNorm")
QWEN3_MOE_ATTENTION = QKNormAttention(norm_class="Qwen3MoeRMSNorm")
GEMMA3_ATTENTION = QKNormAttention(norm_class="Gemma3RMSNorm", eps_attribute="eps", weight_offset=1.0, promote=False)
OLMO2_ATTENTION = QKNormAttention(norm_class="Olmo2RMSNorm", across_heads=True, promote=False, sliding_window=False)
