"""Fine-tune a causal language model whose base is loaded in 4 bits (QLoRA: NF4 weights from bitsandbytes, LoRA
adapters trained over them) on 2 Spark barrier tasks, then generate the answers with transform.

    python notebooks/qlora_example.py [--model FOLDER] [--epochs 80] [--workdir /tmp/qlora-example]

Needs bitsandbytes on the driver and every executor: pip install 'spark-torch-estimator[qlora]'. It runs on
CPUs too (bitsandbytes' CPU kernels); on GPUs, give a compute dtype of torch.bfloat16.

--model: a folder written by save_pretrained (an AutoModelForCausalLM checkpoint and its tokenizer). Without it,
the tiny Llama of sft_example.py (hidden size 128) is built and saved first, the stand-in for a downloaded
checkpoint. Each rank loads the base quantized itself; the driver builds no weight of it, and the checkpoints
and the fitted model hold only the adapters.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import tempfile

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors use this interpreter (and its torch)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from sft_example import color_facts, save_pretrained_llama  # noqa: E402


def main(argv=None) -> float:
    from peft import LoraConfig
    from pyspark.sql import SparkSession
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from estimator import TorchEstimator, TorchModel
    from store import Store

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a save_pretrained folder of a causal LM (default: a tiny Llama built here)")
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "qlora-example"))
    args = parser.parse_args(argv)
    if os.path.exists(os.path.join(args.workdir, "saved")):  # a run before this one's: replaced
        import shutil

        shutil.rmtree(os.path.join(args.workdir, "saved"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    spark = SparkSession.builder.master("local[2]").appName("qlora-example").getOrCreate()
    facts = color_facts()
    path = args.model or save_pretrained_llama(os.path.join(args.workdir, "tiny-llama"),
                                               [p + r for p, r in facts] * 4, hidden=128, layers=2)
    train_df = spark.createDataFrame(facts, "prompt string, response string")
    store = Store.create(os.path.join(args.workdir, "runs"))
    compute = torch.bfloat16 if torch.cuda.is_available() else torch.float32

    # --8<-- [start:qlora]
    four_bits = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute,
    )
    est = TorchEstimator(
        num_proc=2, store=store,
        # each rank loads the base in 4 bits itself
        model=functools.partial(
            AutoModelForCausalLM.from_pretrained, path,
            quantization_config=four_bits,
        ),
        tokenizer=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
        optimizer=functools.partial(torch.optim.AdamW, lr=5e-3),
        lr_scheduler_fn=functools.partial(
            torch.optim.lr_scheduler.LinearLR,
            start_factor=1.0, end_factor=0.05, total_iters=args.epochs,
        ),
        feature_cols=["prompt"], label_cols=["response"],
        batch_size=2, epochs=args.epochs, max_new_tokens=16,
    )
    fitted = est.fit(train_df)
    answers = fitted.transform(train_df.select("prompt", "response"))
    # --8<-- [end:qlora]

    rows = answers.collect()
    for row in rows[:3]:
        print(f"{row.prompt!r} -> {row.prediction!r} (trained on {row.response!r})")
    last = fitted.getHistory()[-1]
    print(f"epoch {last['epoch']:.0f}: loss {last['loss']:.4f} perplexity {last['perplexity']:.2f}")
    layer = fitted.getModel().base_model.model.model.layers[0].self_attn.q_proj.base_layer
    print(f"The trained base's layers: {type(layer).__module__}.{type(layer).__name__}")
    right = sum(row.prediction == row.response for row in rows) / len(rows)
    print(f"Answers written right: {right:.2f}")
    # saved, the model is the base's factory and the adapters; loaded, it writes the same answers
    fitted.save(os.path.join(args.workdir, "saved"))
    loaded = TorchModel.load(os.path.join(args.workdir, "saved"))
    again = {r.prompt: r.prediction for r in loaded.transform(train_df.select("prompt")).collect()}
    same = all(again[row.prompt] == row.prediction for row in rows)
    print(f"Loaded from its folder, the same answers: {same}")
    # merged into the base in its stored precision: a plain transformers folder, no bitsandbytes needed
    fitted.save_pretrained(os.path.join(args.workdir, "merged"))
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(args.workdir, "merged"))
    print(f"The merged folder's layers: {type(merged.model.layers[0].self_attn.q_proj).__name__}")
    spark.stop()
    return right


if __name__ == "__main__":
    main()
