"""A LoRA fit of a real-sized base (a ~100M-parameter Llama built and saved here, ~400 MB of weights): the driver
never holds the base's weights (its peak RSS during fit and transform, sampled), transform sends the adapters and
the factory, not the base (the bytes pickled for Spark and the files added, counted), each executor's Python
worker builds the base once (a second transform, and scoring, build nothing), the generations are
model.generate's and the scores (output_kind='score') a hand computation's, also
after save/load (estimator.core.handle); a TorchModel of a from_pretrained factory without a fit likewise."""
import functools
import os
import threading
import time

import psutil
import pytest
import torch

from estimator import TorchEstimator, TorchModel
from lm_helpers import color_facts, lm_rows, save_pretrained_llama

pytestmark = pytest.mark.spark
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(folder, bytes of its weights): ~102M parameters in float32."""
    folder = save_pretrained_llama(str(tmp_path_factory.mktemp("llama") / "sized"),
                                   [p + r for p, r in color_facts()] * 4, hidden=1024, layers=11, positions=64)
    weights = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert weights > 380e6
    return folder, weights


def counted_build(folder, log):
    """The base, from its folder; each call appends a line to `log` (whichever process calls it)."""
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    return transformers.AutoModelForCausalLM.from_pretrained(folder)


class PeakRss:
    """This process's peak resident memory above its value at the start, sampled every 5 ms."""

    def __enter__(self):
        self.process, self.start, self.peak, self.done = psutil.Process(), 0, 0, False
        self.start = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while not self.done:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()

    @property
    def above(self):
        return self.peak - self.start


class SentBytes:
    """The bytes handed to Spark while it runs: the closures pyspark pickles and the files added."""

    def __init__(self, monkeypatch):
        from pyspark import serializers

        import estimator.model

        self.pickled, self.files = [], []
        dumps, ship = serializers.CloudPickleSerializer.dumps, estimator.model.ship_file

        def counted_dumps(serializer, obj):
            data = dumps(serializer, obj)
            self.pickled.append(len(data))
            return data

        def counted_ship(spark, path):
            self.files.append(os.path.getsize(path))
            return ship(spark, path)

        monkeypatch.setattr(serializers.CloudPickleSerializer, "dumps", counted_dumps)
        monkeypatch.setattr(estimator.model, "ship_file", counted_ship)

    @property
    def total(self):
        return sum(self.pickled) + sum(self.files)


def test_a_lora_fit_of_a_sized_base_keeps_its_weights_off_the_driver_and_out_of_transform(spark, store, base, tmp_path,
                                                                                         monkeypatch):
    folder, weights = base
    log = str(tmp_path / "builds.log")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rows = lm_rows(16)
    df = spark.createDataFrame(rows, "prompt string, response string").cache()
    df.count()
    prompts = [p for p, _ in rows[:6]]
    asked = spark.createDataFrame([(p,) for p in prompts], "prompt string").repartition(2).cache()
    asked.count()

    def estimator(folder):
        return TorchEstimator(
            num_proc=2, store=store, model=functools.partial(counted_build, folder, log), tokenizer=tokenizer,
            peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                        task_type="CAUSAL_LM"),
            optimizer=functools.partial(torch.optim.AdamW, lr=5e-3), feature_cols=["prompt"], label_cols=["response"],
            batch_size=4, epochs=1, max_new_tokens=6, random_seed=1, verbose=0)

    # what a first fit and transform cost the driver whatever the model (imports, Spark's first jobs: ~70 MB here),
    # spent on a small base of the same tokenizer first: what is measured below is what the base's size adds
    small = save_pretrained_llama(str(tmp_path / "small"), [p + r for p, r in color_facts()] * 4)
    estimator(small).fit(df).transform(asked).collect()

    with PeakRss() as fit_rss:
        fitted = estimator(folder).fit(df)
    handle = fitted.getModelHandle()
    assert handle is not None and len(handle.trained) < 2e6  # the adapters: r=4 over two projections
    assert fit_rss.above <= 0.15 * weights, f"the driver grew {fit_rss.above / 2**20:.0f} MB during fit"

    sent = SentBytes(monkeypatch)
    builds = len(open(log).read().split())
    with PeakRss() as transform_rss:
        got = {r.prompt: r.prediction for r in fitted.transform(asked).collect()}
    assert transform_rss.above <= 0.15 * weights, f"the driver grew {transform_rss.above / 2**20:.0f} MB in transform"
    assert 0 < sent.total <= 2 * 2**20 + 1.5 * len(handle.trained), (sent.pickled, sent.files)
    first = len(open(log).read().split()) - builds
    assert first >= 1  # the executors built the base (one Python worker per task at most)
    again = {r.prompt: r.prediction for r in fitted.transform(asked).collect()}
    assert again == got and len(open(log).read().split()) - builds == first  # the workers kept it: no build
    sent.pickled.clear(), sent.files.clear()
    with PeakRss() as score_rss:  # output_kind='score' sends and caches the model as generation does
        scores = {r.prompt: (r.logprob, r.tokens) for r in fitted.copy({fitted.output_kind: "score"}).transform(
            df.filter(df.prompt.isin(prompts[:2]))).collect()}
    assert score_rss.above <= 0.15 * weights and 0 < sent.total <= 2 * 2**20 + 1.5 * len(handle.trained), (
        score_rss.above, sent.pickled, sent.files)
    assert len(open(log).read().split()) - builds == first  # the workers' cached model scored: no build

    model = fitted.getModel()  # built here, on demand: loads the base into the driver, and is the model from now on
    assert fitted.getModelHandle() is None and fitted.getModel() is model
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer([prompt], return_tensors="pt")
            tokens = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id)
            expected.append(tokenizer.decode(tokens[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    assert [got[p] for p in prompts] == expected
    for prompt, response in rows[:2]:  # the scores: the response's tokens and EOS given the prompt, by hand
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0].double(), -1)
        want = sum(float(logp[len(p) + i - 1, t]) for i, t in enumerate(r))
        assert scores[prompt][1] == len(r) and scores[prompt][0] == pytest.approx(want, abs=1e-3)

    path = str(tmp_path / "saved")
    fitted.write().overwrite().save(path)
    with PeakRss() as load_rss:
        loaded = TorchModel.load(path)
    assert load_rss.above <= 0.15 * weights and loaded.getModelHandle().key == handle.key  # adapters, no base
    assert {r.prompt: r.prediction for r in loaded.transform(asked).collect()} == got

    # a pretrained model over a table, no fit: a from_pretrained factory is held as a handle too
    sent.pickled.clear(), sent.files.clear()
    with PeakRss() as plain_rss:
        writer = TorchModel(model=functools.partial(transformers.AutoModelForCausalLM.from_pretrained, folder),
                            tokenizer=tokenizer, feature_cols=["prompt"], output_kind="generate", max_new_tokens=6)
        written = {r.prompt: r.prediction for r in writer.transform(asked).collect()}
    assert plain_rss.above <= 0.15 * weights and 0 < sent.total <= 2 * 2**20, (plain_rss.above, sent.total)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        ids = tokenizer([prompts[0]], return_tensors="pt")
        tokens = base.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    assert written[prompts[0]] == tokenizer.decode(tokens[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_the_drivers_model_of_a_float32_folder_loaded_in_bfloat16_reads_no_weight(base):
    """from_pretrained(dtype=torch.bfloat16) of a float32 folder casts each tensor as it reads it: built under
    parameters_on_meta alone, the driver held 1.3x the weights; told device_map='meta', transformers reads none."""
    from estimator.fit.recipes import model_of

    folder, weights = base
    factory = functools.partial(transformers.AutoModelForCausalLM.from_pretrained, folder, dtype=torch.bfloat16)
    model_of(functools.partial(transformers.AutoModelForCausalLM.from_pretrained, folder), whole=False)  # imports
    with PeakRss() as built:
        skeleton, _ = model_of(factory, whole=False)
    assert built.above <= 0.05 * weights, f"the driver grew {built.above / 2**20:.0f} MB"
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in skeleton.parameters())
