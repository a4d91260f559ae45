"""LanguageModelEvaluator: a Spark ML Evaluator of a language model's transform, so that a fine-tune is judged (and
picked by TrainValidationSplit or CrossValidator over a ParamGridBuilder) as any Spark ML model is.

- 'perplexity' (smaller is better) over a table scored by a TorchModel with output_kind='score': exp of minus the
  total log-probability over the total tokens scored, token-weighted (not a mean of the rows' perplexities), as a
  fit's loss reports it over the same rows.
- 'exactMatch' and 'tokenF1' (larger is better) of generated text (predictionCol) against a reference column
  (labelCol), each normalized as SQuAD's evaluation script does (lower case, no punctuation, no articles, single
  spaces), averaged over the rows.
- 'rewardAccuracy' (larger is better) over a preference table scored by a TorchModel with output_kind='score' and
  label_cols=[chosen, rejected]: how often the chosen answer's log-ratio to the reference (the model with its
  adapters off) is higher than the rejected one's, DPO's rewards/accuracies (TRL's) over the rows. Columns of
  other scores (a reward model's, or `chosen_logprob`/`rejected_logprob`: which answer the model itself finds
  more likely) can be named instead.

Saved and loaded with Spark ML's params metadata (classic and Spark Connect sessions)."""
from __future__ import annotations

import collections
import math
import re
import string
from typing import Any, Dict, Tuple

import pandas as pd
from pyspark import keyword_only
from pyspark.ml.evaluation import Evaluator
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType

from estimator.launch.session import metadata_session
from estimator.launch.shipping import ship_package

# each metric's isLargerBetter
METRICS = {"perplexity": False, "exactMatch": True, "tokenF1": True, "rewardAccuracy": True}


class LanguageModelEvaluator(Evaluator, MLReadable, MLWritable):
    """Evaluates a language model's transform: `metricName` 'perplexity' over `logprobCol` and `tokensCol` (the
    columns output_kind='score' adds), or 'exactMatch' / 'tokenF1' of `predictionCol` (generated text) against
    `labelCol` (the reference), or 'rewardAccuracy': how often `chosenCol` > `rejectedCol` (the columns
    output_kind='score' adds for a preference table)."""

    metricName: Param = Param(Params._dummy(), "metricName", "'perplexity' (over a table scored with "
                              "output_kind='score'), 'exactMatch' or 'tokenF1' (generated text against labelCol), "
                              "'rewardAccuracy' (a preference table's scores: chosenCol > rejectedCol)",
                              typeConverter=TypeConverters.toString)
    logprobCol: Param = Param(Params._dummy(), "logprobCol", "the rows' summed log-probabilities (perplexity)",
                              typeConverter=TypeConverters.toString)
    tokensCol: Param = Param(Params._dummy(), "tokensCol", "the rows' scored token counts (perplexity)",
                             typeConverter=TypeConverters.toString)
    predictionCol: Param = Param(Params._dummy(), "predictionCol", "the generated text (exactMatch, tokenF1)",
                                 typeConverter=TypeConverters.toString)
    labelCol: Param = Param(Params._dummy(), "labelCol", "the reference text (exactMatch, tokenF1)",
                            typeConverter=TypeConverters.toString)
    chosenCol: Param = Param(Params._dummy(), "chosenCol", "the chosen answers' scores (rewardAccuracy)",
                             typeConverter=TypeConverters.toString)
    rejectedCol: Param = Param(Params._dummy(), "rejectedCol", "the rejected answers' scores (rewardAccuracy)",
                               typeConverter=TypeConverters.toString)

    @keyword_only
    def __init__(self, *, metricName: str = "perplexity", logprobCol: str = "logprob", tokensCol: str = "tokens",
                 predictionCol: str = "prediction", labelCol: str = "label", chosenCol: str = "chosen_logratio",
                 rejectedCol: str = "rejected_logratio"):
        """Args:
            metricName: 'perplexity', 'exactMatch', 'tokenF1' or 'rewardAccuracy'.
            logprobCol: The summed log-probability column (output_kind='score' adds `logprob`).
            tokensCol: The scored token count column (output_kind='score' adds `tokens`).
            predictionCol: The generated text column (output_kind='generate' adds `prediction`).
            labelCol: The reference text column.
            chosenCol: The chosen answers' scores (output_kind='score' over label_cols=[chosen, rejected] adds
                `chosen_logratio`: its log-probability over the reference's).
            rejectedCol: The rejected answers' scores (`rejected_logratio`).
        """
        super().__init__()
        self._setDefault(metricName="perplexity", logprobCol="logprob", tokensCol="tokens",
                         predictionCol="prediction", labelCol="label", chosenCol="chosen_logratio",
                         rejectedCol="rejected_logratio")
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

    def getLabelCol(self) -> str:
        return self.getOrDefault(self.labelCol)

    def setPredictionCol(self, value: str) -> "LanguageModelEvaluator":
        return self._set(predictionCol=value)

    def getPredictionCol(self) -> str:
        return self.getOrDefault(self.predictionCol)

    def setLogprobCol(self, value: str) -> "LanguageModelEvaluator":
        return self._set(logprobCol=value)

    def getLogprobCol(self) -> str:
        return self.getOrDefault(self.logprobCol)

    def setTokensCol(self, value: str) -> "LanguageModelEvaluator":
        return self._set(tokensCol=value)

    def getTokensCol(self) -> str:
        return self.getOrDefault(self.tokensCol)

    def setChosenCol(self, value: str) -> "LanguageModelEvaluator":
        return self._set(chosenCol=value)

    def getChosenCol(self) -> str:
        return self.getOrDefault(self.chosenCol)

    def setRejectedCol(self, value: str) -> "LanguageModelEvaluator":
        return self._set(rejectedCol=value)

    def getRejectedCol(self) -> str:
        return self.getOrDefault(self.rejectedCol)

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
        if name == "rewardAccuracy":
            return self._reward_accuracy(dataset)
        return self._text_metric(dataset, name)

    def _columns(self, dataset: Any, first: Param, second: Param, reads: str, fix: str = "") -> Tuple[str, str]:
        """The two columns the metric reads, by their params; a dataset without them refused, saying which column
        is what (`reads`, formatted with their names) and the `fix`."""
        names = self.getOrDefault(first), self.getOrDefault(second)
        missing = [c for c in names if c not in dataset.columns]
        if missing:
            raise ValueError(f"LanguageModelEvaluator(metricName={self.metric()!r}) {reads.format(*names)}; the "
                             f"dataset has no {missing}.{fix}")
        return names

    def _perplexity(self, dataset: Any) -> float:
        logprob, tokens = self._columns(dataset, self.logprobCol, self.tokensCol, "reads the columns {!r} and {!r}, "
                                        "which a TorchModel adds with output_kind='score'",
                                        " Transform with model.copy({model.output_kind: 'score'}) (or "
                                        "setOutputKind('score')) first; in TrainValidationSplit or CrossValidator, "
                                        "give the estimator output_kind='score', so that every fitted model "
                                        "scores. A model that only generates has no likelihood to read.")
        row = dataset.agg(F.sum(F.col(logprob)).alias("l"), F.sum(F.col(tokens)).alias("t")).first()
        if not row["t"]:
            raise ValueError(f"LanguageModelEvaluator(metricName='perplexity'): no token was scored in column "
                             f"{tokens!r} (an empty table, or rows with nothing to score).")
        return math.exp(-float(row["l"]) / float(row["t"]))

    def _reward_accuracy(self, dataset: Any) -> float:
        chosen, rejected = self._columns(dataset, self.chosenCol, self.rejectedCol, "compares {!r} with {!r}, which a "
                                         "TorchModel adds with output_kind='score' over a preference table "
                                         "(label_cols=[chosen, rejected])")
        row = dataset.agg(F.count(F.lit(1)).alias("n"),
                          F.sum(F.when(F.col(chosen).isNull() | F.col(rejected).isNull(), 1).otherwise(0)).alias(
                              "null"),
                          F.avg((F.col(chosen) > F.col(rejected)).cast("double")).alias("m")).first()
        if not row["n"]:
            raise ValueError("LanguageModelEvaluator(metricName='rewardAccuracy'): the dataset has no rows.")
        if row["null"]:
            raise ValueError(f"LanguageModelEvaluator(metricName='rewardAccuracy'): {row['null']} of {row['n']} "
                             f"rows have no value in {chosen!r} or {rejected!r}. The log-ratios are null for a "
                             "model without adapters (its reference, the model before tuning, is not kept): set "
                             "chosenCol='chosen_logprob' and rejectedCol='rejected_logprob' to count how often the "
                             "model itself finds the chosen answer more likely.")
        return float(row["m"])

    def _text_metric(self, dataset: Any, name: str) -> float:
        prediction, label = self._columns(dataset, self.predictionCol, self.labelCol, "compares {!r} (the generated "
                                          "text: a causal LM's transform adds `prediction`) with {!r} (the "
                                          "reference: setLabelCol(...))")
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
        DefaultParamsWriter.saveMetadata(self.instance, path, metadata_session(self))


class _Reader(MLReader):
    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> LanguageModelEvaluator:
        metadata: Dict[str, Any] = DefaultParamsReader.loadMetadata(path, metadata_session(self))
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        return instance
