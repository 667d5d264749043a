"""transformers.activations: the tanh GELUs (GPT-2's NewGELUActivation, Gemma's GELUTanh) ->
trainops.gelu(approximate="tanh")."""

from ._common import TANH_GELU

SWAPS = {
    "NewGELUActivation": TANH_GELU,
    "GELUTanh": TANH_GELU,
}
