"""TorchModel: a trained nn.Module as a Spark ML Model with batched Arrow inference."""
from __future__ import annotations

import hashlib
import uuid
import warnings
from typing import Any, Dict, List, Optional

import numpy as np
from pyspark.ml import Model
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, BinaryType, DoubleType, FloatType, StructField, StructType

from estimator.inference import PREDICTION_FIELD, InferenceLayout, make_predict, make_predict_pandas
from estimator.params import DeclaredParams, declare
from estimator.param_table import MODEL_PARAMS
from estimator.persistence import Persistable
from estimator.pickling import dumps


class TorchModel(DeclaredParams, Model, Persistable):
    """A trained model: `transform` adds one output column per label (and `prediction`)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)

    def getOutputColumns(self) -> List[str]:
        return list(self.getOutputCols() or [f"{c}__output" for c in self.getLabelCols()])

    def getFeatureColumns(self) -> List[str]:
        return list(self.getFeatureCols())

    def getLabelColumns(self) -> List[str]:
        return list(self.getLabelCols())

    def output_schema(self) -> StructType:
        """The columns transform adds, from params alone (no Spark job)."""
        layout = self._layout(self.validated())
        fields = [StructField(name, ArrayType(FloatType(), False) if vec else DoubleType(), False)
                  for name, vec in zip(self.getOutputColumns(), layout.output_is_vector)]
        if layout.prediction_of is not None:
            fields.append(StructField(self.getPredictionCol(), DoubleType(), False))
        return StructType(fields)

    def _layout(self, p: Dict[str, Any], torch_threads: Optional[int] = None) -> InferenceLayout:
        outputs = self.getOutputColumns()
        if len(outputs) != len(p["label_cols"]):
            raise ValueError(f"The 'output_cols' parameter of TorchModel must list {len(p['label_cols'])} names, "
                             f"one per label column {p['label_cols']}. Got {outputs} instead.")
        shapes = p["output_shapes"] or [[]] * len(outputs)
        is_vector = tuple(int(np.prod(s)) > 1 for s in shapes)
        classify = (len(outputs) == 1 and is_vector[0] and len(shapes[0]) == 1 and bool(p["prediction_col"]))
        return InferenceLayout(
            feature_cols=tuple(p["feature_cols"]),
            input_shapes=None if p["input_shapes"] is None else tuple(tuple(s) for s in p["input_shapes"]),
            output_names=tuple(f"_{i}" for i in range(len(outputs))), output_is_vector=is_vector,
            prediction_of=0 if classify else None, batch_size=p["batch_size"], use_gpu=p["use_gpu"],
            torch_threads=torch_threads)

    def _transform(self, df: DataFrame) -> DataFrame:
        p = self.validated()
        layout = self._layout(p, int(df.sparkSession.conf.get("spark.task.cpus", "1")))
        schema = self.output_schema()
        for column in p["feature_cols"]:
            if column not in df.columns:
                raise ValueError(f"Column {column!r} (from feature_cols) is not in the DataFrame. "
                                 f"Available columns: {', '.join(df.columns)}.")
            if isinstance(df.schema[column].dataType, BinaryType):
                raise ValueError(f"Column {column!r} (from feature_cols) holds bytes: TorchModel.transform feeds "
                                 "numbers to the model and does not run transformation_fn. Decode the column into an "
                                 "array column first (e.g. a pandas_udf around your decoding function, as in "
                                 "notebooks/png_digits_example.py) and pass that with setFeatureCols([...]).")
        clash = [f.name for f in schema.fields if f.name in df.columns]
        if clash:
            raise ValueError(f"Output columns {clash} already exist in the DataFrame; choose other names with "
                             "setOutputCols(...) / setPredictionCol(...), or drop them first.")
        blob = self._model_blob()
        key = hashlib.sha256(blob).hexdigest()
        internal = StructType([StructField(n, f.dataType, True) for n, f in
                               zip(list(layout.output_names) + [PREDICTION_FIELD], schema.fields)])
        if hasattr(F, "arrow_udf"):
            predict = F.arrow_udf(make_predict(key, blob, layout), internal).asNondeterministic()
        else:  # pyspark 3.5: a scalar pandas UDF; its varargs signature needs the explicit type
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "PandasUDFType will be deprecated"
                predict = F.pandas_udf(make_predict_pandas(key, blob, layout), internal,
                                       F.PandasUDFType.SCALAR).asNondeterministic()
        inputs = [vector_to_array(F.col(c), "float32") if isinstance(df.schema[c].dataType, VectorUDT) else F.col(c)
                  for c in p["feature_cols"]]
        tmp = f"__torch_{uuid.uuid4().hex[:8]}"
        with_struct = df.withColumn(tmp, predict(*inputs))
        added = [F.col(tmp).getField(n).alias(f.name) for n, f in zip(internal.names, schema.fields)]
        return with_struct.select(*[F.col(f"`{c}`") for c in df.columns], *added)

    def _model_blob(self) -> bytes:
        model = self.getModel()
        return dumps(model.cpu().eval(), "model", roots=[model])



declare(TorchModel, MODEL_PARAMS)
