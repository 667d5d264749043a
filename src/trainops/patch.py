"""``trainops.patch(model)``: swap the torch.nn modules trainops covers for trainops's, in place.

    model = torch.nn.Transformer(...)            # or any nn.Module
    report = trainops.patch(model)
    print(report)                                # what was swapped, and what was left and why

Swapped (exact torch classes only; subclasses are left alone, they may override forward):
    torch.nn.Softmax -> trainops.nn.Softmax            torch.nn.LogSoftmax -> trainops.nn.LogSoftmax
    torch.nn.Embedding -> trainops.nn.Embedding        torch.nn.CrossEntropyLoss -> trainops.nn.CrossEntropyLoss

The new module keeps the old one's arguments, and an Embedding keeps the very same weight
Parameter object, so optimizers built before the patch still update it. An Embedding with
``max_norm`` or ``sparse=True`` is left as it is (trainops does not support them) and reported.
Softmax computed inside other modules' forward (torch.nn.MultiheadAttention calls
``scaled_dot_product_attention``) is not a module and is not touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import nn as trainops_nn


@dataclass
class PatchReport:
    swapped: list[tuple[str, str, str]] = field(default_factory=list)   # (qualified name, from, to)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)   # (qualified name, class, reason)

    def __str__(self) -> str:
        lines = [f"trainops.patch: {len(self.swapped)} module(s) swapped, {len(self.skipped)} left as they are"]
        lines += [f"  {name or '<root>'}: {old} -> {new}" for name, old, new in self.swapped]
        lines += [f"  {name or '<root>'}: {cls} kept ({why})" for name, cls, why in self.skipped]
        return "\n".join(lines)


def _softmax(m):
    return trainops_nn.Softmax(m.dim)


def _log_softmax(m):
    return trainops_nn.LogSoftmax(m.dim)


def _embedding(m):
    if m.max_norm is not None or m.sparse:
        return "max_norm / sparse are not supported by trainops.nn.Embedding"
    new = trainops_nn.Embedding(m.num_embeddings, m.embedding_dim, m.padding_idx, None, m.norm_type,
                                m.scale_grad_by_freq, False, device="meta")
    new.weight = m.weight
    new.train(m.training)
    return new


def _cross_entropy(m):
    new = trainops_nn.CrossEntropyLoss(weight=m.weight, ignore_index=m.ignore_index, reduction=m.reduction,
                                       label_smoothing=m.label_smoothing)
    new.train(m.training)
    return new


_SWAPS = {torch.nn.Softmax: _softmax, torch.nn.LogSoftmax: _log_softmax, torch.nn.Embedding: _embedding,
          torch.nn.CrossEntropyLoss: _cross_entropy}


def patch(model: torch.nn.Module) -> PatchReport:
    """Swap, in place, every torch.nn.Softmax / LogSoftmax / Embedding / CrossEntropyLoss inside
    ``model`` for trainops's module; returns the report. ``model`` itself is returned unchanged
    when it is one of those classes (a module cannot replace itself): patch its parent instead."""
    report = PatchReport()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            make = _SWAPS.get(type(child))
            if make is None:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            new = make(child)
            if isinstance(new, str):
                report.skipped.append((name, type(child).__name__, new))
                continue
            setattr(parent, child_name, new)
            report.swapped.append((name, f"torch.nn.{type(child).__name__}", f"trainops.nn.{type(new).__name__}"))
    if type(model) in _SWAPS:
        report.skipped.append(("", type(model).__name__, "the root module cannot replace itself; patch its parent"))
    return report


__all__ = ["PatchReport", "patch"]
