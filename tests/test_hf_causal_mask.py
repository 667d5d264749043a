"""trainops.hf's causal mask: inside a patched model's training forward (SDPA attention), SDPA's
is_causal (no mask tensor) wherever transformers's eager rule skips the mask, also while
torch.compile traces (where transformers's packed-sequence check cannot read the position ids);
every other call reaches transformers's own functions (packed sequences keep their mask, other
threads' models are untouched); unpatch gives the functions back."""

import copy
import gc
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import masking_utils  # noqa: E402

import trainops  # noqa: E402
from trainops.hf import _causal_mask  # noqa: E402

from numerics import assert_close  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", use_cache=False)
CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    # training with the config's default cache: no packed-sequence check, the mask function alone decides
    "llama-cache": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"use_cache": True}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 8}),
    # one sliding layer (window 4 < 16 tokens: it needs its mask) and one full layer
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               {"head_dim": 8, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    # a window longer than the sequence: the sliding layers' masks are causal too
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 32}),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, None),
}


def flags():
    return getattr(_causal_mask._FLAGS, "patched", 0), getattr(_causal_mask._FLAGS, "default_positions", 0)


@pytest.fixture
def original_calls(monkeypatch):
    """The keywords of every call that reaches transformers's sdpa mask function (a spy registered
    in its place before anything is patched, so the wrapper wraps the spy)."""
    gc.collect()   # earlier tests' patched models: their finalizers give the originals back
    for finalizer in list(_causal_mask._TRACKED.values()):   # one still alive (a failed test's traceback holds it)
        finalizer()
    original = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    masking_utils.AttentionMaskInterface.register("sdpa", spy)
    yield calls
    for finalizer in list(_causal_mask._TRACKED.values()):
        finalizer()
    masking_utils.AttentionMaskInterface.register("sdpa", original)
    _causal_mask._IN_CHAIN["sdpa"] = False   # the spy's chain, with ours in it if a test wrapped it, is gone
    assert flags() == (0, 0)


def tiny(arch, seed=0):
    config_cls, model_cls, extra = CONFIGS[arch]
    torch.manual_seed(seed)
    if extra is None:   # GPT-2's own names
        config = config_cls(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4, attn_implementation="sdpa",
                            use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        config = config_cls(**{**TINY, **extra})
    model = model_cls(config)
    model.train()
    return model


def tokens():
    return torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))


def step(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}


def packed_positions():
    return torch.cat([torch.arange(6), torch.arange(10)]).expand(2, -1)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_patched_models_skip_the_mask_under_compile_where_eager_would(arch, original_calls):
    model = tiny(arch)
    reference = copy.deepcopy(model)   # its own config: not tracked
    report = trainops.patch(model)
    assert report.causal_masks == 1 and "causal mask" in str(report)
    assert trainops.patch(model).causal_masks == 0   # patching twice tracks nothing new
    ids = tokens()
    want_loss, want_grads = step(reference, ids)
    assert original_calls, "the unpatched model's masks reach transformers's function"
    original_calls.clear()

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss, grads = step(compiled, ids)
    assert_close(loss, want_loss, torch.float32, "loss")
    for name, grad in grads.items():
        assert_close(grad, want_grads[name], torch.float32, name)
    # what still reaches transformers: only masks that are not plain causal ones
    needed = [c for c in original_calls if c.get("local_size") is not None and not c["kv_length"] < c["local_size"]]
    assert len(original_calls) == len(needed) == (1 if arch == "gemma3" else 0), original_calls
    torch._dynamo.reset()

    original_calls.clear()   # a padding mask (all ones: its values are not read) still makes a mask
    model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))
    assert original_calls and all(c["attention_mask"] is not None for c in original_calls)

    report = trainops.unpatch(model)
    assert report.causal_masks == 1 and not _causal_mask.is_tracked(model.config)
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is not _causal_mask._sdpa_mask   # given back
    assert masking_utils.find_packed_sequence_indices is not _causal_mask._find_packed_sequence_indices


def test_packed_sequences_keep_their_mask_under_compile(original_calls):
    """Position ids that restart (two sequences packed in a row): the compiled patched model
    computes the unpatched eager model's loss (its packed-sequence mask), and the mask is made."""
    model = tiny("llama")
    reference = copy.deepcopy(model)
    trainops.patch(model)
    ids = tokens()
    want_loss, want_grads = step(reference, ids, position_ids=packed_positions())
    unpacked, _ = step(reference, ids)
    assert not torch.allclose(want_loss, unpacked)   # the packing changes the loss: the check can fail
    original_calls.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss, grads = step(compiled, ids, position_ids=packed_positions())
    assert_close(loss, want_loss, torch.float32, "packed loss")
    for name, grad in grads.items():
        assert_close(grad, want_grads[name], torch.float32, name)
    assert original_calls and flags() == (0, 0)
    torch._dynamo.reset()


def test_another_threads_packed_model_keeps_its_mask_while_a_patched_one_runs(original_calls):
    """The flags are the running thread's: an unpatched model with packed positions on another
    thread, run while a patched model is inside its decoder, computes what it computes alone."""
    patched, other = tiny("llama"), tiny("llama", seed=1)
    trainops.patch(patched)
    other.eval()
    ids = tokens()
    with torch.no_grad():
        alone = other(input_ids=ids, position_ids=packed_positions()).logits
    inside, release = threading.Event(), threading.Event()

    def hold(module, args):   # the patched model waits inside its decoder
        inside.set()
        release.wait(30)

    handle = patched.model.layers[0].register_forward_pre_hook(hold)
    worker = threading.Thread(target=lambda: patched(input_ids=ids, labels=ids))
    worker.start()
    try:
        assert inside.wait(30)
        with torch.no_grad():
            during = other(input_ids=ids, position_ids=packed_positions()).logits
    finally:
        release.set()
        worker.join(30)
        handle.remove()
    assert torch.equal(during, alone)


def test_the_rule_keeps_every_mask_it_cannot_prove_causal(original_calls):
    model = tiny("llama")
    trainops.patch(model)
    plain = dict(batch_size=2, q_length=8, kv_length=8, q_offset=0, kv_offset=0,
                 mask_function=masking_utils.causal_mask_function, attention_mask=None, allow_is_causal_skip=True,
                 config=model.config, device="cpu")
    mask = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    mask(**plain)   # outside a patched forward: transformers's own function
    assert len(original_calls) == 1
    kept = [dict(kv_length=12), dict(q_offset=4, kv_offset=4), dict(allow_is_causal_skip=False),
            dict(attention_mask=torch.ones(2, 8, dtype=torch.bool)), dict(local_size=8), dict(local_size=4),
            dict(mask_function=masking_utils.sliding_window_causal_mask_function(4)),
            dict(q_offset=torch.tensor(0))]
    _causal_mask.patched_forward_begin(False)
    try:
        original_calls.clear()
        assert mask(**plain) is None and not original_calls
        assert mask(**plain, local_size=9) is None and not original_calls   # a window longer than the keys
        for change in kept:
            original_calls.clear()
            mask(**{**plain, **change})
            assert len(original_calls) == 1, change
        original_calls.clear()
        with pytest.MonkeyPatch.context() as m:   # torch.export: never skipped
            m.setattr(torch.compiler, "is_exporting", lambda: True)
            mask(**plain)
        assert len(original_calls) == 1
        assert masking_utils.find_packed_sequence_indices(packed_positions()) is not None   # positions given
    finally:
        _causal_mask.patched_forward_end(False)


def test_the_flags_are_reset_when_the_forward_raises(original_calls):
    model = tiny("llama")
    trainops.patch(model)
    ids = tokens()
    with pytest.raises(IndexError):
        model(input_ids=ids + 1000, labels=ids)   # out of the embedding's range, inside the decoder
    assert flags() == (0, 0)


def test_only_sdpa_configs_are_tracked(original_calls):
    config_cls, model_cls, extra = CONFIGS["llama"]
    model = model_cls(config_cls(**{**TINY, "attn_implementation": "eager"}, **extra))
    assert trainops.patch(model).causal_masks == 0
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is not _causal_mask._sdpa_mask


def test_a_collected_model_gives_the_functions_back_and_old_references_still_work(original_calls):
    model = tiny("llama")
    trainops.patch(model)
    wrapper = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    assert wrapper is _causal_mask._sdpa_mask
    del model
    gc.collect()
    assert not _causal_mask._TRACKED
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is not _causal_mask._sdpa_mask
    assert masking_utils.find_packed_sequence_indices is not _causal_mask._find_packed_sequence_indices
    original_calls.clear()   # a reference kept elsewhere (another library's wrapper) still works
    wrapper(batch_size=1, q_length=4, kv_length=4, device="cpu")
    assert len(original_calls) == 1


def test_a_copy_of_a_patched_model_is_tracked_by_its_first_eager_step(original_calls):
    model = tiny("llama")
    trainops.patch(model)
    twin = copy.deepcopy(model)   # its own config, its patched classes
    del model
    gc.collect()
    assert not _causal_mask._TRACKED
    ids = tokens()
    step(twin, ids)
    assert _causal_mask.is_tracked(twin.config)
    original_calls.clear()
    step(torch.compile(twin, backend="aot_eager", fullgraph=True), ids)
    assert not original_calls
    torch._dynamo.reset()
    assert trainops.unpatch(twin).causal_masks == 1


def test_compiled_steps_on_two_threads_compile_once(original_calls):
    """The flags exist on every thread before any use: the compiled graph does not guard on their
    absence (which made the second step compile the model again)."""
    from torch._dynamo.utils import counters

    model = tiny("llama")
    trainops.patch(model)
    ids = tokens()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    step(compiled, ids)
    step(compiled, ids)
    worker = threading.Thread(target=step, args=(compiled, ids))
    worker.start()
    worker.join(60)
    assert counters["stats"]["unique_graphs"] == 1
    assert not original_calls
    torch._dynamo.reset()


def test_a_wrapper_registered_over_ours_survives_unpatch_and_patch(original_calls):
    """Another library wraps the registered mask function after patch: unpatch leaves its chain
    alone (ours passes calls through), and patching again does not wrap ours a second time."""
    model = tiny("llama")
    trainops.patch(model)
    ours = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    theirs_calls = []

    def theirs(*args, **kwargs):
        theirs_calls.append(1)
        return ours(*args, **kwargs)

    masking_utils.AttentionMaskInterface.register("sdpa", theirs)
    trainops.unpatch(model)
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is theirs
    trainops.patch(model)
    ids = tokens()
    original_calls.clear()
    model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))   # needs a mask: through the chain
    assert theirs_calls and original_calls
    theirs_calls.clear()
    original_calls.clear()
    step(torch.compile(model, backend="aot_eager", fullgraph=True), ids)
    assert theirs_calls and not original_calls   # ours, inside their chain, still skips
    torch._dynamo.reset()
    trainops.unpatch(model)
