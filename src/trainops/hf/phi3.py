"""Phi-3 (transformers.models.phi3): RMSNorm, the fused gate_up_proj MLP (SwiGLU read in place from its
one output), rotary attention (partial rotary: the first R features of each head), causal-LM loss."""

from ._common import CAUSAL_LM, FUSED_GATED_MLP, FUSED_QKV_ROTARY_ATTENTION, LLAMA_NORM, PRE_NORMS

SWAPS = {
    "Phi3RMSNorm": LLAMA_NORM,
    "Phi3MLP": FUSED_GATED_MLP,
    "Phi3Attention": FUSED_QKV_ROTARY_ATTENTION,
    "Phi3ForCausalLM": CAUSAL_LM,
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"Phi3DecoderLayer": PRE_NORMS}
