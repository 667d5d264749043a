"""Granite (transformers.models.granite): as Llama, with the logits divided by config.logits_scaling in
the fused loss (logit_scale = 1 / logits_scaling); its embedding, residual and attention
multipliers stay in transformers's decoder."""

from ._common import GATED_MLP, LLAMA_NORM, PRE_NORMS, ROTARY_ATTENTION, CausalLM

SWAPS = {
    "GraniteRMSNorm": LLAMA_NORM,
    "GraniteMLP": GATED_MLP,
    "GraniteAttention": ROTARY_ATTENTION,
    "GraniteForCausalLM": CausalLM(logit_divisor="logits_scaling"),
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"GraniteDecoderLayer": PRE_NORMS}
