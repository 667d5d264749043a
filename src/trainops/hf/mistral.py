"""Mistral (transformers.models.mistral): as Llama (its sliding window stays in the attention)."""

from ._common import CAUSAL_LM, GATED_MLP, LLAMA_NORM, PRE_NORMS, ROTARY_ATTENTION

SWAPS = {
    "MistralRMSNorm": LLAMA_NORM,
    "MistralMLP": GATED_MLP,
    "MistralAttention": ROTARY_ATTENTION,
    "MistralForCausalLM": CAUSAL_LM,
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"MistralDecoderLayer": PRE_NORMS}
