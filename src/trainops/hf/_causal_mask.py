"""The causal mask of a patched model under torch.compile and CUDA-graph capture: SDPA's
``is_causal`` instead of a materialised mask, wherever the two are the same.

transformers builds each step's attention mask through ``create_causal_mask``, which calls the
mask function registered for the config's attention implementation (``sdpa_mask`` for SDPA). In
eager mode, without padding, that returns None and the attention runs SDPA with
``is_causal=True`` (its flash and cuDNN kernels, GQA without repeating k / v). While dynamo
traces (torch.compile) or a stream captures a CUDA graph it never returns None: transformers 5.17
refuses the skip whenever it is tracing, and 5.24 on torch before 2.14 (where dynamo turns
``torch.compiler.is_exporting()`` into True). The (batch, 1, q, kv) boolean causal mask is then
made every step and SDPA runs its masked kernel: on the H200, Llama-3.2-1B's compiled step spent
22.2 ms in SDPA's backward against 8.9 ms eagerly (benchmarks/NOTES.md).

A second cause is the packed-sequence check: without a padding mask and a cache, transformers
looks for packed sequences in the position ids (``find_packed_sequence_indices``). Eagerly it
reads them and finds none; while tracing it cannot, so it always composes a packed-sequence mask
and forbids the skip. When a patched causal LM's training forward gets no ``position_ids``, the
decoder makes them itself (0, 1, 2, ... in every row: nothing is packed), so for the duration of
that decoder call (``default_positions``) the check answers "nothing packed" without reading them.

For the configs of models ``trainops.patch`` patched, the wrapper installed here returns None
(no mask) where transformers's own eager rule would, and only there: no 2-D padding mask at all
(None: a tensor's values cannot be read while tracing, so an all-ones mask still makes a mask),
the skip allowed (no packed sequences, no extra or / and masks), as many queries as keys with no
offsets (training; not decoding), and the plain causal mask function, or a local window (sliding
or chunked) at least as long as the keys. Under torch.export it never skips, as transformers.

Scope: transformers keeps one mask-function registry for every model, so the wrapper is
registered there (under "sdpa"), and ``masking_utils.find_packed_sequence_indices`` is wrapped,
while at least one patched config is alive and tracked; the originals are put back when the last
one is untracked (``trainops.unpatch``, or the model collected). Other models' masks are the
original functions': the mask wrapper passes every call whose config is not a patched one through
unchanged, and the packed-sequence wrapper answers "nothing packed" only inside a patched forward
that let the decoder make its positions (a model run at the same moment on another thread would
see that answer too: the flag is one per process).
"""

from __future__ import annotations

import threading
import weakref

import torch

_TRACKED: dict[int, weakref.finalize] = {}   # id(config) -> its finalizer (removes the entry when collected)
_ORIGINAL: list = []   # [transformers's sdpa mask function, its find_packed_sequence_indices] while wrapped
_DEFAULT_POSITIONS = [0]   # > 0 while a patched training forward's decoder makes its own position ids
_LOCK = threading.RLock()   # re-entrant: a finalizer may run (garbage collection) while track holds it


def _interface():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    return ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface


@torch.compiler.assume_constant_result
def _skip_for_config(config_id: int) -> bool:
    """Whether the config is a patched model's and no torch.export traces (read once, when traced)."""
    return config_id in _TRACKED and not torch.compiler.is_exporting()


def _skippable(kwargs: dict) -> bool:
    """transformers's eager rule for returning no mask, on create_causal_mask's keywords (the shape
    comparisons stay in the traced code: dynamo guards on them)."""
    from transformers.masking_utils import causal_mask_function

    config = kwargs.get("config")
    if (config is None or kwargs.get("attention_mask") is not None or not kwargs.get("allow_is_causal_skip", True)
            or "q_length" not in kwargs or "kv_length" not in kwargs or "cache_position" in kwargs):
        return False
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    if type(q_offset) is not int or type(kv_offset) is not int or q_offset or kv_offset:
        return False
    q_length, kv_length, local = kwargs["q_length"], kwargs["kv_length"], kwargs.get("local_size")
    if local is None:
        if kwargs.get("mask_function", causal_mask_function) is not causal_mask_function:
            return False
    elif not kv_length < local:
        return False
    return q_length == kv_length and _skip_for_config(id(config))


def _sdpa_mask(*args, **kwargs):
    """transformers's sdpa mask function, but None (SDPA's is_causal) for a patched model's config
    where transformers's eager rule gives None (see the module docstring)."""
    if not args and _skippable(kwargs):
        return None
    return _ORIGINAL[0](*args, **kwargs)


def _find_packed_sequence_indices(position_ids):
    """transformers's packed-sequence check, but None (nothing packed) inside ``default_positions``."""
    if _DEFAULT_POSITIONS[0]:
        return None
    return _ORIGINAL[1](position_ids)


def default_positions_begin() -> None:
    """A patched causal LM's training forward calls its decoder without position ids: until
    ``default_positions_end``, the decoder's own 0, 1, 2, ... are what the mask sees (module docstring)."""
    _DEFAULT_POSITIONS[0] += 1


def default_positions_end() -> None:
    _DEFAULT_POSITIONS[0] -= 1


def _untrack(config_id: int) -> None:
    with _LOCK:
        _TRACKED.pop(config_id, None)
        if not _TRACKED and _ORIGINAL:
            from transformers import masking_utils

            registry, interface = _interface()
            if registry["sdpa"] is _sdpa_mask:
                interface.register("sdpa", _ORIGINAL[0])
            if getattr(masking_utils, "find_packed_sequence_indices", None) is _find_packed_sequence_indices:
                masking_utils.find_packed_sequence_indices = _ORIGINAL[1]
            _ORIGINAL.clear()


def track(config) -> bool:
    """Skip ``config``'s causal masks where SDPA's is_causal is the same (module docstring); True
    when tracked (its attention implementation is SDPA), False otherwise (nothing done)."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    with _LOCK:
        if not _ORIGINAL:
            from transformers import masking_utils

            registry, interface = _interface()
            _ORIGINAL[:] = [registry["sdpa"], getattr(masking_utils, "find_packed_sequence_indices", None)]
            interface.register("sdpa", _sdpa_mask)
            if _ORIGINAL[1] is not None:
                masking_utils.find_packed_sequence_indices = _find_packed_sequence_indices
        if id(config) not in _TRACKED:
            _TRACKED[id(config)] = weakref.finalize(config, _untrack, id(config))
    return True


def untrack(config) -> None:
    """Stop skipping ``config``'s masks (``trainops.unpatch``); the original mask function is
    registered back when no tracked config is left."""
    finalizer = _TRACKED.get(id(config))
    if finalizer is not None:
        finalizer()   # runs _untrack once, and never again at collection


def is_tracked(config) -> bool:
    return id(config) in _TRACKED
