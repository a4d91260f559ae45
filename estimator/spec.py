"""Plain frozen data sent from the driver to every rank. No pyspark here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from store import Store

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """One Parquet row group: the unit a rank reads."""

    path: str
    row_group: int
    num_rows: int


def total_rows(pieces: Tuple[Piece, ...]) -> int:
    return sum(p.num_rows for p in pieces)


@dataclass(frozen=True)
class DataSpec:
    store: Store
    train: Tuple[Piece, ...]
    val: Tuple[Piece, ...]
    feature_cols: Tuple[str, ...]
    label_cols: Tuple[str, ...]
    sample_weight_col: Optional[str] = None
    input_shapes: Optional[Tuple[Shape, ...]] = None
    label_shapes: Optional[Tuple[Shape, ...]] = None

    @property
    def train_rows(self) -> int:
        return total_rows(self.train)

    @property
    def val_rows(self) -> int:
        return total_rows(self.val)

    @property
    def columns(self) -> Tuple[str, ...]:
        extra = (self.sample_weight_col,) if self.sample_weight_col else ()
        return self.feature_cols + self.label_cols + extra


@dataclass(frozen=True)
class TrainSpec:
    """Everything one rank needs. `payload` is the cloudpickled user objects (see `UserObjects`)."""

    data: DataSpec
    payload: bytes
    run_root: str
    batch_size: int
    val_batch_size: int
    epochs: int
    train_steps_per_epoch: Optional[int] = None
    validation_steps_per_epoch: Optional[int] = None
    shuffle: bool = True
    seed: int = 0
    use_gpu: Optional[bool] = None
    verbose: int = 1


@dataclass
class UserObjects:
    """The user's model, optimizer recipe, losses and metrics, pickled together once on the driver."""

    model: Any
    optimizer_cls: type
    optimizer_groups: List[List[int]]  # per param group: indices into list(model.parameters())
    optimizer_defaults: Dict[str, Any]
    optimizer_state: Dict[str, Any]
    losses: List[Any]
    loss_weights: List[float]
    metrics: List[Any] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerResult:
    rank: int
    history: Tuple[Dict[str, float], ...]
    device: str
    train_rows: int
    seconds: float
