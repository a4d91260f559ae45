"""The output kinds of TorchModel.transform: one Predictor (estimator.predict.predictor) per value of its
`output_kind` param, one module each, and the registry PREDICTORS. TorchModel looks its kind up here once;
nothing else compares the value. A new kind is a new module here and one line in PREDICTORS (CONTRIBUTING.md
'Adding an output kind'). Imported where the UDF runs (the kinds' classes are unpickled there): never pyspark's
driver API."""
from __future__ import annotations

from typing import Dict, Optional, Type

from estimator.predict.kinds.embedding import Embedding
from estimator.predict.kinds.generate import Generate
from estimator.predict.kinds.score import Score
from estimator.predict.kinds.values import Values
from estimator.predict.predictor import Predictor

PREDICTORS: Dict[Optional[str], Type[Predictor]] = {
    None: Values,  # the forward's numbers, and a classifier's or regressor's prediction columns
    "generate": Generate,  # the text a causal LM generates
    "embedding": Embedding,  # a vector per row from hidden states
    "score": Score,  # each row's log-likelihood under a causal LM
}

