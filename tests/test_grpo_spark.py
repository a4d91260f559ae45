"""GRPO through Spark (estimator.train.objectives.grpo): a table of prompts with the columns its rewards read,
the example's reward function pickled to the executors, 2 ranks, the history's TRL metrics, transform's text
before and after; the refusals before any job."""
import functools

import pytest
import torch

from estimator import GRPO, TorchEstimator
from lm_helpers import color_facts, save_pretrained_llama
from spark_helpers import jobs_run_by

pytestmark = pytest.mark.spark
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_pretrained_llama(str(tmp_path_factory.mktemp("llama") / "tiny"), [p + r for p, r in color_facts()])


def short_words(completions, **_):
    return [-len(c.split()) / 10 for c in completions]


def grpo(llama, store, objective, **kw):
    params = dict(num_proc=2, store=store, model=functools.partial(transformers.AutoModelForCausalLM.from_pretrained,
                                                                   llama),
                  tokenizer=transformers.AutoTokenizer.from_pretrained(llama),
                  peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
                  optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), feature_cols=["prompt"],
                  label_cols=["answer", "level"], batch_size=2, epochs=1, random_seed=1, verbose=0,
                  objective=objective, max_new_tokens=6)
    params.update(kw)
    return TorchEstimator(**params)


def test_the_example_teaches_the_right_colours_by_reward_alone_and_reports_trls_numbers(spark, tmp_path):
    """notebooks/grpo_example.py on this session: a base that writes either colour learns each noun's from a reward
    function of the example's module (pickled to the executors by value) reading the `answer` column; the
    history's TRL metrics; transform's greedy text before (a TorchModel from a factory) and after."""
    import grpo_example

    result = grpo_example.run(spark, str(tmp_path))
    history = result["history"]
    assert {"loss", "reward", "reward_std", "rewards/right_colour/mean", "completions/mean_length",
            "completions/clipped_ratio", "frac_reward_zero_std", "clip_ratio/region_mean", "kl"} <= set(history[0])
    assert len(history) == 30 and history[-1]["reward"] >= history[0]["reward"] + 0.3, [r["reward"] for r in history]
    assert result["before"] <= 0.6 and result["after"] >= 0.85, result
    assert all(answer.startswith(" The ") for _, _, answer in result["answers"]), result["answers"]


@pytest.mark.connect
@pytest.mark.connect_only  # on classic Spark: the example's test above
def test_grpo_fits_saves_and_generates_through_spark_connect(spark, store, llama, tmp_path):
    """Through Spark Connect: a reward closed over a dict, reading a label column by name, is pickled to the ranks;
    the history carries its mean; the fitted model saves and loads through the session and writes the same
    text."""
    from estimator import TorchModel

    bonus = {1: 0.0, 2: 0.5}

    def levelled(completions, level, **_):
        return [bonus[lv] for lv in level]

    df = spark.createDataFrame([(p, r, 1 + i % 2) for i, (p, r) in enumerate(color_facts()[:4])],
                               "prompt string, answer string, level int")
    fitted = grpo(llama, store, GRPO([levelled, short_words], num_generations=2, max_new_tokens=6)).fit(df)
    last = fitted.getHistory()[-1]
    assert {"reward", "rewards/short_words/mean", "completions/mean_length"} <= set(last)
    assert last["rewards/levelled/mean"] == pytest.approx(0.25)  # the dict's bonus for levels 1, 2, 1, 2
    fitted.write().save(str(tmp_path / "grpo"))
    prompts = df.select("prompt").orderBy("prompt")
    written = [r.prediction for r in fitted.transform(prompts).collect()]
    assert [r.prediction for r in TorchModel.load(str(tmp_path / "grpo")).transform(prompts).collect()] == written
    assert all(isinstance(t, str) for t in written) and len(written) == 4


def test_what_grpo_cannot_train_is_refused_by_name_before_any_job(spark, store, llama):
    df = spark.createDataFrame([("What colour is it?", "red", 1)], "prompt string, answer string, level int")

    def needs_grade(completions, grade, **_):
        return [0.0] * len(completions)

    objective = GRPO(short_words, num_generations=2, max_new_tokens=8)
    cases = [(dict(packing=True), objective, "packing=True: the completions are sampled at each step"),
             (dict(peft_config=None), GRPO(short_words, beta=0.04, max_new_tokens=8), r"peft_config=None: beta=0.04 weighs the KL"),
             (dict(), GRPO(needs_grade, max_new_tokens=8), r"'needs_grade' needs \['grade'\], which nothing gives"),
             (dict(label_cols=["completions"]), objective, r"label_cols \['completions'\] would shadow"),
             (dict(), GRPO(short_words, max_new_tokens=64), r"max_new_tokens=64: the model has 64 positions")]
    frame = df.withColumnRenamed("answer", "completions")
    for params, given, message in cases:
        data = frame if params.get("label_cols") == ["completions"] else df
        with pytest.raises(ValueError, match=message):
            assert jobs_run_by(spark, lambda: grpo(llama, store, given, **params).fit(data)) == []
    # the longest prompt and a completion's max_new_tokens within the positions: counted over the stored table
    four = spark.createDataFrame([(p, r, 1) for p, r in color_facts()[:4]], "prompt string, answer string, level int")
    with pytest.raises(ValueError, match=r"The longest prompt of column 'prompt' takes \d+ tokens, and a completion "
                                         r"of max_new_tokens=60 after it passes the model's 64 positions"):
        grpo(llama, store, GRPO(short_words, num_generations=2, max_new_tokens=60)).fit(four)
    with pytest.raises(ValueError, match=r"GRPO\(num_generations=1\): an int >= 2"):
        GRPO(short_words, num_generations=1)
    with pytest.raises(ValueError, match=r"GRPO\(num_iterations=0\): an int >= 1"):
        GRPO(short_words, num_iterations=0)
    with pytest.raises(ValueError, match=r"item 0, 'x', is not callable"):
        GRPO(["x"])
