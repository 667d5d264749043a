"""Llama (transformers.models.llama): RMSNorm, SwiGLU MLP, rotary attention, causal-LM loss."""

from ._common import CAUSAL_LM, GATED_MLP, LLAMA_NORM, ROTARY_ATTENTION

SWAPS = {
    "LlamaRMSNorm": LLAMA_NORM,
    "LlamaMLP": GATED_MLP,
    "LlamaAttention": ROTARY_ATTENTION,
    "LlamaForCausalLM": CAUSAL_LM,
}
