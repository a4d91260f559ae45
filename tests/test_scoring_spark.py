"""Scoring and evaluating language models the Spark ML way (output_kind='score', LanguageModelEvaluator): a fit's
held-out perplexity is the evaluator's over the same rows scored by its model; a pretrained model from a factory
scores a table with no fit; generated text against a reference (exactMatch, tokenF1); the evaluator saved and
loaded; what it cannot read refused by name."""
import functools
import math
import warnings

import pytest
import torch
from pyspark.sql import functions as F

from estimator import LanguageModelEvaluator, TorchEstimator, TorchModel
from lm_helpers import color_facts, save_pretrained_llama

pytestmark = pytest.mark.spark
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_pretrained_llama(str(tmp_path_factory.mktemp("llama") / "tiny"),
                                 [p + r for p, r in color_facts()] * 4)


def test_a_fits_held_out_perplexity_is_the_evaluators_over_its_scored_rows(spark, store, llama, tmp_path):
    """The validation rows (a column says which) scored by the fitted model: exp(-sum logprob / sum tokens) is the
    history's val_perplexity of the last epoch; the base, scored by a TorchModel from its factory (no fit), is
    worse on them. The model's generated answers against the responses: exactMatch and tokenF1 as SQuAD's script
    computes them over the rows."""
    from pyspark.ml.evaluation import Evaluator

    from estimator.evaluation import normalized, token_f1

    rows = [(p, r, i % 4 == 0) for i, (p, r) in enumerate(color_facts())]
    df = spark.createDataFrame(rows, "prompt string, response string, held boolean")
    factory = functools.partial(transformers.AutoModelForCausalLM.from_pretrained, llama)
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama)
    fitted = TorchEstimator(
        num_proc=2, store=store, model=factory, tokenizer=tokenizer, random_seed=1, verbose=0,
        peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
        optimizer=functools.partial(torch.optim.AdamW, lr=5e-3), feature_cols=["prompt"], label_cols=["response"],
        batch_size=4, epochs=6, max_new_tokens=10, validation="held").fit(df)  # 6: tokenF1 0.28, 4: about 0
    held = df.filter("held").drop("held")
    scored = fitted.copy({fitted.output_kind: "score"}).transform(held)
    assert [f.name for f in scored.schema.fields][-4:] == ["logprob", "tokens", "perplexity", "truncated"]
    evaluator = LanguageModelEvaluator()  # metricName='perplexity'
    assert isinstance(evaluator, Evaluator) and not evaluator.isLargerBetter()
    perplexity = evaluator.evaluate(scored)
    assert perplexity == pytest.approx(fitted.getHistory()[-1]["val_perplexity"], rel=1e-4)
    base = TorchModel(model=factory, tokenizer=tokenizer, feature_cols=["prompt"], label_cols=["response"],
                      output_kind="score")
    assert evaluator.evaluate(base.transform(held)) > 1.5 * perplexity

    answers = fitted.transform(held).select("prediction", "response").collect()
    for name, per_row in (("exactMatch", lambda p, r: float(normalized(p) == normalized(r))), ("tokenF1", token_f1)):
        metric = LanguageModelEvaluator(metricName=name, labelCol="response")
        assert metric.isLargerBetter()
        want = sum(per_row(a.prediction, a.response) for a in answers) / len(answers)
        assert metric.evaluate(fitted.transform(held)) == pytest.approx(want)
    assert 0 < want < 1  # some words right, not all: the rows' scores differ

    evaluator.setMetricName("tokenF1").setLabelCol("response")
    evaluator.write().save(str(tmp_path / "evaluator"))
    loaded = LanguageModelEvaluator.load(str(tmp_path / "evaluator"))
    assert (loaded.uid, loaded.getMetricName(), loaded.getOrDefault("labelCol")) == (evaluator.uid, "tokenF1",
                                                                                     "response")
    with pytest.raises(ValueError, match=r"metricName='perplexity'\) reads the columns 'logprob' and 'tokens'.*"
                                         r"output_kind='score'"):
        LanguageModelEvaluator().evaluate(fitted.transform(held))
    with pytest.raises(ValueError, match=r"Column 'response' \(from label_cols: output_kind='score' reads it\) is "
                                         r"not in the DataFrame"):
        base.transform(held.drop("response"))
    with pytest.raises(ValueError, match=r"Column 'response' \(from label_cols: output_kind='score' reads it\) has "
                                         r"type int; .*cast\('string'\)"):
        base.transform(held.withColumn("response", F.length("response")))


@pytest.mark.connect
def test_the_evaluator_on_a_table_of_its_own_saved_and_loaded(spark, tmp_path):
    """On classic Spark and through Spark Connect: perplexity token-weighted (not a mean of the rows'), exactMatch
    and tokenF1 over the rows, rewardAccuracy over pairs' scores (nulls refused by name), the evaluator saved and
    loaded."""
    from pyspark.sql import functions as F

    df = spark.createDataFrame([(-2.0, 1, "The kettle is teal.", "the kettle is TEAL"),
                                (-6.0, 4, "a red drum", "The drum is red.")],
                               "logprob double, tokens long, prediction string, label string")
    assert LanguageModelEvaluator().evaluate(df) == pytest.approx(math.exp(8 / 5))
    assert LanguageModelEvaluator(metricName="exactMatch").evaluate(df) == pytest.approx(0.5)
    f1 = LanguageModelEvaluator(metricName="tokenF1")
    assert f1.evaluate(df) == pytest.approx((1.0 + 2 * (2 / 2) * (2 / 3) / (1 + 2 / 3)) / 2)
    pairs = spark.createDataFrame([(0.5, 0.1, -3.0, -1.0), (0.2, 0.2, -2.0, -4.0), (-0.1, 0.3, -1.0, -5.0)],
                                  "chosen_logratio double, rejected_logratio double, chosen_logprob double, "
                                  "rejected_logprob double")
    accuracy = LanguageModelEvaluator(metricName="rewardAccuracy")
    assert accuracy.isLargerBetter() and accuracy.evaluate(pairs) == pytest.approx(1 / 3)  # a tie is not a win
    assert accuracy.copy({accuracy.chosenCol: "chosen_logprob", accuracy.rejectedCol: "rejected_logprob"}).evaluate(
        pairs) == pytest.approx(2 / 3)
    mine = LanguageModelEvaluator(metricName="rewardAccuracy").setChosenCol("chosen_logprob").setRejectedCol(
        "rejected_logprob")  # every column param has its setter and getter, as Spark's evaluators have
    assert mine.evaluate(pairs) == pytest.approx(2 / 3)
    assert (mine.getChosenCol(), mine.getRejectedCol(), mine.getLabelCol(), mine.getPredictionCol(),
            mine.getLogprobCol(), mine.getTokensCol()) == ("chosen_logprob", "rejected_logprob", "label",
                                                             "prediction", "logprob", "tokens")
    renamed = df.withColumnRenamed("logprob", "lp").withColumnRenamed("tokens", "n")
    assert LanguageModelEvaluator().setLogprobCol("lp").setTokensCol("n").evaluate(renamed) == pytest.approx(
        math.exp(8 / 5))
    with pytest.raises(ValueError, match=r"'rewardAccuracy'\): 1 of 3 rows have no value in 'chosen_logratio' or "
                                         r"'rejected_logratio'\. The log-ratios are null for a model without adapters"):
        accuracy.evaluate(pairs.withColumn("chosen_logratio", F.expr(
            "CASE WHEN rejected_logprob = -4.0 THEN NULL ELSE chosen_logratio END")))
    with pytest.raises(ValueError, match=r"compares 'chosen_logratio' with 'rejected_logratio', which a TorchModel "
                                         r"adds with output_kind='score' over a preference table"):
        accuracy.evaluate(df)
    f1.write().save(str(tmp_path / "f1"))
    loaded = LanguageModelEvaluator.load(str(tmp_path / "f1"))
    assert (loaded.uid, loaded.getMetricName(), loaded.isLargerBetter()) == (f1.uid, "tokenF1", True)


def test_squads_normalization_and_f1():
    from estimator.evaluation import normalized, token_f1

    assert normalized(" The Kettle, is  TEAL! ") == "kettle is teal"
    assert token_f1("the kettle is teal", "A kettle is red.") == pytest.approx(2 * (2 / 3) * (2 / 3) / (4 / 3))
    assert (token_f1("", ""), token_f1("teal", ""), token_f1("red", "teal")) == (1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"'metricName' parameter of LanguageModelEvaluator is 'bleu'; use one of "
                                         r"'perplexity', 'exactMatch', 'tokenF1', 'rewardAccuracy'"):
        LanguageModelEvaluator(metricName="bleu")
    assert math.isfinite(token_f1(None, "x"))


@pytest.mark.connect
def test_train_validation_split_picks_the_fine_tune_with_the_lower_held_out_perplexity(spark, store, llama,
                                                                                          mlflow_file_store):
    """output_kind='score' set on the estimator reaches each fitted model, so that the evaluator reads it inside
    TrainValidationSplit; of a grid over lr, the one that learns wins. The grid's fits run side by side
    (parallelism=2, a barrier task each on 2 slots), each a run of its own in the store and a child of the MLflow
    run active around the tuning, named alike; the best refit logs into that run. An unknown kind is refused
    before any job."""
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    mlflow = mlflow_file_store
    df = spark.createDataFrame(color_facts(), "prompt string, response string")
    est = TorchEstimator(
        num_proc=1, store=store, model=functools.partial(transformers.AutoModelForCausalLM.from_pretrained, llama),
        tokenizer=transformers.AutoTokenizer.from_pretrained(llama), random_seed=1, verbose=0,
        peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
        optimizer=functools.partial(torch.optim.AdamW), feature_cols=["prompt"], label_cols=["response"],
        batch_size=8, epochs=2, output_kind="score", run_id="tune")
    grid = ParamGridBuilder().addGrid(est.lr, [1e-6, 5e-3]).build()
    tvs = TrainValidationSplit(estimator=est, estimatorParamMaps=grid, evaluator=LanguageModelEvaluator(),
                               trainRatio=0.75, seed=2, parallelism=2)
    try:
        with mlflow.start_run() as parent:
            best = tvs.fit(df)
        assert best.bestModel.getLr() == pytest.approx(5e-3) and best.bestModel.getOutputKind() == "score"
        assert best.validationMetrics[1] < 0.8 * best.validationMetrics[0], best.validationMetrics
        children = mlflow.search_runs(filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                      order_by=["tags.mlflow.runName"])
        assert list(children["tags.mlflow.runName"]) == ["tune-grid0", "tune-grid1"]
        assert list(children["tags.estimator.run_id"]) == ["tune-grid0", "tune-grid1"]
        assert list(children["params.lr"]) == ["1e-06", "0.005"] and children["metrics.loss"].notna().all()
        assert all(store.exists(store.run(name).metadata) for name in children["tags.mlflow.runName"])
        (start0, start1), (end0, end1) = children["start_time"], children["end_time"]
        assert start1 < end0 and start0 < end1, children[["start_time", "end_time"]]  # side by side
        logged = mlflow.get_run(parent.info.run_id).data
        assert logged.params["lr"] == "0.005" and logged.tags["estimator.run_id"] == "tune"  # the best, refit
    finally:
        mlflow.set_tracking_uri(None)
    with pytest.raises(ValueError, match=r"'output_kind' parameter of TorchEstimator must be None, 'generate', "
                                         r"'embedding' or 'score'. Got 'scores'"):
        est.copy({est.output_kind: "scores"}).fit(df)


def test_a_grid_says_when_its_fits_side_by_side_need_more_slots_than_the_cluster_has():
    from estimator.fit.grid import Grid, GridPoint

    grid = Grid()
    with grid.fitting(), grid.fitting():
        grid.check_slots(2, 4)  # 2 fits of 2 tasks on 4 slots: room
        with grid.fitting(), pytest.warns(UserWarning, match=r"3 fits of the grid run at once \(the tuning's "
                                                             r"parallelism\), each of 2 barrier tasks, and this "
                                                             r"Spark application has 4 task slots.* at most 2 run "
                                                             r"side by side\. Set parallelism=2"):
            grid.check_slots(2, 4)
        with grid.fitting(), warnings.catch_warnings():
            warnings.simplefilter("error")
            grid.check_slots(2, 4)  # said once a grid
    assert grid.running == 0 and GridPoint(grid, 3).run_id("tune") == "tune-grid3"
