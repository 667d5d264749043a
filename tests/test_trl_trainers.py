"""trainops.trl_trainers: TRL's DPOTrainer and GKDTrainer with trainops's fused losses, on a tiny
random Llama and an offline word-level tokenizer. At every step the trainer computes both its
trainops loss and TRL's own loss on the same weights and batch (the trajectory is trainops's), so
the comparison is exact step by step, not blurred by two diverging trainings; and a separate TRL
run's first steps match too. Float32 training (bf16=False: TRL's configs default to bf16 autocast,
under which TRL and Hugging Face round the logits to bf16 and trainops keeps them in float32 from
the bf16 matmul, a bf16-rounding-sized difference). CI runs 3 steps of each; the 20-step runs, IPO
and the separate TRL run are marked slow."""

import copy
import tempfile

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from trl.experimental.gkd import GKDConfig  # noqa: E402
from trl.experimental.gkd import GKDTrainer as TRLGKDTrainer  # noqa: E402

from trainops import trl_trainers  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def words(gen, low, high):
    n = int(torch.randint(low, high, (1,), generator=gen))
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 61, (n,), generator=gen))


def preference_data():
    gen = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_list([dict(prompt=words(gen, 2, 6) + " ", chosen=words(gen, 1, 6),
                                            rejected=words(gen, 1, 6)) for _ in range(40)])


def both_losses(cls):
    """``cls`` recording, at each training step, (trainops's loss, TRL's loss) on the same batch."""
    class Recording(cls):
        pairs = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            theirs = cls.__mro__[1].compute_loss(self, model, inputs, num_items_in_batch=num_items_in_batch).detach()
            self.pairs.append((loss.item(), theirs.item()))
            return loss
    Recording.pairs = []
    return Recording


def losses_of(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_dpo(cls, steps, loss_type="sigmoid", precompute=False):
    with tempfile.TemporaryDirectory() as out:
        args = trl.DPOConfig(output_dir=out, per_device_train_batch_size=4, max_steps=steps, logging_steps=1,
                             learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                             loss_type=[loss_type], disable_tqdm=True, bf16=False,
                             precompute_ref_log_probs=precompute)
        trainer = cls(tiny_llama(0), ref_model=None if precompute else tiny_llama(0), args=args,
                      train_dataset=preference_data(), processing_class=tokenizer())
        trainer.train()
    return trainer


def assert_steps_match(pairs, steps, rtol):
    assert len(pairs) == steps
    for step, (ours, theirs) in enumerate(pairs):
        assert abs(ours - theirs) <= rtol * abs(theirs) + 1e-7, (step, ours, theirs)


@pytest.mark.parametrize("steps, loss_type", [(3, "sigmoid"), pytest.param(3, "ipo", marks=pytest.mark.slow),
                                              pytest.param(20, "sigmoid", marks=pytest.mark.slow)])
def test_dpo_trainer_matches_trl_step_by_step(steps, loss_type):
    trainer = run_dpo(both_losses(trl_trainers.DPOTrainer), steps, loss_type)
    assert_steps_match(trainer.pairs, steps, 1e-5)
    logged = trainer.state.log_history[0]
    assert {"rewards/chosen", "rewards/margins", "logps/chosen", "logits/chosen"} <= logged.keys()


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_trainer_with_precomputed_reference_log_probabilities(loss_type):
    """TRL's precomputed reference sums (divided by the count for IPO's averages by the hook)."""
    trainer = run_dpo(both_losses(trl_trainers.DPOTrainer), 3, loss_type, precompute=True)
    assert trainer.ref_model is None
    assert_steps_match(trainer.pairs, 3, 1e-5)


@pytest.mark.slow
def test_dpo_trainer_and_a_trl_run_of_its_own():
    """Two trainings (TRL's, trainops's) from the same weights: the same first steps' losses."""
    ours, theirs = losses_of(run_dpo(trl_trainers.DPOTrainer, 3)), losses_of(run_dpo(trl.DPOTrainer, 3))
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_return_outputs_gives_the_models_logits():
    """TRL's prediction_step (with compute_metrics) reads outputs.logits from compute_loss."""
    with tempfile.TemporaryDirectory() as out:
        args = trl.DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False, per_device_eval_batch_size=2)
        trainer = trl_trainers.DPOTrainer(tiny_llama(0), ref_model=tiny_llama(0), args=args,
                                          train_dataset=preference_data(), processing_class=tokenizer())
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        loss, logits, labels = trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(loss)


def test_dpo_trainer_refuses_what_it_does_not_compute():
    with tempfile.TemporaryDirectory() as out:
        args = trl.DPOConfig(output_dir=out, report_to=[], use_cpu=True, loss_type=["hinge"], bf16=False)
        with pytest.raises(ValueError, match="loss_type"):
            trl_trainers.DPOTrainer(tiny_llama(0), ref_model=tiny_llama(0), args=args, train_dataset=preference_data(),
                                    processing_class=tokenizer())


def distillation_data():
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(40):
        prompt = int(torch.randint(2, 6, (1,), generator=gen))
        completion = int(torch.randint(1, 6, (1,), generator=gen))
        rows.append(dict(input_ids=torch.randint(3, len(WORDS), (prompt + completion,), generator=gen).tolist(),
                         prompt_len=prompt))
    return datasets.Dataset.from_list(rows)


def collate(examples):
    """Padded input_ids, attention_mask and labels (the prompt's tokens -100), as GKD's collator gives."""
    t = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        mask[i, :n] = 1
        labels[i, e["prompt_len"]:n] = ids[i, e["prompt_len"]:n]
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("steps", [3, pytest.param(20, marks=pytest.mark.slow)])
def test_gkd_trainer_matches_trl_step_by_step(steps):
    with tempfile.TemporaryDirectory() as out:
        args = GKDConfig(output_dir=out, per_device_train_batch_size=4, max_steps=steps, logging_steps=1,
                         learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, seed=0, lmbda=0.0,
                         beta=0.3, disable_tqdm=True, bf16=False)
        cls = both_losses(trl_trainers.GKDTrainer)
        trainer = cls(tiny_llama(0), teacher_model=copy.deepcopy(tiny_llama(1)), args=args,
                      train_dataset=distillation_data(), processing_class=tokenizer(), data_collator=collate)
        trainer.train()
    # the JSD of two near-uniform tiny models is ~2e-3, a difference of O(1) terms: float32 rounding of
    # those terms is ~1e-7 of the loss's own size
    assert_steps_match(trainer.pairs, steps, 1e-4)
    assert all(p[1] > 0 for p in trainer.pairs)
    assert TRLGKDTrainer in type(trainer).__mro__



def test_hidden_and_head_of_a_peft_head_give_the_adapted_logits():
    """TRL 1.16's trainers refuse a PEFT adapter on lm_head, but hidden_and_head never reads a PEFT
    head's base weight alone: its operands give peft's logits (LoRA on lm_head: the low-rank terms
    concatenated; lm_head in modules_to_save: the trained copy)."""
    peft = pytest.importorskip("peft")
    ids = torch.randint(3, len(WORDS), (2, 7), generator=torch.Generator().manual_seed(0))
    for options in (dict(target_modules=["q_proj", "lm_head"]), dict(target_modules=["q_proj"],
                                                                      modules_to_save=["lm_head"])):
        torch.manual_seed(0)
        model = peft.get_peft_model(tiny_llama(0), peft.LoraConfig(r=4, init_lora_weights=False, **options)).eval()
        with torch.no_grad():
            head = model.get_base_model().lm_head
            if "modules_to_save" in options:   # the copy differs from the original
                head.modules_to_save["default"].weight.mul_(2)
            hidden, weight, bias = trl_trainers.hidden_and_head(model, {"input_ids": ids})
            logits = torch.nn.functional.linear(hidden, weight, bias)
            want = model(input_ids=ids).logits
            original = head.original_module if "modules_to_save" in options else head.get_base_layer()
            silent = torch.nn.functional.linear(hidden[..., :32], original.weight, original.bias)   # the base head
        assert torch.allclose(logits, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(silent, want, rtol=1e-3, atol=1e-3)
