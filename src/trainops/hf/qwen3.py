"""Qwen3 (transformers.models.qwen3): as Llama, and the per-head q / k norms (Qwen3RMSNorm), which the
attention runs with its rotary embedding in one trainops.qk_norm_rotary pass."""

from ._common import CAUSAL_LM, GATED_MLP, LLAMA_NORM, PRE_NORMS
from ._qk_attention import QWEN3_ATTENTION

SWAPS = {
    "Qwen3RMSNorm": LLAMA_NORM,
    "Qwen3MLP": GATED_MLP,
    "Qwen3Attention": QWEN3_ATTENTION,
    "Qwen3ForCausalLM": CAUSAL_LM,
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"Qwen3DecoderLayer": PRE_NORMS}
