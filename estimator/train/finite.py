"""terminate_on_nan on a rank: a non-finite loss or non-finite weights stop training before they are stepped on
or checkpointed. torch only."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from estimator.failures import FailureKind

# Where the loss is looked at every FiniteCheck.LOOK_EVERY steps instead of every step: reading a value back from a
# GPU makes the host wait for it, and the next batch's work could not be queued meanwhile (tests add "cpu").
DEFERRED_CHECK_DEVICES = ("cuda",)


class NonFiniteLoss(FloatingPointError):
    """A NaN or infinite loss (or weights) with terminate_on_nan=True. Another launch would meet it again."""

    failure_kind = FailureKind.NAN


NAN_ADVICE = ("Try a lower lr, gradient_clip_val, normalized features, or a loss that takes logits (e.g. "
              "BCEWithLogitsLoss rather than BCELoss); terminate_on_nan=False trains on regardless.")


def non_finite_losses(row: Dict[str, float]) -> Dict[str, float]:
    """The epoch row's loss and val_loss values that are NaN or infinite."""
    return {k: v for k, v in row.items() if k in ("loss", "val_loss") and not np.isfinite(v)}


class FiniteCheck:
    """terminate_on_nan: a non-finite training loss stops the rank before its gradients are stepped (CPU) or
    within LOOK_EVERY steps (GPUs, where each look makes the host wait), and always before a checkpoint: the
    weights it would save are checked too. Every rank sees the same reduced epoch row and the same averaged
    weights, so all ranks stop alike at an epoch's end."""

    LOOK_EVERY = 50

    def __init__(self, enabled: bool, rank: int, device: torch.device, columns: Sequence[Sequence[str]] = ((), ())):
        self.enabled, self.rank = enabled, rank
        self.columns = columns  # feature_cols and label_cols (and sample_weight_col): a failing batch's names
        self.deferred = device.type in DEFERRED_CHECK_DEVICES
        # deferred: (step, loss) since the last look. Keeping the detached losses launches nothing per step; the
        # bookkeeping on the device it replaced (isfinite, where, ...) cost 17% of a small MLP's steps on an H100.
        self.pending: List[Tuple[int, torch.Tensor]] = []

    def loss(self, loss: torch.Tensor, epoch: int, step: int, batch: Any = None) -> None:
        if not self.enabled:
            return
        if not self.deferred:
            value = loss.detach().float()
            if not bool(torch.isfinite(value).all()):
                self._fail(float(value), epoch, step, non_finite_columns(batch, self.columns))
            return
        self.pending.append((step, loss.detach()))
        if len(self.pending) >= self.LOOK_EVERY:
            self.flush(epoch)

    def flush(self, epoch: int) -> None:
        """Deferred devices: look at the losses of the steps since the last look (one wait for the device)."""
        if not (self.enabled and self.deferred and self.pending):
            return
        steps, losses = zip(*self.pending)
        self.pending = []
        values = torch.stack([v.float().reshape(()) for v in losses])
        bad = (~torch.isfinite(values)).nonzero()
        if len(bad):
            first = int(bad[0, 0])
            self._fail(float(values[first]), epoch, steps[first])

    def check_epoch(self, model: nn.Module, row: Dict[str, float], epoch: int) -> None:
        if not self.enabled:
            return
        self.check_weights(model, epoch, None)  # the more precise cause first
        bad = non_finite_losses(row)
        if bad:
            raise NonFiniteLoss(f"The {' and '.join(bad)} of epoch {epoch + 1} is not finite "
                                f"({', '.join(f'{k}={v}' for k, v in bad.items())}), over all ranks; stopping "
                                f"before these weights are checkpointed, since terminate_on_nan=True. {NAN_ADVICE}")

    def check_weights(self, model: nn.Module, epoch: int, step: Optional[int]) -> None:
        if not self.enabled:
            return
        self.flush(epoch)
        bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
        if bad:
            where = f"epoch {epoch + 1}" + (f", step {step}" if step is not None else "")
            raise NonFiniteLoss(f"The model's weights are not finite at {where} on rank {self.rank} (parameters "
                                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}): an optimizer step "
                                f"overflowed; stopping before they are checkpointed, since terminate_on_nan=True. "
                                f"{NAN_ADVICE}")

    def _fail(self, value: float, epoch: int, step: int, inputs: Optional[Dict[str, int]] = None) -> None:
        advice = NAN_ADVICE
        if inputs:  # the batch itself holds NaN or infinity: the data, not the lr
            shown = ", ".join(f"{name!r} ({rows} of its rows)" for name, rows in inputs.items())
            advice = (f"The batch of this step holds NaN or infinite values in {shown}: drop or fix those rows "
                      "first (in Spark, F.isnan(c) and c == float('inf') find them; for an array column, with "
                      "F.exists), or set terminate_on_nan=False to train on regardless.")
        raise NonFiniteLoss(f"The training loss is {value} at epoch {epoch + 1}, step {step + 1} on rank {self.rank}; "
                            f"stopping before this step's gradients are applied or checkpointed, since "
                            f"terminate_on_nan=True (the default). {advice}")


def non_finite_columns(batch: Any, columns: Sequence[Sequence[str]]) -> Dict[str, int]:
    """The columns of a batch (features, labels, weights: estimator.data.arrays.Tensors) whose floating values
    hold a NaN or an infinity, with how many of the batch's rows do; looked at only once its loss is not finite."""
    named = getattr(batch, "features", None), getattr(batch, "labels", None)
    if named[0] is None or named[1] is None:
        return {}
    pairs = [*zip(columns[0], named[0]), *zip(columns[1], named[1])]
    weights = getattr(batch, "weights", None)
    if len(columns) > 2 and columns[2] and weights is not None:
        pairs.append((columns[2], weights))
    found = {}
    for name, tensor in pairs:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dim() >= 1:
            rows = (~torch.isfinite(tensor.detach())).reshape(tensor.shape[0], -1).any(dim=1).sum()
            if int(rows):
                found[name] = int(rows)
    return found
