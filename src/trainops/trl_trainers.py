"""TRL trainers whose loss is trainops's fused linear post-training losses (``trl`` is an extra:
this module imports it; ``import trainops`` does not import this module).

    from trainops.trl_trainers import DPOTrainer, GKDTrainer     # instead of trl's
    trainer = DPOTrainer(model, ref_model=ref, args=DPOConfig(...), train_dataset=..., processing_class=tok)

The hook is ``compute_loss``, the method transformers' Trainer calls for every micro-batch; the
subclasses override it and nothing else (data preparation, collation, generation, logging,
checkpoints stay TRL's). Each runs the models' backbones (``model.base_model``: the decoder
without its LM head; the LM head's weight from ``get_output_embeddings()``), shifts the labels as
TRL does (hidden[:, :-1] scored against labels[:, 1:]) and calls
``trainops.linear_preference_loss`` / ``trainops.linear_distillation_loss``: no (B, T, V) logits.

DPOTrainer (trl.DPOTrainer, TRL >= 1.0): loss_type ["sigmoid"] (kind "dpo") or ["ipo"] (kind
"ipo"), f_divergence_type "reverse_kl", no ld_alpha, no WPO weighting, no MoE auxiliary loss
(each refused with a ValueError naming it); a reference model given as ``ref_model``, or TRL's
precomputed reference log-probabilities. It logs TRL's rewards/*, logps/* and logits/* metrics.

GKDTrainer (trl.experimental.gkd.GKDTrainer): TRL's generalized_jsd_loss(beta = args.beta,
temperature 1, divided by num_items_in_batch when the Trainer passes it) between the student and
``teacher_model``; generation (lmbda, seq_kd) stays TRL's.

Both are tested against TRL's own trainers on a tiny random Llama (tests/test_trl_trainers.py).

No SFTTrainer here: TRL's (1.16) computes its loss, token accuracy and entropy with a fused LM head
of its own, without logits, so a ``trainops.patch``-ed model runs under ``trl.SFTTrainer`` as it is
(its decoder modules trainops's, the loss TRL's; trainops.hf's docstring; tests/test_hf_trainers.py).
"""

from __future__ import annotations

import torch
import trl
from trl.experimental.gkd import GKDTrainer as _TRLGKDTrainer

from .functional import linear_distillation_loss, linear_preference_loss
from .hf.lora import head_operands

_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def hidden_and_head(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(last hidden states (B, T, H), LM head weight (V, H), bias or None) of a causal LM: its
    backbone (``base_model``, the decoder without the head) on the batch's inputs. A PEFT head
    (LoRA on lm_head, or lm_head in modules_to_save) gives the operands whose linear layer is the
    adapted head (trainops.hf.lora.head_operands: for LoRA, hidden (B, T, H + r) and weight
    (V, H + r) concatenated with the low-rank terms), never its base weight alone."""
    if hasattr(model, "get_base_model"):   # a PEFT model: the transformers model inside
        model = model.get_base_model()
    kwargs = {k: inputs[k] for k in _MODEL_INPUTS if inputs.get(k) is not None}
    hidden = model.base_model(**kwargs, use_cache=False).last_hidden_state
    return head_operands(model.get_output_embeddings(), hidden)


class DPOTrainer(trl.DPOTrainer):
    """trl.DPOTrainer with its loss computed by ``trainops.linear_preference_loss`` (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        refused = []
        if list(self.loss_types) not in (["sigmoid"], ["ipo"]):
            refused.append(f"loss_type={self.loss_types} (supported: ['sigmoid'], ['ipo'])")
        if self.f_divergence_type != "reverse_kl":
            refused.append(f"f_divergence_type={self.f_divergence_type!r}")
        if self.ld_alpha is not None:
            refused.append(f"ld_alpha={self.ld_alpha}")
        if self.use_weighting:
            refused.append("use_weighting=True")
        if self.aux_loss_enabled:
            refused.append("a router auxiliary loss")
        if refused:
            raise ValueError("trainops.trl_trainers.DPOTrainer does not support " + ", ".join(refused))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        kind = "dpo" if self.loss_types == ["sigmoid"] else "ipo"
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)[:, 1:]
        hidden, weight, bias = hidden_and_head(model, inputs)
        reference = {}
        if self.precompute_ref_logps:
            chosen, rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            if kind == "ipo":   # TRL precomputes sums; IPO's are per-token means
                count = (labels != -100).sum(-1).clamp_min(1).to(chosen.dtype)
                pairs = chosen.shape[0]
                chosen, rejected = chosen / count[:pairs], rejected / count[pairs:]
            reference = dict(ref_chosen_logps=chosen, ref_rejected_logps=rejected)
        else:
            with torch.no_grad():
                if self.ref_model is None:   # a PEFT policy: its adapters disabled
                    from trl.trainer.utils import use_adapter
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                        ref_hidden, ref_weight, ref_bias = hidden_and_head(self.model, inputs)
                else:
                    ref_hidden, ref_weight, ref_bias = hidden_and_head(self.ref_model, inputs)
            reference = dict(ref_hidden=ref_hidden[:, :-1], ref_weight=ref_weight, ref_bias=ref_bias)
        out = linear_preference_loss(hidden[:, :-1], weight, labels, bias=bias, kind=kind, beta=self.beta,
                                     **reference)
        self._log_preference_metrics(out)
        return (out.loss, _model_outputs(model, inputs)) if return_outputs else out.loss

    def _log_preference_metrics(self, out) -> None:
        mode = "train" if self.model.training else "eval"
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        chosen, rejected = gather(out.chosen_rewards), gather(out.rejected_rewards)
        metrics["rewards/chosen"].append(chosen.mean().item())
        metrics["rewards/rejected"].append(rejected.mean().item())
        metrics["rewards/accuracies"].append((chosen > rejected).float().mean().item())
        metrics["rewards/margins"].append((chosen - rejected).mean().item())
        metrics["logps/chosen"].append(gather(out.chosen_logps).mean().item())
        metrics["logps/rejected"].append(gather(out.rejected_logps).mean().item())
        metrics["logits/chosen"].append(gather(out.chosen_logits_mean).mean().item())
        metrics["logits/rejected"].append(gather(out.rejected_logits_mean).mean().item())


class GKDTrainer(_TRLGKDTrainer):
    """trl.experimental.gkd.GKDTrainer with its loss computed by ``trainops.linear_distillation_loss``."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        hidden, weight, bias = hidden_and_head(model, inputs)
        self.teacher_model.eval()
        with torch.no_grad():
            teacher_hidden, teacher_weight, teacher_bias = hidden_and_head(self.teacher_model, inputs)
        loss = linear_distillation_loss(hidden[:, :-1], weight, teacher_hidden[:, :-1], teacher_weight,
                                        inputs["labels"][:, 1:], student_bias=bias, teacher_bias=teacher_bias,
                                        beta=self.beta, num_items_in_batch=num_items_in_batch)
        return (loss, _model_outputs(model, inputs)) if return_outputs else loss


def _model_outputs(model, inputs: dict):
    """The model's own outputs (with its logits), for callers of compute_loss(return_outputs=True)
    (TRL's prediction_step with compute_metrics): an extra forward without gradient, as TRL's DPO
    trainer does since its LM head became fused."""
    kwargs = {k: inputs[k] for k in _MODEL_INPUTS if inputs.get(k) is not None}
    with torch.no_grad():
        return model(**kwargs, use_cache=False)


__all__ = ["DPOTrainer", "GKDTrainer", "hidden_and_head"]
