"""SmolLM3 (transformers.models.smollm3): as Llama; its layers without RoPE (no_rope_layers) skip the rotary
embedding in transformers's own forward, which the swapped attention runs."""

from ._common import CAUSAL_LM, GATED_MLP, LLAMA_NORM, PRE_NORMS, ROTARY_ATTENTION

SWAPS = {
    "SmolLM3RMSNorm": LLAMA_NORM,
    "SmolLM3MLP": GATED_MLP,
    "SmolLM3Attention": ROTARY_ATTENTION,
    "SmolLM3ForCausalLM": CAUSAL_LM,
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"SmolLM3DecoderLayer": PRE_NORMS}
