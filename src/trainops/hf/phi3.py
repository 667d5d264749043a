"""Phi-3 (transformers.models.phi3): RMSNorm, the fused gate_up_proj MLP (SwiGLU read in place from its
one output), rotary attention (partial rotary: the first R features of each head), causal-LM loss."""

from ._common import CAUSAL_LM, FUSED_GATED_MLP, LLAMA_NORM, ROTARY_ATTENTION

SWAPS = {
    "Phi3RMSNorm": LLAMA_NORM,
    "Phi3MLP": FUSED_GATED_MLP,
    "Phi3Attention": ROTARY_ATTENTION,
    "Phi3ForCausalLM": CAUSAL_LM,
}
