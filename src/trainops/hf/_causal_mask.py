"""The causal mask of a patched model under torch.compile and CUDA-graph capture: SDPA's
``is_causal`` instead of a materialised mask, wherever the two are the same.

transformers builds each step's attention mask through ``create_causal_mask``, which calls the
mask function registered for the config's attention implementation (``sdpa_mask`` for SDPA). In
eager mode, without padding, that returns None and the attention runs SDPA with
``is_causal=True`` (its flash and cuDNN kernels, GQA without repeating k / v). While dynamo
traces (torch.compile) or a stream captures a CUDA graph it does not, for two reasons:

- without a padding mask and a cache (training with ``use_cache=False``), transformers looks for
  packed sequences in the position ids (``find_packed_sequence_indices``): eagerly it reads them
  and finds none; while tracing it cannot, so it composes a packed-sequence mask and forbids the
  skip;
- ``_ignore_causal_mask_sdpa`` itself refuses to skip while tracing (transformers 5.17; 5.24 on
  torch before 2.14, where dynamo turns ``torch.compiler.is_exporting()`` into True).

The (batch, 1, q, kv) boolean causal mask is then made every step and SDPA runs its masked kernel:
on the H200, Llama-3.2-1B's compiled step spent 22.2 ms in SDPA's backward against 8.9 ms eagerly
(benchmarks/NOTES.md, fifth session).

Inside a patched causal LM's training forward (the call of its decoder: ``patched_forward``), on
the thread running it:

- when the forward got no ``position_ids``, the decoder makes them (0, 1, 2, ... in every row:
  nothing is packed), so the packed-sequence check answers None without reading them;
- the SDPA mask function returns None (no mask) where transformers's eager rule would, decided
  without reading a tensor: no 2-D padding mask at all (None: an all-ones mask still makes a mask,
  its values cannot be read while tracing), the skip allowed (no packed sequences, no extra or /
  and masks), as many queries as keys with no offsets (training, not decoding), and the plain
  causal mask function or a local window (sliding or chunked) longer than the keys. Under
  torch.export it never skips, as transformers.

These conditions alone make the mask the plain causal one, so the scope (patched forwards, this
thread) decides only which calls get the faster kernel, never what they compute. The flags are
thread-local: another thread's models, and every call outside a patched forward, reach
transformers's functions unchanged.

Installation: transformers keeps one mask-function registry and one module function for every
model, so while at least one patched model's config is alive and tracked (``track``: by
``trainops.patch``, and by a patched forward run eagerly, which covers copies of a patched model),
the registry's "sdpa" entry and ``masking_utils.find_packed_sequence_indices`` are the wrappers
here; when the last config is untracked (``trainops.unpatch``, or collected) the functions they
replaced are put back. The wrappers keep those functions for good, so a reference to a wrapper held
elsewhere keeps working after that. A library that registers its own function over ours keeps it:
ours stays inside its chain (passing calls through outside patched forwards) and is not wrapped
again; if that library later drops the chain, patched models lose the faster kernel (never a mask
they need) until the process restarts.
"""

from __future__ import annotations

import threading
import weakref

import torch

_TRACKED: dict[int, weakref.finalize] = {}   # id(config) -> its finalizer (removes the entry when collected)
_REPLACED: dict[str, object] = {}   # "sdpa" / "packed" -> the function the wrapper stands in for (kept for good)
# "sdpa" / "packed" -> our wrapper is in transformers's call chain: registered itself, or wrapped by
# someone who registered after it (then it stays there, passing calls through, until it is on top again)
_IN_CHAIN = {"sdpa": False, "packed": False}
_LOCK = threading.RLock()   # re-entrant: a finalizer may run (garbage collection) while track holds it


class _Flags(threading.local):
    """Per thread: patched forwards running (``patched``), those whose decoder makes its own
    position ids (``default_positions``). Set in every thread's first use, so that a compiled graph
    does not guard on the attributes' absence (a second compilation at the next step)."""

    def __init__(self):
        self.patched = 0
        self.default_positions = 0


_FLAGS = _Flags()


def _interface():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    return ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface


@torch.compiler.assume_constant_result
def _exporting() -> bool:
    """torch.export is tracing (read outside dynamo: inside it, torch 2.11's dynamo answers True
    for torch.compile too)."""
    return torch.compiler.is_exporting()


def _skippable(kwargs: dict) -> bool:
    """transformers's eager rule for returning no mask, on create_causal_mask's keywords (the shape
    comparisons stay in the traced code: dynamo guards on them)."""
    from transformers.masking_utils import causal_mask_function

    if (_FLAGS.patched <= 0 or kwargs.get("attention_mask") is not None
            or not kwargs.get("allow_is_causal_skip", True) or "q_length" not in kwargs or "kv_length" not in kwargs
            or "cache_position" in kwargs):
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
    return q_length == kv_length and not _exporting()


def _sdpa_mask(*args, **kwargs):
    """transformers's sdpa mask function, but None (SDPA's is_causal) inside a patched forward
    where transformers's eager rule gives None (see the module docstring)."""
    if not args and _skippable(kwargs):
        return None
    return _REPLACED["sdpa"](*args, **kwargs)


def _find_packed_sequence_indices(position_ids):
    """transformers's packed-sequence check, but None (nothing packed) inside a patched forward
    whose decoder makes its own position ids."""
    if _FLAGS.default_positions > 0:
        return None
    return _REPLACED["packed"](position_ids)


def patched_forward_begin(default_positions: bool) -> None:
    """A patched causal LM's training forward calls its decoder (``default_positions``: without
    position ids, so that the decoder makes 0, 1, 2, ...); until ``patched_forward_end``."""
    _FLAGS.patched += 1
    _FLAGS.default_positions += default_positions


def patched_forward_end(default_positions: bool) -> None:
    _FLAGS.patched -= 1
    _FLAGS.default_positions -= default_positions


def _install() -> None:
    """Our wrappers into transformers's call chain, unless they are still in it."""
    from transformers import masking_utils

    registry, interface = _interface()
    if not _IN_CHAIN["sdpa"]:
        _REPLACED["sdpa"] = registry["sdpa"]
        interface.register("sdpa", _sdpa_mask)
        _IN_CHAIN["sdpa"] = True
    packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    if not _IN_CHAIN["packed"] and packed is not None:
        _REPLACED["packed"] = packed
        masking_utils.find_packed_sequence_indices = _find_packed_sequence_indices
        _IN_CHAIN["packed"] = True


def _uninstall() -> None:
    """The replaced functions back where our wrappers are on top; a wrapper someone else wrapped
    since stays in their chain (it passes calls through when no patched forward runs)."""
    from transformers import masking_utils

    registry, interface = _interface()
    if registry["sdpa"] is _sdpa_mask:
        interface.register("sdpa", _REPLACED["sdpa"])
        _IN_CHAIN["sdpa"] = False
    if getattr(masking_utils, "find_packed_sequence_indices", None) is _find_packed_sequence_indices:
        masking_utils.find_packed_sequence_indices = _REPLACED["packed"]
        _IN_CHAIN["packed"] = False


def _untrack(config_id: int) -> None:
    with _LOCK:
        _TRACKED.pop(config_id, None)
        if not _TRACKED:
            _uninstall()


def track(config) -> bool:
    """Keep ``config``'s model's causal masks as SDPA's is_causal where they can be (module
    docstring); True when this call started tracking it (its attention implementation is SDPA and
    it was not tracked yet), False otherwise. One dictionary look-up when tracked already."""
    if id(config) in _TRACKED or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    with _LOCK:
        if id(config) in _TRACKED:
            return False
        _TRACKED[id(config)] = weakref.finalize(config, _untrack, id(config))
        _install()   # after the entry: a collection inside finalize() could otherwise uninstall
    return True


def untrack(config) -> bool:
    """Stop tracking ``config`` (``trainops.unpatch``); True if it was tracked. transformers's
    functions are put back when no tracked config is left."""
    finalizer = _TRACKED.get(id(config))
    if finalizer is None:
        return False
    finalizer()   # runs _untrack once, and never again at collection
    return True


def is_tracked(config) -> bool:
    return id(config) in _TRACKED
