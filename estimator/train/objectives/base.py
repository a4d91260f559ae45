"""What every objective of the built-in loop has by default (estimator.train.objectives): a loss that is a batch's
mean, the model's outputs in transform, no language model's rows, and the history read from its sums' means."""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple

from estimator.train.sums import Sums
from estimator.train.weighting import PerBatch

OWN_LOOP = ("train_fn", "train_step", "loss", "loss_constructors")  # params that bring a loss (or loop) of their own


def own_loop_param(p: Mapping[str, Any]) -> Optional[str]:
    """The first param set that brings its own loss or loop (OWN_LOOP), else None: the built-in loop's objective
    computes the loss."""
    return next((name for name in OWN_LOOP if p.get(name) is not None), None)


def built_in_loop(p: Mapping[str, Any]) -> bool:
    """The built-in loop trains with an objective's loss: no param brings its own."""
    return own_loop_param(p) is None


class BuiltIn:
    """The defaults of an objective class; `layout` (its sums) is set by each."""

    layout: Sums
    weighting: Any = PerBatch  # the loss is a mean over the batch's rows (PerWeight: a sum over its weight)
    transform_output: Optional[str] = None  # the fitted TorchModel's output_kind: the model's outputs
    # a causal LM's objective: the rows it reads, by the name of their reader (estimator.fit.language.ROWS: 'sft'
    # a prompt and its response, a chat or a text; 'preference' pairs of answers), which gives their format
    # (estimator.data.rows: how they are tokenized and labelled); None: no language model's rows
    rows: Optional[str] = None
    # the tokens a row's completion, sampled on the ranks, may add to its prompt (GRPO's max_new_tokens): the
    # driver checks the longest prompt plus these within the model's positions (estimator.fit.language.check_room)
    completion_tokens = 0
    # the global gradient norm gradient_clip_val='auto' (its default) clips at: none for a classic fit; a causal LM's
    # objectives clip at 1.0, as Hugging Face's Trainer does by default under TRL (max_grad_norm=1.0)
    gradient_clip_val: Optional[float] = None
    # the driver's dry run runs the model's forward on a few rows (its weights built there); False: the driver's
    # checks read the rows, the config and shapes only, and a rank's first batch checks the forward (a LoRA fit
    # of a factory then never builds the base's weights on the driver: estimator.core.handle)
    driver_forward = True
    # optimizer steps the loop takes on each batch prepare() made (GRPO's num_iterations reuses its samples)
    iterations = 1
    # the user's functions an objective instance holds (GRPO's reward functions): pickled by value where their
    # module exists on the driver only (estimator.core.pickling.driver_only_modules), as the loss param's are
    user_code: Tuple[Any, ...] = ()
    # the history key monitored where the `monitor` param is unset (its val_ one with validation); None: the loss
    monitor: Optional[str] = None

    @classmethod
    def applies(cls, p: Mapping[str, Any]) -> bool:
        """Whether this is the fit's objective, from the validated params (`p["model"]`: the driver's module)."""
        raise NotImplementedError

    @classmethod
    def history_keys(cls, p: Mapping[str, Any]) -> Optional[List[str]]:
        """The history's training keys, known on the driver before any job (the monitor must be one of them, or
        its val_ one): the means of a layout the class declares; None where the instance builds its layout (the
        driver then knows them otherwise: the loss param's metrics, or a dry run)."""
        layout = getattr(cls, "layout", None)
        return [m.key for m in layout.means] if isinstance(layout, Sums) else None

    @classmethod
    def dry_run(cls, model: Any, data: Any, arrays: Any, rows: int) -> Optional[List[tuple]]:
        """The driver's check on a few training rows (`arrays`, `rows` of them; `model` the driver's copy, in eval
        mode, maybe a skeleton on the meta device), before any job: the output shapes transform reports, or
        None for the fit's own (estimator.fit.dry_run: the forward, then the loss param's losses)."""
        return None

    @classmethod
    def check_fit(cls, p: Mapping[str, Any], shards_checkpoints: bool) -> None:
        """The params this objective refuses for this fit, by name, on the driver before any job (`p`: the
        validated params, `p["objective"]` the objective param's instance if one was given;
        `shards_checkpoints`: the strategy keeps a folder of shards): nothing, by default."""

    @classmethod
    def reference_table(cls, p: Mapping[str, Any]) -> Optional[str]:
        """The name of a table the ranks compute before training and read with the rows (DPO's precomputed
        reference log-probabilities, estimator.data.reference), else None."""
        return None

    @classmethod
    def before_training(cls, spec: Any, ctx: Any, objs: Any, model: Any) -> None:
        """What a rank does with the model as built and placed, before a checkpoint is restored into it and before
        any step (estimator.train.worker): nothing, by default."""

    @classmethod
    def for_rank(cls, spec: Any, objs: Any, model: Any, trainer: Any) -> "BuiltIn":
        """The objective a rank trains with (estimator.train.epochs.Run)."""
        raise NotImplementedError

    def prepare(self, generation: Callable[[], ContextManager[Any]], batch: Any, ctx: Any) -> Any:
        """The batch the loss is computed on, made from the batch read (estimator.train.loop): run before the token
        weighting counts it and outside autocast and no_sync, in training and in validation. `generation()`: the
        strategy's context giving the whole module to generate with (Strategy.generation: eval mode, no gradients,
        a sharded model's parameters gathered); `ctx`: the step's StepContext. A sampling objective adds its
        completions here; by default the batch as read."""
        return batch

    def host_check(self) -> Optional[Callable[[Any], None]]:
        """A check of each batch's tensors as read, on the host (the feed's thread, before a GPU copy, so it makes
        no step wait), raising on rows that cannot be trained on; None (the default): none."""
        return None

    def summarize(self, train: Mapping[str, float], val: Optional[Mapping[str, float]]) -> Dict[str, float]:
        """The epoch's history row: the means of the sums reduced over the ranks, then validation's as val_."""
        return summarize_means(self.layout, train, val)


def summarize_means(layout: Sums, train: Mapping[str, float], val: Optional[Mapping[str, float]]) -> Dict[str, float]:
    """An epoch's row from the reduced sums by name: the loss and the metrics, then the val_ ones."""
    return {**layout.means_of(train), **(layout.means_of(val, "val_") if val is not None else {})}
