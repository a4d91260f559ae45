"""Checks that need more than one param, or the DataFrame's schema. All run before any Spark job."""
from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from pyspark.ml.linalg import VectorUDT
from pyspark.sql.types import ArrayType, BinaryType, BooleanType, DataType, NumericType, StringType, StructType
import torch
from torch import nn

from estimator.core.params import param_error
from estimator.core.spec import compile_options
from estimator.train.memory import no_units
from estimator.core.stopping import Monitor, default_mode, default_monitor
from estimator.fit.language import check_lm_params, string_label_error
from estimator.fit.strategy import check_strategy, strategy_class
from estimator.core.lightning_module import is_lightning_module
from estimator.train.losses import check_metrics, takes_labels
from estimator.train.objectives.classic import Objective

OWNER = "TorchEstimator"

log = logging.getLogger("estimator")


def language_model(objective: Any) -> bool:
    """Whether the fit's objective (estimator.train.objectives; None for a train_fn) fine-tunes a causal LM: its
    rows are prompts and responses, or chats, tokenized with their labels."""
    return objective is not None and objective.rows is not None


def gradient_clip(p: Mapping[str, Any], objective: Any) -> Optional[float]:
    """The global gradient norm the fit clips at: gradient_clip_val's, its 'auto' the objective's own (1.0 for a
    causal LM's, as TRL's trainers clip by default; none for a classic fit or a train_fn's own loop)."""
    value = p["gradient_clip_val"]
    if isinstance(value, str):  # 'auto'
        return getattr(objective, "gradient_clip_val", None)
    return None if value is None else float(value)


def built_in_schedule(p: Mapping[str, Any]) -> bool:
    """Whether the fit asks for the built-in per-step schedule (lr_schedule, or a warmup alone)."""
    return p["lr_schedule"] is not None or bool(p["warmup_steps"]) or bool(p["warmup_ratio"])


def check_schedule(p: Mapping[str, Any]) -> None:
    """lr_schedule and its warmup against what else would set the learning rate (estimator.train.schedules)."""
    if p["warmup_steps"] is not None and p["warmup_ratio"] is not None:
        raise ValueError(f"{OWNER} takes warmup_steps or warmup_ratio, not both (got {p['warmup_steps']!r} and "
                         f"{p['warmup_ratio']!r}).")
    if not built_in_schedule(p):
        return
    given = "lr_schedule" if p["lr_schedule"] is not None else "warmup_steps" if p["warmup_steps"] else "warmup_ratio"
    if p["lr_scheduler_fn"] is not None:
        raise ValueError(f"{OWNER} takes {given} or lr_scheduler_fn, not both: {given} is the built-in schedule "
                         "stepped after every optimizer step; lr_scheduler_fn builds your own.")
    if p["train_fn"] is not None:
        raise ValueError(f"{OWNER}: {given} is stepped by the built-in loop after each optimizer step, and a "
                         "train_fn runs its own loop: build the scheduler in it (over ctx.optimizer) and step it "
                         "there, or leave the param unset.")


def check_params(p: Mapping[str, Any], objective: Any) -> None:
    """`objective`: the fit's (estimator.train.objectives.registry.choose_objective), chosen once."""
    check_schedule(p)
    n_features, n_labels = len(p["feature_cols"]), len(p["label_cols"])
    if p["packing"] and not language_model(objective):
        raise ValueError("packing=True packs a causal LM's tokenized rows (a prompt/response, chat or text column "
                         "with a model that generates and its tokenizer, the built-in loop); this fit is not one. "
                         "Leave packing=False.")
    own = "train_fn" if p["train_fn"] is not None else "train_step" if p["train_step"] is not None else None
    lm = language_model(objective)  # a causal LM's fine-tuning: its loss is the next-token loss over its tokens
    if p["train_fn"] is not None and p["train_step"] is not None:
        raise ValueError(f"{OWNER} takes train_fn or train_step, not both: a train_fn is the whole loop, so it calls "
                         "its own step.")
    if p["train_fn"] is not None and not takes_one_argument(p["train_fn"]):
        raise ValueError(f"The 'train_fn' parameter of {OWNER} is called train_fn(ctx) on every rank, with one "
                         f"argument, the TrainContext; {getattr(p['train_fn'], '__name__', 'it')}"
                         f"{signature_text(p['train_fn'])} cannot take it. A TorchDistributor function's own "
                         "arguments (learning_rate, use_gpu, ...) go into a closure or functools.partial, leaving ctx "
                         "(docs/training.md 'Your own training loop').")
    if not p["label_cols"] and own is None and not is_lightning_module(p["model"]) and not lm:
        raise ValueError(param_error(OWNER, "label_cols", "a non-empty list of distinct column names with the built-in "
                                     "loop (loss=...); only a LightningModule, train_step or train_fn, which compute "
                                     "their own loss, train without labels", None))
    if own is None and is_lightning_module(p["model"]):
        check_lightning(p)
    elif p["optimizer"] is None and p["peft_config"] is not None:  # an instance is refused: recipes.with_peft
        raise ValueError(param_error(OWNER, "optimizer", "with peft_config, a callable(params) returning a "
                                     "torch.optim.Optimizer, as functools.partial(torch.optim.AdamW, lr=2e-4): it "
                                     "is called over the adapters' parameters", None))
    elif p["optimizer"] is None:
        raise ValueError(param_error(OWNER, "optimizer", "a torch.optim.Optimizer built over model.parameters(), or a "
                                     "callable(params) returning one, as functools.partial(torch.optim.AdamW, "
                                     "lr=2e-5) (only a LightningModule brings its own, from configure_optimizers)",
                                     None))
    elif own is not None:
        if p["loss_constructors"] is not None or p["metrics"]:
            raise ValueError(f"{OWNER} with {own} takes no loss_constructors or metrics: {own} computes the loss "
                             "and the metrics (train_step returns them, {'loss': ..., 'accuracy': ...}; a train_fn "
                             f"reports them). Got loss_constructors={p['loss_constructors']!r}, "
                             f"metrics={p['metrics']!r}.")
    elif p["loss"] is not None and p["loss_constructors"] is not None:
        raise ValueError(f"{OWNER} takes one of 'loss' and 'loss_constructors', not both. Got loss={p['loss']!r}, "
                         f"loss_constructors={p['loss_constructors']!r}.")
    elif lm:
        check_lm_params(p)
    elif p["loss"] is None and p["loss_constructors"] is None:
        if not takes_labels(p["model"]):
            raise ValueError(f"{OWNER} needs 'loss' (or 'loss_constructors', a train_step, a train_fn), unless the "
                             "model computes its own loss: forward(..., labels=...) returning .loss, as Hugging Face "
                             f"models do. {type(p['model']).__name__}.forward takes no 'labels'.")
        if n_labels != 1 or p["sample_weight_col"] is not None:
            raise ValueError(f"loss=None trains on the loss the model computes from labels=, which takes one label "
                             f"column and no sample weights. Got label_cols={list(p['label_cols'])}, "
                             f"sample_weight_col={p['sample_weight_col']!r}: pass loss=... instead.")
    if p["backend"] is not None and p["num_proc"] is not None:
        raise ValueError(f"{OWNER} takes 'num_proc' or 'backend', not both: the backend's num_processes() "
                         f"({p['backend'].num_processes()}) sets the number of processes.")
    for name, count, what in (("input_shapes", n_features, "feature_cols"), ("label_shapes", n_labels, "label_cols")):
        if p[name] is not None and len(p[name]) != count:
            raise ValueError(param_error(OWNER, name, f"a list of {count} shapes, one per entry of {what}", p[name]))
    check_compile(p["compile"], p["model"])
    if p["gradient_checkpointing"] and isinstance(p["model"], nn.Module) and not is_lightning_module(p["model"]):
        refusal = no_units(p["model"], p["shard_units"], p["gradient_checkpointing"])
        if refusal:  # (the rank would refuse it after the table is written)
            raise ValueError(refusal)
    check_strategy(p)
    if objective is not None:  # what the objective itself refuses (DPO: where its reference comes from)
        objective.check_fit(p, strategy_class(p).shards_checkpoints)
    if p["precision"] == "16-mixed" and p["use_gpu"] is False:
        raise ValueError(f"{OWNER} cannot train with precision='16-mixed' and use_gpu=False: float16 autocast with a "
                         "GradScaler needs CUDA. Use precision='bf16-mixed' on CPUs.")
    used = list(p["feature_cols"]) + list(p["label_cols"])
    overlap = sorted({c for c in used if used.count(c) > 1})
    if overlap:
        raise ValueError(f"Columns {overlap} appear in both feature_cols and label_cols of {OWNER}; "
                         "a column can be a feature or a label, not both.")
    if p["loss"] is None and p["loss_constructors"] is None:
        return  # a train_step or train_fn without a loss: nothing more to check here
    name = "loss" if p["loss"] is not None else "loss_constructors"
    losses = p[name] if isinstance(p[name], (list, tuple)) else [p[name]]
    if len(losses) not in (1, n_labels):
        raise ValueError(param_error(OWNER, name, f"one loss, or a list of {n_labels} (one per label column)",
                                     p[name]))
    if name == "loss_constructors":
        losses = [make() for make in losses]
    if p["loss_weights"] is not None and len(p["loss_weights"]) != n_labels:
        raise ValueError(param_error(OWNER, "loss_weights", f"a list of {n_labels} numbers, one per label column",
                                     p["loss_weights"]))
    if p["sample_weight_col"]:
        bad = [fn for fn in losses if not (isinstance(fn, nn.Module) and hasattr(fn, "reduction"))
               and not _takes_reduction(fn)]
        if bad:
            raise ValueError(param_error(
                OWNER, name, "torch.nn losses or functions that accept reduction='none' (such as "
                "torch.nn.functional.binary_cross_entropy) when sample_weight_col is set, so that per-row losses "
                "can be weighted", p[name]))
    check_metrics(p["metrics"], losses_per_label(losses, n_labels), p["label_cols"])


def check_lightning(p: Dict[str, Any]) -> None:
    """A LightningModule brings its optimizer (configure_optimizers), loss and metrics (training_step,
    validation_step, self.log): the params that would give them again are refused, not silently ignored."""
    name = type(p["model"]).__name__
    why = {"optimizer": "its configure_optimizers() builds the optimizer on every rank",
           "lr": "the learning rate is configure_optimizers()'s: vary a hyperparameter of the module instead",
           "loss_constructors": "training_step computes the loss",
           "metrics": "self.log in training_step and validation_step names the history's metrics",
           "compile": "not supported with a LightningModule yet (its training_step is called, not forward)"}
    for param, reason in why.items():
        if p[param] is not None and p[param] is not False and p[param] != []:
            raise ValueError(f"{OWNER} trains the LightningModule {name} with its own hooks, so it takes no "
                             f"{param} (got {p[param]!r}): {reason}.")


def check_ranks(p: Dict[str, Any], num_proc: int, per_task: int) -> None:
    """What the data mode and min_num_proc allow, once num_proc and the ranks per task are known."""
    if per_task > 1 and p["data_mode"] == "direct":
        raise ValueError(f"data_mode='direct' runs one training process per Spark task; with "
                         f"spark.task.resource.gpu.amount={per_task} each task runs {per_task}. Use "
                         "data_mode='materialize' (the default) on tasks with several GPUs.")
    if p["min_num_proc"] is None:
        return
    if p["min_num_proc"] > num_proc:
        raise ValueError(param_error(OWNER, "min_num_proc", f"at most num_proc ({num_proc})", p["min_num_proc"]))
    if p["data_mode"] == "direct" and p["min_num_proc"] < num_proc:
        raise ValueError(f"{OWNER} with data_mode='direct' trains one rank per partition of the DataFrame's "
                         f"stage, so a retry cannot go on with fewer ranks: min_num_proc={p['min_num_proc']} needs "
                         "data_mode='materialize' (the default).")


def check_dataframe(df: Any) -> None:
    """fit takes a Spark DataFrame (classic or Connect); a pandas one, a dict or a path is refused with the way."""
    if hasattr(df, "schema") and hasattr(df, "sparkSession"):
        return
    kind = f"{type(df).__module__}.{type(df).__name__}"
    fix = ("spark.createDataFrame(pdf) makes one of a pandas DataFrame" if kind.startswith("pandas.")
           else "spark.read.parquet(path) or spark.createDataFrame(rows) makes one")
    raise TypeError(f"{OWNER}.fit takes a Spark DataFrame; got a {kind}: {fix}.")


def check_schema(p: Mapping[str, Any], objective: Any, schema: StructType) -> None:
    """Every named column exists and has a type the estimator can train on."""
    available = schema.names
    roles: List[tuple] = [(c, "feature_cols") for c in p["feature_cols"]]
    roles += [(c, "label_cols") for c in p["label_cols"]]
    if p["sample_weight_col"]:
        roles.append((p["sample_weight_col"], "sample_weight_col"))
    if isinstance(p["validation"], str):
        roles.append((p["validation"], "validation"))
    for column, param in roles:
        if column not in available:
            raise ValueError(f"Column {column!r} (from {param}) is not in the DataFrame. "
                             f"Available columns: {', '.join(available)}.")
        dtype = schema[column].dataType
        if isinstance(dtype, BinaryType) and param == "feature_cols":
            if p["transformation_fn"] is None:
                raise ValueError(f"Column {column!r} (from feature_cols) holds bytes (binary, e.g. encoded images): "
                                 "set transformation_fn to a function(pandas.DataFrame) -> pandas.DataFrame that turns "
                                 f"each row's bytes in {column!r} into a numpy array (e.g. PIL.Image.open(io.BytesIO"
                                 "(b)) then numpy.asarray); it runs on every batch, off the training thread.")
            continue
        if isinstance(dtype, StringType) and param == "feature_cols":
            if p["tokenizer"] is None:
                raise ValueError(needs_tokenizer(column))
            continue
        if isinstance(dtype, StringType) and param == "label_cols":
            if not language_model(objective):
                raise ValueError(string_label_error(column, p))
            continue
        if language_model(objective):
            continue  # a prompt, a chat, an answer: their format's reader checks their types (language.lm_spec)
        scalar_only = param in ("sample_weight_col", "validation")
        if param == "validation" and not _trainable(dtype, True):
            raise ValueError(f"Column {column!r} (from validation) has type {dtype.simpleString()}; it must be "
                             "boolean (true: a validation row) or a number (non-zero: a validation row), a null "
                             f"being a training row. Make one first, e.g. F.col({column!r}) == 'val'.")
        if not _trainable(dtype, scalar_only):
            allowed = ("a number or boolean" if scalar_only
                       else "numeric, boolean, an array of numbers, or an ml Vector")
            raise ValueError(f"Column {column!r} (from {param}) has type {dtype.simpleString()}; it must be "
                             f"{allowed}. Convert it first (StringIndexer for strings, VectorAssembler for "
                             "several numeric columns).")


def needs_tokenizer(column: str) -> str:
    return (f"Column {column!r} (from feature_cols) holds strings: set tokenizer (a Hugging Face tokenizer, or a "
            "callable(list of str) -> dict of arrays) to tokenize it on the ranks and in transform, or convert it "
            "first (StringIndexer for categories).")


def text_columns(p: Mapping[str, Any], objective: Any, schema: StructType) -> Tuple[str, ...]:
    """The string feature columns (tokenized per batch); refused when training cannot read them by keyword."""
    if language_model(objective):  # the prompt or chat column is tokenized with its labels (estimator.data.lm)
        return ()
    text = tuple(c for c in p["feature_cols"] if isinstance(schema[c].dataType, StringType))
    if text and p["tokenizer"] is None:
        raise ValueError(needs_tokenizer(text[0]))
    if len(text) > 1:
        raise ValueError(f"feature_cols has {len(text)} string columns {list(text)}; one text column is tokenized "
                         "per row (its input_ids, attention_mask... reach forward by keyword). Join them into one "
                         "column first (concat_ws).")
    for i, column in enumerate(p["feature_cols"]):
        if column in text and p["input_shapes"] is not None and p["input_shapes"][i] is not None:
            raise ValueError(f"input_shapes[{i}] is {p['input_shapes'][i]} for the text column {column!r}, whose "
                             "token arrays are as long as each batch's longest text: give None for it.")
    if text and p["reader"] == "petastorm":
        raise ValueError("A tokenizer needs the default reader='arrow' (it tokenizes in the arrow reader's workers).")
    if p["tokenizer"] is not None and not text:
        raise ValueError(f"tokenizer is set, and no column of feature_cols {list(p['feature_cols'])} holds strings: "
                         "name the text column in feature_cols, or leave tokenizer unset.")
    return text


def _trainable(dtype: DataType, scalar_only: bool) -> bool:
    if isinstance(dtype, (NumericType, BooleanType)):
        return True
    if scalar_only:
        return False
    if isinstance(dtype, VectorUDT):
        return True
    while isinstance(dtype, ArrayType):
        dtype = dtype.elementType
        if isinstance(dtype, (NumericType, BooleanType)):
            return True
    return False


def _takes_reduction(fn: Any) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return True
    return any(p.name == "reduction" or p.kind == p.VAR_KEYWORD for p in parameters)


def losses_per_label(loss: Any, labels: int) -> List[Any]:
    """One loss per label column: a single loss (or a list of one) applies to every label."""
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    return losses * labels if len(losses) == 1 else losses


def shapes(value: Optional[Sequence[Sequence[int]]]) -> Optional[tuple]:
    return None if value is None else tuple(tuple(int(d) for d in s) for s in value)


def own_loss(p: Dict[str, Any]) -> bool:
    """The built-in loop on the model's own loss (loss=None, its forward takes labels: checked by check_params)."""
    return (p["loss"] is None and p["loss_constructors"] is None and p["train_step"] is None and p["train_fn"] is None
            and not is_lightning_module(p["model"]))


def metric_names(p: Dict[str, Any], losses: Sequence[Any]) -> List[str]:
    """The history's training keys of the built-in loop: the loss, then the metrics per label."""
    n_labels = len(p["label_cols"])
    objective = Objective(losses_per_label(list(losses), n_labels), [1.0] * n_labels, p["metrics"], p["label_cols"],
                          weighted=False)
    return ["loss"] + [name for name, _, _ in objective.metrics]


def monitor_for(p: Dict[str, Any], names: Optional[Sequence[str]], has_validation: bool,
                keys: Optional[List[str]] = None, own: Optional[str] = None) -> Monitor:
    """The monitored history key (one the history will have: `names`, their val_ ones, data_wait, or `keys` when
    given; names None: a train_fn's, known when it reports), its direction and the early-stopping rule. Unset, the
    loss, or the objective's `own` key (GRPO's reward); their val_ ones with validation."""
    key = p["monitor"] or default_monitor(has_validation, own)
    if keys is None and names is not None:
        keys = list(names) + ([f"val_{n}" for n in names] if has_validation else []) + ["data_wait"]
    if keys is not None and key not in keys:
        raise ValueError(param_error(OWNER, "monitor", "a key of the history this fit writes: " + ", ".join(
            repr(k) for k in keys) + ("" if has_validation else " (val_ keys need validation data)"), key))
    if p["restore_best"] and p["save_top_k"] == 0:
        raise ValueError(f"{OWNER} keeps no best checkpoint with save_top_k=0, so restore_best=True has nothing to "
                         "restore. Set save_top_k >= 1 or restore_best=False.")
    return Monitor(key, p["monitor_mode"] or default_mode(key), float(p["min_delta"]), p["early_stopping_patience"])


def lightning_monitor(p: Dict[str, Any], train_keys: Sequence[str], val_keys: Sequence[str],
                      scheduler_monitor: Optional[str], has_validation: bool) -> Monitor:
    """A LightningModule's history keys: training_step's loss and logs, validation_step's logs. The default
    monitor is val_loss where validation_step logs it, else loss; a ReduceLROnPlateau's monitor must be a key."""
    keys = ["loss", *train_keys, *(val_keys if has_validation else ()), "data_wait"]
    if scheduler_monitor is not None and scheduler_monitor not in keys:
        raise ValueError(f"configure_optimizers() names monitor={scheduler_monitor!r} for its scheduler, which is not "
                         f"a key of this fit's history ({', '.join(repr(k) for k in keys)}): log it in training_step "
                         "or validation_step, or monitor one of these.")
    default = "val_loss" if "val_loss" in keys else "loss"
    return monitor_for({**p, "monitor": p["monitor"] or default}, None, has_validation, keys)


def warn_of_long_warmup(p: Mapping[str, Any], steps: Optional[int]) -> None:
    """A warning where warmup_steps takes the whole fit of `steps` optimizer steps (None: not known on the
    driver): the rate never reaches lr, which a user who set lr for it would not know (Hugging Face's schedules
    allow it too)."""
    warmup = p.get("warmup_steps")
    if steps is None or not warmup or warmup < steps:
        return
    log.warning("warmup_steps=%d is at least the fit's %d optimizer steps: the warmup takes the whole fit, the "
                "learning rate rising toward lr and at %.3g of it at the last step. Lower warmup_steps, or give "
                "warmup_ratio (a share of the steps).", warmup, steps, (steps - 1) / warmup)


def check_compile(setting: Any, model: nn.Module) -> None:
    """torch.compile checks its mode, backend and keyword names when it wraps a module (lazily: nothing is
    compiled here), so a typo fails on the driver, not on every rank."""
    options = compile_options(setting)
    if options is None:
        return
    try:
        torch.compile(model, **options)
    except Exception as exc:  # noqa: BLE001 - torch's own message says what it accepts
        raise ValueError(f"The 'compile' parameter of {OWNER} was refused by torch.compile: {type(exc).__name__}: "
                         f"{exc}") from None


def ignored_params(p: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Params set to values the chosen reader does not use, and why: a warning each, never silence."""
    arrow, processes = p["reader"] == "arrow", p["reader_pool_type"] in ("process", "auto")
    ignored = []
    if p["mp_start_method"] is not None and not (arrow and processes and p["transformation_fn"] is not None):
        ignored.append(("mp_start_method", "it only starts the arrow reader's decoding processes (reader='arrow', "
                                           "reader_pool_type='process' and a transformation_fn)."))
    if arrow and p["reader_pool_type"] == "process" and p["transformation_fn"] is None:
        ignored.append(("reader_pool_type", "the arrow reader's processes run transformation_fn, and there is none: "
                                            "batches are converted on threads."))
    if p["data_mode"] == "direct" and p["partitions_per_process"] is not None:
        ignored.append(("partitions_per_process", "it sets the Parquet files written when materializing, and "
                                                  "data_mode='direct' writes none: each rank takes one partition."))
    if not arrow and p["shuffle_buffer_size"] is not None:
        ignored.append(("shuffle_buffer_size", "it sizes the arrow reader's shuffle buffer; petastorm shuffles row "
                                               "groups and rows its own way."))
    if p["train_fn"] is not None and p["checkpoint_steps"]:
        ignored.append(("checkpoint_steps", "a train_fn's run is checkpointed at each ctx.report (each epoch's end) "
                                            "and resumes there; checkpoints inside an epoch are the built-in loop's."))
    return ignored


def takes_one_argument(fn: Any) -> bool:
    """Whether fn(x) binds (True where the signature cannot be read: the call will tell)."""
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def signature_text(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"
