"""A run's checkpoint in the store: what rank 0 writes at epoch ends (and every `checkpoint_steps`), what a
retry or a refit reads back. Tensors and plain values only: it loads with weights_only=True. The model's and the
optimizer's part is the strategy's (estimator.train.strategies: the tensors, or the name of a folder of shards);
the file says which it holds, and loading follows the file."""
from __future__ import annotations

import functools
import io
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from estimator.core.adapters import is_adapted, load_trainable, trainable_state
from estimator.core.numbers import plain
from estimator.failures import FailureKind
from estimator.train.sharded_checkpoint import SHARDED, folder, load_shards, mapped_shards

CHECKPOINT_FORMAT = 2  # 2: "position" (a checkpoint inside an epoch)
TRAINABLE = "trainable"  # "contents" of a checkpoint holding only the trainable parameters (adapters)


@dataclass
class Position:
    """Where a run stands: `epochs` finished, then `step` batches of the next one, whose loss and metric sums
    so far (already summed over the ranks) are `sums`, by name (estimator.train.sums; a checkpoint of 0.3.0.dev0
    holds them as a list, in its objective's order)."""

    epochs: int = 0
    step: int = 0
    sums: Union[Dict[str, float], List[float]] = field(default_factory=dict)
    global_step: int = 0
    layout: List[int] = field(default_factory=list)  # what `step` counts batches of: epochs.Run.layout


def model_entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The model's and the optimizer's tensors as a file holds them: a model with adapters, its trainable
    parameters only (the frozen base comes from the model's factory)."""
    if is_adapted(model):
        return {"model": trainable_state(model), "optimizer": optimizer.state_dict(), "contents": TRAINABLE}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def checkpoint_file(entries: Mapping[str, Any], history: List[Dict[str, float]], position: Position,
                    scheduler: Any = None, scaler: Any = None, extra: Optional[Dict[str, Any]] = None,
                    copy: bool = True) -> Dict[str, Any]:
    """Everything a resumed run needs: `entries`, the model's and the optimizer's part (the strategy's: the tensors,
    or the folder of shards holding them), and the run's place. With `copy`, its tensors copied to the CPU (training
    may change the live tensors in place while a background thread writes this; a write now needs no copy).
    `scaler`: 16-mixed's GradScaler, whose loss scale and growth count a resumed run continues from (a fresh scale
    would overflow again for its first steps). `extra`: train_fn's own stateful objects (a second optimizer...), by
    name: their state_dict()s."""
    sums = dict(position.sums) if isinstance(position.sums, Mapping) else list(position.sums)
    state = {**entries, "epoch": position.epochs,
             "global_step": position.global_step, "history": [dict(row) for row in history],
             "position": {"step": position.step, "sums": sums, "layout": list(position.layout)}
             if position.step else None,
             "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
             "grad_scaler": scaler.state_dict() if scaler is not None else None,
             "extra": {name: obj.state_dict() for name, obj in (extra or {}).items()},
             "format": CHECKPOINT_FORMAT}
    return _portable(state, copy)


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, history: List[Dict[str, float]],
                     position: Position, scheduler: Any = None, scaler: Any = None,
                     extra: Optional[Dict[str, Any]] = None, copy: bool = True,
                     sharded: Optional[str] = None) -> Dict[str, Any]:
    """The file of a model trained whole (its tensors in it), or with `sharded`, of one whose tensors are in that
    folder of shards (estimator.train.sharded_checkpoint)."""
    entries = {SHARDED: sharded} if sharded is not None else model_entries(model, optimizer)
    if sharded is not None and is_adapted(model):
        entries["contents"] = TRAINABLE
    return checkpoint_file(entries, history, position, scheduler, scaler, extra, copy)


def write_checkpoint(store: Any, state: Dict[str, Any], targets: Sequence[str]) -> None:
    """`state` written atomically (a reader never sees half a checkpoint) at each of `targets`, serialized into the
    store's file as it is written: never whole in memory (a 1B model's full fine-tune: 15 GB)."""
    for target in targets:
        store.write_atomic(target, functools.partial(torch.save, state))


def save_checkpoint(store: Any, path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    history: List[Dict[str, float]], position: Position, scheduler: Any = None,
                    copies: Sequence[str] = (), scaler: Any = None, extra: Optional[Dict[str, Any]] = None) -> None:
    """The checkpoint written now, at `path` and at each of `copies` (the best epochs' checkpoints)."""
    write_checkpoint(store, checkpoint_state(model, optimizer, history, position, scheduler, scaler, extra,
                                             copy=False), [path, *copies])


def _portable(value: Any, copy: bool) -> Any:
    """`value` with numpy numbers as Python's (a scheduler's lambda or a user's hyperparameter may put them in the
    optimizer's groups; torch.load(weights_only=True) refuses them) and, with `copy`, tensors copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if copy else value
    if isinstance(value, dict):
        return type(value)((k, _portable(v, copy)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v, copy) for v in value)
    return plain(value)


class CheckpointWriteFailed(OSError):
    """Rank 0 could not write a checkpoint to the store. A later launch may succeed (the store may come back);
    it resumes from the last checkpoint that was written."""

    failure_kind = FailureKind.WRITE


class CheckpointWriter:
    """Rank 0's checkpoint writes, one at a time. In the background (the default): `submit` returns once the
    state is copied to the CPU, and a thread serializes and writes it while training goes on; the next `submit`
    waits only while the last write is still going (that wait is `stalled`). A failed write fails the run at the
    next submit or at `wait` (CheckpointWriteFailed): never a silent gap. In the foreground every write waits."""

    def __init__(self, background: bool = True):
        self.background, self.stalled, self.written = background, 0.0, 0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._what = ""

    def submit(self, what: str, write: Callable[[], None]) -> None:
        """`write` (which must only read what it was given) runs after the previous one has ended."""
        self.wait()
        self._what = what
        if not self.background:
            started = time.perf_counter()
            self._run(write)
            self.stalled += time.perf_counter() - started
            self._raise()
            return
        self._thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the write in flight has ended; raises CheckpointWriteFailed if it failed."""
        if self._thread is not None:
            started = time.perf_counter()
            self._thread.join()
            self.stalled += time.perf_counter() - started
            self._thread = None
        self._raise()

    def close(self) -> None:
        """The write in flight ended (a failing run leaves its last checkpoint whole for the retry); no error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
            self.written += 1
        except BaseException as exc:  # noqa: BLE001 - reported to the training thread
            self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointWriteFailed(f"could not write the checkpoint of {self._what} to the store: "
                                        f"{type(error).__name__}: {error}") from error


def restore(store: Any, run: Any, path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
            device: Any = "cpu", lazy: bool = False) -> Dict[str, Any]:
    """The checkpoint at `path` (a file of `run`, the run's RunLayout) loaded into `model` and `optimizer` (None:
    the model only), whether it holds the tensors (DDP) or names a folder of shards (FSDP, loaded resharded into
    a sharded or a plain module); returns the rest of it (history, position, ...). `lazy`: load_checkpoint's."""
    state = load_checkpoint(store, path, device, lazy)
    if state.get(SHARDED):
        load_shards(store, folder(run, state[SHARDED]), model, optimizer)
    elif state.get("contents") == TRAINABLE:
        load_trainable(model, state["model"], f"the checkpoint {path}")
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    else:
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    return state


def shards_of(state: Mapping[str, Any]) -> Optional[str]:
    """The folder of shards a checkpoint names (its model and optimizer are there), or None (they are in it)."""
    return state.get(SHARDED) or None


def load_checkpoint(store: Any, path: str, device: Any = "cpu", lazy: bool = False) -> Dict[str, Any]:
    """A checkpoint's tensors and plain values only (weights_only=True: no code is unpickled). numpy's scalars are
    allowed too (data, not code): a run checkpointed by 0.2.0 with a numpy learning rate resumes. `lazy`: its
    tensors mapped from the file, not read (a local store's file, else a local copy of it streamed to disk):
    what reads only the history, or the model's tensors and not the optimizer's, holds no more than it reads
    (a full fine-tune's file is the weights and twice as much again of AdamW's state)."""
    with torch.serialization.safe_globals(_numpy_scalars()):
        if not lazy:
            return torch.load(io.BytesIO(store.read_bytes(path)), map_location=device, weights_only=True)
        if store.is_local:
            return torch.load(path, map_location=device, weights_only=True, mmap=True)
        with tempfile.NamedTemporaryFile(suffix=".pt") as local:  # mapped, the file may go: its pages stay
            store.fs.get_file(path, local.name)
            return torch.load(local.name, map_location=device, weights_only=True, mmap=True)


def _numpy_scalars() -> List[Any]:
    """What pickle needs to rebuild a numpy scalar: numpy's `scalar` function, `dtype` and the dtypes' classes."""
    import numpy as np

    if int(np.__version__.split(".")[0]) >= 2:
        from numpy._core.multiarray import scalar
    else:  # numpy 1.26 (the Spark 3.5 stack): its numpy._core is only a shim
        from numpy.core.multiarray import scalar
    kinds = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_]
    return [scalar, np.dtype, *{type(np.dtype(kind)) for kind in kinds}]


def position_of(state: Optional[Dict[str, Any]]) -> Position:
    if state is None:
        return Position()
    inside = state.get("position") or {}
    saved = inside.get("sums", {})
    sums = ({str(k): float(v) for k, v in saved.items()} if isinstance(saved, Mapping)
            else [float(s) for s in saved])  # 0.3.0.dev0: a list in the objective's order
    return Position(int(state["epoch"]), int(inside.get("step", 0)), sums,
                    int(state.get("global_step", 0)), [int(v) for v in inside.get("layout", [])])


def describe(position: Position) -> str:
    return f"epoch {position.epochs}" + (f" and step {position.step} of epoch {position.epochs + 1}"
                                         if position.step else "")


@dataclass(frozen=True)
class RunState:
    """A fitted model's trained state where the run left it: the checkpoint at `path` of a run in
    `store` (the tensors, or the folder of shards it names). A ModelHandle (estimator.core.handle) holds one for a
    model whose state is the whole model (a full fine-tune) or sharded (fsdp): where the model is built (an
    executor, getModel()), the base comes from the factory and this state is read into it there, mapped from the
    file (load_checkpoint's `lazy`): the optimizer's part is never read. `run`: the run's RunLayout. `written`:
    what tells two fits apart that wrote the same path (a refit of a run_id), for the executors' cache."""

    store: Any
    run: Any
    path: str
    written: str

    @property
    def key(self) -> str:
        return f"{self.store.url(self.path)}@{self.written}"

    def load_into(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        self._present()
        restore(self.store, self.run, self.path, model, optimizer, lazy=True)

    def mapped(self, optimizer: bool = True) -> Optional[Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]]:
        """(the model's state_dict, the optimizer's, or None without `optimizer`) of a whole model's checkpoint, a
        full fine-tune's, their tensors mapped from files, not read: the checkpoint itself (ddp), or fsdp's shards
        read into files of a temporary folder (estimator.train.sharded_checkpoint.mapped_shards). What a save
        writes without building the model. None for a checkpoint of adapters."""
        self._present()
        state = load_checkpoint(self.store, self.path, lazy=True)
        if state.get("contents") == TRAINABLE:
            return None
        if state.get(SHARDED):
            return mapped_shards(self.store, folder(self.run, state[SHARDED]), optimizer)
        return state["model"], state["optimizer"] if optimizer else None

    def _present(self) -> None:
        if not self.store.exists(self.path):
            raise RunStateGone(
                f"The fitted model's weights are read from its run's checkpoint, {self.store.url(self.path)}, and "
                "it is gone (the store's run budget, save_top_k of a refit or a hand removed it). Save a model you "
                "keep with model.save(path) (it holds its weights), or fit it again.")


class RunStateGone(FileNotFoundError):
    """A fitted model's state was read from its run's checkpoint, which is gone."""
