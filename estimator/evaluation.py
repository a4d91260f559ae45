"""LanguageModelEvaluator: a Spark ML Evaluator of a language model's transform, so that a fine-tune is judged (and
picked by TrainValidationSplit or CrossValidator over a ParamGridBuilder) as any Spark ML model is.

- 'perplexity' (smaller is better) over a table scored by a TorchModel with output_kind='score': exp of minus the
  total log-probability over the total tokens scored, token-weighted (not a mean of the rows' perplexities), as a
  fit's loss reports it over the same rows.
- 'exactMatch' and 'tokenF1' (larger is better) of generated text (predictionCol) against a reference column
  (labelCol), each normalized as SQuAD's evaluation script does (lower case, no punctuation, no articles, single
  spaces), averaged over the rows.

Saved and loaded with Spark ML's params metadata (classic and Spark Connect sessions)."""
from __future__ import annotations

import collections
import math
import re
import string
from typing import Any, Dict

import pandas as pd
from pyspark import keyword_only
from pyspark.ml.evaluation import Evaluator
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType

from estimator.launch.session import is_connect
from estimator.launch.shipping import ship_package

METRICS = {"perplexity": False, "exactMatch": True, "tokenF1": True}  # each metric's isLargerBetter


class LanguageModelEvaluator(Evaluator, MLReadable, MLWritable):
    """Evaluates a language model's transform: `metricName` 'perplexity' over `logprobCol` and `tokensCol` (the
    columns output_kind='score' adds), or 'exactMatch' / 'tokenF1' of `predictionCol` (generated text) against
    `labelCol` (the reference)."""

    metricName: Param = Param(Params._dummy(), "metricName", "'perplexity' (over a table scored with "
                              "output_kind='score'), 'exactMatch' or 'tokenF1' (generated text against labelCol)",
                              typeConverter=TypeConverters.toString)
    logprobCol: Param = Param(Params._dummy(), "logprobCol", "the rows' summed log-probabilities (perplexity)",
                              typeConverter=TypeConverters.toString)
    tokensCol: Param = Param(Params._dummy(), "tokensCol", "the rows' scored token counts (perplexity)",
                             typeConverter=TypeConverters.toString)
    predictionCol: Param = Param(Params._dummy(), "predictionCol", "the generated text (exactMatch, tokenF1)",
                                 typeConverter=TypeConverters.toString)
    labelCol: Param = Param(Params._dummy(), "labelCol", "the reference text (exactMatch, tokenF1)",
                            typeConverter=TypeConverters.toString)

    @keyword_only
    def __init__(self, *, metricName: str = "perplexity", logprobCol: str = "logprob", tokensCol: str = "tokens",
                 predictionCol: str = "prediction", labelCol: str = "label"):
        """Args:
            metricName: 'perplexity', 'exactMatch' or 'tokenF1'.
            logprobCol: The summed log-probability column (output_kind='score' adds `logprob`).
            tokensCol: The scored token count column (output_kind='score' adds `tokens`).
            predictionCol: The generated text column (output_kind='generate' adds `prediction`).
            labelCol: The reference text column.
        """
        super().__init__()
        self._setDefault(metricName="perplexity", logprobCol="logprob", tokensCol="tokens",
                         predictionCol="prediction", labelCol="label")
        self._set(**self._input_kwargs)
        self.metric()  # an unknown metricName fails here, not in the first evaluate

    def setMetricName(self, value: str) -> "LanguageModelEvaluator":
        self._set(metricName=value)
        self.metric()
        return self

    def getMetricName(self) -> str:
        return self.getOrDefault(self.metricName)

    def setLabelCol(self, value: str) -> "LanguageModelEvaluator":
        return self._set(labelCol=value)

    def setPredictionCol(self, value: str) -> "LanguageModelEvaluator":
        return self._set(predictionCol=value)

    def metric(self) -> str:
        name = self.getOrDefault(self.metricName)
        if name not in METRICS:
            raise ValueError(f"The 'metricName' parameter of LanguageModelEvaluator is {name!r}; use one of "
                             f"{', '.join(repr(m) for m in METRICS)}.")
        return name

    def isLargerBetter(self) -> bool:
        return METRICS[self.metric()]

    def _evaluate(self, dataset: Any) -> float:
        name = self.metric()
        if name == "perplexity":
            return self._perplexity(dataset)
        return self._text_metric(dataset, name)

    def _perplexity(self, dataset: Any) -> float:
        logprob, tokens = self.getOrDefault(self.logprobCol), self.getOrDefault(self.tokensCol)
        missing = [c for c in (logprob, tokens) if c not in dataset.columns]
        if missing:
            raise ValueError(f"LanguageModelEvaluator(metricName='perplexity') reads the columns {logprob!r} and "
                             f"{tokens!r}, which a TorchModel adds with output_kind='score'; the dataset has no "
                             f"{missing}. Transform with model.copy({{model.output_kind: 'score'}}) (or "
                             "setOutputKind('score')) first; a model that only generates has no likelihood to read.")
        row = dataset.agg(F.sum(F.col(logprob)).alias("l"), F.sum(F.col(tokens)).alias("t")).first()
        if not row["t"]:
            raise ValueError(f"LanguageModelEvaluator(metricName='perplexity'): no token was scored in column "
                             f"{tokens!r} (an empty table, or rows with nothing to score).")
        return math.exp(-float(row["l"]) / float(row["t"]))

    def _text_metric(self, dataset: Any, name: str) -> float:
        prediction, label = self.getOrDefault(self.predictionCol), self.getOrDefault(self.labelCol)
        missing = [c for c in (prediction, label) if c not in dataset.columns]
        if missing:
            raise ValueError(f"LanguageModelEvaluator(metricName={name!r}) compares {prediction!r} (the generated "
                             f"text: a causal LM's transform adds `prediction`) with {label!r} (the reference: "
                             f"setLabelCol(...)); the dataset has no {missing}.")
        ship_package(dataset.sparkSession)
        scores = F.pandas_udf(_exact_match if name == "exactMatch" else _token_f1, DoubleType())
        found = dataset.select(F.avg(scores(F.col(prediction), F.col(label))).alias("m")).first()["m"]
        if found is None:
            raise ValueError(f"LanguageModelEvaluator(metricName={name!r}): the dataset has no rows.")
        return float(found)

    def write(self) -> MLWriter:
        return _Writer(self)

    @classmethod
    def read(cls) -> MLReader:
        return _Reader(cls)


def normalized(text: Any) -> str:
    """SQuAD's normalization: lower case, punctuation removed, the articles a/an/the removed, single spaces."""
    text = "".join(c for c in str("" if text is None else text).lower() if c not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def token_f1(prediction: Any, reference: Any) -> float:
    """SQuAD's F1 of the normalized texts' words (both empty: 1.0, one empty: 0.0)."""
    guess, truth = normalized(prediction).split(), normalized(reference).split()
    if not guess or not truth:
        return float(guess == truth)
    common = sum((collections.Counter(guess) & collections.Counter(truth)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(guess), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def _exact_match(predictions: pd.Series, references: pd.Series) -> pd.Series:
    return pd.Series([float(normalized(p) == normalized(r)) for p, r in zip(predictions, references)])


def _token_f1(predictions: pd.Series, references: pd.Series) -> pd.Series:
    return pd.Series([token_f1(p, r) for p, r in zip(predictions, references)])


class _Writer(MLWriter):
    def __init__(self, instance: LanguageModelEvaluator):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        session = self.sparkSession if is_connect(self.sparkSession) else self.sc
        DefaultParamsWriter.saveMetadata(self.instance, path, session)


class _Reader(MLReader):
    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> LanguageModelEvaluator:
        session = self.sparkSession if is_connect(self.sparkSession) else self.sc
        metadata: Dict[str, Any] = DefaultParamsReader.loadMetadata(path, session)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        return instance
