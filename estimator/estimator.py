"""TorchEstimator: validate -> materialize -> TrainSpec -> launcher.run -> TorchModel."""
from __future__ import annotations

import copy
import io
import logging
import os
import random
import tempfile
import time
import uuid
from typing import Any, Dict, List, Sequence

import torch
from pyspark.ml import Estimator
from pyspark.sql import DataFrame
from torch import nn

from estimator import checks
from estimator.data import read_rows
from estimator.launcher import SparkBarrierLauncher, check_slots
from estimator.losses import Objective
from estimator.materialize import materialize
from estimator.model import TorchModel
from estimator.params import (DeclaredParams, ParamSpec, declare, is_bool, is_callable_or_list, is_instance, is_int,
                              is_metric_list, is_number_list, is_run_id, is_shape_list, is_str_list, is_validation,
                              optional)
from estimator.persistence import Persistable
from estimator.pickling import dumps, user_objects
from estimator.spec import DataSpec, TrainSpec, UserObjects
from estimator.worker import as_tuple, prepare_arrays, to_tensors
from store import LocalStore, Store

log = logging.getLogger("estimator")

ESTIMATOR_PARAMS = [
    ParamSpec("num_proc", "number of training processes (Spark barrier tasks); default: the cluster's default "
              "parallelism", None, optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("store", "where materialized data, checkpoints and logs go; default: a local temporary folder",
              None, optional(is_instance(Store)), "a store.Store (Store.create(url)) or None", json=False),
    ParamSpec("model", "the torch.nn.Module to train (fit trains a copy)", None, is_instance(nn.Module),
              "a torch.nn.Module", json=False),
    ParamSpec("optimizer", "a torch.optim.Optimizer over the model's parameters; rebuilt on every rank", None,
              is_instance(torch.optim.Optimizer), "a torch.optim.Optimizer built over model.parameters()",
              json=False),
    ParamSpec("loss", "loss callable(output, label), or one per label column", None, is_callable_or_list,
              "a callable such as nn.CrossEntropyLoss(), or a list of them (one per label column)", json=False),
    ParamSpec("loss_weights", "weight of each label's loss in the total; default all 1", None,
              optional(is_number_list), "a list of numbers >= 0 (one per label column) or None"),
    ParamSpec("metrics", "metrics per epoch: 'accuracy' or callables(output, label) -> number", [],
              is_metric_list, "a list of 'accuracy' or callables(output, label)", json=False),
    ParamSpec("feature_cols", "columns passed to model.forward(), in order", None, is_str_list(),
              "a non-empty list of distinct column names"),
    ParamSpec("label_cols", "label columns, one per model output", None, is_str_list(),
              "a non-empty list of distinct column names"),
    ParamSpec("input_shapes", "shape of each feature batch, e.g. [[-1, 1, 28, 28]] (-1: the batch)", None,
              optional(is_shape_list), "a list of shapes like [[-1, 1, 28, 28]] or None"),
    ParamSpec("label_shapes", "shape of each label batch (-1: the batch)", None, optional(is_shape_list),
              "a list of shapes like [[-1, 3]] or None"),
    ParamSpec("sample_weight_col", "column of per-row loss weights", None, optional(is_instance(str)),
              "a column name or None"),
    ParamSpec("validation", "fraction of rows held out (0 <= v < 1), or a column that is true for validation rows",
              None, is_validation, "a float in [0, 1), a column name, or None"),
    ParamSpec("batch_size", "rows per training batch on each rank", 32, is_int(1), "an int >= 1"),
    ParamSpec("val_batch_size", "rows per validation batch; default batch_size", None, optional(is_int(1)),
              "an int >= 1 or None"),
    ParamSpec("epochs", "passes over the training data", 1, is_int(1), "an int >= 1"),
    ParamSpec("train_steps_per_epoch", "batches per epoch on every rank; default: one pass over the largest shard",
              None, optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("validation_steps_per_epoch", "validation batches per epoch; default: all validation rows", None,
              optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("shuffle", "shuffle each rank's rows every epoch", True, is_bool, "True or False"),
    ParamSpec("random_seed", "seed of the split, shuffling and dropout; default: drawn at fit time", None,
              optional(is_int(0)), "an int >= 0 or None"),
    ParamSpec("run_id", "name of the run folder in the store; default: a new unique id", None, is_run_id,
              "a name without '/', '\\\\' or '..', or None"),
    ParamSpec("use_gpu", "None: GPUs when every rank has one; True: require them; False: CPU", None,
              optional(is_bool), "True, False or None"),
    ParamSpec("verbose", "0: quiet, 1: per-epoch log lines, 2: more", 1, is_int(0, 2), "0, 1 or 2"),
]



class TorchEstimator(DeclaredParams, Estimator, Persistable):
    """Distributed PyTorch training as a Spark ML Estimator. See README for every param."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)

    def _fit(self, df: DataFrame) -> TorchModel:
        started = time.perf_counter()
        p = self.validated()
        checks.check_params(p)
        checks.check_schema(p, df.schema)
        losses = checks.losses_per_label(p["loss"], len(p["label_cols"]))
        loss_weights = list(p["loss_weights"] or [1.0] * len(p["label_cols"]))
        objs = user_objects(p["model"], p["optimizer"], losses, loss_weights, list(p["metrics"]))
        payload = dumps(objs, "model, optimizer, loss or metrics", roots=[objs.model, *losses, *p["metrics"]])
        spark = df.sparkSession
        store = p["store"] or default_store()
        num_proc = p["num_proc"] or spark.sparkContext.defaultParallelism
        seed = p["random_seed"] if p["random_seed"] is not None else random.SystemRandom().randrange(2**31)
        run_id = p["run_id"] or new_run_id()
        check_slots(spark.sparkContext, num_proc)
        data = self._materialize(df, p, store, seed, num_proc)
        output_shapes = dry_run(objs, data)
        spec = TrainSpec(data=data, payload=payload, run_root=store.run(run_id).root, batch_size=p["batch_size"],
                         val_batch_size=p["val_batch_size"] or p["batch_size"], epochs=p["epochs"],
                         train_steps_per_epoch=p["train_steps_per_epoch"],
                         validation_steps_per_epoch=p["validation_steps_per_epoch"], shuffle=p["shuffle"],
                         seed=seed, use_gpu=p["use_gpu"], verbose=p["verbose"])
        launch_started = time.perf_counter()
        results = SparkBarrierLauncher(spark, f"TorchEstimator.fit {run_id}").run(spec, num_proc)
        if p["verbose"]:
            for row in results[0].history:
                log.info("run %s epoch %d: %s", run_id, row["epoch"],
                         " ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "epoch"))
        log.info("Trained run %s on %d ranks in %.1fs (fit total %.1fs)", run_id, num_proc,
                 time.perf_counter() - launch_started, time.perf_counter() - started)
        return self._model(p, store, run_id, output_shapes, results[0].history)

    def _materialize(self, df: DataFrame, p: Dict[str, Any], store: Store, seed: int, num_proc: int) -> DataSpec:
        columns = list(p["feature_cols"]) + list(p["label_cols"])
        if p["sample_weight_col"]:
            columns.append(p["sample_weight_col"])
        m = materialize(df, store, columns, p["validation"], seed, num_proc)
        if m.train_rows < num_proc:
            raise ValueError(f"The training split has {m.train_rows} rows, fewer than num_proc={num_proc}: every "
                             "rank needs at least one row. Use more data, a smaller validation, or fewer processes.")
        return DataSpec(store, m.train, m.val, tuple(p["feature_cols"]), tuple(p["label_cols"]),
                        p["sample_weight_col"], checks.shapes(p["input_shapes"]), checks.shapes(p["label_shapes"]))

    def _model(self, p: Dict[str, Any], store: Store, run_id: str, output_shapes: List[tuple],
               history: Sequence[Dict[str, float]]) -> TorchModel:
        checkpoint = torch.load(io.BytesIO(store.read_bytes(store.run(run_id).checkpoint)), map_location="cpu",
                                weights_only=True)
        trained = copy.deepcopy(p["model"]).cpu()
        trained.load_state_dict(checkpoint["model"])
        trained.eval()
        return TorchModel(model=trained, feature_cols=list(p["feature_cols"]), label_cols=list(p["label_cols"]),
                          input_shapes=p["input_shapes"], output_shapes=[list(s) for s in output_shapes],
                          history=[dict(h) for h in history], run_id=run_id,
                          batch_size=max(p["val_batch_size"] or p["batch_size"], 256), use_gpu=p["use_gpu"])



declare(TorchEstimator, ESTIMATOR_PARAMS)


def dry_run(objs: UserObjects, data: DataSpec) -> List[tuple]:
    """Forward and loss on two training rows on the driver, before launching: a wrong signature,
    shape or loss fails here in a second with a clear message, not on every rank. Returns the
    per-row shape of each output (the TorchModel's output schema comes from it)."""
    rows = min(2, data.train_rows)
    arrays = prepare_arrays(data, read_rows(data.store, data.train, 0, rows, data.columns))
    features, labels, weights = to_tensors(arrays, data, torch.device("cpu"))
    model = copy.deepcopy(objs.model).eval()
    shown = ", ".join(f"{c}: {tuple(t.shape)}" for c, t in zip(data.feature_cols, features))
    try:
        with torch.no_grad():
            outputs = as_tuple(model(*features))
    except Exception as exc:  # noqa: BLE001 - any failure here is the user's forward
        raise ValueError(f"The model's forward() failed on {rows} training rows, called with the feature_cols "
                         f"in order ({shown}): {type(exc).__name__}: {exc}. Check feature_cols, input_shapes and "
                         "forward()'s arguments.") from None
    objective = Objective(copy.deepcopy(objs.losses), objs.loss_weights, objs.metrics, data.label_cols,
                          weighted=data.sample_weight_col is not None)
    try:
        objective(outputs, labels, weights)
    except Exception as exc:  # noqa: BLE001
        got = ", ".join(str(tuple(o.shape)) for o in outputs)
        want = ", ".join(f"{c}: {tuple(t.shape)} {t.dtype}" for c, t in zip(data.label_cols, labels))
        raise ValueError(f"The loss or metrics failed on the model's outputs ({got}) and the labels ({want}): "
                         f"{type(exc).__name__}: {exc}. Check loss, label_cols and label_shapes.") from None
    return [tuple(o.shape[1:]) for o in outputs]


def default_store() -> Store:
    path = os.path.join(tempfile.gettempdir(), "spark-torch-estimator")
    log.info("No store given: using %s (local mode only; pass store=Store.create(url) on a cluster)", path)
    return LocalStore(path)


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
