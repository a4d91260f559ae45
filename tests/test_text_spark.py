"""Fine-tuning a "pretrained" Hugging Face model on a text column: a small BERT and its WordPiece tokenizer saved
with save_pretrained (built here, no model hub), built on every rank from a factory, the text tokenized on the
ranks and in transform. Distributed equals one plain Hugging Face loop; Pipelines save and load."""
import functools
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from estimator import TorchEstimator
from estimator.core.faults import ENV
from text_helpers import save_pretrained_bert, topic_texts

pytestmark = pytest.mark.spark


def test_two_ranks_fine_tuning_bert_equal_one_plain_hugging_face_loop_of_batch_2b(spark, store, tmp_path, caplog):
    """Shuffle off and no dropout: 2 ranks of batch 8 (each padding its own batch) take the steps of one loop of
    batch 16 over the same rows; the factory's model is built on the ranks and the spec carries no weights."""
    ranks, batch, steps = 2, 8, 6
    rows = topic_texts(ranks * batch * steps, seed=3)
    path = save_pretrained_bert(str(tmp_path / "bert"), [t for t, _ in rows], hidden=64, dropout=0.0)
    store.makedirs(store.path("train"))
    for f in range(4):
        part = rows[f * len(rows) // 4:(f + 1) * len(rows) // 4]
        pq.write_table(pa.table({"text": [t for t, _ in part], "label": [y for _, y in part]}),
                       store.path("train", f"part-{f}.parquet"), row_group_size=20)
    tokenizer = AutoTokenizer.from_pretrained(path)
    factory = functools.partial(AutoModelForSequenceClassification.from_pretrained, path)
    with caplog.at_level(logging.INFO, logger="estimator"):
        fitted = TorchEstimator(num_proc=ranks, store=store, model=factory, tokenizer=tokenizer,
                                optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01),
                                loss=nn.CrossEntropyLoss(), feature_cols=["text"], label_cols=["label"],
                                batch_size=batch, epochs=1, shuffle=False, random_seed=3).fit_on_parquet("train")
    spec_bytes = [int(m) for m in re.findall(r"a spec of (\d+) bytes", caplog.text)]
    weights = sum(t.numel() * t.element_size() for t in factory().state_dict().values())
    assert spec_bytes and max(spec_bytes) < weights / 5, (spec_bytes, weights)

    plain = factory()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01)
    texts, labels = [t for t, _ in rows], torch.tensor([y for _, y in rows])
    half = len(rows) // ranks
    losses = []
    for step in range(steps):  # step s: batch s of every rank, together
        idx = np.concatenate([np.arange(r * half + step * batch, r * half + (step + 1) * batch) for r in range(ranks)])
        encoded = tokenizer([texts[i] for i in idx], padding="longest", truncation=True, max_length=64,
                            return_tensors="pt")
        optimizer.zero_grad()
        loss = nn.CrossEntropyLoss()(plain(**encoded).logits, labels[idx])
        loss.backward()
        optimizer.step()
        losses.append(loss.item() * len(idx))
    trained = fitted.getModel().state_dict()
    for name, value in plain.state_dict().items():
        assert torch.allclose(trained[name], value, atol=2e-5), (name, (trained[name] - value).abs().max())
    assert fitted.getHistory()[0]["loss"] == pytest.approx(sum(losses) / len(rows), rel=1e-4)
    assert not torch.allclose(factory().state_dict()["classifier.weight"], trained["classifier.weight"])

    # a train_step gets the encoded batch by name (and batch.features[0] as forward's keywords): the same weights
    stepped = TorchEstimator(num_proc=ranks, store=store, model=factory, tokenizer=tokenizer, run_id="step",
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01),
                             train_step=by_name, feature_cols=["text"], label_cols=["label"], batch_size=batch,
                             epochs=1, shuffle=False, random_seed=3).fit_on_parquet("train")
    for name, value in plain.state_dict().items():
        assert torch.allclose(stepped.getModel().state_dict()[name], value, atol=2e-5), name


def by_name(model, batch, ctx):
    assert set(batch.features[0]) >= {"input_ids", "attention_mask"}, batch.features
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return nn.functional.cross_entropy(logits, batch["label"])


def plain_loop_accuracy(path, train, test, epochs=3, batch=32):
    """A plain single-process Hugging Face loop over the training rows (batch 32 = 2 ranks x 16, the same AdamW,
    shuffled each epoch): its accuracy on the test rows."""
    torch.manual_seed(1)
    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    encode = lambda rows: tokenizer([r.text for r in rows], padding="longest", truncation=True,  # noqa: E731
                                    return_tensors="pt")
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(train)).tolist()
        for start in range(0, len(order), batch):
            rows = [train[i] for i in order[start:start + batch]]
            optimizer.zero_grad()
            nn.CrossEntropyLoss()(model(**encode(rows)).logits, torch.tensor([r.label for r in rows])).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        predicted = model(**encode(test)).logits.argmax(-1)
    return (predicted == torch.tensor([r.label for r in test])).float().mean().item()


def test_a_bert_fine_tuned_on_text_predicts_and_its_pipeline_loads_in_a_new_process(spark, store, tmp_path):
    from pyspark.ml import Pipeline
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    rows = topic_texts(800, seed=5)
    path = save_pretrained_bert(str(tmp_path / "bert"), [t for t, _ in rows])
    df = spark.createDataFrame(rows, "text string, label long")
    train, test = df.randomSplit([0.75, 0.25], seed=1)
    est = TorchEstimator(num_proc=2, store=store,
                         model=functools.partial(AutoModelForSequenceClassification.from_pretrained, path),
                         optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.01),
                         tokenizer=AutoTokenizer.from_pretrained(path), loss=nn.CrossEntropyLoss(),
                         metrics=["accuracy"], feature_cols=["text"], label_cols=["label"], batch_size=16, epochs=3,
                         random_seed=1)  # no validation split: the plain loop below trains on the same rows
    Pipeline(stages=[est]).write().save(str(tmp_path / "unfitted"))  # the estimator keeps its recipes
    again = Pipeline.load(str(tmp_path / "unfitted")).getStages()[0]
    assert type(again.getModel()()).__name__ == "BertForSequenceClassification"
    assert again.getModel().args == (path,) and again.getOptimizer().keywords == {"lr": 3e-3, "weight_decay": 0.01}
    assert again.getTokenizer()("a cat")["input_ids"] == est.getTokenizer()("a cat")["input_ids"]
    pm = Pipeline(stages=[est]).fit(train)
    history = pm.stages[0].getHistory()
    assert history[-1]["accuracy"] >= 0.9 and 0.0 < history[-1]["data_wait"] < 0.5, history
    pred = pm.transform(test)
    accuracy = MulticlassClassificationEvaluator(labelCol="label").setMetricName("accuracy").evaluate(pred)
    assert accuracy >= 0.9
    plain = plain_loop_accuracy(path, train.collect(), test.collect())
    assert abs(accuracy - plain) <= 0.02
    probabilities = np.array([r.probability.toArray() for r in pred.orderBy("text").select("probability").collect()])
    assert np.allclose(probabilities.sum(1), 1.0)
    pm.write().overwrite().save(str(tmp_path / "pipeline"))
    test.write.parquet(str(tmp_path / "test.parquet"))
    code = f"""
import numpy as np
from pyspark.ml import PipelineModel
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
pred = PipelineModel.load({str(tmp_path / 'pipeline')!r}).transform(spark.read.parquet({str(tmp_path / 'test.parquet')!r}))
np.save({str(tmp_path / 'loaded.npy')!r}, np.array([r.probability.toArray() for r in pred.orderBy("text").select("probability").collect()]))
spark.stop()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "loaded.npy"), probabilities, atol=1e-5)
    saved = tmp_path / "pipeline" / "stages" / os.listdir(tmp_path / "pipeline" / "stages")[0]
    assert {"module.json", "pretrained", "optimizer.pt"} <= set(os.listdir(saved)), os.listdir(saved)
    assert not (saved / "model.pkl").exists() and (saved / "pretrained" / "model.safetensors").exists()
    assert (saved / "objects.pkl").stat().st_size < (saved / "pretrained" / "model.safetensors").stat().st_size / 2

    # Hugging Face's own folder, tokenizer included: the trained model outside Spark, as from_pretrained loads it
    fitted = pm.stages[0]
    fitted.save_pretrained(str(tmp_path / "hf"))
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    texts = [r.text for r in test.orderBy("text").select("text").collect()]
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding="longest", truncation=True, return_tensors="pt")).logits
    np.testing.assert_allclose(torch.softmax(logits, -1).numpy(), probabilities, atol=1e-5)


def test_a_rank_killed_inside_an_epoch_resumes_the_fine_tuning_as_if_nothing_happened(spark, store, tmp_path,
                                                                                    monkeypatch, caplog):
    """Rank 1 dies before optimizer step 13 (epoch 2 holds steps 10-18), the retry
    rebuilds the model from its factory, resumes after the step-12 checkpoint with the same rows (dropout on: the
    same random numbers too), and ends with the weights and predictions of an uninterrupted fit."""
    rows = topic_texts(320, seed=7)
    path = save_pretrained_bert(str(tmp_path / "bert"), [t for t, _ in rows])
    df = spark.createDataFrame(rows, "text string, label long")

    def fit(run_id, **kw):
        return TorchEstimator(num_proc=2, store=store, run_id=run_id,
                              model=functools.partial(AutoModelForSequenceClassification.from_pretrained, path),
                              optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
                              tokenizer=AutoTokenizer.from_pretrained(path), loss=nn.CrossEntropyLoss(),
                              metrics=["accuracy"], feature_cols=["text"], label_cols=["label"], batch_size=16,
                              epochs=2, validation=0.1, random_seed=4, inmemory_cache_all=False, **kw).fit(df)

    clean = fit("text-clean")
    monkeypatch.setenv(ENV, json.dumps([{"point": "step", "rank": 1, "action": "exit", "step": 13, "attempt": 0}]))
    with caplog.at_level(logging.INFO, logger="estimator"):
        resumed = fit("text-resumed", checkpoint_steps=4, max_retries=1)
    assert re.search(r"Run text-resumed continues from its checkpoint after epoch 1 and step \d+ of epoch 2",
                     caplog.text), caplog.text[-2000:]
    for a, b in zip(resumed.getHistory(), clean.getHistory()):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    for name, value in clean.getModel().state_dict().items():
        assert torch.allclose(resumed.getModel().state_dict()[name], value, atol=1e-5), name
    sample = df.orderBy("text", "label").limit(40)
    probabilities = [np.array([r.probability.toArray() for r in m.transform(sample).orderBy("text").collect()])
                     for m in (clean, resumed)]
    np.testing.assert_allclose(probabilities[0], probabilities[1], atol=1e-5)
    assert clean.getHistory()[-1]["val_accuracy"] >= 0.8


def test_a_classifier_from_a_factory_and_its_tokenizer_predicts_a_text_column_without_a_fit(spark, tmp_path):
    """Off-the-shelf classification of a text column (no fit): the output's shape found by tokenizing two texts
    on the driver (it once fed BERT float zeros of its first Linear's width), the class scores, probabilities and
    prediction as a fitted classifier's, equal to a hand-written forward."""
    from estimator import TorchModel

    texts = [t for t, _ in topic_texts(40, seed=3)]
    path = save_pretrained_bert(str(tmp_path / "bert"), texts)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = TorchModel(model=functools.partial(AutoModelForSequenceClassification.from_pretrained, path),
                       tokenizer=tokenizer, feature_cols=["text"])
    assert [f.name for f in model.output_schema().fields] == ["output", "prediction", "rawPrediction", "probability"]
    got = model.transform(spark.createDataFrame([(t,) for t in texts[:12]], "text string").repartition(2)).collect()
    plain = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        logits = plain(**tokenizer([r.text for r in got], padding=True, return_tensors="pt")).logits
    assert np.allclose([list(r.output) for r in got], logits.numpy(), atol=1e-5)
    assert np.allclose([r.probability.toArray() for r in got], logits.softmax(-1).numpy(), atol=1e-5)
    assert [r.prediction for r in got] == logits.argmax(-1).double().tolist()
