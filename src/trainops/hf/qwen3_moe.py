"""Qwen3-MoE (transformers.models.qwen3_moe): as Mixtral, with the per-head q / k norms (fused with the rotary embedding, as Qwen3), the dense
SwiGLU MLP of its mlp_only_layers, and a router that renormalises where norm_topk_prob is set."""

from ._common import EXPERTS, GATED_MLP, LLAMA_NORM, PRE_NORMS, CausalLM, Router
from ._qk_attention import QWEN3_MOE_ATTENTION

SWAPS = {
    "Qwen3MoeRMSNorm": LLAMA_NORM,
    "Qwen3MoeMLP": GATED_MLP,
    "Qwen3MoeAttention": QWEN3_MOE_ATTENTION,
    "Qwen3MoeTopKRouter": Router(normalize_always=False, cast_weights=True),
    "Qwen3MoeExperts": EXPERTS,
    "Qwen3MoeForCausalLM": CausalLM(output="MoeCausalLMOutputWithPast", moe=True),
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"Qwen3MoeDecoderLayer": PRE_NORMS}
