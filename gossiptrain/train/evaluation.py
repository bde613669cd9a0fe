"""Classification metrics computed in torch, the same way on every peer.

Curves from different peers, the simulator and the experiments are only
comparable if every one of them computes its numbers identically. Macro
precision, recall and F1 follow scikit-learn's definitions (the mean over the
classes that occur in the targets or the predictions, with ``zero_division=0``)
so that the tests can hold them against sklearn, without sklearn being needed
at run time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from gossiptrain.errors import WorkloadError

__all__ = ["EvalResult", "classification_eval", "evaluate_classifier"]


@dataclass(frozen=True)
class EvalResult:
    """One evaluation of a model on a held-out split."""

    loss: float  # mean cross-entropy (nats)
    accuracy: float  # fraction of samples whose argmax is the target
    precision: float  # macro average over classes
    recall: float  # macro average over classes
    f1: float  # macro average of the per-class F1 (not F1 of the averages)
    samples: int  # how many samples the numbers are over

    def to_dict(self) -> dict[str, float]:
        """Plain numbers for logs, CSV rows and msgpack."""
        return asdict(self)

    def extras(self) -> dict[str, float]:
        """What a workload's subclass adds (charlm: ``bits_per_char``), for metrics records and simulator rows."""
        base = {f.name for f in fields(EvalResult)}
        return {k: v for k, v in asdict(self).items() if k not in base}


def classification_eval(logits: Tensor, targets: Tensor, num_classes: int) -> EvalResult:
    """Score logits (N, C) against integer targets (N,) with C == num_classes."""
    if logits.dim() != 2 or logits.shape[1] != num_classes:
        raise WorkloadError(
            f"classification_eval: logits must have shape (N, {num_classes}), "
            f"got {tuple(logits.shape)}"
        )
    n = logits.shape[0]
    if targets.shape != (n,):
        raise WorkloadError(
            f"classification_eval: targets must have shape ({n},), got {tuple(targets.shape)}"
        )
    if n == 0:
        raise WorkloadError("classification_eval: no samples to evaluate")
    targets = targets.detach().long()
    if int(targets.min()) < 0 or int(targets.max()) >= num_classes:
        raise WorkloadError(
            f"classification_eval: targets must lie in [0, {num_classes}), "
            f"got [{int(targets.min())}, {int(targets.max())}]"
        )
    # Double precision so that the metrics do not depend on the model's dtype.
    logits = logits.detach().double()  # (N, C)
    loss = F.cross_entropy(logits, targets).item()
    preds = logits.argmax(dim=1)  # (N,) first maximum on ties, like numpy
    hits = preds == targets  # (N,)

    tp = torch.bincount(targets[hits], minlength=num_classes).double()  # (C,)
    predicted = torch.bincount(preds, minlength=num_classes).double()  # (C,)
    actual = torch.bincount(targets, minlength=num_classes).double()  # (C,)
    zero = torch.zeros_like(tp)
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), zero)  # (C,)
    recall = torch.where(actual > 0, tp / actual.clamp(min=1), zero)  # (C,)
    # 2tp / (2tp + fp + fn), which is 2PR / (P + R) without the 0/0 case.
    f1 = torch.where(predicted + actual > 0, 2 * tp / (predicted + actual).clamp(min=1), zero)
    # sklearn averages over the labels seen in targets or predictions only.
    present = (predicted + actual) > 0  # (C,)
    return EvalResult(
        loss=loss,
        accuracy=hits.double().mean().item(),
        precision=precision[present].mean().item(),
        recall=recall[present].mean().item(),
        f1=f1[present].mean().item(),
        samples=n,
    )


def evaluate_classifier(
    model: torch.nn.Module, inputs: Tensor, targets: Tensor, num_classes: int
) -> EvalResult:
    """Evaluate a classifier in eval mode without autograd, then restore its mode.

    The shared body of every classification workload's ``evaluate``: dropout
    and batch-norm must not act during evaluation, and a training loop that
    evaluates in between steps must get its model back as it was.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(inputs)  # (N, C)
    finally:
        model.train(was_training)
    return classification_eval(logits, targets, num_classes)
