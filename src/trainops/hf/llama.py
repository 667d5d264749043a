"""Llama (transformers.models.llama): RMSNorm, SwiGLU MLP, rotary attention, causal-LM loss."""

from ._common import CAUSAL_LM, GATED_MLP, LLAMA_NORM, PRE_NORMS, ROTARY_ATTENTION

SWAPS = {
    "LlamaRMSNorm": LLAMA_NORM,
    "LlamaMLP": GATED_MLP,
    "LlamaAttention": ROTARY_ATTENTION,
    "LlamaForCausalLM": CAUSAL_LM,
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"LlamaDecoderLayer": PRE_NORMS}
