"""Hugging Face transformers models in ``trainops.patch``: which of their modules become trainops's.

transformers is never imported here at import time (the core does not depend on it); a class is
recognised by its module and name, looked up in ``ARCHITECTURES`` below. A module is swapped by
changing its class to a subclass that overrides ``forward`` (and, for MoE experts, the gate the
grouped matmuls call) alone: parameters, buffers, hooks and state_dict keys are kept, as patch.py
does for torch's modules, and ``trainops.unpatch`` changes the class back. The subclass keeps the
transformers class's ``__name__``, so what reads it sees the model it knows
(``config.architectures`` written by save_pretrained, Trainer's causal-LM label shifting, PEFT); it
is importable from this package by its ``__qualname__``
(``Trainops__<transformers module path>__<class>``), so a patched model pickles
(``torch.save(model)``) and loads where trainops and transformers are installed. Subclasses of
these transformers classes (a user's own) are not swapped and are reported, as are instances
that lack what the swap needs (an activation other than SiLU or tanh GELU, an experts layout
other than fused [gate; up], ...), with the reason.

What each kind computes (``_common.py``):
    norm       RMSNorm by trainops.rms_norm: Llama's x_normed.to(dtype) * w; Gemma's (1 + w) and
               OLMo 2's w * x_normed in float32, rounded once to the input's dtype. Under autocast,
               a decoder layer's pre-norm that only projections read writes the autocast dtype
               (below: "Pre-norms under autocast")
    mlp        act(gate) * up by trainops.swiglu (SiLU) or trainops.geglu (tanh GELU), between
               transformers's Linear layers (separate gate_proj / up_proj, or one gate_up_proj)
    gelu       the tanh GELUs of transformers.activations -> trainops.gelu(approximate="tanh")
    embedding  Gemma's scaled embedding: trainops.embedding times embed_scale
    attention  the attention's own forward with apply_rotary_pos_emb resolved to
               trainops.rotary_embedding (partial rotary as Phi-3, interleaved as GLM-4); the rotated
               q and k come out in q's dtype (transformers's in the promotion of q's and cos's).
               Models with q / k norms (Qwen3, Qwen3-MoE, Gemma 3, OLMo 2): a forward of trainops's
               (transformers 5.17 to 5.24's statements) whose q / k RMSNorm and rotary embedding are
               one trainops.qk_norm_rotary (``_qk_attention.py``; other versions refused)
    router     MoE top-k router: trainops.softmax of the router logits in float32
    experts    MoE experts (fused 3-D weights): trainops.swiglu between the expert matmuls
    loss       the causal LM in training mode with labels: trainops.linear_cross_entropy of the last
               hidden states and the LM head (no logits made: ``output.logits`` is None, so code
               that reads a training step's logits, such as a token-accuracy metric, needs
               hf=False), with the logit transform z = softcap(logit_scale * (h W^T + b)) its
               config sets, and the MoE router's auxiliary loss as transformers adds it

Pre-norms under autocast: with float32 parameters under bf16 (or fp16) autocast the residual
stream is float32, so a decoder layer's RMSNorm returns float32, and each projection reading it
(q_proj, k_proj and v_proj one norm's output, gate_proj and up_proj the other's) casts it to bf16
on its own: autocast caches the casts of parameters, not of activations. In the backward each cast's
ToCopyBackward0 turns its bf16 gradient back into float32 before autograd sums them. ``patch``
therefore marks (instance attribute ``autocast_output = True``) each norm of a decoder layer
(``DECODER_LAYERS`` of the family's module: input_layernorm, and post_attention_layernorm or
Gemma 2 / 3's pre_feedforward_layernorm) whose output goes to one child (``self_attn``, ``mlp``)
whose forward passes it only to its projections (its kind's ``input_projections``), each an exact
torch.nn.Linear (not a PEFT or quantized layer, whose forward may read the input otherwise: their
dropout would round differently). Under autocast of a half dtype on the input's device, a marked
norm whose output would be float32 from a float32 input writes the autocast dtype: y computed in
float32 and rounded once, the very values the projections' casts made (forward bit-identical),
with no float32 y and no casts. Backward: autograd now sums the projections' bf16 input gradients
in bf16 (three terms, two), where it summed their float32 copies; the norm's backward reads that
bf16 dy and computes in float32 (benchmarks/notes/norm-autocast.md measures the difference).
Not marked: post-norms (Gemma 2 / 3, OLMo 2, GLM-4: they feed the residual add), the final norm
(its output leaves the model as ``last_hidden_state``), q / k norms, the norm before a
mixture-of-experts block (its router and experts are not plain projections), norms shared by
several modules. A forward hook on a marked norm sees the autocast dtype. ``patch(model,
autocast_norms=False)`` marks none; ``norm.autocast_output = False`` turns one off; unpatch removes
the attribute.

The causal mask (``_causal_mask.py``): a patched causal LM's training forward (SDPA attention)
gets SDPA's ``is_causal`` (no mask tensor) wherever transformers's eager rule skips the mask (no
padding mask passed, as many queries as keys, no packed sequences or extra masks, no sliding window
shorter than the keys), also while torch.compile traces and a CUDA graph captures, where
transformers materialises a (batch, 1, q, kv) mask every step and SDPA runs its masked kernels:
while tracing, its packed-sequence check cannot read the position ids, so when the forward gets
none (the decoder makes 0, 1, 2, ...) trainops answers it. transformers keeps one mask-function
registry and one such check for all models, so both are wrapped while a patched model is alive;
calls outside a patched forward, and other threads', pass through. A padding mask of all ones
still makes a mask under torch.compile (its values cannot be read there): leave ``attention_mask``
out when nothing is padded. TRL's SFTTrainer, which calls the decoder itself, does not get this.

PEFT models (``lora.py``): the swapped attention and MLPs call their projections as modules, so
LoRA layers there (any variant) run peft's forward and train; the fused loss computes a LoRA
``lm_head`` (h W^T + b + s * dropout(h) A^T B^T, exactly, through concatenated operands) or an
lm_head in ``modules_to_save`` (the trained copy); DoRA and other variants on the head, and other
PEFT heads, are refused with the reason.

The Hugging Face Trainer: patch the model before handing it over, nothing else changes:

    trainops.patch(model)                     # or the PeftModel: trainops.patch(get_peft_model(model, config))
    trainer = transformers.Trainer(model=model, args=args, ...)      # optimizers=(trainops.optim.AdamW(...), None) too

Training steps run the fused loss (the Trainer reads only ``outputs.loss``; its ``num_items_in_batch``,
an int or float tensor, divides the summed loss as transformers's does); evaluation runs the model
in eval mode, where the original forward makes the logits that prediction_step / compute_metrics
ask for; label smoothing and ``compute_loss_func`` take the logits of a forward without labels
(the original forward). The forward shows transformers's signature, so ``remove_unused_columns``
keeps the dataset's columns. With ``model_init``, patch inside it.

TRL's SFTTrainer (TRL 1.16): it computes the loss, ``mean_token_accuracy`` and ``entropy`` itself,
with a fused LM head of its own (``trl.trainer.utils.add_fused_lm_head``: chunked, no logits) that
it installs on the model as an instance ``forward``, calling the model's decoder and reading
``lm_head.weight``. So on a patched model SFTTrainer's steps run trainops's decoder modules
(norms, SwiGLU / GeGLU, rotary) and TRL's loss; trainops's fused loss does not run there and its
metrics need nothing from trainops. Patch before ``SFTTrainer(...)``; patched after it, the causal
LM is reported as kept (TRL's instance ``forward``) and the rest is patched. TRL refuses a PEFT
adapter on lm_head itself. SFTTrainers that compute the metrics from ``outputs.logits`` (before
TRL's fused head) are untested: there a patched training step has no logits.

Token accuracy and entropy without logits (for loops and trainers that read them from
``outputs.logits``, which a patched training step does not make): pass
``return_token_accuracy=True`` and / or ``return_entropy=True`` to the patched causal LM's forward,
and read ``outputs.token_accuracy`` / ``outputs.entropy`` (float32 scalars without gradient: the
means, over the tokens whose shifted label is not ignore_index, of [argmax(z) == label] and of
the entropy of softmax(z), z the logits as the loss sees them; 0 when no token counts). The fused
loss computes them from each chunk's logits (trainops.linear_cross_entropy's ``token_accuracy`` /
``entropy``). ``return_token_accuracy`` is the keyword Liger-Kernel's patched forward takes. In
eval mode or without labels the original forward runs: logits, no metrics (the keywords are taken
out of the call). TRL 1.16's SFTTrainer needs none of this: it computes both with its own fused
head (above).

Adding an architecture: its module here (``SWAPS``: class name -> kind; ``DECODER_LAYERS``: its
decoder layer's pre-norms, where only projections read them), a row of ``ARCHITECTURES``, and its
tiny configuration in tests/test_hf.py's ``ARCHS``.
"""

from __future__ import annotations

import torch

from ..dtensor import fsdp_wrapped_class
from . import (activations, gemma, gemma2, gemma3, glm4, gpt2, granite, llama, mistral, mixtral, olmo2, phi3, qwen2,
               qwen3, qwen3_moe, smollm3)
from ._common import (_SUBCLASSES, _SWAPPED, AUTOCAST_OUTPUT, GEMMA_NORM, LLAMA_NORM, QUALNAME_PREFIX,
                      SCALED_EMBEDDING, TANH_GELU, CausalLM, GatedMLP, Kind, RMSNorm, RotaryAttention,
                      is_transformers_class, original_class, trainops_class)
from ._causal_mask import track as track_causal_mask
from ._causal_mask import untrack as untrack_causal_mask
from ._qk_attention import QKNormAttention

# family -> (the transformers module whose classes are swapped, the trainops.hf module saying which and how)
ARCHITECTURES = {
    "llama": ("transformers.models.llama.modeling_llama", llama),
    "mistral": ("transformers.models.mistral.modeling_mistral", mistral),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", qwen2),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", qwen3),
    "smollm3": ("transformers.models.smollm3.modeling_smollm3", smollm3),
    "gemma": ("transformers.models.gemma.modeling_gemma", gemma),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", gemma2),
    "gemma3": ("transformers.models.gemma3.modeling_gemma3", gemma3),
    "phi3": ("transformers.models.phi3.modeling_phi3", phi3),
    "olmo2": ("transformers.models.olmo2.modeling_olmo2", olmo2),
    "glm4": ("transformers.models.glm4.modeling_glm4", glm4),
    "granite": ("transformers.models.granite.modeling_granite", granite),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", mixtral),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", qwen3_moe),
    "gpt2": ("transformers.models.gpt2.modeling_gpt2", gpt2),
    "activations": ("transformers.activations", activations),
}

_KINDS: dict[tuple[str, str], Kind] = {
    (module_name, class_name): kind
    for module_name, family in ARCHITECTURES.values() for class_name, kind in family.SWAPS.items()}


# (transformers module, decoder layer class) -> {its norm: the child that alone reads the norm's output}
_DECODER_LAYERS: dict[tuple[str, str], dict[str, str]] = {
    (module_name, layer): norms
    for module_name, family in ARCHITECTURES.values() for layer, norms in getattr(family, "DECODER_LAYERS", {}).items()}
# the instance attributes patch may add to a swapped module (unpatch removes them)
INSTANCE_ATTRIBUTES = (AUTOCAST_OUTPUT,)


def _names(test) -> frozenset[str]:
    return frozenset(name for (_, name), kind in _KINDS.items() if test(kind))


# The class names of each kind (what trainops.hf exported before it became a package).
LLAMA_STYLE_NORMS = _names(lambda kind: kind is LLAMA_NORM)
GEMMA_STYLE_NORMS = _names(lambda kind: kind is GEMMA_NORM)
GATED_MLPS = _names(lambda kind: isinstance(kind, GatedMLP))
TANH_GELUS = _names(lambda kind: kind is TANH_GELU)
SCALED_EMBEDDINGS = _names(lambda kind: kind is SCALED_EMBEDDING)
CAUSAL_LMS = _names(lambda kind: isinstance(kind, CausalLM))
ROTARY_ATTENTIONS = _names(lambda kind: isinstance(kind, RotaryAttention))
QK_NORM_ATTENTIONS = _names(lambda kind: isinstance(kind, QKNormAttention))


def kind_of(cls: type) -> Kind | None:
    """The kind of swap trainops.hf has for exactly ``cls`` (None: it has none)."""
    return _KINDS.get((cls.__module__, cls.__name__))


def description(cls: type) -> str | None:
    """What trainops.hf's swap of ``cls`` (a transformers class, or its swapped subclass) computes,
    in the patch report's words ("norm", "attention: fused q/k norm + rotary", ...); None: no swap."""
    kind = kind_of(original_class(cls) if cls in _SWAPPED else cls)
    return None if kind is None else kind.description


def _transformers_class(module: torch.nn.Module) -> type:
    """The class ``module`` was made with: below fully_shard's wrapper and trainops's swap."""
    cls = fsdp_wrapped_class(type(module)) or type(module)
    return original_class(cls) if cls in _SWAPPED else cls


def _is_linear(module) -> bool:
    """An exact torch.nn.Linear (or fully_shard's wrapper around one)."""
    return module is not None and torch.nn.Linear in (type(module), fsdp_wrapped_class(type(module)))


def _hooked(module) -> bool:
    """Whether ``module`` has forward, forward-pre or backward hooks of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def norms_into_projections(modules) -> dict[int, tuple[str, ...]]:
    """id(norm) -> the projections (names under the decoder layer) that alone read its output, for
    each RMSNorm that trainops.hf's families' decoder layers feed to one child (``DECODER_LAYERS``:
    the attention, the MLP) whose kind's ``input_projections`` are all exact torch.nn.Linear
    modules; such a norm may write the autocast dtype under autocast (module docstring, "Pre-norms
    under autocast"). ``modules``: every module of the model, once each. A norm reachable from
    more than one parent is left out (its output may go elsewhere too), and so is one where the
    norm, its reader or a projection has hooks (they would see the autocast dtype, not float32).
    The marks are made when ``patch`` runs: projections replaced afterwards (adapters applied after
    patching) then read the autocast dtype too; apply PEFT before ``patch``."""
    parents: dict[int, int] = {}
    for module in modules:
        for child in module._modules.values():
            if child is not None:
                parents[id(child)] = parents.get(id(child), 0) + 1
    found = {}
    for layer in modules:
        layer_class = _transformers_class(layer)
        for norm_name, reader_name in _DECODER_LAYERS.get((layer_class.__module__, layer_class.__name__), {}).items():
            norm, reader = layer._modules.get(norm_name), layer._modules.get(reader_name)
            if norm is None or reader is None or parents[id(norm)] != 1 \
                    or not isinstance(kind_of(_transformers_class(norm)), RMSNorm) or _hooked(norm) or _hooked(reader):
                continue
            reader_kind = kind_of(_transformers_class(reader))
            projections = () if reader_kind is None else reader_kind.input_projections
            if projections and all(_is_linear(reader._modules.get(name)) and not _hooked(reader._modules[name])
                                   for name in projections):
                found[id(norm)] = tuple(f"{reader_name}.{name}" for name in projections)
    return found


def is_swapped(module: torch.nn.Module, cls: type | None = None) -> bool:
    """Whether ``module``'s class (or ``cls``: the class fully_shard wrapped) is a swapped one."""
    return (cls or type(module)) in _SWAPPED


def swap_for(module: torch.nn.Module, cls: type | None = None):
    """(trainops class or None, reasons it cannot be swapped) for a transformers module trainops
    covers or a subclass of one (not swapped: reported), else None. ``cls``: the module's class
    (default its type; the class fully_shard wrapped, for a module it wrapped)."""
    cls = cls or type(module)
    if kind_of(cls) is None:
        base = next((b for b in cls.__mro__[1:] if kind_of(b) is not None), None)
        if base is None or is_swapped(module, cls):
            return None
        return None, [f"a subclass of transformers.{base.__name__}: only exact transformers classes are swapped "
                      "(a subclass may change what the module computes)"]
    sub, reasons = swap_for_class(cls)
    return sub, reasons + (kind_of(cls).instance_reasons(module) if sub is not None else [])


def swap_for_class(cls: type):
    """(trainops subclass, []) or (None, reasons no instance of ``cls`` can be swapped) for a
    transformers class trainops covers, else None."""
    kind = kind_of(cls) if isinstance(cls, type) else None
    if kind is None:
        return None
    if cls in _SUBCLASSES:
        return _SUBCLASSES[cls], []
    attributes, reasons = kind.make(cls)
    return (None, reasons) if attributes is None else (trainops_class(cls, attributes), [])


def __getattr__(name: str):
    """A swapped class by its ``__qualname__``, made on first use (unpickling in a fresh process)."""
    if name.startswith(QUALNAME_PREFIX):
        import importlib

        *module_parts, class_name = name[len(QUALNAME_PREFIX):].split("__")
        cls = getattr(importlib.import_module(".".join(module_parts)), class_name, None)
        found = swap_for_class(cls) if isinstance(cls, type) else None
        if found is not None and found[0] is not None and found[0].__qualname__ == name:
            return found[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ARCHITECTURES", "AUTOCAST_OUTPUT", "CAUSAL_LMS", "GATED_MLPS", "GEMMA_STYLE_NORMS", "INSTANCE_ATTRIBUTES",
           "LLAMA_STYLE_NORMS", "ROTARY_ATTENTIONS", "SCALED_EMBEDDINGS", "TANH_GELUS", "is_swapped",
           "is_transformers_class", "kind_of", "norms_into_projections", "original_class", "swap_for", "swap_for_class",
           "QK_NORM_ATTENTIONS", "description", "track_causal_mask", "untrack_causal_mask"]
