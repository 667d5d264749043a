"""Qwen3 (transformers.models.qwen3): as Llama, and the per-head q / k norms (Qwen3RMSNorm)."""

from ._common import CAUSAL_LM, GATED_MLP, LLAMA_NORM, ROTARY_ATTENTION

SWAPS = {
    "Qwen3RMSNorm": LLAMA_NORM,
    "Qwen3MLP": GATED_MLP,
    "Qwen3Attention": ROTARY_ATTENTION,
    "Qwen3ForCausalLM": CAUSAL_LM,
}
