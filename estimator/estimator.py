"""TorchEstimator: validate -> materialize -> TrainSpec -> launch with retries -> TorchModel."""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import random
import re
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union, overload

from pyspark.ml import Estimator
from pyspark.ml.base import _FitMultipleIterator
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from estimator.compression import compression_name
from estimator.core.handle import ModelHandle, on_meta, trainable_on_cpu
from estimator.core.param_table import ESTIMATOR_PARAMS, HOROVOD_REFUSED, TRAINING_PARAMS
from estimator.core.params import DeclaredParams, declare, one_of, param_error
from estimator.core.pickling import dumps, user_objects
from estimator.core.spec import DataSpec, LMSpec, ReaderSpec, TrainSpec, UserObjects
from estimator.core.stopping import Monitor
from estimator.data.parquet import list_pieces, parquet_columns, parquet_schema
from estimator.data.plan import optimizer_steps, plan_steps
from estimator.fit import checks
from estimator.fit.attempts import launch_with_retries
from estimator.fit.direct import direct_source, head
from estimator.fit.dry_run import HEAD_ROWS, dry_lightning, dry_run, dry_step, feature_sizes
from estimator.fit.grid import Grid, GridPoint
from estimator.fit.materialize import finish, materialize
from estimator.fit.language import check_room, lm_spec
from estimator.fit.recipes import check_optimizer, check_quantized, model_of, with_peft
from estimator.fit.report import log_fit, report_stop, tensorboard_on
from estimator.fit.run_identity import began, check_same_run, params_identity, pieces_identity
from estimator.fit.tracking import MlflowLog, check_mlflow, model_facts
from estimator.fit.strategy import check_shared_gpus, strategy_class
from estimator.launch.session import check_slots, default_num_proc, ranks_per_task, task_gpus, task_slots
from estimator.launch.shipping import ship_package
from estimator.model import TorchModel
from estimator.predict.language_checks import (check_generate_kwargs, check_generation_batching, check_max_length,
                                               check_max_new_tokens, check_vocabulary, effective_max_length)
from estimator.predict.kinds import PREDICTORS
from estimator.predict.persistence import Persistable
from estimator.train.checkpoint import RunState, load_checkpoint, restore
from estimator.train.lightning import optimizer_for
from estimator.train.losses import ModelsOwnLoss, loss_kind
from estimator.train.objectives.registry import choose_objective
from estimator.train.worker import build_optimizer
from store import LocalStore, Store
from store.runs import enforce_runs

log = logging.getLogger("estimator")
SPLIT_SEED = 0  # the validation split's seed when random_seed is not given


@dataclass(frozen=True)
class RunPlan:
    """What the driver decides before any Spark job."""

    objs: UserObjects
    payload: bytes
    num_proc: int
    seed: int  # shuffles, dropout
    split_seed: int  # the validation split
    store: Store
    run_id: str
    monitor: Optional[Monitor]  # None until train_step's dry run names the history's keys
    per_task: int = 1  # ranks per Spark task: one per GPU the task is given
    trains: Dict[str, Any] = dataclasses.field(default_factory=dict)  # what decides what it trains (run_identity)


class TorchEstimator(DeclaredParams, Estimator, Persistable):
    """Distributed PyTorch training as a Spark ML Estimator: `fit(df)` writes the DataFrame's columns as Parquet to
    the store, trains a copy of `model` with DistributedDataParallel on `num_proc` Spark barrier tasks, and returns
    a TorchModel whose `transform(df)` adds the model's outputs. It works in Pipelines, CrossValidator, save/load.

        est = TorchEstimator(
            model=net, optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
            loss=nn.CrossEntropyLoss(),
            feature_cols=["features"], label_cols=["label"],
            batch_size=64, epochs=5, num_proc=2,
        )
        model = est.fit(train_df)
        predictions = model.transform(test_df)"""

    _grid_point: Optional[GridPoint] = None  # set on a grid's fit by fitMultiple

    def __init__(self, **params: Any):
        """Args:
            **params: Any params of the [param reference](params.md), by name (`model`, `feature_cols`, ...).
        """
        super().__init__(**params)

    @overload
    def fit(self, dataset: DataFrame, params: Optional[Dict[Any, Any]] = None) -> TorchModel: ...

    @overload
    def fit(self, dataset: DataFrame, params: List[Dict[Any, Any]]) -> List[TorchModel]: ...

    def fit(self, dataset: DataFrame, params: Any = None) -> Union[TorchModel, List[TorchModel]]:
        """Train on a DataFrame (classic or Spark Connect); Spark ML's `Estimator.fit`.

        Args:
            dataset: The rows: `feature_cols`, `label_cols` (and `sample_weight_col`, text or chat columns)
                as the params name them.
            params: A param map that overrides this estimator's params for this fit only; a list of maps
                gives a list of models, one per map.

        Returns:
            A TorchModel (for a list of maps, one per map) with the run's history and its best epoch.

        Raises:
            ValueError: A param, a column or the data is not what training needs, said before any Spark job
                (a param of the wrong type: TypeError).
            RankFailed: A rank failed and no retry could help (`max_retries`); the other failures are in the
                API reference's 'Failures'.
        """
        return super().fit(dataset, params)

    def fitMultiple(self, dataset: DataFrame, paramMaps: Any) -> Any:
        """Spark ML's fit of a grid (TrainValidationSplit and CrossValidator call it): a thread-safe iterator of
        (index, model), each param map's fit a run of its own, `<run_id>-grid<index>` in the store and a child
        of the MLflow run active here (estimator.fit.grid)."""
        estimator, grid = self.copy(), Grid.here()

        def fit_point(index: int) -> TorchModel:
            point = estimator.copy(paramMaps[index])
            point._grid_point = GridPoint(grid, index)
            with grid.fitting():
                return point._fit(dataset)

        return _FitMultipleIterator(fit_point, len(paramMaps))

    def _fit(self, df: DataFrame) -> TorchModel:
        checks.check_dataframe(df)
        p, objective = self._checked()
        checks.check_schema(p, objective, df.schema)
        text = TextColumns.of(p, objective, df.schema)
        run = self._prepare(p, objective, df.sparkSession, has_validation=bool(p["validation"]))
        columns = columns_of(p)
        if p["data_mode"] == "direct":
            plain, source = direct_source(df, columns, p["validation"], run.split_seed, run.num_proc, p["drop_nulls"])
            return self._train(p, run, data_spec(p, text, run.store), df.sparkSession, source,
                               head(plain, columns, HEAD_ROWS))
        materialize_started = time.perf_counter()
        m = materialize(df, run.store, columns, p["validation"], run.split_seed, run.num_proc,
                        p["partitions_per_process"], p["drop_nulls"])
        data = data_spec(p, text, run.store, m.train, m.val,
                         materialize_seconds=time.perf_counter() - materialize_started)
        try:
            return self._train(p, run, data, df.sparkSession, rows=m.key.rsplit("/", 1)[-1])  # content, not files
        finally:
            finish(run.store, m)

    @classmethod
    def load(cls, path: str) -> TorchEstimator:
        """Load a TorchEstimator saved by `save` (of this release or an earlier one); a `PipelineModel` holding one loads
        with `PipelineModel.load`.

        Args:
            path: The folder `save` wrote.

        Returns:
            The TorchEstimator, as it was saved.
        """
        return cls.read().load(path)

    def fit_on_parquet(self, train_path: str, val_path: Optional[str] = None) -> TorchModel:
        """Train on Parquet already in the store: folders (paths inside the store, or full URLs of it)
        holding the feature, label and weight columns."""
        p, objective = self._checked()
        spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
        run = self._prepare(p, objective, spark, has_validation=val_path is not None)
        store = run.store
        train_dir, val_dir = (_in_store(store, path) if path else "" for path in (train_path, val_path))
        train = list_pieces(store, train_dir)
        if not train:
            raise ValueError(f"fit_on_parquet found no Parquet rows under {train_path!r} in {store!r}.")
        available = parquet_columns(store, train[0])
        missing = [c for c in columns_of(p) if c not in available]
        if missing:
            raise ValueError(f"Columns {missing} are not in the Parquet files under {train_path!r}. "
                             f"Available columns: {', '.join(available)}.")
        schema = from_arrow_schema(parquet_schema(store, train[0]))
        text = TextColumns.of(p, objective, schema)
        val = list_pieces(store, val_dir) if val_dir else []
        return self._train(p, run, data_spec(p, text, store, train, val), spark, rows=pieces_identity(train, val))

    # -- steps ---------------------------------------------------------------------------------
    def _checked(self) -> Tuple[Mapping[str, Any], Any]:
        """The params, validated and completed once (read-only from here on: the driver's module, the factory that
        built it, the label columns as a list), and the fit's objective, chosen once (estimator.train.objectives)."""
        validated = self.validated()
        # A factory is called here, then on each rank. A fit of a factory whose objective needs no forward here
        # holds no weight of the base on the driver: its parameters stay on the meta device (estimator.core.handle;
        # a weights_folder is checked, not read), and the TorchModel holds the trained adapters (read back from the
        # run's checkpoint) or, for a full fine-tune or fsdp's shards, where that checkpoint is. One that needs a
        # forward here builds it again whole, what it left on the meta device read from weights_folder.
        model, factory = model_of(validated["model"], validated["weights_folder"], whole=False)
        model = with_peft(model, factory, validated["peft_config"], validated["weights_folder"], validated["optimizer"])
        p = MappingProxyType({**validated, "model": model, "model_factory": factory,
                              # none: a loop that computes its own loss (checked below)
                              "label_cols": list(validated["label_cols"] or [])})
        objective = choose_objective(p)
        check_quantized(p, checks.language_model(objective))
        if factory is not None and (objective is None or objective.driver_forward):  # a forward here
            model = with_peft(model_of(factory, p["weights_folder"])[0], factory, p["peft_config"],
                              p["weights_folder"], p["optimizer"])
            p = MappingProxyType({**p, "model": model})
        checks.check_params(p, objective)
        if p["output_kind"] is not None and p["output_kind"] not in PREDICTORS:  # the fitted model's: the registry's
            raise ValueError(param_error("TorchEstimator", "output_kind", one_of(list(PREDICTORS)), p["output_kind"]))
        check_max_length(p)
        check_vocabulary(p)
        if checks.language_model(objective) and PREDICTORS[output_kind(p, objective)].generates:  # (its transform
            # checks them again: a model switched to generate later)
            check_max_new_tokens(p)
            check_generation_batching(p)
            check_generate_kwargs(p)
        check_optimizer(p["optimizer"], p["model"], p["lr"])
        check_mlflow(p["mlflow"])
        for name, why in checks.ignored_params(p):
            warnings.warn(f"TorchEstimator ignores {name}={p[name]!r}: {why}", UserWarning, stacklevel=4)
        if p["reader"] == "petastorm":
            from estimator.data.petastorm import check_petastorm

            if p["data_mode"] == "direct":
                raise ValueError("reader='petastorm' reads Parquet files from the store, and data_mode='direct' "
                                 "writes none. Set reader='arrow' or data_mode='materialize'.")
            check_petastorm()
            if p["checkpoint_steps"] is not None:
                raise ValueError("checkpoint_steps needs the default reader='arrow': petastorm's training stream runs "
                                 "across epochs, so a position inside an epoch cannot be resumed. Set "
                                 "checkpoint_steps=None or reader='arrow'.")
        return p, objective

    def _prepare(self, p: Mapping[str, Any], objective: Any, spark: SparkSession, has_validation: bool) -> RunPlan:
        """Everything decided on the driver before any Spark job: pickled objects, process count, seed."""
        lm = checks.language_model(objective)
        losses = checks.losses_per_label(p["loss"], len(p["label_cols"])) if p["loss"] is not None else \
            [ModelsOwnLoss()] if checks.own_loss(p) and not lm else []
        constructors = checks.losses_per_label(p["loss_constructors"], len(p["label_cols"])) \
            if p["loss_constructors"] is not None else []
        labels = len(p["label_cols"])
        weights = list(p["loss_weights"] or [1.0 / max(labels, 1)] * labels)
        strategy = strategy_class(p)
        objs = user_objects(p["model"], p["optimizer"], losses, weights, list(p["metrics"]), p["lr"],
                            model_factory=p["model_factory"], loss_constructors=constructors,
                            transformation_fn=p["transformation_fn"], callbacks=list(p["callbacks"]),
                            lr_scheduler_fn=p["lr_scheduler_fn"], train_step=p["train_step"], train_fn=p["train_fn"],
                            tokenizer=p["tokenizer"], shard_units=p["shard_units"],
                            weights_folder=p["weights_folder"], peft_config=p["peft_config"], objective=objective,
                            strategy=strategy)
        if p["train_fn"] is not None:  # the keys are what it reports: checked by the ranks at its first report
            monitor: Optional[Monitor] = checks.monitor_for(p, None, has_validation)
        else:  # the objective's keys, or the loss param's metrics (train_step's are known after its dry run)
            names = objective.history_keys(p)
            if names is None:
                names = checks.metric_names(p, losses or [make() for make in constructors])
            monitor = None if p["train_step"] is not None or objs.lightning else checks.monitor_for(
                p, names, has_validation, own=getattr(objective, "monitor", None))
        payload = dumps(objs, "model, optimizer, losses, metrics, transformation_fn, train_step, train_fn, "
                              "lr_scheduler_fn or callbacks",
                        roots=[p["model_factory"] or objs.model, objs.optimizer_factory, *losses, *constructors,
                               *p["metrics"], p["transformation_fn"], p["train_step"], p["train_fn"], *p["callbacks"],
                               p["lr_scheduler_fn"], p["tokenizer"], p["shard_units"], objective, strategy,
                               *getattr(objective, "user_code", ())])
        num_proc = p["backend"].num_processes() if p["backend"] is not None else p["num_proc"]
        num_proc = num_proc or default_num_proc(spark)
        per_task = ranks_per_task(spark, num_proc)
        check_slots(spark, num_proc, per_task)
        checks.check_ranks(p, num_proc, per_task)
        check_shared_gpus(p, task_gpus(spark))
        if per_task > 1:
            log.info("num_proc=%d: %d Spark tasks of %d ranks each, a rank per GPU (spark.task.resource.gpu.amount=%d)",
                     num_proc, num_proc // per_task, per_task, per_task)
        store = p["store"] or default_store()
        store.check_writable()  # a dead endpoint or missing credentials fail here, in seconds
        ship_package(spark)
        point = self._grid_point
        run_id = point.run_id(p["run_id"] or new_run_id()) if point is not None else p["run_id"] or new_run_id()
        if point is not None:
            point.grid.check_slots(num_proc // per_task, task_slots(spark))
        trains = params_identity(p, objective)
        if p["run_id"]:  # a named run resumes only its own fit (before the data's job: its params)
            check_same_run(store, store.run(run_id), run_id, trains)
        seed, split_seed = p["random_seed"], p["random_seed"]
        if seed is None and p["run_id"]:  # a refit of a named run keeps its split and shuffles
            known = run_metadata(store, run_id)
            seed, split_seed = known.get("seed"), known.get("split_seed", known.get("seed"))
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        # Without random_seed the split does not follow the drawn training seed: refits of the same data with a
        # validation fraction reuse one materialized copy instead of writing a new one each time.
        return RunPlan(objs, payload, num_proc, seed, SPLIT_SEED if split_seed is None else split_seed, store, run_id,
                       monitor, per_task, trains)

    def _train(self, p: Mapping[str, Any], run: RunPlan, data: DataSpec, spark: SparkSession, source: Any = None,
               first_rows: Optional[Dict[str, Any]] = None, rows: Optional[str] = None) -> TorchModel:
        """`source` and `first_rows`: the direct mode's input DataFrame (estimator.fit.direct) and its first rows.
        `rows`: the data's identity (estimator.fit.run_identity; None in the direct mode, where no pass made it)."""
        started = time.perf_counter()
        num_proc, store, run_id = run.num_proc, run.store, run.run_id
        if source is None:
            check_rows(data, num_proc, p["reader"])
            if p["drop_last"]:  # refuses shards smaller than a batch now, not on the ranks
                plan_steps(data.train_rows, num_proc, p["batch_size"], p["train_steps_per_epoch"], True)
        checked = time.perf_counter()
        if data.lm is not None and source is None:  # the whole table (the direct mode's: its first rows)
            check_room(data, p["tokenizer"], p["model"], getattr(p["objective"], "completion_tokens", 0))
        output_shapes = dry_run(run.objs, data, first_rows)
        sizes = feature_sizes(run.objs, data, first_rows)
        step_metrics, val_metrics = (dry_step(run.objs, data, first_rows) if p["train_step"] is not None else ()), ()
        has_validation = bool(p["validation"] or data.val)
        if p["train_step"] is not None:  # the history's keys are train_step's: the monitor is one of them
            run = replace(run, monitor=checks.monitor_for(p, ["loss", *step_metrics], has_validation))
        stepping = None if source is not None else optimizer_steps(  # the direct mode's rows: on the ranks
            data.train_rows, num_proc, p["batch_size"], p["train_steps_per_epoch"], p["drop_last"],
            p["backward_passes_per_step"], p["epochs"]) * getattr(run.objs.objective, "iterations", 1)
        checks.warn_of_long_warmup(p, stepping)
        if run.objs.lightning:  # the keys are what its steps log
            step_metrics, val_metrics, scheduler_monitor = dry_lightning(
                run.objs, data, first_rows, has_validation, p["epochs"], stepping,
                built_in_schedule=checks.built_in_schedule(p))
            run = replace(run, monitor=checks.lightning_monitor(p, step_metrics, val_metrics, scheduler_monitor,
                                                                 has_validation))
        dry_run_seconds = time.perf_counter() - checked
        # The fields named as params take the param's value; the rest are derived here, once.
        derived = dict(data=data, payload=run.payload, run=store.run(run_id), seed=run.seed,
                       val_batch_size=p["val_batch_size"] or p["batch_size"],
                       reader=ReaderSpec.from_params(p, pyspark_memory_per_task(spark)),
                       monitor=run.monitor, tensorboard=tensorboard_on(p["verbose"]), step_metrics=step_metrics,
                       val_metrics=val_metrics,
                       compression=compression_name(p["gradient_compression"]),
                       gradient_clip_val=checks.gradient_clip(p, run.objs.objective),
                       rendezvous_timeout=float(p["rendezvous_timeout"]),
                       collective_timeout=float(p["collective_timeout"]))
        spec = TrainSpec(**{**{f.name: p[f.name] for f in dataclasses.fields(TrainSpec) if f.name in p}, **derived})
        check_same_run(store, spec.run, run_id, run.trains, rows)  # its rows too, now known
        if not store.exists(spec.run.metadata) or not store.exists(spec.run.checkpoint):  # its first launch's
            store.write_bytes_atomic(spec.run.metadata, json.dumps({"seed": run.seed, "split_seed": run.split_seed,
                                                                    "run_id": run_id,
                                                                    **began(run.trains, rows)}).encode())
        facts = model_facts(p["model"], p["optimizer"], p["lr"], run.objs.build_losses(), num_proc,
                            data.train_rows if source is None else None, data.val_rows if source is None else None)
        grid = self._grid_point.grid if self._grid_point is not None else Grid()
        tracked = MlflowLog.open(p["mlflow"], {s.name: p[s.name] for s in ESTIMATOR_PARAMS if s.json}, facts,
                                 run_id, grid.parent_run, grid.experiment)
        launched = time.perf_counter()
        try:
            results = launch_with_retries(p, run, spec, spark, source,
                                          on_epoch=tracked.epoch if tracked is not None else None)
        except BaseException:
            if tracked is not None:
                tracked.end("KILLED" if sys.exc_info()[0] is KeyboardInterrupt else "FAILED")
            raise
        launch_seconds = time.perf_counter() - launched
        if results:
            log_fit(run_id, results, data, dry_run_seconds, launch_seconds, started, direct=source is not None)
        model = self._model(p, run, output_shapes, stepping or 1).setFeatureSizes(sizes)
        if tracked is not None:
            tracked.finish(model.getHistory(), model.getBestEpoch(), model)
            log.info("Logged run %s to MLflow run %s", run_id, tracked.run_id)
        if not getattr(store, "save_runs", True):
            store.rm(store.run(run_id).root)
        try:
            enforce_runs(store, keep={store.run(run_id).root})
        except Exception as exc:  # noqa: BLE001 - the budget is housekeeping: never costs the trained model
            log.warning("Store budget: could not check the run folders: %s", exc)
        return model

    def _model(self, p: Mapping[str, Any], run: RunPlan, output_shapes: List[tuple], stepping: int) -> TorchModel:
        """The TorchModel of the run's last checkpoint (weights, optimizer state and the whole history), or with
        restore_best, of its best epoch's checkpoint (the history stays whole)."""
        objs, store, run_id, layout = run.objs, run.store, run.run_id, run.store.run(run.run_id)
        history = load_checkpoint(store, layout.checkpoint, lazy=True)["history"]  # a full fine-tune's: no tensor
        best = run.monitor.best_epoch(history)
        report_stop(p, run.monitor, run.run_id, history)
        chosen = layout.checkpoint
        if p["restore_best"] and best is not None and best != len(history):
            if not store.exists(layout.best(best)):
                raise ValueError(f"restore_best=True: run {run_id!r} has no checkpoint of its best epoch {best} by "
                                 f"{run.monitor.key} ({store.url(layout.best(best))}); it keeps save_top_k="
                                 f"{p['save_top_k']} of them. Refit under a new run_id to keep it.")
            chosen = layout.best(best)
        skeleton = on_meta(p["model"])  # a fit of a factory: the base never built here (estimator.core.handle)
        # the adapters of a LoRA fit whose checkpoint holds them (a few MB) are read here; a full fine-tune's state
        # and fsdp's shards stay in the run's checkpoint, read where the model is built
        stored = skeleton and (p["peft_config"] is None or strategy_class(p).shards_checkpoints)
        trained = copy.deepcopy(p["model"])
        if skeleton and not stored:
            trainable_on_cpu(trained)
        elif not skeleton:
            trained = trained.cpu()
        optimizer = optimizer_for(trained, p["epochs"], stepping) if objs.lightning else build_optimizer(objs, trained)
        if stored:
            handle = ModelHandle(p["model_factory"], p["peft_config"], b"", run.seed,
                                 stored=RunState(store, layout, chosen, uuid.uuid4().hex))
            if not getattr(store, "save_runs", True):  # the run's folder goes after the fit: read whole here
                trained, optimizer = handle.built_with(optimizer, trained)
                handle = None
        else:
            restore(store, layout, chosen, trained, optimizer)  # fsdp's shards gathered into the whole module here
            handle = ModelHandle.of(p["model_factory"], p["peft_config"], trained, run.seed) if skeleton else None
        trained.eval()
        return TorchModel(model=trained, model_handle=handle, base_seed=run.seed if p["model_factory"] else None,
                          model_factory=p["model_factory"], optimizer=optimizer,
                          feature_cols=list(p["feature_cols"]), label_cols=list(p["label_cols"]),
                          input_shapes=p["input_shapes"], output_shapes=[list(s) for s in output_shapes],
                          history=[dict(h) for h in history],
                          run_id=run_id,
                          best_epoch=best,
                          use_gpu=p["use_gpu"], loss_kinds=[loss_kind(fn) for fn in objs.build_losses()],
                          tokenizer=p["tokenizer"],
                          **{**{s.name: p[s.name] for s in TRAINING_PARAMS},
                             "inference_batch_size": inference_rows(p, objs.objective),
                             "output_kind": output_kind(p, objs.objective)})


def output_kind(p: Mapping[str, Any], objective: Any) -> Optional[str]:
    """The fitted model's output_kind: the estimator's, else the objective's (a causal LM's: 'generate')."""
    if p["output_kind"] is not None:
        return p["output_kind"]
    return objective.transform_output if objective is not None else None


def inference_rows(p: Mapping[str, Any], objective: Any) -> Optional[int]:
    """The fitted model's inference_batch_size: the estimator's, else the larger of the validation batch and 256,
    else for a language model None (its output kind's own bound: generation's tokens per generate() call)."""
    if p["inference_batch_size"] is not None:
        return p["inference_batch_size"]
    if checks.language_model(objective):
        return None
    return max(p["val_batch_size"] or p["batch_size"], 256)


declare(TorchEstimator, ESTIMATOR_PARAMS, HOROVOD_REFUSED)


@dataclass(frozen=True)
class TextColumns:
    """What the schema says of the string columns, decided once: the text feature columns tokenized per batch, or
    a causal LM's prompt and response (or chat) columns (its objective says the fit is one)."""

    text_cols: Tuple[str, ...] = ()
    lm: Optional[LMSpec] = None

    @classmethod
    def of(cls, p: Mapping[str, Any], objective: Any, schema: Any) -> "TextColumns":
        return cls(checks.text_columns(p, objective, schema),
                   lm_spec(p, schema, objective.rows) if checks.language_model(objective) else None)


def columns_of(p: Mapping[str, Any]) -> List[str]:
    """The columns a fit reads: features, labels, the sample weights."""
    return list(p["feature_cols"]) + list(p["label_cols"]) + ([p["sample_weight_col"]] if p["sample_weight_col"]
                                                              else [])


def data_spec(p: Mapping[str, Any], text: TextColumns, store: Store, train: Tuple[Any, ...] = (),
              val: Tuple[Any, ...] = (), materialize_seconds: float = 0.0) -> DataSpec:
    """The columns and shapes from the params; the pieces (none in the direct mode: the ranks have them)."""
    return DataSpec(store, tuple(train), tuple(val), tuple(p["feature_cols"]), tuple(p["label_cols"]),
                    p["sample_weight_col"], checks.shapes(p["input_shapes"]), checks.shapes(p["label_shapes"]),
                    materialize_seconds=materialize_seconds, text_cols=text.text_cols,
                    max_length=effective_max_length(p), lm=text.lm)


def run_metadata(store: Store, run_id: str) -> Dict[str, Any]:
    path = store.run(run_id).metadata
    return json.loads(store.read_bytes(path)) if store.exists(path) else {}


def check_rows(data: DataSpec, num_proc: int, reader: str) -> None:
    if data.train_rows < num_proc:
        raise ValueError(f"The training split has {data.train_rows} rows, fewer than num_proc={num_proc}: every "
                         "rank needs at least one row. Use more data, a smaller validation, or fewer processes.")
    if reader == "petastorm" and len(data.train) < num_proc:
        raise ValueError(f"reader='petastorm' shards by Parquet row group, and the training data has "
                         f"{len(data.train)} row groups for num_proc={num_proc}. Set partitions_per_process or "
                         "repartition the DataFrame.")


def default_store() -> Store:
    path = os.path.join(tempfile.gettempdir(), "spark-torch-estimator")
    log.info("No store given: using %s (local mode only; pass store=Store.create(url) on a cluster)", path)
    return LocalStore(path)


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def _in_store(store: Store, path: str) -> str:
    """A folder of the store, from a path inside it or a full URL/path that names it."""
    if "://" in path or path.startswith(store.root):
        return store.fs._strip_protocol(path).rstrip("/")
    return store.path(path.strip("/"))


def pyspark_memory_per_task(spark: SparkSession) -> Optional[float]:
    """MB each Python worker may use when spark.executor.pyspark.memory is set: Spark splits it evenly over the
    executor's cores (one Python worker per task); None when it is not set."""
    text = spark.conf.get("spark.executor.pyspark.memory", None)
    if not text:
        return None
    units = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 ** 2}
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt])?b?\s*", str(text).lower())
    if match is None:
        return None
    cores = int(spark.conf.get("spark.executor.cores", "1") or 1)
    return int(match.group(1)) * units[match.group(2) or "m"] / max(1, cores)
