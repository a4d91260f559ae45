"""A fitted TorchModel as an MLflow pyfunc model: what MLflow logs for a model held as a handle
(estimator.core.handle), so that the driver never builds the weights for MLflow either. It holds what transform
sends the executors (the handle and the output kind's predictor, both pickled) and predicts a pandas DataFrame of
the feature columns with the same code transform runs per Arrow batch (estimator.predict.inference): its
columns are transform's added columns, a generated text the same text; with handle_invalid 'keep' or 'skip',
a row with a null gets null outputs (a pyfunc returns a row for each row it is given). Loading it builds the
model where it is loaded: the base folder (and for a full fine-tune, the run's checkpoint in the store) must be
readable there. mlflow is imported only by whoever logs or loads one."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import mlflow.pyfunc
import pyarrow as pa

from estimator.predict import inference


class TorchModelPyfunc(mlflow.pyfunc.PythonModel):
    """transform's per-batch function over a pandas DataFrame."""

    def __init__(self, key: str, blob: bytes, predictor: inference.SentPredictor, feature_cols: Sequence[str],
                 columns: Sequence[Tuple[str, str]], keep: bool = False):
        self.key, self.blob, self.predictor = key, blob, predictor
        self.feature_cols: List[str] = list(feature_cols)
        self.columns = list(columns)  # (the added column's name, the field of the predictor's struct it comes from)
        self.keep = keep  # handle_invalid other than 'error': a row with a null gets null outputs (one row a row)

    def predict(self, context, model_input, params=None):  # noqa: ANN001 - no hints: MLflow reads them as a signature
        """The added columns for the rows of `model_input` (a pandas DataFrame holding the feature columns)."""
        missing = [c for c in self.feature_cols if c not in model_input.columns]
        if missing:
            raise ValueError(f"The model reads the columns {self.feature_cols}; the input lacks {missing}.")
        arrays = [pa.array(model_input[c].tolist()) for c in self.feature_cols]
        predictor = inference.loaded(self.predictor)
        if getattr(self, "keep", False):  # (a pyfunc pickled before 0.3 has no `keep`)
            struct = inference.kept_nulls(lambda cols: inference.predict_arrow(self.key, self.blob, predictor, *cols),
                                          arrays, predictor.arrow_type())
        else:
            struct = inference.predict_arrow(self.key, self.blob, predictor, *arrays)
        frame = inference.pandas_frame(struct)
        return frame[[field for _, field in self.columns]].set_axis([name for name, _ in self.columns], axis=1)
