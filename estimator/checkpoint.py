"""A run's checkpoint in the store: what rank 0 writes at epoch ends (and every `checkpoint_steps`), what a
retry or a refit reads back. Tensors and plain values only: it loads with weights_only=True."""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

CHECKPOINT_FORMAT = 2  # 2: "position" (a checkpoint inside an epoch)


@dataclass
class Position:
    """Where a run stands: `epochs` finished, then `step` batches of the next one, whose loss and metric sums
    so far (already summed over the ranks) are `sums`."""

    epochs: int = 0
    step: int = 0
    sums: List[float] = field(default_factory=list)
    global_step: int = 0
    layout: List[int] = field(default_factory=list)  # [batch_size, world_size] that `step` counts batches of


def save_checkpoint(store: Any, path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    history: List[Dict[str, float]], position: Position, scheduler: Any = None,
                    copies: Sequence[str] = (), scaler: Any = None, extra: Optional[Dict[str, Any]] = None) -> None:
    """Everything a resumed run needs, written atomically (a reader never sees half a checkpoint), at `path`
    and at each of `copies` (the best epochs' checkpoints). `scaler`: 16-mixed's GradScaler, whose loss scale
    and growth count a resumed run continues from (a fresh scale would overflow again for its first steps).
    `extra`: train_fn's own stateful objects (a second optimizer...), by name: their state_dict()s."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": position.epochs,
                "global_step": position.global_step, "history": history,
                "position": {"step": position.step, "sums": list(position.sums), "layout": list(position.layout)}
                if position.step else None,
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                "grad_scaler": scaler.state_dict() if scaler is not None else None,
                "extra": {name: obj.state_dict() for name, obj in (extra or {}).items()},
                "format": CHECKPOINT_FORMAT}, buffer)
    for target in (path, *copies):
        store.write_bytes_atomic(target, buffer.getvalue())


def load_checkpoint(store: Any, path: str, device: Any = "cpu") -> Dict[str, Any]:
    """A checkpoint's tensors and plain values only (weights_only=True: no code is unpickled)."""
    return torch.load(io.BytesIO(store.read_bytes(path)), map_location=device, weights_only=True)


def position_of(state: Optional[Dict[str, Any]]) -> Position:
    if state is None:
        return Position()
    inside = state.get("position") or {}
    return Position(int(state["epoch"]), int(inside.get("step", 0)), [float(s) for s in inside.get("sums", [])],
                    int(state.get("global_step", 0)), [int(v) for v in inside.get("layout", [])])


def describe(position: Position) -> str:
    return f"epoch {position.epochs}" + (f" and step {position.step} of epoch {position.epochs + 1}"
                                         if position.step else "")
