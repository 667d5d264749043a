"""Gemma 3 (transformers.models.gemma3): as Gemma 2, with its q / k norms ((1 + w) RMSNorm over each
head, run with the rotary embedding in one trainops.qk_norm_rotary pass); the causal LM
(Gemma3ForCausalLM, soft-capping where set) and the text tower and loss of
Gemma3ForConditionalGeneration (its vision tower's LayerNorm and GELU are torch's / patch's;
transformers applies no final soft-capping there, and neither does the fused loss)."""

from ._common import GATED_MLP, GEMMA2_PRE_NORMS, GEMMA_NORM, SCALED_EMBEDDING, CausalLM
from ._qk_attention import GEMMA3_ATTENTION

SWAPS = {
    "Gemma3RMSNorm": GEMMA_NORM,
    "Gemma3MLP": GATED_MLP,
    "Gemma3TextScaledWordEmbedding": SCALED_EMBEDDING,
    "Gemma3Attention": GEMMA3_ATTENTION,
    "Gemma3ForCausalLM": CausalLM(softcap="final_logit_softcapping"),
    "Gemma3ForConditionalGeneration": CausalLM(output="Gemma3CausalLMOutputWithPast", labels_to_decoder=True,
                                               loss_types=(None, "ForCausalLM", "ForConditionalGeneration")),
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"Gemma3DecoderLayer": GEMMA2_PRE_NORMS}
