"""Mixtral (transformers.models.mixtral): RMSNorm, rotary attention, the top-k router (trainops's
softmax, weights renormalised), the experts (fused 3-D weights: SwiGLU between the matmuls) and the
causal-LM loss plus the router's auxiliary loss."""

from ._common import EXPERTS, LLAMA_NORM, PRE_NORMS, ROTARY_ATTENTION, ROUTER, CausalLM

SWAPS = {
    "MixtralRMSNorm": LLAMA_NORM,
    "MixtralAttention": ROTARY_ATTENTION,
    "MixtralTopKRouter": ROUTER,
    "MixtralExperts": EXPERTS,
    "MixtralForCausalLM": CausalLM(output="MoeCausalLMOutputWithPast", moe=True),
}

# its decoder layer's norms -> the child that alone reads each one's output (_common.PRE_NORMS)
DECODER_LAYERS = {"MixtralDecoderLayer": PRE_NORMS}
