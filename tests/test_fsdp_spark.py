"""strategy='fsdp' through Spark: the small BERT of the text example fine-tuned sharded on 2 ranks, a rank killed
inside an epoch and the run retried from every rank's shards, trains what DDP trains uninterrupted; the
TorchModel is a plain module that transforms, saves and loads in a Pipeline; accumulation,
validation in lockstep, bf16-mixed, a train_step, a train_fn and a LightningModule; what sharding cannot serve is
refused before any job."""
import functools
import json
import logging
import re

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from estimator import TorchEstimator
from estimator.core.faults import ENV
from helpers import BlockMLP, metrics, seeded
from spark_helpers import digits_frame
from text_helpers import save_pretrained_bert, topic_texts

pytestmark = pytest.mark.spark


def bert_on_meta(path):
    """The saved BERT's shape on the meta device: its weights are the fit's weights_folder."""
    from transformers import AutoConfig

    from estimator import parameters_on_meta

    with parameters_on_meta():
        return AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(path))


def test_a_bert_fine_tuned_sharded_and_retried_after_a_killed_rank_trains_what_ddp_trains(spark, store, tmp_path,
                                                                                           monkeypatch, caplog):
    """The sharded fit's model is built on the meta device, each rank reading its shards of the saved weights
    (weights_folder); DDP's is from_pretrained on each rank. Rank 1 dies before optimizer step 13 (epoch 2); the
    retry loads the step-12 shards both ranks wrote (in the foreground here: a background write that the kill cuts
    leaves the epoch-1 checkpoint, as it should). The weights, the history (validation in lockstep over uneven
    shards) and the predictions are DDP's."""
    rows = topic_texts(320, seed=7)
    path = save_pretrained_bert(str(tmp_path / "bert"), [t for t, _ in rows])
    df = spark.createDataFrame(rows, "text string, label long")

    def estimator(run_id, model=functools.partial(AutoModelForSequenceClassification.from_pretrained, path), **kw):
        return TorchEstimator(num_proc=2, store=store, run_id=run_id, model=model,
                              optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
                              tokenizer=AutoTokenizer.from_pretrained(path), loss=nn.CrossEntropyLoss(),
                              metrics=["accuracy"], feature_cols=["text"], label_cols=["label"], batch_size=16,
                              epochs=2, validation=0.1, random_seed=4, inmemory_cache_all=False, **kw)

    ddp = estimator("bert-ddp", shared_memory_allreduce=False).fit(df)
    monkeypatch.setenv(ENV, json.dumps([{"point": "step", "rank": 1, "action": "exit", "step": 13, "attempt": 0}]))
    with caplog.at_level(logging.INFO, logger="estimator"):
        pipeline = Pipeline(stages=[estimator("bert-fsdp", functools.partial(bert_on_meta, path), weights_folder=path,
                                              strategy="fsdp", checkpoint_steps=4, max_retries=1,
                                              checkpoint_async=False)]).fit(df)
    fsdp = pipeline.stages[0]
    monkeypatch.delenv(ENV)
    assert re.search(r"Run bert-fsdp continues from its checkpoint after epoch 1 and step \d+ of epoch 2",
                     caplog.text), caplog.text[-2000:]
    assert "gradients averaged by gloo reduce-scatter (fsdp: model, gradients and optimizer state in 2 shards)" \
        in caplog.text
    for a, b in zip(fsdp.getHistory(), ddp.getHistory()):
        assert metrics(a) == pytest.approx(metrics(b), rel=1e-5)
    for name, value in ddp.getModel().state_dict().items():
        assert torch.allclose(fsdp.getModel().state_dict()[name], value, atol=1e-5), name
    assert fsdp.getOrDefault("strategy") == "fsdp"
    saved = str(tmp_path / "fsdp-pipeline")
    pipeline.write().save(saved)
    sample = df.orderBy("text", "label").limit(40)
    probabilities = [np.array([r.probability.toArray() for r in m.transform(sample).orderBy("text").collect()])
                     for m in (ddp, fsdp, PipelineModel.load(saved))]
    np.testing.assert_allclose(probabilities[1], probabilities[0], atol=1e-5)
    np.testing.assert_allclose(probabilities[2], probabilities[1], atol=1e-6)


def test_accumulation_validation_bf16_mixed_and_a_lightning_module_sharded(spark, store, digits):
    """backward_passes_per_step=2 without gradient sync in between: DDP's weights and exact metrics. bf16-mixed
    (with its blocks compiled): bfloat16 compute, float32 master weights: the TorchModel's weights are float32 and
    it learns."""
    df = digits_frame(spark, digits)

    def fit(run_id, **kw):
        model = seeded(BlockMLP)
        return TorchEstimator(num_proc=2, store=store, run_id=run_id, model=model,
                              optimizer=torch.optim.Adam(model.parameters(), lr=0.005), loss=nn.CrossEntropyLoss(),
                              metrics=["accuracy"], feature_cols=["features"], label_cols=["label"], batch_size=32,
                              epochs=3, validation=0.25, backward_passes_per_step=2, random_seed=2, **kw).fit(df)

    ddp, fsdp = fit("acc-ddp", shared_memory_allreduce=False), fit("acc-fsdp", strategy="fsdp")
    for a, b in zip(fsdp.getHistory(), ddp.getHistory()):
        assert metrics(a) == pytest.approx(metrics(b), rel=1e-5)
    for name, value in ddp.getModel().state_dict().items():
        assert torch.allclose(fsdp.getModel().state_dict()[name], value, atol=1e-6), name
    # compiled too: each block before it is sharded (fullgraph: FSDP's hooks are outside the blocks' graphs)
    bf16 = fit("acc-bf16", strategy="fsdp", precision="bf16-mixed", compile={"backend": "aot_eager", "fullgraph": True})
    assert {p.dtype for p in bf16.getModel().parameters()} == {torch.float32}
    assert bf16.getHistory()[-1]["val_accuracy"] >= 0.85, bf16.getHistory()

    # A LightningModule (its steps registered as FSDP forward methods) trains sharded what it trains with DDP - in
    # the Spark workers these fits used, whose ranks may now be other processes: DTensor's caches of an earlier fit
    # must not give this fit's state dict that fit's mesh (the head's bias, a shape both models have, was
    # checkpointed with its halves swapped here until each sharding had a mesh of its own).
    from test_lightning_spark import LitBuiltIn, seeded_lit

    kw = dict(num_proc=2, store=store, feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=2,
              validation=0.2, random_seed=5)
    lit_ddp = TorchEstimator(model=seeded_lit(LitBuiltIn), run_id="lit-ddp", shared_memory_allreduce=False,
                             **kw).fit(df)
    lit_fsdp = TorchEstimator(model=seeded_lit(LitBuiltIn), run_id="lit-fsdp", strategy="fsdp", **kw).fit(df)
    for name, value in lit_ddp.getModel().state_dict().items():
        assert torch.allclose(lit_fsdp.getModel().state_dict()[name], value, atol=1e-6), name
    for x, y in zip(lit_fsdp.getHistory(), lit_ddp.getHistory()):
        assert metrics(x) == pytest.approx(metrics(y), rel=1e-6)


def test_what_sharding_cannot_serve_is_refused_before_any_job(spark, store, digits):
    """(A refit of a run under the other strategy: tests/test_fsdp.py.)"""
    df = digits_frame(spark, digits)
    model = seeded(BlockMLP)
    stepped = torch.optim.Adam(model.parameters())
    model(torch.zeros(2, 64)).sum().backward()
    stepped.step()
    base = dict(num_proc=2, store=store, model=model, loss=nn.CrossEntropyLoss(), feature_cols=["features"],
                label_cols=["label"], strategy="fsdp")
    cases = [(dict(precision="16-mixed"), r"takes no precision='16-mixed': float16 with a GradScaler is DDP's"),
             (dict(model=nn.Sequential(nn.Flatten())), r"has no parameters to shard. Use strategy='ddp'"),
             (dict(), r"has taken steps already"),
             (dict(strategy="ddp", shard_units=[nn.Linear]), r"shard_units says what strategy='fsdp' shards"),
             (dict(strategy="auto", precision="16-mixed"), r"strategy='auto' takes no precision='16-mixed'"),
             (dict(strategy="ddp", reshard_after_forward=False),
              r"reshard_after_forward=False is strategy='fsdp''s choice; with strategy='ddp' nothing is sharded")]
    for extra, message in cases:
        params = {**base, "optimizer": stepped if not extra else torch.optim.Adam(model.parameters()), **extra}
        with pytest.raises(ValueError, match=message):
            TorchEstimator(**params).fit(df)


def sharded_step(model, batch, ctx):
    return nn.functional.cross_entropy(model(batch["features"]), batch["label"])


def own_loop(ctx):
    """ctx.model: the sharded module behind the loop's stand-in (call it, .module, no_sync())."""
    for _ in ctx.epochs_to_run():
        ctx.model.train()
        total = 0.0
        for batch in ctx.train_batches():
            ctx.optimizer.zero_grad()
            loss = nn.functional.cross_entropy(ctx.model(*batch.features), batch["label"])
            loss.backward()
            ctx.optimizer.step()
            total += float(loss.detach()) * batch.rows
        for batch in ctx.val_batches():  # refused on several ranks with fsdp (ranks hold uneven batches)
            pass
        ctx.report({"loss": total / max(1, ctx.rows)})


def test_a_train_step_and_a_train_fn_train_the_sharded_model_as_the_built_in_loop_does(spark, store, digits):
    from estimator.failures import RankFailed

    X, y = digits  # rows that divide by the ranks: a train_fn trains a short rank's repeat, the built-in loop not
    df = digits_frame(spark, (X[:1796], y[:1796]))

    def fit(run_id, **kw):
        model = seeded(BlockMLP)
        return TorchEstimator(num_proc=2, store=store, run_id=run_id, model=model, strategy="fsdp",
                              optimizer=torch.optim.Adam(model.parameters(), lr=0.005), feature_cols=["features"],
                              label_cols=["label"], batch_size=32, epochs=2, random_seed=3, **kw).fit(df)

    built_in = fit("built-in", loss=nn.CrossEntropyLoss()).getModel().state_dict()
    for run_id, loop in (("step", dict(train_step=sharded_step)), ("fn", dict(train_fn=own_loop))):
        trained = fit(run_id, **loop).getModel().state_dict()
        for name, value in built_in.items():
            assert torch.allclose(trained[name], value, atol=1e-6), (run_id, name)
    with pytest.raises(RankFailed, match=r"ctx.val_batches\(\) with strategy='fsdp' on several ranks is not served"):
        fit("fn-val", train_fn=own_loop, validation=0.2, max_retries=0)
