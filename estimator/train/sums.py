"""The sums an epoch's numbers come from, by name.

An objective adds, batch by batch, a float64 vector of sums on the device: the loss summed (`loss`), what it is
averaged over (`loss_weight`: rows, sample weights or labelled tokens), the rows (`rows`), then each metric's sum.
The vector stays one tensor (one all_reduce over the ranks, one concatenation with validation's), and its layout,
a `Sums`, names each slot: the loop adds and reduces vectors without knowing the names; the objective reads the
reduced values back by name (`named`), and a checkpoint inside an epoch keeps them by name (`Position.sums`), so
that a resumed epoch adds to the right slots. A checkpoint of 0.3.0.dev0 kept them as a list in the same order
(`restore`). torch only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

LOSS, WEIGHT, ROWS = "loss", "loss_weight", "rows"  # every objective's first three slots, in this order
Saved = Union[Mapping[str, float], Sequence[float]]  # a checkpoint's sums: by name, or 0.3.0.dev0's list


class SumsMismatch(ValueError):
    """A checkpoint inside an epoch holds sums of another layout (other metrics): its epoch cannot be resumed with
    the numbers an uninterrupted one would report."""


@dataclass(frozen=True)
class Mean:
    """A history number: the sum in slot `total` over the sum in slot `weight` (NaN where that is 0)."""

    key: str
    total: str
    weight: str


@dataclass(frozen=True)
class Sums:
    """The names of a vector of sums, in order, and the history numbers (means) read from them."""

    slots: Tuple[str, ...]
    means: Tuple[Mean, ...] = ()

    def __post_init__(self) -> None:
        if len(set(self.slots)) != len(self.slots):
            raise ValueError(f"the sums' slots are named twice: {self.slots}")

    @classmethod
    def of_loss(cls, metrics: Sequence[str] = (), pairs: Sequence[str] = ()) -> "Sums":
        """loss, loss_weight, rows, then each of `metrics` averaged over the rows, then each of `pairs` averaged over
        a weight of its own (its slot, then its weight's: the rows of the batches that gave it)."""
        slots = [LOSS, WEIGHT, ROWS] + [metric_slot(m) for m in metrics]
        means = [Mean(LOSS, LOSS, WEIGHT)] + [Mean(m, metric_slot(m), ROWS) for m in metrics]
        for key in pairs:
            slots += [metric_slot(key), weight_slot(key)]
            means.append(Mean(key, metric_slot(key), weight_slot(key)))
        return cls(tuple(slots), tuple(means))

    @property
    def width(self) -> int:
        return len(self.slots)

    def index(self, slot: str) -> int:
        return self.slots.index(slot)

    def zeros(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.width, dtype=torch.float64, device=device)

    def named(self, values: Sequence[float]) -> Dict[str, float]:
        """A reduced vector (its first `width` values) by slot name."""
        return {slot: float(v) for slot, v in zip(self.slots, values[:self.width])}

    def vector(self, named: Mapping[str, float], device: torch.device) -> torch.Tensor:
        return torch.tensor([float(named[s]) for s in self.slots], dtype=torch.float64, device=device)

    def restore(self, saved: Saved) -> Dict[str, float]:
        """A checkpoint's sums by name: as saved, or 0.3.0.dev0's list read in this layout's order; another layout's
        sums are refused (they would add a metric's sum to another's slot)."""
        if isinstance(saved, Mapping):
            if set(saved) == set(self.slots):
                return {s: float(saved[s]) for s in self.slots}
            found = sorted(saved)
        elif len(saved) == self.width:
            return dict(zip(self.slots, (float(v) for v in saved)))
        else:
            found = [f"{len(saved)} values"]
        raise SumsMismatch(f"The checkpoint stands inside an epoch whose sums are {found}, and this fit's objective "
                           f"sums {list(self.slots)}: its loss and metrics differ from the run's. Resume with the "
                           "same loss and metrics, or under a new run_id.")

    def means_of(self, named: Mapping[str, float], prefix: str = "") -> Dict[str, float]:
        """The history numbers, each key with `prefix` (validation's 'val_')."""
        return {prefix + m.key: named[m.total] / named[m.weight] if named[m.weight] else float("nan")
                for m in self.means}


def metric_slot(key: str) -> str:
    """A metric's slot: named apart from the loss's and the rows' whatever the metric is called."""
    return f"metric:{key}"


def weight_slot(key: str) -> str:
    return f"metric:{key}:weight"


def split(layout: Sums, values: Sequence[float], with_val: bool) -> Tuple[Dict[str, float], Optional[Dict[str, float]]]:
    """A reduced epoch vector (training's sums, then validation's when there is validation) by name."""
    train = layout.named(values[:layout.width])
    return train, layout.named(values[layout.width:2 * layout.width]) if with_val else None
