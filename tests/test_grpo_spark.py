"""GRPO through Spark (estimator.train.objectives.grpo): a table of prompts with the columns its rewards read,
reward functions pickled to the executors (a closure over a dict, a function of this module), 2 ranks, the
history's TRL metrics, validation's greedy rewards, transform's text afterwards; the refusals before any job."""
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


def test_grpo_on_two_ranks_reports_trls_numbers_and_the_fitted_model_writes_text(spark, store, llama):
    rows = [(p, r[len(" The "):-1].split(" is ")[1], i % 3) for i, (p, r) in enumerate(color_facts()[:10])]
    df = spark.createDataFrame(rows, "prompt string, answer string, level int")
    bonus = {0: 0.0, 1: 0.1, 2: 0.2}  # a closure over a dict, pickled to the executors

    def right(completions, answer, level, **_):
        return [(1.0 if a in c else 0.0) + bonus[lv] for c, a, lv in zip(completions, answer, level)]

    objective = GRPO([right, short_words], reward_weights=[1.0, 0.5], num_generations=4, max_new_tokens=6)
    fitted = grpo(llama, store, objective, validation=0.2).fit(df)
    history = fitted.getHistory()
    assert {"loss", "reward", "reward_std", "rewards/right/mean", "rewards/short_words/mean",
            "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std", "clip_ratio/region_mean",
            "val_reward", "val_rewards/right/mean"} <= set(history[0]), sorted(history[0])
    assert history[0]["rewards/right/mean"] >= 0.1 - 1e-9  # the levels' bonus at least: the columns reached it
    assert 0 < history[0]["completions/mean_length"] <= 6
    asked = spark.createDataFrame([(p,) for p, _, _ in rows[:3]], "prompt string")
    assert all(isinstance(r.prediction, str) for r in fitted.transform(asked).collect())


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
    with pytest.raises(ValueError, match=r"GRPO\(num_generations=1\): an int >= 2"):
        GRPO(short_words, num_generations=1)
    with pytest.raises(ValueError, match=r"item 0, 'x', is not callable"):
        GRPO(["x"])
