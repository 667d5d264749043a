"""GPT-2 (transformers.models.gpt2): the causal-LM loss of GPT2LMHeadModel (its head tied to wte, no
bias). Its tanh GELU (NewGELUActivation) is activations.py's; its LayerNorm and Dropout are
torch.nn's, swapped by trainops.patch with block_ops=True."""

from ._common import CausalLM

SWAPS = {
    "GPT2LMHeadModel": CausalLM(output="CausalLMOutputWithCrossAttentions"),
}
