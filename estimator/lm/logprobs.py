"""Sequence log-probabilities of a causal LM's answers: each row's labelled tokens' log-probabilities summed, for
padded batches and for packed ones (a batch's rows in one sequence, estimator.data.lm.packed). DPO's scores
(estimator.train.objectives.preference) and its reference table (estimator.train.objectives.reference) read them;
a per-row score would too. torch only."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from estimator.data.lm import IGNORE


def answer_logps(logits: torch.Tensor, labels: torch.Tensor, rows: Any = None) -> torch.Tensor:
    """Each row's answer scored: its labelled tokens' log-probabilities summed, in float32; `rows`: a packed
    batch's row of each position and its row count (row_index)."""
    return answer_sums(token_logps(logits, labels) * (labels[:, 1:] != IGNORE), rows)


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's log-probability of the next label (rows x positions - 1, float32; any value where the label
    is IGNORE): DPO's answers and GRPO's completion tokens."""
    return -F.cross_entropy(logits[:, :-1, :].float().transpose(1, 2), labels[:, 1:].clamp(min=0), reduction="none")


def answer_sums(values: torch.Tensor, rows: Any) -> torch.Tensor:
    """Per row, the sum of `values` (rows x positions - 1, each position predicting the next token's label); a
    packed batch's (1 x positions - 1) summed by the row of the token predicted."""
    if rows is None:
        return values.sum(dim=1)
    index, count = rows
    return torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(0, index[1:], values[0])


def row_index(features: Any) -> Any:
    """A packed batch's (row of each position, rows) (estimator.data.lm.packed: a row starts where its position is
    0), with no read from the device; None for a batch not packed."""
    positions = features.get("position_ids") if isinstance(features, dict) else None
    if positions is None or features.get("cu_seq_lens_q") is None:
        return None
    return (positions[0] == 0).cumsum(0) - 1, features["cu_seq_lens_q"].shape[0] - 1
