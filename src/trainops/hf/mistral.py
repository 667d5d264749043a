"""Mistral (transformers.models.mistral): as Llama (its sliding window stays in the attention)."""

from ._common import CAUSAL_LM, GATED_MLP, LLAMA_NORM, ROTARY_ATTENTION

SWAPS = {
    "MistralRMSNorm": LLAMA_NORM,
    "MistralMLP": GATED_MLP,
    "MistralAttention": ROTARY_ATTENTION,
    "MistralForCausalLM": CAUSAL_LM,
}
