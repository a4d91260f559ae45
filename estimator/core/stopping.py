"""Which epoch is best, which epochs' checkpoints to keep, and when to stop: read from the history alone.

Every rank holds the same history (each row is reduced over all ranks exactly), so every rank reaches the same
decision without another collective; a resumed run, or a refit of its run_id, decides from its checkpoint's
history what an uninterrupted run would have. Pure Python: the driver uses it too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

History = Sequence[Dict[str, float]]


@dataclass(frozen=True)
class Monitor:
    """`key` of the history watched, `mode` "min" or "max"; early stopping after `patience` epochs without an
    improvement larger than `min_delta` (None: never)."""

    key: str
    mode: str = "min"
    min_delta: float = 0.0
    patience: Optional[int] = None

    def value(self, row: Dict[str, float]) -> Optional[float]:
        value = row.get(self.key)
        return None if value is None or math.isnan(value) else float(value)

    def better(self, value: Optional[float], than: Optional[float], delta: float = 0.0) -> bool:
        if value is None:
            return False
        if than is None:
            return True
        return value < than - delta if self.mode == "min" else value > than + delta

    def ranked(self, history: History) -> List[int]:
        """Epochs (1-based) from best to worst; ties keep the earlier epoch first; epochs without a value last."""
        scored = [(i + 1, self.value(row)) for i, row in enumerate(history)]
        valued = [(epoch, v) for epoch, v in scored if v is not None]
        valued.sort(key=lambda ev: (ev[1] if self.mode == "min" else -ev[1], ev[0]))
        return [epoch for epoch, _ in valued]

    def best_epoch(self, history: History) -> Optional[int]:
        ranked = self.ranked(history)
        return ranked[0] if ranked else None

    def top_k(self, history: History, k: int) -> List[int]:
        return self.ranked(history)[:max(0, k)]

    def stop_reason(self, history: History) -> Optional[str]:
        """Why training stops after the history's last epoch (Keras' EarlyStopping rule: the reference value
        moves only on an improvement larger than min_delta); None while it goes on."""
        if not self.patience or not history:
            return None
        reference, waited, reference_epoch = None, 0, 0
        for epoch, row in enumerate(history, start=1):
            value = self.value(row)
            if self.better(value, reference, self.min_delta if reference is not None else 0.0):
                reference, waited, reference_epoch = value, 0, epoch
            else:
                waited += 1
        if waited < self.patience:
            return None
        since = f"since epoch {reference_epoch} ({reference:.6g})" if reference is not None else "at all"
        return (f"{self.key} did not improve by more than min_delta={self.min_delta:g} ({self.mode}) for "
                f"{waited} epochs {since}; early_stopping_patience={self.patience}")


def default_monitor(has_validation: bool, key: Optional[str] = None) -> str:
    """`key` (an objective's own, GRPO's reward; else the loss), its val_ one with validation."""
    key = key or "loss"
    return f"val_{key}" if has_validation else key


def default_mode(key: str) -> str:
    """'max' for accuracies and rewards (GRPO's reward, each reward function's mean), else 'min'."""
    bare = key[len("val_"):] if key.startswith("val_") else key
    return "max" if "accuracy" in key or bare == "reward" or (bare.startswith("rewards/") and
                                                              bare.endswith("/mean")) else "min"
