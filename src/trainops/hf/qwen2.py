"""Qwen2 (transformers.models.qwen2): as Llama (q/k/v biases stay in their Linear)."""

from ._common import CAUSAL_LM, GATED_MLP, LLAMA_NORM, PRE_NORMS, ROTARY_ATTENTION

SWAPS = {
    "Qwen2RMSNorm": LLAMA_NORM,
    "Qwen2MLP": GATED_MLP,
    "Qwen2Attention": ROTARY_ATTENTION,
    "Qwen2ForCausalLM": CAUSAL_LM,
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"Qwen2DecoderLayer": PRE_NORMS}
