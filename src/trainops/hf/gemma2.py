"""Gemma 2 (transformers.models.gemma2): as Gemma, with the final logit soft-capping in the fused loss
(its attention soft-capping and sliding windows stay in transformers's attention)."""

from ._common import GATED_MLP, GEMMA2_PRE_NORMS, GEMMA_NORM, ROTARY_ATTENTION, SCALED_EMBEDDING, CausalLM

SWAPS = {
    "Gemma2RMSNorm": GEMMA_NORM,
    "Gemma2MLP": GATED_MLP,
    "Gemma2TextScaledWordEmbedding": SCALED_EMBEDDING,
    "Gemma2Attention": ROTARY_ATTENTION,
    "Gemma2ForCausalLM": CausalLM(softcap="final_logit_softcapping"),
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"Gemma2DecoderLayer": GEMMA2_PRE_NORMS}
