"""OLMo 2 (transformers.models.olmo2): its RMSNorm ((w * x_normed) in float32, rounded once: after the
attention and the MLP, and over all of q and of k), SwiGLU MLP, attention (its q / k norms over the
whole projection and the rotary embedding in one trainops.qk_norm_rotary pass), causal-LM loss."""

from ._common import CAUSAL_LM, GATED_MLP, OLMO2_NORM
from ._qk_attention import OLMO2_ATTENTION

SWAPS = {
    "Olmo2RMSNorm": OLMO2_NORM,
    "Olmo2MLP": GATED_MLP,
    "Olmo2Attention": OLMO2_ATTENTION,
    "Olmo2ForCausalLM": CAUSAL_LM,
}
