"""trainops.patch under the Hugging Face Trainer and TRL's SFTTrainer: a few float32 training steps
and an evaluation of a tiny patched Llama against the unpatched one from the same weights, data
and seed: every logged loss within 1e-5 relative, the trained weights too, the eval loss and the
logits evaluation asks for; the Trainer's default optimizer and a trainops.optim one; SFTTrainer
with packing on and off, its token accuracy and entropy logged (TRL's own fused LM head computes
them: no logits needed), and with a LoRA adapter."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("accelerate")   # the Trainer's

import trainops  # noqa: E402

from numerics import relative_error  # noqa: E402


def lm_data(rows, seed, vocab=64, length=12):
    """Token rows (labels = input_ids, the first 3 tokens a prompt left out of the loss)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        out.append(dict(input_ids=ids, attention_mask=[1] * length, labels=[-100] * 3 + ids[3:]))
    return datasets.Dataset.from_list(out)


def tiny_llama():
    from test_trl_trainers import tiny_llama

    return tiny_llama(0)   # vocabulary 64: pad 0, eos 1


def assert_runs_agree(ours, theirs, keys=("loss",), tolerance=1e-5, weight_tolerance=1e-4):
    """Every logged value of ``keys`` (per step and in the evaluation) within ``tolerance`` relative
    (float32: 1e-5), the trained weights within ``weight_tolerance`` (float32: 1e-4): Adam's update
    g / (sqrt(v) + eps) is about lr whatever the size of g, so where a gradient is near zero a
    rounding-sized difference of it moves the weight by a larger fraction of lr (measured: 1.8e-5
    after 3 steps at lr 1e-2, with the losses equal to 1e-7)."""
    for key in keys:
        got = [h[key] for h in ours.state.log_history if key in h]
        want = [h[key] for h in theirs.state.log_history if key in h]
        assert len(got) == len(want) >= 1, key
        for step, (a, b) in enumerate(zip(got, want)):
            assert abs(a - b) <= tolerance * abs(b), (key, step, a, b)
    want = dict(theirs.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert relative_error(p, want[name]) <= weight_tolerance, name


def run_trainer(tmp_path, patched, optimizer=None, lora=False, bf16=False):
    model = tiny_llama()
    if lora:   # LoRA on the projections and the head, dropout on: the fused loss's LoRA head
        peft = pytest.importorskip("peft")
        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.1, init_lora_weights=False,
            target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]))
    if patched:
        report = trainops.patch(model)   # the one line: patch before Trainer(...)
        assert report.skipped == [] and report.swapped[0][0] == ("base_model.model" if lora else "")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("patched" if patched else "plain")), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=3, logging_steps=1, learning_rate=1e-2, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, per_device_eval_batch_size=4, bf16=bf16)
    optimizers = (None, None) if optimizer is None else (optimizer(model.parameters(), lr=1e-2), None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=lm_data(12, 0), eval_dataset=lm_data(4, 1),
                                   optimizers=optimizers)
    trainer.train()
    trainer.evaluate()
    return trainer


@pytest.mark.parametrize("optimizer, lora", [(None, False), pytest.param("AdamW", False, marks=pytest.mark.slow),
                                             pytest.param(None, True, marks=pytest.mark.slow)])
def test_trainer_patched_runs_as_unpatched(tmp_path, optimizer, lora):
    """The Trainer's default optimizer or trainops.optim.AdamW (``optimizers=(opt, None)``); a PEFT
    LoRA model with an adapted lm_head; gradient accumulation (the Trainer's num_items_in_batch,
    a float tensor in transformers 5.24); a datasets.Dataset whose columns the Trainer keeps by the
    forward's signature."""
    opt = None if optimizer is None else getattr(trainops.optim, optimizer)
    ours, theirs = run_trainer(tmp_path, True, opt, lora), run_trainer(tmp_path, False, opt, lora)
    assert_runs_agree(ours, theirs, ("loss", "eval_loss"))
    # evaluation asks for logits (predict: prediction_loss_only is False): the eval-mode forward makes them
    data = lm_data(4, 1)
    got, want = ours.predict(data), theirs.predict(data)
    assert got.predictions.shape == (4, 12, 64)
    assert relative_error(torch.from_numpy(got.predictions), torch.from_numpy(want.predictions)) <= 1e-5
    assert abs(got.metrics["test_loss"] - want.metrics["test_loss"]) <= 1e-5 * want.metrics["test_loss"]


# ---- TRL's SFTTrainer -----------------------------------------------------------------------------

def sft_text(rows, seed):
    from test_trl_trainers import words

    gen = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_list([dict(text=words(gen, 3, 10)) for _ in range(rows)])


def run_sft(tmp_path, patched, packing, lora=False, bf16=False):
    trl = pytest.importorskip("trl")
    from test_trl_trainers import tokenizer

    model = tiny_llama()
    if patched:
        trainops.patch(model)
    peft_config = None
    if lora:
        peft = pytest.importorskip("peft")
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                      target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    args = trl.SFTConfig(output_dir=str(tmp_path / f"sft-{patched}"), per_device_train_batch_size=2, max_steps=3,
                         logging_steps=1, learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                         disable_tqdm=True, bf16=bf16, packing=packing, max_length=24, per_device_eval_batch_size=4)
    torch.manual_seed(0)   # peft's adapter initialisation
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=sft_text(12, 0), eval_dataset=sft_text(4, 1),
                             processing_class=tokenizer(), peft_config=peft_config)
    trainer.train()
    trainer.evaluate()
    return trainer


@pytest.mark.parametrize("packing, lora", [(False, False), pytest.param(True, False, marks=pytest.mark.slow),
                                           pytest.param(False, True, marks=pytest.mark.slow)])
def test_sft_trainer_patched_runs_as_unpatched(tmp_path, packing, lora):
    ours, theirs = run_sft(tmp_path, True, packing, lora), run_sft(tmp_path, False, packing, lora)
    assert any(type(m).__module__ == "trainops.hf" for m in ours.model.modules())   # the patched blocks trained
    assert_runs_agree(ours, theirs, ("loss", "mean_token_accuracy", "entropy", "eval_loss", "eval_entropy"))


@pytest.mark.parametrize("trainer", ["Trainer", "SFTTrainer"])
def test_bf16_autocast_runs_agree_within_bf16_noise(tmp_path, trainer):
    """``bf16=True`` (the Trainer's bf16 autocast, float32 weights): the patched run's logged values
    within 1e-2 relative of the unpatched run's (bf16 keeps 8 bits: ~4e-3 a rounding; the two runs
    round different sums), and each trained weight no farther from the unpatched bf16 run's than
    twice bf16 itself moves that run from float32's (Adam at lr 1e-2 turns rounding-sized gradient
    differences into lr-sized steps where gradients are near zero: the embedding rows of rare
    tokens), or 2e-2. The float32 run shows that the autocast reached the unpatched run; a patched
    model that ignored it would still pass these bounds (its bf16 numerics are test_hf.py's)."""
    if trainer == "Trainer":
        ours, theirs = run_trainer(tmp_path, True, bf16=True), run_trainer(tmp_path, False, bf16=True)
        keys = ("loss", "eval_loss")
        float32 = run_trainer(tmp_path / "float32", False)
    else:
        ours, theirs = run_sft(tmp_path, True, False, bf16=True), run_sft(tmp_path, False, False, bf16=True)
        keys = ("loss", "mean_token_accuracy", "entropy", "eval_loss")
        float32 = run_sft(tmp_path / "float32", False, False)
    assert_runs_agree(ours, theirs, keys, tolerance=1e-2, weight_tolerance=float("inf"))
    plain = [h["loss"] for h in theirs.state.log_history if "loss" in h]
    exact = [h["loss"] for h in float32.state.log_history if "loss" in h]
    assert plain != exact, "bf16=True changed nothing: the runs were not under autocast"
    want, exact_weights = dict(theirs.model.named_parameters()), dict(float32.model.named_parameters())
    for name, p in ours.model.named_parameters():
        noise = relative_error(want[name], exact_weights[name])
        assert relative_error(p, want[name]) <= max(2e-2, 2 * noise), (name, noise)
