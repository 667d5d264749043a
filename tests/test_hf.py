"""trainops.patch on Hugging Face transformers models (tiny random configurations, nothing
downloaded): the patched model gives the unpatched one's loss and every parameter's gradient
(the loss path without logits), in float32 and bf16, with gradient checkpointing, under
torch.compile; without labels or in eval mode it returns logits as before; the report lists
every swap."""

import copy

import pytest
import torch
import transformers

import trainops

from numerics import assert_close

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 8}),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 8}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               {"head_dim": 8, "final_logit_softcapping": 5.0, "attn_logit_softcapping": 20.0}),
}


def tiny_model(arch, dtype=torch.float32, seed=0):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**TINY, **extra)).to(dtype)
    with torch.no_grad():   # norm weights away from their initial values, so a lost (1 + w) or w would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, 16), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100   # a prompt left out of the loss
    return ids, labels


def loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(got, want, what):
    """float32: the loss and every parameter's gradient of ``got`` (loss_and_grads's) match ``want``'s."""
    (out, grads), (expected, expected_grads) = got, want
    assert_close(out.loss, expected.loss, torch.float32, f"{what} loss")
    assert {name.removeprefix("_orig_mod.") for name in grads} == set(expected_grads)   # torch.compile's prefix
    for name in grads:
        assert_close(grads[name], expected_grads[name.removeprefix("_orig_mod.")], torch.float32, name)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_patched_model_gives_the_unpatched_loss_and_gradients(arch):
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    params_before = list(model.parameters())
    report = trainops.patch(model)
    assert list(model.parameters()) == params_before   # the same Parameter objects: optimizers stay valid
    swapped = {name: new for name, _, new in report.swapped}
    assert swapped[""].startswith("trainops.hf.") and swapped[""].endswith("ForCausalLM")
    assert swapped["model.layers.0.mlp"].endswith("MLP")
    assert swapped["model.norm"].endswith("RMSNorm") and swapped["model.layers.1.input_layernorm"].endswith("RMSNorm")
    if arch == "qwen3":   # its per-head q / k norms too
        assert swapped["model.layers.0.self_attn.q_norm"].endswith("Qwen3RMSNorm")
    assert swapped["model.layers.1.self_attn"].endswith("Attention")   # the rotary embedding
    if arch.startswith("gemma"):   # its scaled embedding
        assert swapped["model.embed_tokens"].endswith("TextScaledWordEmbedding")
    assert report.skipped == []
    ids, labels = batch()
    model.train()
    reference.train()
    with trainops.track_kernels() as used:
        out, grads = loss_and_grads(model, ids, labels)
    ran = {op for op, *_ in used}
    assert {"rms_norm", "rotary_embedding", "rotary_embedding_backward", "cross_entropy"} <= ran, ran
    assert ("swiglu" if arch in ("llama", "mistral", "qwen2", "qwen3") else "geglu") in ran, ran
    want, want_grads = loss_and_grads(reference, ids, labels)
    assert out.logits is None   # the loss came from the hidden states: no logits made
    assert_close(out.loss, want.loss, torch.float32, "loss")
    assert grads.keys() == want_grads.keys()
    for name in grads:
        assert_close(grads[name], want_grads[name], torch.float32, name)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_without_labels_or_in_eval_logits_come_back(arch):
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    trainops.patch(model)
    ids, labels = batch()
    for train in (True, False):
        model.train(train)
        reference.train(train)
        with torch.no_grad():
            got = model(input_ids=ids)
            want = reference(input_ids=ids)
            assert_close(got.logits, want.logits, torch.float32, "logits")
        if not train:   # eval with labels: the original forward, logits and loss
            with torch.no_grad():
                got = model(input_ids=ids, labels=labels)
                want = reference(input_ids=ids, labels=labels)
            assert got.logits is not None
            assert_close(got.loss, want.loss, torch.float32, "eval loss")


def test_num_items_in_batch_and_shift_labels_go_to_the_loss():
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    trainops.patch(model)
    model.train()
    reference.train()
    ids, labels = batch()
    items = torch.tensor(40)
    assert_same_step(loss_and_grads(model, ids, labels, num_items_in_batch=items),
                     loss_and_grads(reference, ids, labels, num_items_in_batch=items), "num_items")
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    out = model(input_ids=ids, labels=labels, shift_labels=shift)
    want = reference(input_ids=ids, labels=labels, shift_labels=shift)
    assert_close(out.loss, want.loss, torch.float32, "shift_labels loss")


def test_bfloat16_model():
    """bf16 weights: the patched model is at least as close to a float32 run of the same weights as
    the unpatched one is (both round in bf16, differently)."""
    from numerics import relative_error

    model = tiny_model("llama", torch.bfloat16)
    reference = copy.deepcopy(model)
    exact = copy.deepcopy(model).float()
    trainops.patch(model)
    ids, labels = batch()
    results = []
    for m in (model, reference, exact):
        m.train()
        results.append(loss_and_grads(m, ids, labels))
    (out, grads), (theirs, their_grads), (want, want_grads) = results
    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - want.loss.item()) <= 1.25 * abs(theirs.loss.item() - want.loss.item()) + 1e-3
    for name in grads:
        assert grads[name].dtype == torch.bfloat16
        ours, torchs = relative_error(grads[name], want_grads[name]), relative_error(their_grads[name], want_grads[name])
        assert ours <= 1.25 * torchs + 1e-3, (name, ours, torchs)


def test_gradient_checkpointing_and_torch_compile():
    model = tiny_model("qwen2")
    reference = copy.deepcopy(model)
    trainops.patch(model)
    for m in (model, reference):   # transformers 5.23 renamed it; 5.17 (the GPU machine's) has the old name
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        m.train()
    ids, labels = batch()
    want = loss_and_grads(reference, ids, labels)
    assert_same_step(loss_and_grads(model, ids, labels), want, "checkpointed")

    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    compiled = torch.compile(model, backend="aot_eager")
    assert_same_step(loss_and_grads(compiled, ids, labels), want, "compiled")
    torch._dynamo.reset()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_patched_model_compiles_whole(arch):
    """fullgraph=True: nothing trainops swaps breaks the graph (a graph break per attention layer
    made torch.compile recompile it per layer and give up after 8 layers)."""
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    trainops.patch(model)
    model.train()
    reference.train()
    ids, labels = batch()
    want = loss_and_grads(reference, ids, labels)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_same_step(loss_and_grads(compiled, ids, labels), want, "compiled whole")
    torch._dynamo.reset()


def test_patched_training_step_warns_of_nothing(monkeypatch):
    """No deprecation from the patched forward: transformers 5.24 renamed past_key_values to cache
    and warns (a FutureWarning, and its logger) whenever the old name is passed or read."""
    import warnings

    from transformers.utils import generic

    logged = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda *args, **kwargs: logged.append(args))
    model = tiny_model("llama")
    trainops.patch(model)
    model.train()
    ids, labels = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        model(input_ids=ids, labels=labels).loss.backward()
    assert logged == []


def test_hf_false_and_patching_twice():
    model = tiny_model("gemma")
    report = trainops.patch(model, hf=False)
    assert all(not new.startswith("trainops.hf") for _, _, new in report.swapped)
    first = trainops.patch(model)
    assert any(new.startswith("trainops.hf") for _, _, new in first.swapped)
    second = trainops.patch(model)
    assert second.swapped == [] and second.skipped == []
    with pytest.raises(trainops.InvalidProblemError, match="argument 'hf'"):
        trainops.patch(model, hf="yes")


def test_gpt2_gelu_layernorm_and_dropout():
    """GPT-2: its tanh GELU (NewGELUActivation) by default, LayerNorm and Dropout with block_ops; the
    loss path stays transformers's (GPT2LMHeadModel is not among the swapped causal LMs)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2,
                                                                 n_head=4, attn_implementation="eager"))
    reference = copy.deepcopy(model)
    report = trainops.patch(model, block_ops=True)
    kinds = {new for _, _, new in report.swapped}
    assert {"trainops.hf.NewGELUActivation", "trainops.nn.LayerNorm", "trainops.nn.Dropout"} <= kinds
    model.eval()   # dropout off: the same function
    reference.eval()
    ids, labels = batch()
    assert_same_step(loss_and_grads(model, ids, labels), loss_and_grads(reference, ids, labels), "gpt2")


def test_the_patched_model_keeps_its_name_pickles_and_saves(tmp_path):
    """What reads the class name (Trainer's label shifting, save_pretrained's config.architectures)
    sees transformers's; torch.save / pickle round-trip, also where the swapped class has not been
    made yet (a fresh process)."""
    import io
    import pickle

    from trainops import hf

    model = tiny_model("llama")
    trainops.patch(model)
    assert type(model).__name__ == "LlamaForCausalLM" and model._get_name() == "LlamaForCausalLM"
    assert type(model) is not transformers.LlamaForCausalLM
    model.save_pretrained(tmp_path)
    assert model.config.architectures == ["LlamaForCausalLM"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is transformers.LlamaForCausalLM and loaded.config.architectures == ["LlamaForCausalLM"]

    ids, labels = batch()
    model.train()
    want = model(input_ids=ids, labels=labels).loss
    buffer = io.BytesIO()
    torch.save(model, buffer)
    data = pickle.dumps(model)
    qualname = type(model).__qualname__
    made = hf._SUBCLASSES.pop(transformers.LlamaForCausalLM)   # as in a process that has not patched yet
    assert qualname not in vars(hf)   # found by the package's __getattr__
    try:
        for restored in (pickle.loads(data), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
            assert type(restored).__qualname__ == qualname and restored.training
            assert torch.equal(restored(input_ids=ids, labels=labels).loss, want)
            assert restored(input_ids=ids, labels=labels).logits is None   # still patched
    finally:
        hf._SUBCLASSES.setdefault(transformers.LlamaForCausalLM, made)


def test_a_custom_loss_function_or_loss_type_runs_the_original_forward():
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    trainops.patch(model)

    def square_loss(logits, labels, vocab_size, **kwargs):
        return logits.float().pow(2).mean()

    ids, labels = batch()
    for m in (model, reference):
        m.train()
        m.loss_function = square_loss
    got, want = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert got.logits is not None
    assert_close(got.loss, want.loss, torch.float32, "custom loss")


def test_the_attention_sees_later_changes_of_its_module(monkeypatch):
    """Only apply_rotary_pos_emb is replaced: the copied forward reads the module's other names live."""
    import transformers.models.llama.modeling_llama as modeling

    model = tiny_model("llama")
    trainops.patch(model)
    calls = []
    original = modeling.eager_attention_forward

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", spy)
    model(input_ids=batch()[0])
    assert len(calls) == 2   # both layers
    assert modeling.apply_rotary_pos_emb is not None and "trainops" not in modeling.apply_rotary_pos_emb.__module__


def test_the_compiled_attention_sees_later_changes_of_its_module(monkeypatch):
    """torch.compile guards the copied forward's globals: a name rebound in the module after the
    first compilation is traced again (not the stale function)."""
    import transformers.models.llama.modeling_llama as modeling

    model = tiny_model("llama")
    trainops.patch(model)
    model.eval()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    ids = batch()[0]
    want = compiled(input_ids=ids).logits
    calls = []
    original = modeling.eager_attention_forward

    def doubled_output(*args, **kwargs):
        calls.append(1)
        out, weights = original(*args, **kwargs)
        return out * 2, weights

    monkeypatch.setattr(modeling, "eager_attention_forward", doubled_output)
    got = compiled(input_ids=ids).logits
    assert calls and not torch.allclose(got, want)
    torch._dynamo.reset()


def test_attention_compiled_as_its_own_frame():
    """A graph break inside the patched attention (SDPA asked for attention weights) makes Dynamo
    compile the copied forward as a frame of its own, whose generated helpers Dynamo stores in, and
    reads back from, that function's globals."""
    config_cls, model_cls, extra = ARCHS["llama"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, "attn_implementation": "sdpa"}, **extra))
    reference = copy.deepcopy(model)
    trainops.patch(model)
    model.eval()
    reference.eval()
    ids = batch()[0]
    want = reference(input_ids=ids, output_attentions=True)
    got = torch.compile(model, backend="eager")(input_ids=ids, output_attentions=True)
    assert_close(got.logits, want.logits, torch.float32, "logits")
    torch._dynamo.reset()


def test_a_users_subclass_is_reported_not_swapped():
    class MyLM(transformers.LlamaForCausalLM):
        pass

    config_cls, _, extra = ARCHS["llama"]
    torch.manual_seed(0)
    model = MyLM(config_cls(**TINY, **extra))
    report = trainops.patch(model)
    assert [(name, cls) for name, cls, _ in report.skipped] == [("", "MyLM")]
    assert "a subclass of transformers.LlamaForCausalLM" in report.skipped[0][2]
    assert type(model) is MyLM and any(name == "model.norm" for name, *_ in report.swapped)


@pytest.mark.gpu
def test_gpu_llama_under_bf16_autocast():
    """A small Llama on the GPU, float32 parameters under bf16 autocast (the usual training set-up): the
    patched model (Triton kernels) is as close to a float32 run as the unpatched one is."""
    from numerics import relative_error

    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda()
    reference = copy.deepcopy(model)
    exact = copy.deepcopy(model)
    trainops.patch(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (4, 128), generator=gen).cuda()
    labels = ids.clone()
    labels[:, :10] = -100
    results = []
    for m, autocast in ((model, True), (reference, True), (exact, False)):
        m.train()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            results.append(loss_and_grads(m, ids, labels))
    (out, grads), (theirs, their_grads), (want, want_grads) = results
    assert out.logits is None
    assert abs(out.loss.item() - want.loss.item()) <= 1.25 * abs(theirs.loss.item() - want.loss.item()) + 2e-3
    for name in grads:
        ours, torchs = relative_error(grads[name], want_grads[name]), relative_error(their_grads[name], want_grads[name])
        assert ours <= 1.25 * torchs + 1e-3, (name, ours, torchs)
