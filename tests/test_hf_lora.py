"""trainops.patch on PEFT LoRA models (tiny random configurations, float32, CPU): LoRA on the
attention and MLP projections and on lm_head, or lm_head in modules_to_save. The patched model
gives peft's loss and the gradient of every trainable parameter (the adapters'), with LoRA
dropout (the same random numbers: the dropout modules run in peft's order), several active
adapters, adapters disabled or merged; the patched MLPs and the fused loss are what ran; the
refusals (DoRA on the head, a hooked head, disabled-while-merged) name lm_head and the reason;
unpatch restores transformers's classes under peft's layers."""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import trainops  # noqa: E402
from trainops.errors import UnsupportedError  # noqa: E402

from numerics import assert_close, relative_error  # noqa: E402
from test_hf import batch, tiny_model  # noqa: E402

TARGETS = {   # the attention's and the MLP's projections and the head, by each family's names
    "llama": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "lm_head"],   # q / k norms
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"],
    "gemma2": ["q_proj", "k_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens"],
}


def lora_model(arch="llama", seed=0, **options):
    """A tiny ``arch`` under peft LoRA (rank 4, alpha 8) with random, non-zero B: the adapters change
    the loss (peft's default B = 0 would hide a head computed from its base weight alone)."""
    config = dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=TARGETS[arch], init_lora_weights=False)
    config.update(options)
    torch.manual_seed(seed)
    return peft.get_peft_model(tiny_model(arch), peft.LoraConfig(**config))


def step(model, ids, labels, seed=5):
    """Loss and the gradients of the trainable parameters, dropout drawn from ``seed``."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same_step(model, reference, what=""):
    ids, labels = batch()
    (out, grads), (want, want_grads) = step(model, ids, labels), step(reference, ids, labels)
    assert out.logits is None   # the fused loss ran: no logits made
    assert_close(out.loss, want.loss, torch.float32, f"{what} loss")
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        assert grad is not None and want_grads[name] is not None, name
        assert_close(grad, want_grads[name], torch.float32, f"{what} {name}")
    return out


def swapped_and_skipped(report):
    return {name: new for name, _, new in report.swapped}, {name: why for name, _, why in report.skipped}


@pytest.mark.parametrize("arch", list(TARGETS))
def test_lora_model_gives_peft_loss_and_adapter_gradients(arch):
    model = lora_model(arch)
    reference = copy.deepcopy(model)
    report = trainops.patch(model)
    swapped, skipped = swapped_and_skipped(report)
    assert skipped == {}
    assert swapped["base_model.model"].startswith("trainops.hf.")   # the causal LM: the fused loss
    assert swapped["base_model.model.model.layers.0.mlp"].endswith("MLP")   # its projections are LoRA layers
    assert swapped["base_model.model.model.layers.1.self_attn"].endswith("Attention")
    if arch == "gemma2":   # LoRA on the scaled embedding: peft's layer around trainops's embedding
        assert swapped["base_model.model.model.embed_tokens.base_layer"].endswith("TextScaledWordEmbedding")
    head = model.base_model.model.lm_head
    assert type(head).__name__ == "Linear" and type(head).__module__.startswith("peft.")
    with trainops.track_kernels() as used:
        out = assert_same_step(model, reference, arch)
    ran = {op for op, *_ in used}
    assert {"cross_entropy", "geglu" if arch == "gemma2" else "swiglu"} <= ran, ran
    assert {"rotary_embedding", "qk_norm_rotary"} & ran, ran   # q / k norm families: the fused one on main
    with model.disable_adapter():   # the adapters change the loss: a head read from its base weight would show
        base = model(input_ids=batch()[0], labels=batch()[1]).loss
    assert relative_error(base, out.loss) > 1e-3


def test_lora_head_with_lora_bias_and_several_active_adapters():
    model = lora_model(lora_bias=True, lora_dropout=0.0)
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=3, lora_dropout=0.2, init_lora_weights=False,
                                                target_modules=["lm_head", "q_proj"]))
    model.base_model.set_adapter(["default", "second"])   # both active, both trained
    assert model.base_model.model.lm_head.active_adapters == ["default", "second"]
    reference = copy.deepcopy(model)
    assert swapped_and_skipped(trainops.patch(model))[1] == {}
    assert_same_step(model, reference, "two adapters")


def loss_of(model, ids, labels):
    """The training-mode loss without a backward (disabled or merged adapters: nothing in it trains)."""
    model.train()
    with torch.no_grad():
        return model(input_ids=ids, labels=labels)


def test_lora_head_disabled_or_merged_is_its_base_layer():
    model = lora_model(lora_dropout=0.0)
    reference = copy.deepcopy(model)
    trainops.patch(model)
    ids, labels = batch()
    with model.disable_adapter(), reference.disable_adapter():
        out, want = loss_of(model, ids, labels), loss_of(reference, ids, labels)
    assert out.logits is None
    assert_close(out.loss, want.loss, torch.float32, "disabled")
    disabled = out.loss
    model.merge_adapter()
    reference.merge_adapter()
    out, want = loss_of(model, ids, labels), loss_of(reference, ids, labels)
    assert out.logits is None
    assert_close(out.loss, want.loss, torch.float32, "merged")
    assert relative_error(out.loss, disabled) > 1e-3   # the merged weight holds the adapters


def test_head_in_modules_to_save_is_the_trained_copy():
    model = lora_model(target_modules=["q_proj", "down_proj"], modules_to_save=["lm_head"])
    head = model.base_model.model.lm_head
    assert type(head).__name__ == "ModulesToSaveWrapper"
    reference = copy.deepcopy(model)
    assert swapped_and_skipped(trainops.patch(model))[1] == {}
    with torch.no_grad():   # the copy differs from the original: the loss tells which one was used
        head.modules_to_save["default"].weight.add_(torch.randn_like(head.weight))
        copy_weight = head.modules_to_save["default"].weight
        reference.base_model.model.lm_head.modules_to_save["default"].weight.copy_(copy_weight)
    assert_same_step(model, reference, "modules_to_save")
    assert head.modules_to_save["default"].weight.grad is not None
    assert head.original_module.weight.grad is None
    ids, labels = batch()
    with model.disable_adapter(), reference.disable_adapter():   # the original module
        out, want = loss_of(model, ids, labels), loss_of(reference, ids, labels)
    assert out.logits is None
    assert_close(out.loss, want.loss, torch.float32, "disabled")


def test_dora_head_is_refused_with_the_reason_and_dora_projections_run_as_modules():
    model = lora_model(use_dora=True, lora_dropout=0.0)
    reference = copy.deepcopy(model)
    for report in (trainops.patch(model, dry_run=True), trainops.patch(model)):
        swapped, skipped = swapped_and_skipped(report)
        assert "lm_head" in skipped["base_model.model"] and "DoraLinearVariant" in skipped["base_model.model"]
        assert swapped["base_model.model.model.layers.0.mlp"].endswith("MLP")   # DoRA projections: called as modules
    ids, labels = batch()
    (out, grads), (want, want_grads) = step(model, ids, labels), step(reference, ids, labels)
    assert out.logits is not None   # the causal LM left as it is: peft's head, logits made
    assert_close(out.loss, want.loss, torch.float32, "DoRA loss")
    for name in grads:
        assert_close(grads[name], want_grads[name], torch.float32, name)


def test_other_peft_heads_are_refused_with_the_reason():
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(target_modules=["q_proj"],
                                                                      trainable_token_indices={"lm_head": [3, 4]}))
    skipped = swapped_and_skipped(trainops.patch(model, dry_run=True))[1]
    assert "lm_head is a PEFT TrainableTokensWrapper" in skipped["base_model.model"]


def test_states_the_fused_head_cannot_compute_raise_naming_lm_head():
    model = lora_model(lora_dropout=0.0)
    trainops.patch(model)
    ids, labels = batch()
    handle = model.base_model.model.lm_head.register_forward_hook(lambda *args: None)
    with pytest.raises(UnsupportedError, match="lm_head: it has forward hooks"):
        step(model, ids, labels)
    handle.remove()
    model.add_adapter("dora", peft.LoraConfig(use_dora=True, target_modules=["lm_head"]))   # after patching
    model.set_adapter("dora")
    with pytest.raises(UnsupportedError, match="lm_head: its active adapters have LoRA variants.*DoraLinearVariant"):
        step(model, ids, labels)
    model.set_adapter("default")
    model.merge_adapter()
    with model.disable_adapter():
        with pytest.raises(UnsupportedError, match="lm_head: its adapters are disabled while merged"):
            step(model, ids, labels)


def test_unpatch_restores_transformers_classes_under_peft():
    model = lora_model()
    reference = copy.deepcopy(model)
    trainops.patch(model)
    trainops.unpatch(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    ids, labels = batch()
    (out, grads), (want, want_grads) = step(model, ids, labels), step(reference, ids, labels)
    assert out.logits is not None
    assert_close(out.loss, want.loss, torch.float32, "unpatched loss")
    for name in grads:
        assert_close(grads[name], want_grads[name], torch.float32, name)


def test_lora_model_with_gradient_checkpointing():
    model = lora_model(lora_dropout=0.0)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable()
        m.enable_input_require_grads()
    trainops.patch(model)
    assert_same_step(model, reference, "checkpointed")


@pytest.mark.slow
def test_lora_model_compiles_whole():
    """torch.compile(fullgraph=True) of the patched PeftModel (the LoRA head's concatenations and
    checks traced), against the unpatched model run eagerly."""
    model = lora_model(lora_dropout=0.0)
    reference = copy.deepcopy(model)
    trainops.patch(model)
    assert_same_step(torch.compile(model, fullgraph=True), reference, "compiled")


def three_runs(model, exact, ids, labels):
    """(patched, unpatched, float32) steps of ``model`` and of ``exact`` (its weights in float32)."""
    with torch.no_grad():
        for p, q in zip(model.parameters(), exact.parameters()):
            q.copy_(p.float())
    reference = copy.deepcopy(model)
    trainops.patch(model)
    return [step(m, ids, labels) for m in (model, reference, exact)]


def assert_as_close_to_float32(runs):
    """Within bf16 noise of the float32 run, as the unpatched model is: the loss within 2e-3
    relative (bf16's unit roundoff is 3.9e-3), the median over the adapter gradients of (our relative
    error / the unpatched model's) at most 1.25 and our worst gradient error at most twice theirs.
    Measured on the CPU over 4 seeds (bf16 base, float32 adapters, dropout 0.1): loss within 6.4e-4,
    median ratio 0.85-1.13 (ours the larger on 35-77% of the gradients: both errors are the blocks'
    bf16 rounding, which differs), worst errors 0.018-0.047 against the unpatched model's
    0.025-0.054; the fused LoRA head alone moved the loss by at most 5e-4 (without dropout)."""
    import statistics

    (out, grads), (theirs, their_grads), (want, want_grads) = runs
    assert out.logits is None
    assert abs(out.loss.item() - want.loss.item()) <= 2e-3 * abs(want.loss.item())
    ours = {name: relative_error(grads[name], want_grads[name]) for name in grads}
    torchs = {name: relative_error(their_grads[name], want_grads[name]) for name in grads}
    assert statistics.median(ours[name] / torchs[name] for name in grads) <= 1.25, (ours, torchs)
    assert max(ours.values()) <= 2 * max(torchs.values()), (ours, torchs)


def test_bfloat16_base_with_float32_adapters():
    """peft's usual set-up: a bf16 model, its adapters float32 (autocast_adapter_dtype). The LoRA head's
    low-rank activations come from float32 adapters and are rounded to bf16 for the fused matmul."""
    model = lora_model()
    model.base_model.model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert_as_close_to_float32(three_runs(model, lora_model(), *batch()))


@pytest.mark.gpu
def test_gpu_lora_llama_under_bf16_autocast():
    """A small Llama under LoRA (projections and head, dropout 0.1) on the GPU, float32 weights under
    bf16 autocast: the patched model (Triton kernels, the fused LoRA head) is as close to a float32
    run as the unpatched one is."""
    def build():
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(config)
        return peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1, init_lora_weights=False,
                                                         target_modules=TARGETS["llama"])).cuda()

    model, exact = build(), build()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (4, 128), generator=gen).cuda()
    labels = ids.clone()
    labels[:, :10] = -100
    with torch.no_grad():
        for p, q in zip(model.parameters(), exact.parameters()):
            q.copy_(p)
    reference = copy.deepcopy(model)
    trainops.patch(model)
    runs = []
    for m, autocast in ((model, True), (reference, True), (exact, False)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            runs.append(step(m, ids, labels))
    assert_as_close_to_float32(runs)


def test_a_head_whose_weight_is_not_its_matrix_is_refused():
    """A quantized head (bitsandbytes's layers subclass torch.nn.Linear and hold packed or int8
    weights) would be read as garbage: refused with the reason, plain or under LoRA."""
    for wrap in (False, True):
        model = tiny_model("llama")
        head = model.lm_head
        head.weight = torch.nn.Parameter(torch.zeros(97 * 32 // 2, 1, dtype=torch.uint8), requires_grad=False)
        if wrap:
            model = peft.get_peft_model(model, peft.LoraConfig(target_modules=["lm_head"]))
        skipped = swapped_and_skipped(trainops.patch(model, dry_run=True))[1]
        why = skipped["base_model.model" if wrap else ""]
        assert "weight is not a floating (out_features, in_features) matrix ((1552, 1) torch.uint8" in why, why
