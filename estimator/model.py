"""TorchModel: a trained nn.Module as a Spark ML Model with batched Arrow inference."""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import uuid
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import torch
from pyspark.ml import Model
from pyspark.ml.functions import array_to_vector, vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_type
from pyspark.sql.types import (ArrayType, BinaryType, DataType, DoubleType, FloatType, StringType, StructField,
                               StructType)
from torch import nn

from estimator.core import adapters
from estimator.core.adapters import can_generate
from estimator.core.param_table import MODEL_PARAMS
from estimator.core.params import DeclaredParams, declare
from estimator.core.pickling import dumps
from estimator.core.quiet import hf_bars_off
from estimator.core.outputs import outputs_of
from estimator.data.arrays import reshape
from estimator.data.text import Tokenize
from estimator.launch.session import task_gpus
from estimator.launch.shipping import ship_file, ship_package, temporary_file
from estimator.predict import inference
from estimator.predict.inference import (PREDICTION_FIELD, PROBABILITY_FIELD, RAW_FIELD, InferenceLayout, arrow_type,
                                 head_fields, head_of, make_predict, make_predict_pandas)
from estimator.predict.language_checks import (check_max_length, check_max_new_tokens, check_vocabulary,
                                               effective_max_length)
from estimator.predict.persistence import Persistable
from estimator.predict.schema import is_chat
from estimator.predict.weights import save_pretrained_to
from estimator.train.lightning import for_inference

log = logging.getLogger("estimator")


# Horovod's TorchModel constructor names, and the arguments it takes that inference does not use
HOROVOD_NAMES = {"feature_columns": "feature_cols", "label_columns": "label_cols"}
HOROVOD_UNUSED = ("_metadata", "loss", "loss_constructors")


class TorchModel(DeclaredParams, Model, Persistable):
    """A trained model: `transform` adds one output column per label (and Spark ML's prediction columns).
    Also built directly, with Horovod's names (`TorchModel(model=m, feature_columns=[...], label_columns=[...],
    input_shapes=[[2]], history=None, optimizer=o, run_id='a')`)."""

    def __init__(self, **kwargs: Any):
        kwargs = {HOROVOD_NAMES.get(k, k): v for k, v in kwargs.items() if k not in HOROVOD_UNUSED}
        if callable(kwargs.get("model")) and not isinstance(kwargs["model"], nn.Module):
            # a factory (inference over a table with a pretrained model, no fit): built once here; save writes
            # its weights and load rebuilds it through the factory, as for a fitted model built by one
            kwargs["model_factory"], kwargs["model"] = kwargs["model"], built_model(kwargs["model"])
        if "history" in kwargs and kwargs["history"] is None:
            kwargs["history"] = []
        super().__init__(**kwargs)

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
        p = self.validated()
        return StructType([field for field, _ in self._added(p, self._layout(p))])

    def _added(self, p: Dict[str, Any], layout: InferenceLayout) -> List[Tuple[StructField, str]]:
        """Each added column with the field of the inference struct it comes from."""
        if layout.kind == "generate":  # the text in each output column and in prediction_col
            added = [(StructField(name, StringType(), True), field)
                     for name, field in zip(self.getOutputColumns(), layout.output_names)]
            return added + ([(StructField(p["prediction_col"], StringType(), True), PREDICTION_FIELD)]
                            if p["prediction_col"] else [])
        added = [(StructField(name, ArrayType(FloatType(), False) if vec else DoubleType(), False), field)
                 for name, vec, field in zip(self.getOutputColumns(), layout.output_is_vector, layout.output_names)]
        names = {PREDICTION_FIELD: p["prediction_col"], RAW_FIELD: p["raw_prediction_col"],
                 PROBABILITY_FIELD: p["probability_col"]}
        for field in head_fields(layout.head):
            if names[field]:
                added.append((StructField(names[field], DoubleType() if field == PREDICTION_FIELD else VectorUDT(),
                                          False), field))
        return added

    def _layout(self, p: Dict[str, Any], torch_threads: Optional[int] = None) -> InferenceLayout:
        if p["output_kind"] is not None:
            return self._kind_layout(p, torch_threads)
        for_inference(p["model"])  # a LightningModule with neither forward() nor predict_step() is refused here
        outputs = self.getOutputColumns()
        if p["label_cols"] and len(outputs) != len(p["label_cols"]):
            raise ValueError(f"The 'output_cols' parameter of TorchModel must list {len(p['label_cols'])} names, "
                             f"one per label column {p['label_cols']}. Got {outputs} instead.")
        shapes = p["output_shapes"] if p["output_shapes"] is not None else self._probe_output_shapes(p)
        if len(shapes) != len(outputs):
            raise ValueError(f"The model returns {len(shapes)} outputs but TorchModel has {len(outputs)} label columns "
                             f"{p['label_cols']}; pass one label column per output.")
        is_vector = tuple(int(np.prod(s)) > 1 for s in shapes)
        kinds = p["loss_kinds"] or ["unknown"] * len(outputs)
        return InferenceLayout(
            feature_cols=tuple(p["feature_cols"]),
            input_shapes=None if p["input_shapes"] is None else tuple(tuple(s) for s in p["input_shapes"]),
            output_names=tuple(f"_{i}" for i in range(len(outputs))), output_is_vector=is_vector,
            head=head_of(kinds[0], shapes[0]) if len(outputs) == 1 and p["label_cols"] else None, batch_size=p["inference_batch_size"],
            use_gpu=p["use_gpu"], torch_threads=torch_threads,
            feature_sizes=None if p["feature_sizes"] is None else tuple(p["feature_sizes"]),
            tokenize=Tokenize(p["tokenizer"], (), effective_max_length(p)) if p["tokenizer"] is not None else None)

    def _kind_layout(self, p: Dict[str, Any], torch_threads: Optional[int]) -> InferenceLayout:
        """output_kind 'generate' or 'embedding' (estimator.predict.generation): one text or chat column."""
        kind, outputs = p["output_kind"], self.getOutputColumns()
        if p["tokenizer"] is None:
            raise ValueError(f"TorchModel with output_kind={kind!r} tokenizes its feature column: set tokenizer (the "
                             "model's Hugging Face tokenizer).")
        if len(p["feature_cols"]) != 1:
            raise ValueError(f"TorchModel with output_kind={kind!r} reads one column (the text, or a chat's "
                             f"messages); got feature_cols={list(p['feature_cols'])}.")
        if kind == "generate" and not can_generate(p["model"]):
            raise ValueError(f"TorchModel with output_kind='generate' needs a model that generates (a causal LM, "
                             f"AutoModelForCausalLM); {type(p['model']).__name__} does not.")
        check_max_length(p, "TorchModel")
        check_vocabulary(p, "TorchModel")
        if kind == "generate":
            check_max_new_tokens(p, "TorchModel")
        return InferenceLayout(
            feature_cols=tuple(p["feature_cols"]), input_shapes=None,
            output_names=tuple(f"_{i}" for i in range(len(outputs))),
            output_is_vector=(kind == "embedding",) * len(outputs), head=None, batch_size=p["inference_batch_size"],
            use_gpu=p["use_gpu"], torch_threads=torch_threads,
            tokenize=Tokenize(p["tokenizer"], (), effective_max_length(p)), kind=kind,
            max_new_tokens=p["max_new_tokens"], generate_kwargs=p["generate_kwargs"])

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
        layout = self._layout(p, int(df.sparkSession.conf.get("spark.task.cpus", "1")))
        if layout.kind == "generate" and p["feature_cols"][0] in df.columns:
            layout = dataclasses.replace(layout, chat=is_chat(df.schema[p["feature_cols"][0]].dataType))
        ship_package(df.sparkSession)
        added = self._added(p, layout)
        schema = StructType([field for field, _ in added])
        for column in p["feature_cols"]:
            if column not in df.columns:
                raise ValueError(f"Column {column!r} (from feature_cols) is not in the DataFrame. "
                                 f"Available columns: {', '.join(df.columns)}.")
            if isinstance(df.schema[column].dataType, BinaryType):
                raise ValueError(f"Column {column!r} (from feature_cols) holds bytes: TorchModel.transform feeds "
                                 "numbers to the model and does not run transformation_fn. Decode the column into an "
                                 "array column first (e.g. a pandas_udf around your decoding function, as in "
                                 "notebooks/png_digits_example.py) and pass that with setFeatureCols([...]).")
            if is_chat(df.schema[column].dataType) and p["output_kind"] != "generate":
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
        key = hashlib.sha256(blob).hexdigest()
        source = blob if len(blob) <= inference.INLINE_BYTES else ship_model_file(df.sparkSession, key, blob)
        internal = spark_type(arrow_type(layout))  # the UDF's struct, as inference builds it
        if hasattr(F, "arrow_udf"):
            predict = F.arrow_udf(make_predict(key, source, layout), internal).asNondeterministic()
        else:  # pyspark 3.5: a scalar pandas UDF; its varargs signature needs the explicit type
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "PandasUDFType will be deprecated"
                predict = F.pandas_udf(make_predict_pandas(key, source, layout), internal,
                                       F.PandasUDFType.SCALAR).asNondeterministic()
        inputs = [vector_to_array(F.col(c), "float32") if isinstance(df.schema[c].dataType, VectorUDT) else F.col(c)
                  for c in p["feature_cols"]]
        tmp = f"__torch_{uuid.uuid4().hex[:8]}"
        with_struct = df.withColumn(tmp, predict(*inputs))
        columns = [(array_to_vector(F.col(tmp).getField(n)) if isinstance(f.dataType, VectorUDT)
                    else F.col(tmp).getField(n)).alias(f.name) for f, n in added]
        return with_struct.select(*[F.col(f"`{c}`") for c in df.columns], *columns)

    def _probe_output_shapes(self, p: Dict[str, Any]) -> List[List[int]]:
        """Per-row output shapes by one forward pass on the driver (no Spark job), for a TorchModel built
        without output_shapes: the feature shapes come from input_shapes, else from a first Linear layer."""
        rows, inputs = 2, []
        for i, column in enumerate(p["feature_cols"]):
            shape = p["input_shapes"][i] if p["input_shapes"] else None
            if shape is None:
                first = next((m for m in p["model"].modules() if isinstance(m, nn.Linear)), None)
                if first is None or len(p["feature_cols"]) > 1:
                    raise ValueError(f"TorchModel cannot tell the shape of {column!r} to find the model's output "
                                     "columns without a Spark job: pass input_shapes (e.g. [[-1, 64]]) or "
                                     "output_shapes (e.g. [[10]]).")
                shape = [-1, first.in_features]
            inputs.append(reshape(np.zeros((rows, int(np.prod([d for d in shape if d != -1]))), np.float32),
                                  shape, column))
        model = copy.deepcopy(p["model"]).cpu().eval()
        with torch.no_grad():
            outputs = outputs_of(model(*[torch.from_numpy(np.ascontiguousarray(a)) for a in inputs]))
        return [list(o.shape[1:]) for o in outputs]

    def save_pretrained(self, path: str, merged: bool = True) -> None:
        """Write a folder that Hugging Face's `from_pretrained` loads (config.json, model.safetensors) with the
        tokenizer's files when it is a Hugging Face tokenizer: a local path or a store URL. For a
        transformers PreTrainedModel only; `save(path)` saves any TorchModel. A model with adapters (peft_config):
        with `merged`, the adapters merged into the base weights (a plain model for serving); else the adapter
        folder that peft's PeftModel.from_pretrained(base, path) loads."""
        model = self.getModel()
        save_pretrained_to(adapters.merged(model) if merged else model, self.getTokenizer(), path)

    def _model_blob(self) -> bytes:
        model = self.getModel()
        return dumps(for_inference(model.cpu().eval()), "model", roots=[model])



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


def spark_type(t: pa.DataType) -> DataType:
    """Arrow -> Spark, keeping whether list elements may be null (pyspark 3.5's converter drops that)."""
    if pa.types.is_struct(t):
        return StructType([StructField(f.name, spark_type(f.type), True) for f in t])
    if pa.types.is_list(t):
        return ArrayType(spark_type(t.value_type), t.value_field.nullable)
    return from_arrow_type(t)


declare(TorchModel, MODEL_PARAMS)
