"""Language models through Spark: the SFT contract (a prompt/response table, LoRA on 2 ranks, generated text in
transform, identical after save/load and in a Pipeline, a merged folder for serving), chat rows, a killed rank
retried from the adapters' checkpoint, embeddings from a TorchModel built without a fit, and the refusals before
any job."""
import functools
import json
import math
import logging
import os
import sys

import pandas as pd
import pytest
import torch
from pyspark.sql import functions as F

from estimator import TorchEstimator, TorchModel
from estimator.core.faults import ENV
from helpers import metrics
from lm_helpers import color_facts, lm_rows, save_pretrained_llama
from spark_helpers import jobs_run_by

pytestmark = pytest.mark.spark
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    facts = color_facts()
    return save_pretrained_llama(str(tmp_path_factory.mktemp("llama") / "tiny"), [p + r for p, r in facts] * 4)


def lora():
    return peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def sft(llama, store, **kw):
    params = dict(num_proc=2, store=store, model=functools.partial(transformers.AutoModelForCausalLM.from_pretrained,
                                                                   llama),
                  tokenizer=transformers.AutoTokenizer.from_pretrained(llama), peft_config=lora(),
                  optimizer=functools.partial(torch.optim.AdamW, lr=5e-3), feature_cols=["prompt"],
                  label_cols=["response"], batch_size=4, epochs=3, max_new_tokens=12, random_seed=1, verbose=0)
    params.update(kw)
    return TorchEstimator(**params)


def generated_one_by_one(model, tokenizer, prompts, max_new_tokens):
    """model.generate on each prompt alone (no padding), greedy."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer([prompt], return_tensors="pt")
            tokens = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            out.append(tokenizer.decode(tokens[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


@pytest.mark.connect
def test_sft_with_lora_on_two_ranks_then_transform_writes_what_generate_writes(spark, store, llama, tmp_path):
    from pyspark.ml import PipelineModel

    rows = lm_rows(24)
    df = spark.createDataFrame(rows, "prompt string, response string")
    fitted = sft(llama, store, run_id="sft", validation=0.25).fit(df)
    assert fitted.getInferenceBatchSize() is None  # generation's own bound: tokens per generate() call
    history = fitted.getHistory()
    assert history[-1]["loss"] < history[0]["loss"] and "perplexity" in history[-1]
    assert history[-1]["val_perplexity"] == pytest.approx(math.exp(history[-1]["val_loss"]))
    state = torch.load(store.fs.open(store.run("sft").checkpoint).__enter__(), weights_only=True)
    assert state["contents"] == "trainable" and all("lora_" in k for k in state["model"])  # no frozen weight

    prompts = [p for p, _ in rows[:10]]
    test_df = spark.createDataFrame([(p,) for p in prompts], "prompt string").repartition(2)
    got = {r.prompt: (r.prediction, r.response__output) for r in fitted.transform(test_df).collect()}
    model, tokenizer = fitted.getModel().eval(), fitted.getTokenizer()
    expected = generated_one_by_one(model, tokenizer, prompts, 12)
    assert [got[p][0] for p in prompts] == expected and [got[p][1] for p in prompts] == expected
    assert len(set(expected)) > 1  # not one text for every prompt

    fitted.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    PipelineModel(stages=[fitted]).write().overwrite().save(str(tmp_path / "pipeline"))
    pipeline = PipelineModel.load(str(tmp_path / "pipeline"))
    for again in (loaded, pipeline):
        assert {r.prompt: r.prediction for r in again.transform(test_df).collect()} == {p: got[p][0] for p in prompts}
    fitted.write().option("standalone", "true").save(str(tmp_path / "standalone"))  # the base copied in
    os.rename(llama, llama + "-moved")  # the base's folder gone: the saved adapters have nothing to go on
    try:
        with pytest.raises(ValueError, match="holds a model's adapters .peft_config. without its base weights.*"
                                             "tiny.*fitted.save_pretrained"):
            TorchModel.load(str(tmp_path / "model"))
        alone = TorchModel.load(str(tmp_path / "standalone"))  # its own base: a handle on its folder
        assert alone.getModelHandle() is not None and str(tmp_path) in repr(alone.getModelHandle().factory)
        assert {r.prompt: r.prediction for r in alone.transform(test_df).collect()} == \
            {p: got[p][0] for p in prompts}
    finally:
        os.rename(llama + "-moved", llama)

    fitted.save_pretrained(str(tmp_path / "merged"))  # a plain model for serving: the adapters merged in
    served = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not hasattr(served, "peft_config")
    ids = tokenizer(prompts[:3], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.allclose(served(**ids).logits, model(**ids).logits, atol=1e-4)


def test_chat_rows_train_on_the_assistant_turns_and_transform_writes_the_reply(spark, store, llama):
    chat = "chat array<struct<role:string, content:string>>"
    rows = [([("user", p), ("assistant", r.strip())],) for p, r in color_facts()[:16]]
    df = spark.createDataFrame(rows, chat)
    fitted = sft(llama, store, feature_cols=["chat"], label_cols=None, epochs=2).fit(df)
    assert fitted.getHistory()[-1]["loss"] < fitted.getHistory()[0]["loss"]
    asked = spark.createDataFrame([([("user", p)],) for p, _ in color_facts()[:4]], chat)
    got = [r.prediction for r in fitted.transform(asked).collect()]
    tokenizer, model = fitted.getTokenizer(), fitted.getModel().eval()
    expected = []
    with torch.no_grad():
        for p, _ in color_facts()[:4]:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
            out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            expected.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    assert got == expected
    assert fitted.getGenerationBatching() == "auto"  # model.generate on the CPU; continuous batching alike:
    continuous = fitted.copy({fitted.getParam("generation_batching"): "continuous"})
    assert [r.prediction for r in continuous.transform(asked).collect()] == expected


def test_a_rank_killed_mid_run_is_retried_from_the_adapters_checkpoint(spark, store, llama, monkeypatch, caplog):
    df = spark.createDataFrame(lm_rows(16), "prompt string, response string")
    clean = sft(llama, store, run_id="clean").fit(df)
    monkeypatch.setenv(ENV, json.dumps([{"point": "epoch", "rank": 1, "action": "exit", "epoch": 3,
                                         "attempt": 0}]))
    with caplog.at_level(logging.INFO, logger="estimator"):
        retried = sft(llama, store, run_id="killed", max_retries=1).fit(df)
    assert "continues from its checkpoint after epoch 2" in caplog.text
    for got, expected in zip(retried.getHistory(), clean.getHistory(), strict=True):
        assert metrics(got) == pytest.approx(metrics(expected), rel=1e-5)
    a, b = retried.getModel().state_dict(), clean.getModel().state_dict()
    for name in (n for n in a if "lora_" in n):
        assert torch.allclose(a[name], b[name], atol=1e-6), name


def test_embeddings_of_a_pretrained_model_over_a_table_without_a_fit(spark, tmp_path):
    from text_helpers import save_pretrained_bert, topic_texts

    texts = [t for t, _ in topic_texts(12, seed=2)]
    path = save_pretrained_bert(str(tmp_path / "bert"), texts)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = TorchModel(model=functools.partial(transformers.AutoModel.from_pretrained, path), tokenizer=tokenizer,
                       feature_cols=["text"], output_kind="embedding", inference_batch_size=5)
    df = spark.createDataFrame([(t,) for t in texts], "text string")
    got = torch.tensor([r.output for r in model.transform(df).collect()])
    encoder = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        hidden = encoder(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        expected = (hidden * mask).sum(1) / mask.sum(1)  # the mean over the attention mask
    assert got.shape == (12, 32) and torch.allclose(got, expected, atol=1e-5)
    model.write().overwrite().save(str(tmp_path / "embedder"))
    again = torch.tensor([r.output for r in TorchModel.load(str(tmp_path / "embedder")).transform(df).collect()])
    assert torch.equal(again, got)
    from pyspark.ml.clustering import KMeans
    from pyspark.ml.functions import array_to_vector, vector_to_array

    vectors = model.transform(df).withColumn("v", array_to_vector("output"))  # for Spark ML, as the docs say
    clusters = KMeans(k=2, seed=1, featuresCol="v").fit(vectors).transform(vectors)
    rows = clusters.select(vector_to_array("v").alias("back"), "prediction").collect()
    assert torch.allclose(torch.tensor([r.back for r in rows]), got, atol=1e-6)  # the same rows, in order
    assert {r.prediction for r in rows} == {0, 1}

    unbounded = transformers.AutoTokenizer.from_pretrained(path)
    unbounded.model_max_length = int(1e30)  # as a tokenizer saved without a maximum reads: it cuts nothing
    long_text = " ".join(texts) * 3  # hundreds of tokens, past the model's 64 positions
    wide = TorchModel(model=functools.partial(transformers.AutoModel.from_pretrained, path), tokenizer=unbounded,
                      feature_cols=["text"], output_kind="embedding")
    out = wide.transform(spark.createDataFrame([(long_text,)], "text string")).collect()[0].output
    cut = tokenizer([long_text], truncation=True, max_length=64, return_tensors="pt")  # cut at the positions
    with torch.no_grad():
        assert torch.allclose(torch.tensor(out), encoder(**cut).last_hidden_state.mean(1)[0], atol=1e-5)


def test_what_cannot_train_is_refused_by_name_before_any_job(spark, store, llama, tmp_path, monkeypatch):
    from text_helpers import save_pretrained_bert

    bert = save_pretrained_bert(str(tmp_path / "bert"), ["a b c", "d e f"])
    bloom = str(tmp_path / "bloom")  # a causal LM whose attention is its own code (no attention interface)
    transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=400, hidden_size=16, n_layer=1, n_head=2)
                                  ).save_pretrained(bloom)
    texts = spark.createDataFrame(lm_rows(8), "prompt string, response string")
    bad_chat = spark.createDataFrame([([("user", "hi")],)], "chat array<struct<role:string, text:string>>")
    map_chat = spark.createDataFrame([([{"role": "user", "content": "hi"}],)], "chat array<map<string,string>>")
    int_responses = spark.createDataFrame([(p, i) for i, (p, _) in enumerate(lm_rows(8))],
                                          "prompt string, response int")
    tool_chat = spark.createDataFrame(
        [([("user", "Weather?", None), ("assistant", None, [("function", ("weather", '{"city": "Oslo"}'))])],)],
        "chat array<struct<role:string, content:string, tool_calls:array<struct<type:string, "
        "function:struct<name:string, arguments:string>>>>>")
    cases = [
        (dict(model=functools.partial(transformers.AutoModelForSequenceClassification.from_pretrained, bert),
              tokenizer=transformers.AutoTokenizer.from_pretrained(bert), peft_config=None), texts,
         "holds strings.*cannot generate"),
        (dict(max_length=512), texts, "'max_length'.* 512, beyond the 64 positions"),
        (dict(loss=torch.nn.CrossEntropyLoss()), texts,
         r"holds strings: the response this causal LM would be fine-tuned to write.*leave loss unset \(loss=None\)"),
        (dict(max_new_tokens=64), texts, r"'max_new_tokens'.* 64 \(the most tokens transform generates a row; 64 "
                                         r"unless set\), and the model has 64 positions.*< 64"),
        (dict(feature_cols=["chat"], label_cols=None), bad_chat, r"need \['role', 'content'\].*missing: \['content'\]"),
        (dict(optimizer=torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())), texts,
         "optimizer must be built over them"),
        (dict(), int_responses, r"Column 'response' \(from label_cols\) has type int;.*cast it first"),
        (dict(feature_cols=["chat"], label_cols=None), map_chat,
         r"is array<map<string,string>>, and a chat column's messages are structs.*F\.transform"),
        (dict(label_cols=["response", "response2"]), texts.withColumn("response2", texts.response),
         r"takes the response as one string label column.*got label_cols=\['response', 'response2'\]\. A chat"),
        (dict(optimizer=None), texts, "'optimizer' parameter .* must be with peft_config, a callable"),
        (dict(generation_batching="continuous", generate_kwargs={"num_beams": 2}), texts,
         r"'generation_batching' .* 'continuous', and generate_kwargs \['num_beams'\] are model.generate's only"),
        (dict(generate_kwargs={"max_new_tokens": 2}), texts,
         "'max_new_tokens' is set by the transform \\(its own param: set max_new_tokens\\)"),
        (dict(generate_kwargs={"max_length": 5}), texts,  # generate() let max_new_tokens overrule it, silently
         r"'max_length' is set by the transform \(the length generated is the max_new_tokens param"),
        (dict(generate_kwargs={"do_sample": True, "num_return_sequences": 2}), texts,  # an IndexError, on executors
         r"num_return_sequences=2: transform writes one text a row\. For several samples .*crossJoin"),
        (dict(generate_kwargs={"do_sample": True, "temprature": 0.5}), texts,  # transformers: on the executors
         r"'generate_kwargs' .* holds 'temprature', which LlamaForCausalLM.generate does not take.*'temperature'\?"),
        (dict(feature_cols=["chat"], label_cols=None), tool_chat,
         r"messages hold \['tool_calls'\], and the chat template .* never reads them: they would be dropped"),
        (dict(chat_tools=[{"type": "function", "function": {"name": "weather"}}]), texts,
         "chat_tools are given to the chat template .* 'prompt' is a string column"),
        (dict(model=functools.partial(transformers.AutoModelForCausalLM.from_pretrained, bloom), packing=True),
         texts, "packing=True puts a batch's rows in one sequence.*BloomForCausalLM.*Leave packing=False"),
    ]
    for params, df, message in cases:
        with pytest.raises(ValueError, match=message):
            assert jobs_run_by(spark, lambda: sft(llama, store, **params).fit(df)) == []
        assert jobs_run_by(spark, lambda: pytest.raises(ValueError, sft(llama, store, **params).fit, df)) == []
    writer = TorchModel(model=functools.partial(transformers.AutoModelForCausalLM.from_pretrained, llama),
                        tokenizer=transformers.AutoTokenizer.from_pretrained(llama), feature_cols=["prompt"],
                        output_kind="generate", max_new_tokens=80)
    with pytest.raises(ValueError, match="'max_new_tokens' parameter of TorchModel is 80.*64 positions"):
        assert jobs_run_by(spark, lambda: writer.transform(texts).collect()) == []
    writer.setMaxNewTokens(8)
    with_null = spark.createDataFrame([("Tell me",), (None,)], "prompt string")  # handle_invalid='keep': a null
    kept = writer.copy({writer.handle_invalid: "keep"}).transform(with_null).collect()  # prompt, a null text
    assert [r.prediction is None for r in kept] == [False, True] and isinstance(kept[0].prediction, str)
    typo = writer.copy({writer.generate_kwargs: {"top_p": 0.9, "do_smaple": True}})
    with pytest.raises(ValueError, match="'generate_kwargs' parameter of TorchModel holds 'do_smaple'.*'do_sample'"):
        typo.transform(texts)
    assert jobs_run_by(spark, lambda: pytest.raises(ValueError, typo.transform, texts)) == []
    for kind, df, message in [  # what transform cannot read as text: refused before any job, as fit refuses it
            ("generate", map_chat.withColumnRenamed("chat", "prompt"),
             r"'prompt' \(from feature_cols\) is array<map<string,string>>, .* F\.transform"),
            ("generate", texts.withColumn("prompt", F.length("prompt")), r"'prompt' \(from feature_cols\) has type "
             r"int; output_kind='generate' reads text: a string column, or a chat column .*cast\('string'\)"),
            ("embedding", texts.withColumn("prompt", F.length("prompt")), "output_kind='embedding' reads text: a "
             r"string column\. Cast")]:
        model = writer.copy({writer.output_kind: kind})
        assert jobs_run_by(spark, lambda: pytest.raises(ValueError, model.transform, df)) == []
        with pytest.raises(ValueError, match=message):
            model.transform(df)
    long_prompts = [("Tell me " * 4 + p, r) if i in (20, 33, 39) else (p, r) for i, (p, r) in enumerate(lm_rows(40))]
    monkeypatch.setattr("estimator.estimator.launch_with_retries", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(ValueError, match="max_length=24: 3 of 40 training rows.*raise max_length above 3"):
        # counted over the whole table once it is in the store (the first rows leave room), before any rank starts
        sft(llama, store, max_length=24).fit(spark.createDataFrame(long_prompts, "prompt string, response string"))
    as_json = [(json.dumps([{"role": "user", "content": p}, {"role": "assistant", "content": r}]),)
               for p, r in lm_rows(8)]
    with pytest.raises(ValueError, match=r"Column 'chat' holds chats written as JSON text \('\[\{\"role\".*"
                                         r"F\.from_json\('chat', 'array<struct<role:string,content:string>>'\)"):
        sft(llama, store, feature_cols=["chat"], label_cols=None).fit(spark.createDataFrame(as_json, "chat string"))
    json_prompts = spark.createDataFrame(as_json, "prompt string")  # transform sees rows in its tasks only (score's:
    with pytest.raises(Exception, match=r"Column 'prompt' holds chats written as JSON text .*given the JSON itself "
                                        r"as its prompt.*F\.from_json\('prompt'"):  # tests/test_scoring.py)
        writer.transform(json_prompts).collect()
    monkeypatch.setitem(sys.modules, "peft", None)  # as where peft is not installed
    with pytest.raises(ImportError, match="needs the peft package.*pip install peft"):
        sft(llama, store).fit(texts)


def test_a_base_drawn_at_random_by_the_factory_is_rebuilt_as_the_ranks_drew_it(spark, store, llama, tmp_path):
    """A factory that draws its base (a config's model, no weights read) is called where the adapters go on it
    (each executor in transform, a load): under the run's seed, as the ranks called it, else the adapters would
    sit on another base and the text would be nonsense of the right form."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(llama)
    factory = functools.partial(LlamaForCausalLM, config)
    df = spark.createDataFrame(lm_rows(16), "prompt string, response string")
    fitted = sft(llama, store, model=factory, epochs=2, random_seed=7).fit(df)
    assert fitted.getModelHandle() is not None and fitted.getBaseSeed() == 7
    prompts = [p for p, _ in lm_rows(6)]
    asked = spark.createDataFrame([(p,) for p in prompts], "prompt string").repartition(2)
    got = {r.prompt: r.prediction for r in fitted.transform(asked).collect()}
    fitted.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert {r.prompt: r.prediction for r in loaded.transform(asked).collect()} == got
    model, tokenizer = fitted.getModel().eval(), fitted.getTokenizer()
    torch.manual_seed(7)
    drawn = factory().state_dict()
    base = {k.replace(".base_layer", ""): v for k, v in model.get_base_model().state_dict().items()
            if "lora_" not in k}
    assert base.keys() == drawn.keys() and all(torch.equal(base[k], v) for k, v in drawn.items())
    assert [got[p] for p in prompts] == generated_one_by_one(model, tokenizer, prompts, 12)


def built_here(folder, log):
    """The base from its folder; each call appends its process id and whether its weights are on the meta device
    (built_on_meta's skeleton) to `log`, whichever process calls it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with open(log, "a") as f:
        f.write(f"{os.getpid()} {int(next(model.parameters()).is_meta)}\n")
    return model


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_full_fine_tune_is_read_from_its_run_where_the_model_is_built_never_on_the_driver(spark, store, llama,
                                                                                        tmp_path, strategy,
                                                                                        mlflow_file_store, caplog):
    """A full fine-tune (no peft_config: the checkpoint is the whole model and AdamW's state) and fsdp's shards:
    the driver builds the factory's model on the meta device only (each call in its process is logged), the
    TorchModel holds where the run's checkpoint is, and transform reads it on the executors (only the model's
    part of it): the text is model.generate's of the model restored from that checkpoint by hand, and the same
    from the MLflow pyfunc the fit logged, from getModel() and after save/load. With a store that keeps no run,
    the driver reads the model whole."""
    from estimator.train.checkpoint import restore
    from store import Store

    log = str(tmp_path / "builds.log")
    df = spark.createDataFrame(lm_rows(16), "prompt string, response string")
    mlflow = mlflow_file_store
    with caplog.at_level(logging.WARNING, logger="estimator"):
        fitted = sft(llama, store, model=functools.partial(built_here, llama, log), peft_config=None,
                     strategy=strategy, optimizer=functools.partial(torch.optim.AdamW, lr=2e-3), epochs=2,
                     run_id="full", mlflow=True).fit(df)
    assert "MLflow's model of this run holds no weights: where it is loaded it reads them from the run's " \
           f"checkpoint, {store.url(store.run('full').checkpoint)}" in caplog.text
    on_driver = [line.split()[1] for line in open(log).read().splitlines() if int(line.split()[0]) == os.getpid()]
    assert on_driver and set(on_driver) == {"1"}, on_driver  # built, on meta only
    handle = fitted.getModelHandle()
    assert handle is not None and handle.stored is not None and handle.trained == b""
    prompts = [p for p, _ in lm_rows(6)]
    asked = spark.createDataFrame([(p,) for p in prompts], "prompt string").repartition(2)
    got = {r.prompt: r.prediction for r in fitted.transform(asked).collect()}
    assert set(open(log).read().split()[1::2]) == {"0", "1"}  # the executors built it whole
    by_hand = transformers.AutoModelForCausalLM.from_pretrained(llama)
    base = {k: v.clone() for k, v in by_hand.state_dict().items()}
    restore(store, store.run("full"), store.run("full").checkpoint, by_hand, None)
    assert any(not torch.equal(v, base[k]) for k, v in by_hand.state_dict().items())  # trained: not the base
    tokenizer = fitted.getTokenizer()
    assert [got[p] for p in prompts] == generated_one_by_one(by_hand.eval(), tokenizer, prompts, 12)
    assert list(logged_pyfunc(mlflow).predict(pd.DataFrame({"prompt": prompts}))["prediction"]) == \
        [got[p] for p in prompts]  # MLflow holds the handle, the run's checkpoint read where it is loaded

    # save and save_pretrained write the checkpoint's tensors, mapped from it: the model is not built here
    builds = len(open(log).read().splitlines())
    fitted.write().overwrite().save(str(tmp_path / "model"))  # stands alone: the weights in it
    fitted.save_pretrained(str(tmp_path / "exported"))
    assert len(open(log).read().splitlines()) == builds
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    assert all(torch.equal(v, by_hand.state_dict()[k]) for k, v in exported.state_dict().items())
    # loaded as a handle too: the executors build it from the saved folder, the driver holds its skeleton
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getModelHandle() is not None and next(loaded.getOrDefault("model").parameters()).is_meta
    assert {r.prompt: r.prediction for r in loaded.transform(asked).collect()} == got
    loaded.write().save(str(tmp_path / "again"))  # saved again from the saved files, mapped
    model = fitted.getModel()
    assert fitted.getModelHandle() is None and fitted.getOptimizer().state  # AdamW's state read back too
    assert all(torch.equal(v, by_hand.state_dict()[k]) for k, v in model.state_dict().items())
    built = fitted.getOptimizer().state_dict()
    for again in (loaded, TorchModel.load(str(tmp_path / "again"))):
        assert all(torch.equal(v, by_hand.state_dict()[k]) for k, v in again.getModel().state_dict().items())
        saved = again.getOptimizer().state_dict()  # read where the model is built (getModel)
        assert built["param_groups"] == saved["param_groups"] and sorted(built["state"]) == sorted(saved["state"])
        assert all(torch.equal(v, saved["state"][i][k]) for i, s in built["state"].items() for k, v in s.items())

    if strategy == "ddp":  # a store that removes each run's folder after the fit: the model read whole here
        kept = Store.create(str(tmp_path / "nothing-kept"), save_runs=False)
        whole = sft(llama, kept, model=functools.partial(built_here, llama, log), peft_config=None,
                    optimizer=functools.partial(torch.optim.AdamW, lr=2e-3), epochs=2, run_id="full").fit(df)
        assert whole.getModelHandle() is None and not kept.exists(kept.run("full").root)
        assert {r.prompt: r.prediction for r in whole.transform(asked).collect()} == got


def llama_on_meta(folder):
    """The saved Llama's shape with its parameters on the meta device: its weights are the fit's weights_folder."""
    from estimator import parameters_on_meta

    with parameters_on_meta():
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))


def test_a_full_fine_tune_of_a_base_read_from_weights_folder_never_reads_it_on_the_driver(spark, store, llama,
                                                                                         tmp_path, monkeypatch):
    """A factory that builds on the meta device, its weights the fit's weights_folder, under fsdp (each rank reads
    its shards of the folder): the driver checks the folder but reads no weight of it, the TorchModel holds where
    the run's checkpoint is, and where the model is built (transform's executors, getModel()) the factory's meta
    tensors are given memory and the whole trained model read into them: model.generate's text of the checkpoint
    restored by hand. A folder that lacks a weight is refused before any job."""
    from estimator.fit import recipes
    from estimator.train.checkpoint import restore

    def never(*args, **kwargs):
        raise AssertionError("the driver read the weights folder")

    monkeypatch.setattr(recipes, "materialize", never)
    df = spark.createDataFrame(lm_rows(16), "prompt string, response string")
    fitted = sft(llama, store, model=functools.partial(llama_on_meta, llama), weights_folder=llama, peft_config=None,
                 strategy="fsdp", optimizer=functools.partial(torch.optim.AdamW, lr=2e-3), epochs=2,
                 run_id="full-meta").fit(df)
    assert fitted.getModelHandle() is not None and next(fitted.getOrDefault("model").parameters()).is_meta
    by_hand = transformers.AutoModelForCausalLM.from_pretrained(llama)
    base = {k: v.clone() for k, v in by_hand.state_dict().items()}
    restore(store, store.run("full-meta"), store.run("full-meta").checkpoint, by_hand, None)
    assert any(not torch.equal(v, base[k]) for k, v in by_hand.state_dict().items())  # trained: not the base
    prompts = [p for p, _ in lm_rows(4)]
    asked = spark.createDataFrame([(p,) for p in prompts], "prompt string").repartition(2)
    got = {r.prompt: r.prediction for r in fitted.transform(asked).collect()}
    assert [got[p] for p in prompts] == generated_one_by_one(by_hand.eval(), fitted.getTokenizer(), prompts, 12)
    assert all(torch.equal(v, by_hand.state_dict()[k]) for k, v in fitted.getModel().state_dict().items())

    partial = tmp_path / "partial"
    partial.mkdir()
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(llama, "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 weight the model leaves on the meta device is not in .*lm_head"):
        assert jobs_run_by(spark, lambda: sft(llama, store, model=functools.partial(llama_on_meta, llama),
                                              weights_folder=str(partial), peft_config=None).fit(df)) == []


def colour_pairs():
    """(prompt, chosen, rejected): each fact twice, its colour chosen and another one rejected."""
    import random

    from sft_example import COLORS

    rng, rows = random.Random(0), []
    for prompt, response in color_facts() * 2:
        noun, colour = response[len(" The "):-1].split(" is ")
        rows.append((prompt, response, f" The {noun} is {rng.choice([c for c in COLORS if c != colour])}."))
    return rows


@pytest.mark.connect
def test_dpo_on_pairs_of_message_lists_fits_and_generates(spark, store, llama):
    """The pairs as message lists (the chat template renders the prompt's messages, then each answer's), also
    through Spark Connect."""
    from estimator import DPO

    chats = spark.createDataFrame(
        [([("user", p)], [("assistant", c)], [("assistant", r)]) for p, c, r in colour_pairs()],
        "prompt array<struct<role:string,content:string>>, chosen array<struct<role:string,content:string>>, "
        "rejected array<struct<role:string,content:string>>")
    fitted = sft(llama, store, objective=DPO(beta=0.5), label_cols=["chosen", "rejected"], epochs=1,
                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-2)).fit(chats)
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"} <= set(
        fitted.getHistory()[-1])
    assert all(isinstance(r.prediction, str) for r in fitted.transform(chats.select("prompt").limit(2)).collect())


@pytest.fixture(autouse=True)
def no_tracking_left():
    yield
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(None)


def logged_pyfunc(mlflow):
    """The pyfunc model of the active experiment's last run (what the fit logged as 'model')."""
    import mlflow.pyfunc

    runs = mlflow.search_runs(order_by=["start_time DESC"], max_results=1)  # in the active experiment
    return mlflow.pyfunc.load_model(f"runs:/{runs.run_id.iloc[0]}/model")


def test_a_lora_fit_logged_to_mlflow_keeps_the_base_off_the_driver_and_its_pyfunc_generates_transforms_text(
        spark, store, llama, tmp_path, mlflow_file_store):
    """With mlflow, the fit logs the handle as a pyfunc model (estimator.predict.pyfunc), not a module built on the
    driver: the driver's process builds the base on the meta device only, and the pyfunc loaded back writes
    transform's text for each prompt (the base built where it is loaded)."""
    log = str(tmp_path / "builds.log")
    mlflow = mlflow_file_store
    df = spark.createDataFrame(lm_rows(16), "prompt string, response string")
    fitted = sft(llama, store, model=functools.partial(built_here, llama, log), epochs=2, mlflow=True,
                 inference_batch_size=3).fit(df)
    assert fitted.getInferenceBatchSize() == 3  # set on the estimator, carried to its model (3 prompts a call)
    on_driver = [line.split()[1] for line in open(log).read().splitlines() if int(line.split()[0]) == os.getpid()]
    assert on_driver and set(on_driver) == {"1"}, on_driver
    assert fitted.getModelHandle() is not None
    prompts = [p for p, _ in lm_rows(6)]
    asked = spark.createDataFrame([(p,) for p in prompts], "prompt string").repartition(2)
    got = {r.prompt: r.prediction for r in fitted.transform(asked).collect()}
    loaded = logged_pyfunc(mlflow)
    predicted = loaded.predict(pd.DataFrame({"prompt": prompts}))
    assert list(predicted.columns) == ["response__output", "prediction"]  # transform's added columns
    logged = mlflow.artifacts.download_artifacts(f"runs:/{loaded.metadata.run_id}/model")
    required = open(os.path.join(logged, "requirements.txt")).read()
    for package in ("torch", "transformers", "peft", "spark-torch-estimator"):  # what the handle builds with
        assert f"{package}==" in required, required
    assert list(predicted["prediction"]) == [got[p] for p in prompts] and len(set(got.values())) > 1


def test_whole_texts_without_a_label_train_every_token_and_held_out_perplexity_falls(spark, store, llama):
    """Continued pretraining: a text column, no label column: every token in the loss, the rows packed; the
    held-out documents' perplexity falls epoch by epoch, and transform continues a text as model.generate does."""
    from sft_example import color_facts

    documents = [(p.replace("What color is the", "The") .replace("?", "") + r,) for p, r in color_facts()] * 2
    df = spark.createDataFrame(documents, "text string")
    fitted = sft(llama, store, feature_cols=["text"], label_cols=None, epochs=3, validation=0.25,
                 max_new_tokens=6, packing=True).fit(df)  # packed: the texts are short, the sequences 64
    history = fitted.getHistory()
    assert [round(row["val_perplexity"], 3) for row in history] == sorted(
        [round(row["val_perplexity"], 3) for row in history], reverse=True), history
    assert history[-1]["val_perplexity"] < 0.8 * history[0]["val_perplexity"]
    starts = ["The kettle", "The drum"]
    got = {r.text: r.output for r in fitted.transform(spark.createDataFrame([(t,) for t in starts],
                                                                            "text string")).collect()}
    assert [got[t] for t in starts] == generated_one_by_one(fitted.getModel().eval(), fitted.getTokenizer(), starts, 6)


def test_dpo_on_preference_pairs_trains_the_adapters_reports_trls_numbers_and_generates(spark, store, llama,
                                                                                          tmp_path, mlflow_file_store):
    """objective=DPO(...) over a (prompt, chosen, rejected) table on 2 ranks, in a Pipeline: the history holds the
    loss and the rewards (TRL's names) for training and validation, and MLflow the same; the chosen answers'
    reward rises above the rejected ones'; the held-out pairs scored by the fitted model (output_kind='score') give
    the last epoch's val_rewards/accuracies through LanguageModelEvaluator and its val_rewards/margins as beta x the
    log-ratios' difference; transform writes text, also from the saved pipeline; and what DPO cannot take is
    refused by name before any job."""
    from pyspark.ml import Pipeline, PipelineModel

    from estimator import DPO, LanguageModelEvaluator

    rows = colour_pairs()
    df = spark.createDataFrame([(*row, i % 4 == 1) for i, row in enumerate(rows)],
                               "prompt string, chosen string, rejected string, held boolean")
    est = sft(llama, store, objective=DPO(beta=0.5), label_cols=["chosen", "rejected"], epochs=4,
              validation="held", optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    for change, message in (({est.peft_config: None, est.data_mode: "direct"},
                             r"objective=DPO\(beta=0.5, loss_type='sigmoid'\) with data_mode='direct': the "
                             r"precomputed reference log-probabilities are kept beside the materialized rows"),
                            ({est.objective: DPO(reference="adapters"), est.peft_config: None},
                             r"with peft_config=None: reference='adapters' is the trained model with its adapters "
                             r"off"),
                            ({est.label_cols: ["chosen"]}, r"reads preference pairs: feature_cols=\['prompt'\] .* "
                                                           r"got feature_cols=\['prompt'\], label_cols=\['chosen'\]"),
                            ({est.loss: torch.nn.CrossEntropyLoss()}, r"objective=DPO.* and loss is set too: leave "
                                                                      r"loss unset")):
        def refused():
            with pytest.raises(ValueError, match=message):
                est.copy(change).fit(df)
        assert jobs_run_by(spark, refused) == []
    blank = spark.createDataFrame(rows[:6] + [("What color is the kite?", " ", " The kite is red.")],
                                  "prompt string, chosen string, rejected string")
    with pytest.raises(ValueError, match=r"Preference pairs with an empty answer: 1 of [0-9]+ training rows in "
                                         r"column 'chosen'\. Each pair compares two answers"):
        est.copy({est.validation: None}).fit(blank)
    mlflow = mlflow_file_store
    pipeline = Pipeline(stages=[est.copy({est.mlflow: True})]).fit(df)
    fitted = pipeline.stages[-1]
    history = fitted.getHistory()
    run = mlflow.search_runs(order_by=["start_time DESC"], max_results=1).run_id.iloc[0]
    for key in ("rewards/margins", "val_rewards/accuracies"):
        logged = sorted(mlflow.MlflowClient().get_metric_history(run, key), key=lambda m: m.step)
        assert [m.value for m in logged] == pytest.approx([row[key] for row in history]), key
    keys = {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"}
    assert keys | {"val_" + k for k in keys} <= set(history[-1])
    assert history[-1]["loss"] < history[0]["loss"] < math.log(2) + 0.05  # DPO starts at log 2 (policy = reference)
    assert history[-1]["rewards/margins"] > 0 and history[-1]["rewards/accuracies"] > 0.8
    table = fitted.copy({fitted.output_kind: "score"}).transform(df.filter("held")).cache()
    accuracy, scored = LanguageModelEvaluator(metricName="rewardAccuracy").evaluate(table), table.collect()
    assert accuracy == pytest.approx(history[-1]["val_rewards/accuracies"]) and 0 < accuracy
    margins = [0.5 * (r.chosen_logratio - r.rejected_logratio) for r in scored]
    assert sum(margins) / len(margins) == pytest.approx(history[-1]["val_rewards/margins"], rel=1e-4)
    assert len(scored) == len(rows) // 4 and len(set(margins)) == len(margins)
    prompts = df.select("prompt").limit(4)
    out = [r.prediction for r in fitted.transform(prompts).orderBy("prompt").collect()]
    assert all(isinstance(text, str) for text in out) and len(out) == 4
    pipeline.write().save(str(tmp_path / "pipeline"))
    est.write().save(str(tmp_path / "estimator"))
    assert [r.prediction for r in PipelineModel.load(str(tmp_path / "pipeline")).transform(prompts).orderBy(
        "prompt").collect()] == out
    assert TorchEstimator.load(str(tmp_path / "estimator")).getOrDefault("objective") == DPO(beta=0.5)
    # the whole model trained (no adapters): the reference computed on the ranks before training, stored beside
    # the rows, and read again by a second fit of them
    whole = est.copy({est.peft_config: None, est.epochs: 1, est.validation: None,
                      est.optimizer: functools.partial(torch.optim.AdamW, lr=1e-3)})
    first = whole.fit(df).getHistory()
    markers = list(store.find(store.path("data"), "/_COMPLETE.json"))
    parts = {p: os.stat(p).st_mtime_ns for p in store.find(os.path.dirname(markers[0]), ".parquet")}
    assert len(markers) == 1 and len(parts) == 2, (markers, parts)
    second = whole.fit(df).getHistory()
    assert {p: os.stat(p).st_mtime_ns for p in parts} == parts  # read, not computed again
    assert second[0]["loss"] == pytest.approx(first[0]["loss"], rel=1e-3) and first[0]["loss"] < math.log(2) + 0.05


def test_a_causal_lms_fit_clips_gradients_at_1_as_trls_trainers_do_unless_told_otherwise(spark, store, llama,
                                                                                          digits, monkeypatch):
    """gradient_clip_val='auto' (the default) reaches the ranks as 1.0 for SFT and DPO, as Hugging Face's Trainer
    under TRL clips (max_grad_norm=1.0), and as no clipping for a classic fit; a value set wins, None turns it off.
    (tests/test_worker.py checks that the ranks clip at what they get.)"""
    from torch import nn

    from estimator import DPO

    class Launched(Exception):
        pass

    def launch(p, run, spec, *args, **kwargs):
        raise Launched(spec.gradient_clip_val)

    monkeypatch.setattr("estimator.estimator.launch_with_retries", launch)

    def clipped_at(est, df):
        with pytest.raises(Launched) as launched:
            est.fit(df)
        return launched.value.args[0]

    texts = spark.createDataFrame(lm_rows(8), "prompt string, response string")
    assert clipped_at(sft(llama, store), texts) == 1.0
    assert clipped_at(sft(llama, store, gradient_clip_val=None), texts) is None
    assert clipped_at(sft(llama, store, gradient_clip_val=0.25), texts) == 0.25
    pairs = spark.createDataFrame(colour_pairs()[:8], "prompt string, chosen string, rejected string")
    assert clipped_at(sft(llama, store, objective=DPO(), label_cols=["chosen", "rejected"]), pairs) == 1.0
    x, y = digits
    table = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x[:64], y[:64])],
                                  "features array<float>, label long")
    net = nn.Linear(64, 10)
    classic = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                             loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"], verbose=0)
    assert classic.getGradientClipVal() == "auto" and clipped_at(classic, table) is None
    assert clipped_at(classic.copy({classic.gradient_clip_val: 2.0}), table) == 2.0
