"""The pieces trainops.hf's architecture modules share: the kinds of swap (what a swapped class's
forward computes, and what an instance must have for it), the copied attention forward that runs
trainops's rotary embedding, the fused causal-LM loss, and the registry of swapped classes.

transformers is never imported here at import time; the forwards import trainops.functional
when first run (trainops.functional imports nothing of this package).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..dtensor import fsdp_wrapped_class
from ..errors import UnsupportedError
from . import _causal_mask as causal_mask
from .lora import head_operands, head_reasons, out_features, projection_reasons


def is_transformers_class(cls: type) -> bool:
    return cls.__module__.startswith("transformers.")


# ---- the kinds of swap ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """One kind of swap: ``make(cls)`` gives the attributes of ``cls``'s swapped subclass (its
    ``forward``, and whatever else it overrides) and the reasons no instance of ``cls`` can be
    swapped (then the attributes are None); ``instance_reasons(module)`` what one instance lacks.
    ``group``: the word the report and the docs use (norm, mlp, gelu, embedding, attention,
    router, experts, loss). ``input_projections``: the names of the module's children that alone
    read its forward's input (an attention's q / k / v projections, an MLP's gate and up), in
    transformers's forward and the swapped one alike; empty (the default) where something else
    reads it too, or nothing is known."""

    group: str
    forward: Callable | None = None

    def make(self, cls: type) -> tuple[dict | None, list[str]]:
        return {"forward": self.forward}, []

    @property
    def input_projections(self) -> tuple[str, ...]:
        return ()

    def instance_reasons(self, module: torch.nn.Module) -> list[str]:
        return []

    @property
    def description(self) -> str:
        """What the swapped forward computes, in the patch report's words."""
        return self.group


_SILUS = frozenset({"SiLU", "SiLUActivation"})
# transformers.activations's (PytorchGELUTanh is an alias of GELUTanh)
_TANH_GELU_NAMES = frozenset({"NewGELUActivation", "GELUTanh"})


def _activation_kind(act) -> str | None:
    name = type(act).__name__
    if name in _SILUS:
        return "silu"
    if name in _TANH_GELU_NAMES or (name == "GELU" and getattr(act, "approximate", None) == "tanh"):
        return "tanh_gelu"
    return None


def _gated(act, gate: Tensor, up: Tensor | None = None) -> Tensor:
    """act(gate) * up by trainops.swiglu / geglu; ``up=None``: gate holds [gate, up] on its last axis."""
    from .. import functional as F

    if _activation_kind(act) == "silu":
        return F.swiglu(gate, up)
    return F.geglu(gate, up, approximate="tanh")


# The instance attribute trainops.patch sets on a decoder layer's norm whose output only autocast's
# matmuls read (``norms_into_projections``); unpatch removes it
AUTOCAST_OUTPUT = "autocast_output"
_HALF = (torch.bfloat16, torch.float16)


def _autocast_output_dtype(module, x: Tensor, promote: bool) -> torch.dtype | None:
    """The autocast dtype, where ``module`` (a norm with ``autocast_output`` set) would return float32
    computed from a float32 x while autocast of a half dtype is on for x's device: its readers (the
    projections) cast that output to the autocast dtype, so the norm writes it there itself. Else
    None: the norm's own dtype."""
    if not getattr(module, AUTOCAST_OUTPUT, False) or x.dtype != torch.float32:
        return None
    if promote and torch.promote_types(module.weight.dtype, x.dtype) != torch.float32:
        return None
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype in _HALF else None


def _rms_norm_forward(eps_attribute: str, weight_offset: float, promote: bool):
    def forward(self, hidden_states: Tensor) -> Tensor:
        from .. import functional as F

        eps = getattr(self, eps_attribute)
        autocast_dtype = _autocast_output_dtype(self, hidden_states, promote)
        if autocast_dtype is not None:
            return F.rms_norm(hidden_states, self.weight, eps, weight_offset=weight_offset, out_dtype=autocast_dtype)
        y = F.rms_norm(hidden_states, self.weight, eps, weight_offset=weight_offset)
        if promote:   # weight * x_normed.to(input dtype): torch's promotion of the two
            out_dtype = torch.promote_types(self.weight.dtype, hidden_states.dtype)
            y = y if y.dtype == out_dtype else y.to(out_dtype)
        return y

    return forward


@dataclass(frozen=True)
class RMSNorm(Kind):
    """y = x / sqrt(mean(x^2) + eps) * (w + weight_offset) by trainops.rms_norm, statistics in float32.
    ``promote``: the output in the promotion of the weight's and the input's dtypes (Llama's
    ``w * x_normed.to(input dtype)``), else in the input's dtype (Gemma's and OLMo 2's, which
    multiply in float32 and round once).

    Under autocast, a decoder layer's norm whose output only autocast's matmuls read (trainops.patch
    sets its ``autocast_output``: ``norms_into_projections``) and which would return float32 from a
    float32 input writes y in the autocast dtype (bf16 / fp16) instead: y computed in float32 and
    rounded once, the values each projection's autocast cast would make, without the float32 y
    and the casts (one per projection, each way)."""

    eps_attribute: str = "variance_epsilon"
    weight_offset: float = 0.0
    promote: bool = True

    def make(self, cls):
        return {"forward": _rms_norm_forward(self.eps_attribute, self.weight_offset, self.promote)}, []

    def instance_reasons(self, module):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or not hasattr(module, self.eps_attribute):
            return [f"it has no 1-D weight and {self.eps_attribute} as {type(module).__name__} has in transformers"]
        return []


def _activation_reasons(module, attribute: str) -> list[str]:
    act = getattr(module, attribute, None)
    if _activation_kind(act) is None:
        return [f"its activation {type(act).__name__} is neither SiLU nor tanh GELU"]
    return []




def _gated_mlp_forward(self, x: Tensor) -> Tensor:
    return self.down_proj(_gated(self.act_fn, self.gate_proj(x), self.up_proj(x)))


def _fused_gated_mlp_forward(self, x: Tensor) -> Tensor:
    return self.down_proj(_gated(self.activation_fn, self.gate_up_proj(x)))


@dataclass(frozen=True)
class GatedMLP(Kind):
    """down_proj(act(gate_proj(x)) * up_proj(x)), act(gate) * up by trainops.swiglu (SiLU) or
    trainops.geglu (tanh GELU). ``fused``: one gate_up_proj whose output holds [gate, up] (Phi-3,
    GLM-4; activation ``activation_fn``), read in place by the kernel."""

    group: str = "mlp"
    fused: bool = False

    @property
    def input_projections(self) -> tuple[str, ...]:
        return ("gate_up_proj",) if self.fused else ("gate_proj", "up_proj")

    def make(self, cls):
        return {"forward": _fused_gated_mlp_forward if self.fused else _gated_mlp_forward}, []

    def instance_reasons(self, module):
        if self.fused:
            reasons = projection_reasons(module, ("gate_up_proj", "down_proj"))
            if not reasons and out_features(module.gate_up_proj) % 2:
                reasons.append("its gate_up_proj has an odd number of outputs")
            return reasons + _activation_reasons(module, "activation_fn")
        return projection_reasons(module, ("gate_proj", "up_proj", "down_proj")) + _activation_reasons(module, "act_fn")


def _tanh_gelu_forward(self, input: Tensor) -> Tensor:
    from .. import functional as F

    return F.gelu(input, approximate="tanh")


def _scaled_embedding_forward(self, input_ids: Tensor) -> Tensor:
    from .. import functional as F

    embedded = F.embedding(input_ids, self.weight, self.padding_idx, check_index=getattr(self, "check_index", True))
    return embedded * self.embed_scale.to(self.weight.dtype)


@dataclass(frozen=True)
class ScaledEmbedding(Kind):
    """trainops.embedding times the ``embed_scale`` buffer (Gemma's sqrt(hidden) scale), in the
    weight's dtype; ``check_index`` as trainops.nn.Embedding's (set the attribute after patching)."""

    group: str = "embedding"
    forward: Callable = _scaled_embedding_forward

    def instance_reasons(self, module):
        if module.max_norm is not None or module.sparse or not isinstance(getattr(module, "embed_scale", None), Tensor):
            return ["max_norm, sparse=True or a missing embed_scale buffer (trainops.embedding supports neither of "
                    "the first two)"]
        return []


TANH_GELU = Kind("gelu", _tanh_gelu_forward)
LLAMA_NORM = RMSNorm("norm")
GEMMA_NORM = RMSNorm("norm", eps_attribute="eps", weight_offset=1.0, promote=False)
OLMO2_NORM = RMSNorm("norm", promote=False)
GATED_MLP = GatedMLP()
FUSED_GATED_MLP = GatedMLP(fused=True)
SCALED_EMBEDDING = ScaledEmbedding()


# ---- the attention: transformers's forward, trainops's rotary embedding ---------------------------

def _trainops_apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
    """transformers's ``apply_rotary_pos_emb(q, k, cos, sin)`` for (batch, heads, seq, head_dim) q and k
    and (batch, seq, R) cos and sin (``unsqueeze_dim=1``), by trainops.rotary_embedding: rotate_half
    on the first R = cos.shape[-1] features of each head, the rest passed through (Phi-3's partial
    rotary)."""
    from .. import functional as F

    if unsqueeze_dim != 1:
        raise NotImplementedError("trainops.hf: apply_rotary_pos_emb with unsqueeze_dim != 1 is not swapped")
    return F.rotary_embedding(q, k, cos, sin)


def _trainops_apply_interleaved_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
    """GLM-4's ``apply_rotary_pos_emb``: pairs (2i, 2i+1) rotated by angle i on the first R =
    cos.shape[-1] features (cos[..., :R/2] repeated per pair), the rest passed through; by
    trainops.rotary_embedding(interleaved=True)."""
    from .. import functional as F

    if unsqueeze_dim != 1:
        raise NotImplementedError("trainops.hf: apply_rotary_pos_emb with unsqueeze_dim != 1 is not swapped")
    half = cos.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    return F.rotary_embedding(q, k, cos, sin, interleaved=True)


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


def _forward_with_rotary(cls: type, rotary):
    """A copy of ``cls.forward`` (decorators included) whose global ``apply_rotary_pos_emb`` is
    ``rotary``; None when its module has no such global or a decorator cannot be copied."""
    namespace = vars(sys.modules[cls.__module__])
    if not isinstance(cls.forward, types.FunctionType) or "apply_rotary_pos_emb" not in namespace:
        return None

    def overlay(function_globals):
        if function_globals is not namespace:   # a decorator's own module: left as it is
            return function_globals
        return _OverlayGlobals(namespace, {"apply_rotary_pos_emb": rotary})

    return _with_globals(cls.forward, overlay)


@dataclass(frozen=True)
class RotaryAttention(Kind):
    """The attention's own forward, run with ``apply_rotary_pos_emb`` resolved to trainops's
    (a copy of the forward function whose globals are that one name over the module's own
    namespace, looked up at each call: transformers's module and every other model are untouched,
    and later changes to the module are seen, by torch.compile too: ``_OverlayGlobals``).
    ``interleaved``: GLM-4's pairwise rotation. The attention computation itself (masks, sliding
    windows, soft-capping, the attention implementation) stays transformers's."""

    group: str = "attention"
    interleaved: bool = False
    input_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")

    @property
    def description(self) -> str:
        return "attention: rotary embedding"

    def make(self, cls):
        rotary = _trainops_apply_interleaved_rotary_pos_emb if self.interleaved else _trainops_apply_rotary_pos_emb
        forward = _forward_with_rotary(cls, rotary)
        if forward is None:
            return None, ["its forward calls no module-level apply_rotary_pos_emb, or is wrapped by a decorator "
                          "that could not be copied: the rotary embedding stays transformers's"]
        return {"forward": forward}, []


ROTARY_ATTENTION = RotaryAttention()
INTERLEAVED_ROTARY_ATTENTION = RotaryAttention(interleaved=True)
FUSED_QKV_ROTARY_ATTENTION = RotaryAttention(input_projections=("qkv_proj",))   # Phi-3's one qkv_proj


# ---- the pre-norms: whose output only projections read ------------------------------------------------

# A decoder layer's norms -> the child whose forward alone reads each one's output (transformers
# 5.24's decoder layers: the pre-norm before the attention, the one before the MLP; the post-norms
# of Gemma 2 / 3, OLMo 2 and GLM-4 feed the residual add and are not listed)
PRE_NORMS = {"input_layernorm": "self_attn", "post_attention_layernorm": "mlp"}
GEMMA2_PRE_NORMS = {"input_layernorm": "self_attn", "pre_feedforward_layernorm": "mlp"}


# ---- mixture of experts ----------------------------------------------------------------------------

def _router_forward(normalize_always: bool, cast_weights: bool):
    def forward(self, hidden_states: Tensor):
        from .. import functional as F

        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = F.softmax(router_logits.float(), dim=-1)
        top_weights, top_index = torch.topk(probs, self.top_k, dim=-1)
        if normalize_always or self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        if cast_weights:
            top_weights = top_weights.to(router_logits.dtype)
        return router_logits, top_weights, top_index

    return forward


@dataclass(frozen=True)
class Router(Kind):
    """The top-k router: logits = x W^T, probabilities by trainops.softmax in float32, the top k
    (renormalised to sum 1 always (Mixtral) or where ``norm_topk_prob`` is set (Qwen3-MoE, whose
    weights then go back to the logits' dtype: ``cast_weights``)); returns (logits, weights,
    indices) as transformers's router, whose logits the auxiliary loss reads."""

    group: str = "router"
    normalize_always: bool = True
    cast_weights: bool = False

    def make(self, cls):
        return {"forward": _router_forward(self.normalize_always, self.cast_weights)}, []

    def instance_reasons(self, module):
        weight = getattr(module, "weight", None)
        needed = ("top_k", "hidden_dim") + (() if self.normalize_always else ("norm_topk_prob",))
        if (not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2
                or not all(hasattr(module, a) for a in needed)):
            return [f"it has no 2-D weight and {', '.join(needed)} as {type(module).__name__} has in transformers"]
        return []


def _experts_apply_gate(self, gate_up_out: Tensor) -> Tensor:
    """act(gate) * up of the experts' fused [gate, up] projection (transformers's grouped_mm and
    batched_mm experts implementations call it between their two grouped matmuls)."""
    return _gated(self.act_fn, gate_up_out)


def _experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers's experts dispatch (``config._experts_implementation``: grouped_mm by default
    in transformers 5, batched_mm, ...: their gate runs through ``_experts_apply_gate``); for
    "eager", the tokens sorted by expert and each expert's rows run as two matmuls around
    trainops's gate. The per-expert loop reads the counts on the host (one synchronisation a
    layer, as transformers's eager loop)."""
    implementation = getattr(getattr(self, "config", None), "_experts_implementation", "eager")
    if implementation not in (None, "eager"):
        return original_class(type(self)).forward(self, hidden_states, top_k_index, top_k_weights)
    top_k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // top_k
    weights = top_k_weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=self.num_experts).tolist()[:self.num_experts]   # a sentinel expert: dropped
    out = torch.zeros_like(hidden_states)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            taken = rows[start:start + count]
            h = torch.nn.functional.linear(hidden_states[taken], self.gate_up_proj[expert])
            h = torch.nn.functional.linear(_gated(self.act_fn, h), self.down_proj[expert])
            out.index_add_(0, taken, (h * weights[start:start + count, None]).to(out.dtype))
            start += count
    return out


@dataclass(frozen=True)
class Experts(Kind):
    """A layer's experts kept as fused 3-D weights (gate_up_proj (E, 2I, H), down_proj (E, H, I)):
    act(gate) * up by trainops.swiglu between the matmuls (``_experts_forward``)."""

    group: str = "experts"

    def make(self, cls):
        return {"forward": _experts_forward, "_apply_gate": _experts_apply_gate}, []

    def instance_reasons(self, module):
        reasons = []
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(module, name, None)
            if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 3:
                reasons.append(f"its {name} is not a 3-D parameter")
        layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                  "has_post_expert_norm": False}
        odd = [f"{name}={getattr(module, name)!r}" for name, want in layout.items()
               if getattr(module, name, want) != want]
        if odd:
            reasons.append(f"its layout ({', '.join(odd)}) is not the fused [gate; up] one trainops runs")
        if not hasattr(module, "num_experts"):
            reasons.append("it has no num_experts")
        return reasons + _activation_reasons(module, "act_fn")


ROUTER = Router()
EXPERTS = Experts()


# ---- the causal-LM loss -----------------------------------------------------------------------------

_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")
# forward keywords asking the fused loss for its metrics -> linear_cross_entropy's keyword and the output's key
_METRIC_KWARGS = {"return_token_accuracy": "token_accuracy", "return_entropy": "entropy"}


@dataclass(frozen=True)
class CausalLM(Kind):
    """In training mode with labels, the decoder's last hidden states go to
    trainops.linear_cross_entropy with the LM head's weight and bias: the logits are never made
    (``output.logits`` is None). A PEFT head (LoRA on lm_head, or lm_head in modules_to_save) is
    computed as trainops.hf.lora says: the adapted logits exactly, LoRA dropout included. Labels
    shifted as transformers's ForCausalLMLoss shifts them (or ``shift_labels``),
    ``num_items_in_batch`` and ``ignore_index`` passed on (a float ``num_items_in_batch`` tensor,
    as the Trainer of transformers 5.24 passes: the summed loss divided by it). The logits transform
    z = softcap(logit_scale * (h W^T + b)): ``softcap`` names the config attribute holding the cap
    (Gemma 2 / 3's final_logit_softcapping), ``logit_divisor`` the one the logits are divided by
    (Granite's logits_scaling: logit_scale = 1 / it). ``moe``: the router's auxiliary loss, when
    ``output_router_logits`` (or the config's) asks for it, added as transformers adds it (its own
    ``load_balancing_loss_func`` times ``router_aux_loss_coef``). ``labels_to_decoder``: the base
    model takes the labels too and is called with return_dict=True (Gemma 3's multimodal model).
    ``output``: the name of the output class in the model's module. ``loss_types``: the
    ``loss_type`` values whose loss is this one.

    ``return_token_accuracy=True`` / ``return_entropy=True`` (forward keywords, taken out of the
    call whichever forward runs): the fused loss also computes the token accuracy / entropy of its
    logits (trainops.linear_cross_entropy's token_accuracy / entropy: means over the rows whose
    shifted label is not ignore_index, float32 scalars without gradient), set on the output as
    ``output.token_accuracy`` / ``output.entropy`` (as Liger's output), for loops that would read
    them from ``output.logits``. In eval mode or without labels the original forward runs: the
    output has its logits and no metrics. A training call with labels that the fused loss does not
    take (logits_to_keep, return_dict=False, a custom loss) and asks for a metric raises
    UnsupportedError naming the keyword.

    The original forward runs without labels, in eval mode, with ``logits_to_keep``,
    ``return_dict=False``, a custom ``model.loss_function`` or another ``loss_type``. An LM head
    that FSDP2's ``fully_shard`` made a unit of its own computes the loss as one of its FSDP
    forward methods (the weight gathered by FSDP, not read as a shard)."""

    group: str = "loss"
    output: str = "CausalLMOutputWithPast"
    softcap: str | None = None
    logit_divisor: str | None = None
    moe: bool = False
    labels_to_decoder: bool = False
    loss_types: tuple = (None, "ForCausalLM")

    def make(self, cls):
        namespace = vars(sys.modules[cls.__module__])
        output_class = namespace.get(self.output)
        balance = namespace.get("load_balancing_loss_func")
        if not (isinstance(output_class, type) and dataclasses.is_dataclass(output_class)):
            return None, [f"its module has no output class {self.output}"]
        if self.moe and balance is None:
            return None, ["its module has no load_balancing_loss_func (the router's auxiliary loss)"]
        return {"forward": _causal_lm_forward(self, cls, output_class, balance)}, []

    def instance_reasons(self, module):
        reasons = []
        reasons += head_reasons(getattr(module, "lm_head", None))
        if not isinstance(getattr(module, getattr(module, "base_model_prefix", ""), None), torch.nn.Module):
            reasons.append("it has no decoder under its base_model_prefix")
        return reasons


def _causal_lm_forward(kind: CausalLM, cls: type, output_class: type, balance):
    original = cls.forward
    positional = tuple(p.name for p in list(inspect.signature(original).parameters.values())[1:]
                       if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    # the decoder's outputs the original copies into its own (torch.compile cannot read a dataclass's fields)
    carried = tuple(f.name for f in dataclasses.fields(output_class) if f.name not in ("loss", "logits", "aux_loss"))

    def forward(self, *args, **kwargs):
        metrics = {key: kwargs.pop(name) for name, key in _METRIC_KWARGS.items() if name in kwargs}
        named = dict(zip(positional, args))
        named.update(kwargs)
        labels, keep = named.get("labels"), named.get("logits_to_keep", 0)
        if (labels is None or not self.training or len(args) > len(positional) or not isinstance(keep, int)
                or keep != 0 or named.get("return_dict") is False or hasattr(self, "_loss_function")
                or getattr(self, "loss_type", None) not in kind.loss_types):
            if labels is not None and self.training and any(metrics.values()):
                asked = " and ".join(name for name, key in _METRIC_KWARGS.items() if metrics.get(key))
                raise UnsupportedError(
                    f"trainops: {type(self).__name__}.forward({asked}=True): the metrics come from the fused "
                    "loss, which this call does not run (logits_to_keep, return_dict=False, extra positional "
                    "arguments, a custom loss function or loss_type): compute them from outputs.logits")
            return original(self, *args, **kwargs)
        loss_kwargs = {name: named.pop(name) for name in _LOSS_KWARGS if name in named}
        for name in ("labels", "logits_to_keep", "return_dict"):
            named.pop(name, None)
        if kind.moe and named.get("output_router_logits") is None:
            named["output_router_logits"] = self.config.output_router_logits
        if kind.labels_to_decoder:
            named.update(labels=labels, return_dict=True)
        if not torch.compiler.is_compiling():
            causal_mask.track(self.config)   # a copy of a patched model (hf/_causal_mask.py)
        default_positions = named.get("position_ids") is None   # the decoder makes them: nothing packed
        causal_mask.patched_forward_begin(default_positions)
        try:
            outputs = getattr(self, self.base_model_prefix)(**named)
        finally:
            causal_mask.patched_forward_end(default_positions)
        hidden = outputs.last_hidden_state
        ignore_index = loss_kwargs.get("ignore_index", -100)
        shift_labels = loss_kwargs.get("shift_labels")
        if shift_labels is None:   # tokens < n predict n, as transformers's ForCausalLMLoss
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        options = {}
        if kind.softcap is not None:
            options["softcap"] = getattr(self.config, kind.softcap)
        if kind.logit_divisor is not None:
            options["logit_scale"] = 1.0 / getattr(self.config, kind.logit_divisor)
        items = loss_kwargs.get("num_items_in_batch")
        if isinstance(items, Tensor) and items.is_floating_point():
            # the Trainer's token count divided by its parallel sizes (transformers 5.24 passes a float
            # tensor): the summed loss divided by it, as transformers's ForCausalLMLoss does
            loss = _head_loss(self.lm_head, hidden, shift_labels.to(hidden.device), ignore_index=ignore_index,
                              reduction="sum", **metrics, **options)
        else:
            loss = _head_loss(self.lm_head, hidden, shift_labels.to(hidden.device), ignore_index=ignore_index,
                              num_items_in_batch=items, **metrics, **options)
        found = None
        if any(metrics.values()):   # linear_cross_entropy returned a LinearCrossEntropyOutput
            loss, found = loss.loss, loss
        if isinstance(items, Tensor) and items.is_floating_point():
            loss = loss / items.to(loss.device)
        extra = {}
        if kind.moe:
            aux_loss = None
            if named["output_router_logits"]:
                aux_loss = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                   named.get("attention_mask"))
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
            extra["aux_loss"] = aux_loss
        output = output_class(loss=loss, logits=None, **extra, **{name: getattr(outputs, name) for name in carried})
        for key in ("token_accuracy", "entropy") if found is not None else ():
            if getattr(found, key) is not None:   # a ModelOutput key and attribute: output.token_accuracy
                output[key] = getattr(found, key)
        return output

    forward.__doc__ = CausalLM.__doc__
    # what reads the signature sees transformers's: the Trainer keeps the dataset columns it names
    # (remove_unused_columns) and passes num_items_in_batch where it takes **kwargs
    forward.__signature__ = inspect.signature(original)
    return forward


def _linear_cross_entropy_of_head(head: torch.nn.Module, hidden: Tensor, labels: Tensor, **options) -> Tensor:
    from ..functional import linear_cross_entropy

    hidden, weight, bias = head_operands(head, hidden)
    return linear_cross_entropy(hidden, weight, labels, bias, **options)


_HEAD_LOSS = "trainops_linear_cross_entropy"


def _head_loss(head: torch.nn.Module, hidden: Tensor, labels: Tensor, **options) -> Tensor:
    """The fused loss of the LM head's weight and bias (a PEFT head's: trainops.hf.lora). When
    FSDP2's ``fully_shard`` made the head a unit of its own, the loss runs as a forward method of
    the head (``register_fsdp_forward_method``): FSDP gathers the weight for it and reduce-scatters
    its gradient, as for ``head(hidden)``; outside it the weight would be this rank's shard."""
    if fsdp_wrapped_class(type(head)) is None:
        return _linear_cross_entropy_of_head(head, hidden, labels, **options)
    if _HEAD_LOSS not in vars(head):
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(head, _HEAD_LOSS, types.MethodType(_linear_cross_entropy_of_head, head))
        register_fsdp_forward_method(head, _HEAD_LOSS)
    return getattr(head, _HEAD_LOSS)(hidden, labels, **options)


CAUSAL_LM = CausalLM()


# ---- the swapped classes ----------------------------------------------------------------------------

PACKAGE = "trainops.hf"
QUALNAME_PREFIX = "Trainops__"
_SUBCLASSES: dict[type, type] = {}
_SWAPPED: set[type] = set()   # _SUBCLASSES's values (and those made before a test dropped them)


def qualname_of(cls: type) -> str:
    return QUALNAME_PREFIX + cls.__module__.replace(".", "__") + "__" + cls.__name__


def trainops_class(cls: type, attributes: dict) -> type:
    """The subclass of ``cls`` (one per class) overriding ``attributes`` (its forward, ...): ``cls``'s
    ``__name__``, importable from trainops.hf by its ``__qualname__`` (pickles name it so)."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            **attributes, "__module__": PACKAGE, "__qualname__": qualname_of(cls),
            "__doc__": f"transformers's {cls.__name__} computed by trainops (trainops.hf)"})
        _SWAPPED.add(sub)
    return sub


def original_class(swapped: type) -> type:
    """The transformers class of a swapped class (or of fully_shard's wrapper around one)."""
    return next(c for c in swapped.__mro__ if c in _SWAPPED).__bases__[0]
