"""GLM-4 (transformers.models.glm4): RMSNorm (also after the attention and the MLP), the fused gate_up_proj
MLP, rotary attention with GLM's interleaved partial rotation, causal-LM loss."""

from ._common import CAUSAL_LM, FUSED_GATED_MLP, INTERLEAVED_ROTARY_ATTENTION, LLAMA_NORM

SWAPS = {
    "Glm4RMSNorm": LLAMA_NORM,
    "Glm4MLP": FUSED_GATED_MLP,
    "Glm4Attention": INTERLEAVED_ROTARY_ATTENTION,
    "Glm4ForCausalLM": CAUSAL_LM,
}
