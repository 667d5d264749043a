"""GLM-4 (transformers.models.glm4): RMSNorm (also after the attention and the MLP), the fused gate_up_proj
MLP, rotary attention with GLM's interleaved partial rotation, causal-LM loss."""

from ._common import CAUSAL_LM, FUSED_GATED_MLP, INTERLEAVED_ROTARY_ATTENTION, LLAMA_NORM, PRE_NORMS

SWAPS = {
    "Glm4RMSNorm": LLAMA_NORM,
    "Glm4MLP": FUSED_GATED_MLP,
    "Glm4Attention": INTERLEAVED_ROTARY_ATTENTION,
    "Glm4ForCausalLM": CAUSAL_LM,
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"Glm4DecoderLayer": PRE_NORMS}
