"""QLoRA (issue 64): a base the model factory loads in 4 bits (bitsandbytes' NF4, on the CPU here), LoRA adapters
trained over it. On the ranks (LocalLauncher, no Spark): k ranks equal a plain QLoRA loop of batch k*b, and the
base they trained is the quantized one. On the driver (Spark): what is refused before any job.

bitsandbytes comes from .cache/qlora-site (`bash .ci/setup main test` installs it there, not in .venv: peft
imports it at its own import wherever it is installed, a second more in each of the suite's processes); the
tests here put it on the path of this process and of the processes they start."""
import functools
import importlib.util
import os
import pickle
import subprocess
import sys

import pytest
import torch

from estimator.launch.local import LocalLauncher
from estimator.train.checkpoint import load_checkpoint
from lm_helpers import lm_rows, lm_train_spec
from test_lm import llama, lora  # noqa: F401 - the tiny Llama (hidden size 64), the LoRA config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(ROOT, ".cache", "qlora-site")


def four_bits():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)  # float32: the sums compared to 1e-5


def eight_bits():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True)


@pytest.fixture
def bitsandbytes(monkeypatch):
    """bitsandbytes importable in this process and in those it starts (their PYTHONPATH)."""
    if os.path.isdir(SITE):
        monkeypatch.syspath_prepend(SITE)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SITE, *filter(None, [os.environ.get("PYTHONPATH")])]))
    else:
        assert importlib.util.find_spec("bitsandbytes"), f"bitsandbytes is neither installed nor in {SITE}: run " \
                                                         "bash .ci/setup main test"
    return os.environ.get("PYTHONPATH", "")


def plain_loop(tmp_path, **kwargs):
    """lm_helpers.plain_qlora_loop in a new Python process (peft there defines its 4-bit layers)."""
    args, out = tmp_path / "args.pkl", tmp_path / "plain.pt"
    args.write_bytes(pickle.dumps({**kwargs, "out": str(out)}))
    code = ("import pickle, sys; sys.path.insert(0, sys.argv[1]); import lm_helpers; "
            "lm_helpers.plain_qlora_loop(**pickle.load(open(sys.argv[2], 'rb')))")
    result = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "tests"), str(args)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


RANKS, STEPS, EPOCHS, LR, BATCH = 2, 3, 2, 1e-2, 2


@pytest.fixture(scope="module")
def unquantized(llama, tmp_path_factory):  # noqa: F811
    """The first epoch's loss of the same fit over the stored (unquantized) base: once for both quantizations."""
    from store import Store

    store = Store.create(str(tmp_path_factory.mktemp("unquantized")))
    whole = LocalLauncher().run(lm_train_spec(store, llama, lm_rows(RANKS * BATCH * STEPS), batch=BATCH,
                                              epochs=EPOCHS, peft_config=lora(), lr=LR, run="full"), RANKS)
    return whole[0].history[0]["loss"]


@pytest.mark.parametrize("bits", [four_bits, eight_bits], ids=["nf4", "int8"])
def test_two_ranks_of_qlora_equal_one_plain_qlora_loop_of_batch_2b_on_the_quantized_base(llama, store, tmp_path,
                                                                                       bitsandbytes, bits,
                                                                                       unquantized):
    """Each rank loads the base in 4 bits itself, prepares it as peft's prepare_model_for_kbit_training does and
    trains the adapters over it: the losses and the adapters are a plain QLoRA loop's over the same steps, and not
    those of the same fit over the unquantized base (the quantization changes the numbers). The fit validates
    after each epoch and the plain loop does not: validation changes no number (bitsandbytes would repack the
    4-bit layers at validation's forward on a CPU with AVX512-BF16, after which their input gets no gradient:
    estimator.core.recipe.cpu_repacking_off)."""
    ranks, steps, epochs, lr, batch = RANKS, STEPS, EPOCHS, LR, BATCH
    rows = lm_rows(ranks * batch * steps)
    quantized = LocalLauncher().run(lm_train_spec(store, llama, rows, batch=batch, epochs=epochs, peft_config=lora(),
                                                  lr=lr, quantization=bits(), run="q", val_rows=rows[:4]), ranks)
    plain = plain_loop(tmp_path, path=llama, rows=rows, ranks=ranks, batch=batch, steps=steps, epochs=epochs, lr=lr,
                       peft_config=lora(), quantization=bits())
    assert [row["loss"] for row in quantized[0].history] == pytest.approx(plain["losses"], rel=1e-5)
    adapters = load_checkpoint(store, store.run("q").checkpoint)["model"]
    assert set(adapters) == set(plain["state"]) and all("lora_" in name for name in adapters)
    for name, value in plain["state"].items():
        assert torch.allclose(adapters[name].float(), value.float(), atol=1e-5), name
    first = [unquantized, quantized[0].history[0]["loss"]]
    assert abs(first[0] - first[1]) > 1e-4 * first[0], first  # the ranks trained the quantized base, not the stored one


@pytest.mark.spark
def test_what_a_quantized_base_cannot_train_is_refused_by_name_before_any_job(spark, store, llama, bitsandbytes,
                                                                            monkeypatch):
    from transformers import AutoModelForCausalLM

    from spark_helpers import jobs_run_by
    from test_lm_spark import sft

    df = spark.createDataFrame(lm_rows(8), "prompt string, response string")
    quantized = functools.partial(AutoModelForCausalLM.from_pretrained, llama, quantization_config=four_bits())
    cases = [
        (dict(peft_config=None), ValueError, "loads its base quantized .*peft_config is None: a quantized base "
         "cannot be trained itself.*Set peft_config=LoraConfig"),
        (dict(strategy="fsdp"), ValueError, "strategy='fsdp': the model factory loads its base quantized .*Use "
         "strategy='ddp'"),
        (dict(strategy="auto"), ValueError, "strategy='auto': the model factory loads its base quantized"),
        (dict(model=quantized()), ValueError, "is a model loaded quantized .*give the factory that loads it"),
        (dict(loss=torch.nn.CrossEntropyLoss(), label_cols=["label"]), ValueError,
         "a quantized base trains a causal language model's adapters"),
    ]
    for params, error, message in cases:
        frame = df.withColumn("label", df.prompt.substr(0, 0).cast("int")) if "loss" in params else df
        with pytest.raises(error, match=message):
            assert jobs_run_by(spark, lambda: sft(llama, store, **{"model": quantized, **params}).fit(frame)) == []
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # missing here: the driver says so and what installs it
    with pytest.raises(ImportError, match=r"bitsandbytes package, missing on the driver: pip install "
                                          r"'spark-torch-estimator\[qlora\]'"):
        assert jobs_run_by(spark, lambda: sft(llama, store, model=quantized).fit(df)) == []


def test_dpo_over_a_4_bit_base_trains_and_gradient_checkpointing_changes_no_number(llama, store, bitsandbytes):
    """DPO's reference over a QLoRA fit is the 4-bit base with the adapters off (the same forward, no copy); its
    validation and selective gradient checkpointing (recomputed through the 4-bit layers) change no number."""
    from estimator.train.objectives.preference import DPO
    from test_preference import pairs

    rows, runs = pairs(8), {}
    for checkpointing in (False, "selective"):
        runs[checkpointing] = LocalLauncher().run(lm_train_spec(
            store, llama, rows, batch=2, epochs=2, peft_config=lora(), lr=1e-2, objective=DPO(beta=0.5),
            quantization=four_bits(), gradient_checkpointing=checkpointing, val_rows=rows[:4],
            run=f"dpo-{checkpointing}"), 2)[0].history
    assert [h[k] for h in runs["selective"] for k in ("loss", "val_loss")] == pytest.approx(
        [h[k] for h in runs[False] for k in ("loss", "val_loss")], rel=1e-5)
    assert runs[False][1]["loss"] < runs[False][0]["loss"] < 0.6932  # below log 2: it learned the chosen answers
