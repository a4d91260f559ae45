"""TorchModel: a trained nn.Module as a Spark ML Model with batched Arrow inference."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import uuid
import warnings
from typing import Any, Dict, List, Optional

from pyspark.ml import Model
from pyspark.ml.functions import array_to_vector
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, StringType, StructType
from torch import nn

from estimator.core import adapters
from estimator.core.handle import ModelHandle, held
from estimator.core.recipe import built_on_meta, loads_pretrained
from estimator.core.param_table import MODEL_PARAMS
from estimator.core.params import DeclaredParams, declare, one_of, param_error
from estimator.core.pickling import dumps
from estimator.core.quiet import hf_bars_off
from estimator.launch.session import task_gpus
from estimator.launch.shipping import ship_file, ship_package, temporary_file
from estimator.predict import inference
from estimator.predict.inference import SentPredictor, make_predict, make_predict_pandas
from estimator.predict.language_checks import check_chat_fields
from estimator.predict.kinds import PREDICTORS
from estimator.predict.persistence import Persistable
from estimator.predict.predictor import Predictor
from estimator.predict.schema import (CHAT_TYPE, added_fields, any_null, as_read, chat_of_maps, is_chat,
                                      null_checks, spark_type)
from estimator.predict.weights import save_pretrained_to
from estimator.core.lightning_module import for_inference

log = logging.getLogger("estimator")


# Horovod's TorchModel constructor names, and the arguments it takes that inference does not use
HOROVOD_NAMES = {"feature_columns": "feature_cols", "label_columns": "label_cols"}
HOROVOD_UNUSED = ("_metadata", "loss", "loss_constructors")


class TorchModel(DeclaredParams, Model, Persistable):
    """A trained model: `transform` adds one output column per label (and Spark ML's prediction columns).
    Also built directly, with Horovod's names (`TorchModel(model=m, feature_columns=[...], label_columns=[...],
    input_shapes=[[2]], history=None, optimizer=o, run_id='a')`)."""

    def __init__(self, **params: Any):
        """Args:
            **params: Any params of the [param reference](params.md), by name; Horovod's `feature_columns` and
                `label_columns` too.
        """
        kwargs = {HOROVOD_NAMES.get(k, k): v for k, v in params.items() if k not in HOROVOD_UNUSED}
        if callable(kwargs.get("model")) and not isinstance(kwargs["model"], nn.Module):
            # A factory (inference over a table with a pretrained model, no fit). A from_pretrained partial is held
            # as a handle: built here on the meta device (config and shapes), and on each executor by transform
            # (estimator.core.handle). Any other is built once here (it may draw its weights at random: every
            # executor must get the same) and sent whole. save writes its weights; load rebuilds it from them.
            factory = kwargs["model_factory"] = kwargs["model"]
            if loads_pretrained(factory):
                kwargs["model"] = built_model(functools.partial(built_on_meta, factory))
                kwargs["model_handle"] = ModelHandle(factory, None, b"")
            else:
                kwargs["model"] = built_model(factory)
        if "history" in kwargs and kwargs["history"] is None:
            kwargs["history"] = []
        super().__init__(**kwargs)

    @classmethod
    def load(cls, path: str) -> TorchModel:
        """Load a TorchModel saved by `save` (of this release or an earlier one); a `PipelineModel` holding one loads
        with `PipelineModel.load`.

        Args:
            path: The folder `save` wrote.

        Returns:
            The TorchModel, as it was saved.
        """
        return cls.read().load(path)

    def getHistory(self) -> List[Dict[str, float]]:
        """The run's history: one dict per epoch, `epoch` (1-based), `loss`, the metrics and their `val_` twins
        (with validation data), `lr` where a schedule sets it; empty for a model built without a fit."""
        return self.getOrDefault(self.history)

    def getBestEpoch(self) -> Optional[int]:
        """The best epoch (1-based) by the estimator's `monitor` and `monitor_mode`, the one `restore_best` keeps;
        None for a model built without a fit."""
        return self.getOrDefault(self.best_epoch)

    def getModel(self) -> nn.Module:
        """The trained module. A model held as a handle (a fit of a model factory: the driver keeps the adapters, or
        for a full fine-tune or fsdp, where the run's checkpoint is, not the weights; estimator.core.handle) is
        built here, once: this loads the base's weights (and the checkpoint's model and optimizer state) into this
        process. The module returned is then the model: what you change in it, transform and save use,
        so transform sends it whole from then on (a TorchModel.load of a saved copy holds a handle again). A base
        the factory loads quantized (QLoRA) is the exception: such a module cannot be sent, so getModel() builds
        a copy each time and transform and save keep the handle."""
        model, handle = self.getOrDefault("model"), self._held()
        if handle is not None and handle.recipe.quantization is not None:
            # a base loaded quantized (QLoRA) cannot be pickled to the executors: transform and save keep sending
            # the handle (they build the base there, quantized as the fit did); this is a copy
            log.info("getModel() built the model from its handle in this process (its base quantized); transform "
                     "and save keep the handle: what you change in this copy is not used")
            return handle.build()
        if handle is not None:
            built, optimizer = handle.built_with(self.getOrDefault("optimizer"), model)
            self._set(model=built, optimizer=optimizer, model_handle=None)
            log.info("getModel() built the model from its handle in this process; transform now sends this module")
            return built
        return model

    def getOutputColumns(self) -> List[str]:
        """output_cols, else `<label>__output` per label column; a model trained without labels: `output` (or
        `output_0`, `output_1`... for several outputs)."""
        if self.getOutputCols():
            return list(self.getOutputCols())
        if self.getLabelCols():
            return [f"{c}__output" for c in self.getLabelCols()]
        count = len(self.getOutputShapes() or [[1]])
        return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]

    def getFeatureColumns(self) -> List[str]:
        return list(self.getFeatureCols())

    def getLabelColumns(self) -> List[str]:
        return list(self.getLabelCols())

    def output_schema(self) -> StructType:
        """The columns transform adds, from params alone (no Spark job)."""
        return StructType([field for field, _ in added_fields(self._predictor(self.validated()))])

    def _predictor(self, p: Dict[str, Any], torch_threads: Optional[int] = None) -> Predictor:
        """What transform runs: the predictor of this model's output_kind from the registry
        (estimator.predict.kinds), chosen here once, built from its params and checked; the rest of transform only
        asks it. The param table checks only the value's type: which values exist is the registry's."""
        kind = p["output_kind"]
        if kind not in PREDICTORS:
            raise ValueError(param_error(type(self).__name__, "output_kind", one_of(list(PREDICTORS)), kind))
        return PREDICTORS[kind].build(p, self.getOutputColumns(), torch_threads)

    def transform(self, dataset: DataFrame, params: Any = None) -> DataFrame:
        """Add the model's outputs to a DataFrame (classic or Spark Connect); Spark ML's `Model.transform`.
        A task that fails while predicting fails the Spark action that computes the result; its Python
        traceback ends with a TransformFailed naming the cause.

        Args:
            dataset: Rows with the `feature_cols` the model was trained on (or its text/chat column).
            params: A param map that overrides this model's params for this call only.

        Returns:
            The rows with `getOutputColumns()` added (and, for a classifier, Spark ML's prediction columns);
                lazy, as any Spark transform.

        Raises:
            ValueError: A feature column is missing or of a type the model cannot read, or an output column
                exists already.
        """
        return super().transform(dataset, params)

    def _transform(self, df: DataFrame) -> DataFrame:
        p = self.validated()
        predictor = self._predictor(p, int(df.sparkSession.conf.get("spark.task.cpus", "1")))
        if p["feature_cols"][0] in df.columns:  # a chat column reads otherwise, where the kind takes chats
            predictor = predictor.bind_chat(is_chat(df.schema[p["feature_cols"][0]].dataType))
        ship_package(df.sparkSession)
        added = added_fields(predictor)
        schema = StructType([field for field, _ in added])
        for column in predictor.input_cols():
            if column not in df.columns:
                source = "feature_cols" if column in p["feature_cols"] else \
                    f"label_cols: output_kind={p['output_kind']!r} reads it"
                raise ValueError(f"Column {column!r} (from {source}) is not in the DataFrame. "
                                 f"Available columns: {', '.join(df.columns)}.")
            dtype = df.schema[column].dataType
            maps = chat_of_maps(column, dtype, "feature_cols" if column in p["feature_cols"] else "label_cols")
            if maps is not None and predictor.reads_text:
                raise ValueError(maps)
            if (column in p["feature_cols"] and predictor.reads_text and not isinstance(dtype, StringType)
                    and not is_chat(dtype)):  # a chat where the kind takes none: refused below
                text = "a string column" + (f", or a chat column ({CHAT_TYPE})" if predictor.accepts_chat else "")
                raise ValueError(f"Column {column!r} (from feature_cols) has type {dtype.simpleString()}; "
                                 f"output_kind={p['output_kind']!r} reads text: {text}. Cast it first "
                                 f"(F.col({column!r}).cast('string')).")
            if column not in p["feature_cols"] and not isinstance(dtype, StringType) and not is_chat(dtype):
                raise ValueError(f"Column {column!r} (from label_cols: output_kind={p['output_kind']!r} reads it) has "
                                 f"type {dtype.simpleString()}; the answer scored after the prompt is a string "
                                 f"column, as a fit reads it: cast it first (F.col({column!r}).cast('string')).")
            if isinstance(dtype, BinaryType):
                raise ValueError(f"Column {column!r} (from feature_cols) holds bytes: TorchModel.transform feeds "
                                 "numbers to the model and does not run transformation_fn. Decode the column into an "
                                 "array column first, e.g. F.pandas_udf(lambda s: s.map(decode), 'array<float>')"
                                 f"({column!r}) with your decoding function (bytes -> a flat list of floats), and "
                                 "pass that column with setFeatureCols([...]).")
            if is_chat(df.schema[column].dataType) and predictor.accepts_chat:  # every message field rendered
                check_chat_fields(p["tokenizer"], column, df.schema[column].dataType.elementType.names,
                                  p["chat_tools"])
            if is_chat(df.schema[column].dataType) and not predictor.accepts_chat:
                raise ValueError(f"Column {column!r} (from feature_cols) holds chats (a list of messages): transform "
                                 "generates the assistant's reply to them with output_kind='generate', a causal LM "
                                 "and its tokenizer.")
            if isinstance(df.schema[column].dataType, StringType) and p["tokenizer"] is None:
                raise ValueError(f"Column {column!r} (from feature_cols) holds strings and this TorchModel has no "
                                 "tokenizer: setTokenizer(...) with the one it was trained with.")
        clash = [f.name for f in schema.fields if f.name in df.columns]
        if clash:
            raise ValueError(f"Output columns {clash} already exist in the DataFrame; choose other names with "
                             "setOutputCols(...) / setPredictionCol(...), or drop them first.")
        gpus = task_gpus(df.sparkSession)
        if gpus > 1 and p["use_gpu"] is not False:
            log.warning("transform runs one copy of the model per Spark task, on the first of the %d GPUs each task "
                        "is given (spark.task.resource.gpu.amount=%g): the other %d stay idle. For inference, give "
                        "tasks one GPU each (spark.task.resource.gpu.amount=1, or a stage-level ResourceProfile) "
                        "and more tasks run at once.", int(gpus), gpus, int(gpus) - 1)
        blob = self._model_blob()
        handle = self._held()
        key = handle.key if handle is not None else hashlib.sha256(blob).hexdigest()
        source = blob if len(blob) <= inference.INLINE_BYTES else ship_model_file(df.sparkSession, key, blob)
        internal = spark_type(predictor.arrow_type())  # the UDF's struct, as inference builds it
        # the predictor travels as a model does: a kind of the user's own, defined only on the driver, by value
        sent = sent_predictor(predictor, p)
        keep = p["handle_invalid"] == "keep"  # a null struct for a row with a null, in the UDF
        if hasattr(F, "arrow_udf"):
            predict = F.arrow_udf(make_predict(key, source, sent, keep), internal).asNondeterministic()
        else:  # pyspark 3.5: a scalar pandas UDF; its varargs signature needs the explicit type
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "PandasUDFType will be deprecated"
                predict = F.pandas_udf(make_predict_pandas(key, source, sent, keep), internal,
                                       F.PandasUDFType.SCALAR).asNondeterministic()
        if p["handle_invalid"] == "skip":
            df = df.filter(~any_null(null_checks(df, predictor.input_cols())))  # as drop_nulls drops in fit
        inputs = [as_read(df, c) for c in predictor.input_cols()]
        tmp = f"__torch_{uuid.uuid4().hex[:8]}"
        with_struct = df.withColumn(tmp, predict(*inputs))
        columns = [(as_vector(F.col(tmp).getField(n)) if isinstance(f.dataType, VectorUDT)
                    else F.col(tmp).getField(n)).alias(f.name) for f, n in added]
        return with_struct.select(*[F.col(f"`{c}`") for c in df.columns], *columns)

    def as_pyfunc(self) -> Any:
        """The model as an MLflow pyfunc PythonModel (estimator.predict.pyfunc): transform's function over a
        pandas DataFrame of the feature columns (text columns as strings). A model held as a handle stays one:
        what it holds is the handle, built where the pyfunc is loaded."""
        from estimator.predict.pyfunc import TorchModelPyfunc

        p = self.validated()
        predictor = self._predictor(p).bind_chat(False)
        handle = self._held()
        if handle is not None and hasattr(handle.stored, "store"):  # the run's checkpoint: read with the
            stored = handle.stored  # credentials of where it is loaded, none kept in MLflow's files
            handle = dataclasses.replace(handle, stored=dataclasses.replace(
                stored, store=stored.store.without_credentials()))
        if handle is not None and hasattr(handle.factory, "without_credentials"):  # a folder at a remote URL
            stored = handle.stored  # (estimator.predict.folders): its optimizer's file is not the pyfunc's
            handle = dataclasses.replace(handle, factory=handle.factory.without_credentials(), stored=None if (
                stored is None) else dataclasses.replace(stored, fs=None, optimizer=None))
        blob = dumps(handle, "model", roots=[handle.factory, handle.peft_config]) if handle is not None else \
            self._model_blob()
        key = handle.key if handle is not None else hashlib.sha256(blob).hexdigest()
        sent = sent_predictor(predictor, p)
        added = [(f.name, n) for f, n in added_fields(predictor)]
        return TorchModelPyfunc(key, blob, sent, list(predictor.input_cols()), added,
                                keep=p["handle_invalid"] != "error")

    def save_pretrained(self, path: str, merged: bool = True) -> None:
        """Write a folder that Hugging Face's `from_pretrained` loads (config.json, model.safetensors) with the
        tokenizer's files when it is a Hugging Face tokenizer: a local path or a store URL. For a
        transformers PreTrainedModel only; `save(path)` saves any TorchModel. A model with adapters (peft_config):
        with `merged`, the adapters merged into the base weights (a plain model for serving); else the adapter
        folder that peft's PeftModel.from_pretrained(base, path) loads. A base the factory loads quantized (QLoRA)
        is merged into in its stored precision (the factory without its quantization_config): the folder holds
        no quantized weight."""
        handle = self._held()
        state = handle.mapped(self.getOrDefault("model"), None) if handle is not None else None
        if state is not None:  # a full fine-tune's weights, mapped from its run's checkpoint: the model not built
            save_pretrained_to(self.getOrDefault("model"), self.getTokenizer(), path, state[0])
            return
        if handle is None or not merged:
            model = self.getOrDefault("model") if handle is not None else self.getModel()  # the adapters: no base
        else:  # built here, not kept (a base loaded quantized, QLoRA's, in its stored precision: not rounded)
            model = handle.dequantized().build()
        save_pretrained_to(adapters.merged(model) if merged else model, self.getTokenizer(), path)

    def _held(self) -> Optional[ModelHandle]:
        """The handle the model is held as, else None (estimator.core.handle.held): what getModel, transform, the
        pyfunc and save_pretrained ask."""
        return held(self.getOrDefault("model"), self.getOrDefault("model_handle"))

    def _model_blob(self) -> bytes:
        """What transform sends: the handle (the base's factory and the adapters: the executors build the base),
        else the pickled module."""
        handle = self._held()
        if handle is not None:
            return dumps(handle, "model", roots=[handle.factory, handle.peft_config])
        model = self.getModel()
        return dumps(for_inference(model.cpu().eval()), "model", roots=[model])



def as_vector(column: Any) -> Any:
    """An array column as ml Vectors, a null as a null (array_to_vector fails on one: handle_invalid='keep')."""
    return F.when(column.isNull(), F.lit(None)).otherwise(array_to_vector(column))


def sent_predictor(predictor: Predictor, p: Dict[str, Any]) -> SentPredictor:
    """The predictor as transform (and the MLflow pyfunc) carries it: pickled with a kind of the user's own, one
    defined only on the driver, by value."""
    return SentPredictor(dumps(predictor, f"output_kind={p['output_kind']!r}'s predictor",
                               roots=[predictor, p['tokenizer']]))


def built_model(factory: Any) -> nn.Module:
    try:
        with hf_bars_off():
            model = factory()
    except Exception as exc:
        raise ValueError(f"The 'model' parameter of TorchModel is a callable, which is called once with no arguments "
                         f"to build the module; it raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise TypeError(f"The 'model' parameter of TorchModel must be a torch.nn.Module, or a zero-argument callable "
                        f"returning one; the callable returned {type(model).__name__}.")
    return model.eval()


def ship_model_file(spark: Any, key: str, blob: bytes) -> inference.ModelFile:
    """A pickled model too large for the UDF's closure, sent as a file named by its content (once a session)."""
    path = temporary_file("spark-torch-estimator-models", f"torch-model-{key[:32]}.pkl", blob)
    log.info("transform sends the model (%.0f MB pickled) to the executors as a file, not inside the UDF",
             len(blob) / 2 ** 20)
    return inference.ModelFile(ship_file(spark, path))


declare(TorchModel, MODEL_PARAMS)
