"""The interface every strategy has (estimator.train.strategies): how a rank's model is placed, wrapped, kept in
step with its peers and checkpointed. The defaults here are those of a model trained whole on every rank."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from estimator.train.checkpoint import model_entries, restore


@dataclass(frozen=True)
class ModelState:
    """What one checkpoint holds of the model and the optimizer, as a strategy writes it: `entries` go into the run's
    checkpoint file; `write` runs in the checkpoint writer's thread before that file is written (fsdp: every
    rank's shards, waited for); `folder`: the folder of shards the file names (None: the tensors are in the file)."""

    entries: Dict[str, Any]
    write: Callable[[], None] = lambda: None
    folder: Optional[str] = None


@dataclass(frozen=True)
class CheckpointAt:
    """Where a checkpoint is written from: the run's store and layout, the launch and attempt, the optimizer steps
    taken so far (a folder of shards is named by them), and the writer whose writes are one at a time."""

    store: Any
    run: Any
    launch_id: str
    attempt: int
    global_step: int
    writer: Any = field(compare=False)


class Strategy:
    """One per fit on each rank, built when the rank sets up (estimator.train.worker): `place` puts the model on
    the rank's device, `wrap` gives what the loop trains through; the rest is asked by the loop, the epochs and
    a train_fn's context. Class methods check the params on the driver, before any job."""

    shards_checkpoints: ClassVar[bool] = False  # its checkpoints name a folder of shards beside the file
    writes_as: ClassVar[Optional[str]] = None  # the strategy its checkpoint files name (None: its own name)
    lockstep: bool = False  # validation's forwards are collectives: every rank forwards as many batches

    def __init__(self, name: str, spec: Any, ctx: Any, objs: Any):
        self.name, self.spec, self.ctx, self.objs = name, spec, ctx, objs
        self.device = torch.device(ctx.device)

    # -- the driver ----------------------------------------------------------------------------
    @classmethod
    def check(cls, name: str, p: Mapping[str, Any]) -> None:
        """The params this strategy refuses, with why and the way out."""

    @classmethod
    def check_gpus(cls, name: str, p: Mapping[str, Any], gpus_per_task: float) -> None:
        """What the tasks' GPUs (spark.task.resource.gpu.amount) allow."""

    # -- the rank ------------------------------------------------------------------------------
    def place(self, model: nn.Module) -> nn.Module:
        """The model on the rank's device, with its weights (a weights_folder read)."""
        raise NotImplementedError

    def wrap(self, model: nn.Module, steps: Optional[nn.Module] = None) -> nn.Module:
        """What the loop (and a train_step, a train_fn) trains through: called like the model (or like `steps`,
        a LightningModule's training_step), with `.module` and `no_sync()`."""
        raise NotImplementedError

    def describe(self) -> str:
        """How the gradients are averaged (the fit's log line, WorkerResult.allreduce)."""
        raise NotImplementedError

    def no_sync(self, trained: nn.Module) -> Any:
        """No gradient averaging while accumulating (the step after it averages the sums)."""
        return trained.no_sync()

    def clip(self, trained: nn.Module, max_norm: float) -> None:
        """The global gradient norm clipped (every rank holds the same averaged gradients: each clips alike)."""
        torch.nn.utils.clip_grad_norm_(trained.parameters(), max_norm)

    def gradients(self, trained: nn.Module) -> List[torch.Tensor]:
        """This rank's gradients, as tensors it may scale in place."""
        return [p.grad for p in trained.parameters() if p.grad is not None]

    @contextlib.contextmanager
    def generation(self, trained: nn.Module) -> Iterator[nn.Module]:
        """The whole module to generate with inside training (an objective's `prepare`: GRPO's completions), as
        TRL's unwrap_model_for_generation gives it: what `trained` wraps (DDP's module, torch.compile's original),
        in eval mode and without gradients; its mode restored after. Each rank may generate as many tokens as its
        rows need (a sharded model's ranks are kept in step by transformers' generate itself: synced_gpus)."""
        module = getattr(trained, "module", trained)
        module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: its attributes (generate) are the
        was_training = module.training  # module's, and a fresh compile per generated length is not wanted
        module.eval()
        try:
            with torch.no_grad():
                yield module
        finally:
            module.train(was_training)

    def remember(self, batch: Any) -> None:
        """A training batch seen (a lockstep's stand-in for a rank out of validation batches)."""

    def validation(self, batches: Iterable[Any]) -> Iterator[Tuple[Any, bool]]:
        """(batch, whether its numbers count) for this rank's validation batches."""
        return ((batch, True) for batch in batches)

    def writes_checkpoints(self) -> bool:
        """Whether this rank writes checkpoints (whole files: rank 0)."""
        return self.ctx.rank == 0

    def model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, at: CheckpointAt) -> ModelState:
        """The model's and the optimizer's tensors in the file (an adapted model's trainable ones only), with the
        name of the strategy that wrote them."""
        return ModelState({**model_entries(model, optimizer), "strategy": self.writes_as or self.name})

    def keep_folders(self, store: Any, run: Any, named: Iterable[Optional[str]]) -> None:
        """After a checkpoint is written (rank 0): what its strategy left that no kept checkpoint names, removed."""

    def restore(self, store: Any, run: Any, path: str, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The checkpoint at `path` loaded into the model and the optimizer, whatever wrote it (its file says)."""
        return restore(store, run, path, model, optimizer, self.device)

    def teardown(self, failed: bool) -> None:
        """At the rank's end (`failed`: it raised)."""

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Around training: teardown, told whether it failed."""
        try:
            yield
        except BaseException:
            self.teardown(failed=True)
            raise
        self.teardown(failed=False)


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of parameters and optimizer state this rank holds (a DTensor's own shard only)."""
    def size(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    params = sum(size(p) for p in model.parameters())
    state = sum(size(v) for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return params + state
