"""Plain frozen data sent from the driver to every rank. No pyspark here."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from estimator.core.stopping import Monitor
from store import RunLayout, Store

Shape = Tuple[int, ...]


def compile_options(setting: Any) -> Optional[Dict[str, Any]]:
    """torch.compile's keyword arguments for the `compile` param (True: none), or None when it is False."""
    return None if setting is False else dict(setting) if isinstance(setting, dict) else {}


@dataclass(frozen=True)
class Piece:
    """One Parquet row group: the unit a rank reads."""

    path: str
    row_group: int
    num_rows: int
    nbytes: int = 0  # uncompressed size of the row group (footer), for the memory estimate


def total_rows(pieces: Tuple[Piece, ...]) -> int:
    return sum(p.num_rows for p in pieces)


@dataclass(frozen=True)
class LMSpec:
    """What the rows of a causal LM's fit are: their format (estimator.data.rows: a text, a prompt with its response,
    a chat, preference pairs; each says how it is tokenized and labelled), and what applies to every format."""

    rows: Any  # an estimator.data.rows.RowFormat
    every_token: bool = False  # completion_only_loss=False: the prompt (the whole conversation) in the loss too
    packed: bool = False  # packing=True: each batch's rows packed into sequences (estimator.data.lm.packed)

    @property
    def column(self) -> str:
        """The prompt's (or the text's, or the chat's) column: its tokens are the batch's input_ids."""
        return self.rows.column

    @property
    def labels_key(self) -> str:
        """Where the batch holds the labels (the format's: the response's place, or `<column>.labels`)."""
        return self.rows.labels_key


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
    materialize_seconds: float = 0.0  # driver-side, for the fit's stage report
    local: Optional[Store] = None  # direct mode: train and val are this rank's own rows, spilled to this store
    largest_shard: int = 0  # direct mode: the most training rows a rank holds (each rank draws that many)
    text_cols: Tuple[str, ...] = ()  # string feature columns, tokenized per batch (estimator.data.text)
    max_length: Optional[int] = None  # tokens kept per text (None: the tokenizer's model maximum)
    lm: Optional[LMSpec] = None  # a causal LM's fine-tuning rows (estimator.data.lm): tokenized with their labels

    @property
    def source(self) -> Store:
        """Where the train and val pieces lie: the store, or this rank's local spill."""
        return self.local if self.local is not None else self.store

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
class ReaderSpec:
    """How ranks read shards: 'arrow' (in memory or streaming, see estimator.data.shards) or 'petastorm'."""

    kind: str = "arrow"
    train_workers: Optional[int] = None  # decode workers (arrow) / petastorm workers
    val_workers: Optional[int] = None
    pool_type: str = "auto"  # estimator.data.feed.decoding
    inmemory_cache_all: Optional[bool] = None  # None: in memory when the shards fit the memory budget
    mp_start_method: Optional[str] = None
    shuffle_buffer_size: Optional[int] = None  # rows; None: estimator.data.shards.default_buffer_rows
    memory_budget_mb: Optional[float] = None  # per rank, from spark.executor.pyspark.memory when set

    @classmethod
    def from_params(cls, p: Dict[str, Any], memory_budget_mb: Optional[float]) -> "ReaderSpec":
        """From the estimator's params, by name (READER_PARAMS: the fields whose param has another name)."""
        named = {f.name: p[READER_PARAMS.get(f.name, f.name)] for f in fields(cls)
                 if READER_PARAMS.get(f.name, f.name) in p}
        return cls(**{**named, "memory_budget_mb": memory_budget_mb})


READER_PARAMS = {"kind": "reader", "train_workers": "train_reader_num_workers",
                 "val_workers": "val_reader_num_workers", "pool_type": "reader_pool_type"}


@dataclass(frozen=True)
class TrainSpec:
    """Everything one rank needs. `payload` is the cloudpickled user objects (see `UserObjects`)."""

    data: DataSpec
    payload: bytes
    run: RunLayout  # where this run's checkpoint and logs go
    batch_size: int
    val_batch_size: int
    epochs: int
    train_steps_per_epoch: Optional[int] = None
    validation_steps_per_epoch: Optional[int] = None
    shuffle: bool = True
    drop_last: bool = False  # training batches full only (estimator.data.plan)
    seed: int = 0
    use_gpu: Optional[bool] = None
    verbose: int = 1
    reader: ReaderSpec = ReaderSpec()
    backward_passes_per_step: int = 1
    compression: str = "none"
    shared_memory_allreduce: bool = True  # CPU ranks on one host average gradients in shared memory, not gloo
    terminate_on_nan: bool = True
    rendezvous_timeout: float = 120.0  # seconds for all ranks to meet (at rank 0's store, then its check-in)
    collective_timeout: float = 1800.0  # seconds a collective may wait for a peer (torch process group)
    launch_id: str = "launch"  # one per launch: names its folder in the store (spec, rendezvous, failures)
    attempt: int = 0  # 0 for the first launch of a fit, then 1, 2, ... for retries
    resume_from: Optional[str] = None  # a checkpoint of this run to continue from (retry or refit)
    checkpoint_steps: Optional[int] = None  # rank 0 also checkpoints every N optimizer steps (with the position)
    checkpoint_async: bool = True  # rank 0 writes checkpoints from a background thread (estimator.train.checkpoint)
    monitor: Monitor = Monitor("loss")  # the best epoch, the checkpoints kept, early stopping
    save_top_k: int = 1  # checkpoints of the best epochs kept besides the last one
    tensorboard: bool = False  # rank 0 writes event files into the run's logs folder
    log_every_n_steps: int = 50  # the training loss goes to TensorBoard every N optimizer steps
    precision: str = "32"  # "32", "bf16-mixed" (autocast) or "16-mixed" (autocast and a GradScaler; CUDA only)
    gradient_clip_val: Optional[float] = None  # the global gradient norm is clipped to this before each step
    lr_schedule: Optional[str] = None  # the built-in schedule stepped per optimizer step (estimator.train.schedules)
    warmup_steps: Optional[int] = None
    warmup_ratio: Optional[float] = None
    compile: Any = False  # torch.compile the module before DDP wraps it: False, True or torch.compile's kwargs
    strategy: str = "ddp"  # "ddp", "fsdp" or "auto": the model sharded over the ranks (estimator.train.sharding)
    gradient_checkpointing: Any = False  # True, 'selective': activations recomputed in backward (estimator.train.memory)
    reshard_after_forward: bool = True  # strategy='fsdp': FSDP2's option for every unit but the whole model
    shard_alone: bool = False  # not a param: strategy='fsdp' shards on one rank too (the GPU suite's FSDP2 on one GPU)
    step_metrics: Tuple[str, ...] = ()  # train_step's numbers besides the loss, or a LightningModule's step logs
    val_metrics: Tuple[str, ...] = ()  # what a LightningModule's validation_step logs


@dataclass(frozen=True)
class UserObjects:
    """The user's model, optimizer recipe, losses and metrics, and what the driver chose for them (the objective,
    the strategy), pickled together once on the driver (estimator.core.pickling.user_objects builds it whole)."""

    model: Any
    optimizer_cls: Optional[type]  # None: a LightningModule's configure_optimizers builds it on each rank
    optimizer_groups: List[List[int]]  # per param group: indices into list(model.parameters())
    optimizer_defaults: Dict[str, Any]
    optimizer_state: Dict[str, Any]
    losses: List[Any]  # empty when loss_constructors build them on each rank
    loss_weights: List[float]
    metrics: List[Any] = field(default_factory=list)
    loss_constructors: List[Any] = field(default_factory=list)
    transformation_fn: Any = None
    callbacks: List[Any] = field(default_factory=list)
    lr_scheduler_fn: Any = None
    train_step: Any = None  # the user's step (estimator.train.steps): the losses and metrics are then unused
    train_fn: Any = None  # the user's loop (estimator.train.train_fn): the losses, metrics and train_step are unused
    lightning: bool = False  # model is a LightningModule run by the built-in loop (estimator.train.lightning)
    model_factory: Any = None  # the model param as a zero-argument callable: called on each rank, never pickled out
    optimizer_factory: Any = None  # the optimizer param as a callable(params) -> Optimizer, called on each rank
    optimizer_lr: Optional[float] = None  # the lr param, over every group of optimizer_factory's optimizer
    tokenizer: Any = None  # tokenizes DataSpec.text_cols per batch (estimator.data.text)
    shard_units: Any = None  # strategy='fsdp': what is sharded as a unit (estimator.train.sharding.unit_modules)
    weights_folder: Optional[str] = None  # what model_factory leaves on the meta device, read there (estimator.core.meta)
    peft_config: Any = None  # adapters added to the model where it is built (estimator.core.adapters)
    objective: Any = None  # the built-in loop's objective class (estimator.train.objectives); None: train_fn's loop
    strategy: Any = None  # the strategy class that trains it (estimator.train.strategies); None: ddp

    def __getstate__(self) -> Dict[str, Any]:
        """A model built by a factory travels as its factory: the weights load on each rank, never through the
        launch spec (its size does not grow with the model)."""
        state = dict(self.__dict__)
        if self.model_factory is not None:
            state["model"] = None
        return state

    def module(self, seed: Optional[int] = None) -> Any:
        """The model to train: the instance sent, or, where only the factory came (a rank), the factory's with
        its adapters, built now under the run's `seed` (a rank calls this once)."""
        if self.model is None:
            from estimator.core.recipe import ModelRecipe

            return ModelRecipe(self.model_factory, self.peft_config, seed).build(training=True)
        return self.model

    def build_losses(self) -> List[Any]:
        return [make() for make in self.loss_constructors] if self.loss_constructors else list(self.losses)


@dataclass(frozen=True)
class WorkerResult:
    rank: int
    history: Tuple[Dict[str, float], ...]
    device: str
    train_rows: int
    seconds: float
    reader: str = "arrow"
    optimizer_steps: int = 0
    assigned_gpu: Optional[str] = None  # the GPU address Spark assigned to this rank (one of its task's), if any
    setup_seconds: float = 0.0  # task start to training start: spec, rendezvous, process group, model, data
    teardown_seconds: float = 0.0  # final barrier and process-group teardown
    allreduce: str = "gloo"  # how gradients were averaged: "shared memory", "gloo", "nccl", "gloo fp16", ...
    peak_rss_mb: float = 0.0  # this Python worker's peak resident memory (Spark reuses workers: a lifetime peak)
    read_seconds: float = 0.0  # reading this rank's shards into memory (overlapping the rendezvous when read early)
    read_wait_seconds: float = 0.0  # of `seconds`, the time training waited for those shards
    data_wait_seconds: float = 0.0  # of `seconds`, the time the loop waited for batches (all epochs)
    train_loop_seconds: float = 0.0  # of `seconds`, the time spent in training epochs (the wait included)
    checkpoint_wait_seconds: float = 0.0  # of `seconds`, rank 0's waits for checkpoint writes (train.checkpoint)
    objective_setup_seconds: float = 0.0  # of `seconds`, the objective's before training (DPO's reference pass)
    state_bytes: int = 0  # the parameters and optimizer state this rank held at the end (fsdp: its shards only)
    spill_seconds: float = 0.0  # direct mode: receiving this rank's rows from Spark and writing them to local disk
