"""Gemma (transformers.models.gemma): (1 + w) RMSNorm, GeGLU (tanh) MLP, the sqrt(hidden)-scaled
embedding, rotary attention, causal-LM loss."""

from ._common import CAUSAL_LM, GATED_MLP, GEMMA_NORM, ROTARY_ATTENTION, SCALED_EMBEDDING

SWAPS = {
    "GemmaRMSNorm": GEMMA_NORM,
    "GemmaMLP": GATED_MLP,
    "GemmaTextScaledWordEmbedding": SCALED_EMBEDDING,
    "GemmaAttention": ROTARY_ATTENTION,
    "GemmaForCausalLM": CAUSAL_LM,
}
