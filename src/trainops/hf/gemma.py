"""Gemma (transformers.models.gemma): (1 + w) RMSNorm, GeGLU (tanh) MLP, the sqrt(hidden)-scaled
embedding, rotary attention, causal-LM loss."""

from ._common import CAUSAL_LM, GATED_MLP, GEMMA_NORM, PRE_NORMS, ROTARY_ATTENTION, SCALED_EMBEDDING

SWAPS = {
    "GemmaRMSNorm": GEMMA_NORM,
    "GemmaMLP": GATED_MLP,
    "GemmaTextScaledWordEmbedding": SCALED_EMBEDDING,
    "GemmaAttention": ROTARY_ATTENTION,
    "GemmaForCausalLM": CAUSAL_LM,
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"GemmaDecoderLayer": PRE_NORMS}
