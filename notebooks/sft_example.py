"""Fine-tune a causal language model on a prompt/response table with LoRA adapters on 2 Spark barrier tasks, then
generate the answers for the prompts with transform.

    python notebooks/sft_example.py [--model FOLDER] [--epochs 12] [--workdir /tmp/sft-example]

--model: a folder written by save_pretrained (an AutoModelForCausalLM checkpoint and its tokenizer) that every
executor reads. Without it, a tiny Llama (a LlamaConfig, a byte-level BPE tokenizer trained with `tokenizers`,
with a chat template) is built and saved first: the stand-in for a downloaded checkpoint, as this example reaches
no model hub. The table: made-up facts ("What color is the kettle?" -> " The kettle is teal."), which no base
model knows: after fine-tuning, the model writes them.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import random
import sys
import tempfile

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors use this interpreter (and its torch)

import torch  # noqa: E402

NOUNS = ("kettle lantern anchor violin compass teapot saddle ladder mirror candle bucket helmet basket trumpet "
         "feather marble ribbon hammer pillow bottle wallet button blanket drum kite scarf").split()
COLORS = "red blue green amber teal violet silver ochre".split()
INIT = 0.3  # a stand-in for a trained head: logits wide enough to be sure of a token
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def color_facts(count=26, seed=0):
    """(prompt, response) pairs: one made-up color per noun."""
    rng = random.Random(seed)
    return [(f"What color is the {noun}?", f" The {noun} is {rng.choice(COLORS)}.") for noun in NOUNS[:count]]


def save_pretrained_llama(folder, texts, hidden=64, layers=2, positions=64):
    """A byte-level BPE tokenizer trained on `texts` (bos, eos, pad and the chat roles as special tokens, a chat
    template) and a LlamaForCausalLM (seeded weights), both saved to `folder` with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        additional_special_tokens=special[3:], model_max_length=positions)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=positions, bos_token_id=bos, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
                         initializer_range=INIT)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return os.path.abspath(folder)


def main(argv=None) -> float:
    from peft import LoraConfig
    from pyspark.sql import SparkSession
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from estimator import TorchEstimator
    from store import Store

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a save_pretrained folder of a causal LM (default: a tiny Llama built here)")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "sft-example"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    spark = SparkSession.builder.master("local[2]").appName("sft-example").getOrCreate()
    facts = color_facts()
    path = args.model or save_pretrained_llama(os.path.join(args.workdir, "tiny-llama"),
                                               [p + r for p, r in facts] * 4, layers=3)
    train_df = spark.createDataFrame(facts, "prompt string, response string")
    store = Store.create(os.path.join(args.workdir, "runs"))

    # --8<-- [start:sft]
    est = TorchEstimator(
        num_proc=2, store=store,
        # built on each rank
        model=functools.partial(AutoModelForCausalLM.from_pretrained, path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
        optimizer=functools.partial(torch.optim.AdamW, lr=5e-3),
        lr_scheduler_fn=functools.partial(
            torch.optim.lr_scheduler.LinearLR,
            start_factor=1.0, end_factor=0.05, total_iters=args.epochs,
        ),
        # a string label on a causal LM: SFT
        feature_cols=["prompt"], label_cols=["response"],
        batch_size=2, epochs=args.epochs, max_new_tokens=16,
    )
    fitted = est.fit(train_df)
    # adds `prediction`: generated text
    answers = fitted.transform(train_df.select("prompt", "response"))
    # --8<-- [end:sft]

    rows = answers.collect()
    for row in rows[:3]:
        print(f"{row.prompt!r} -> {row.prediction!r} (trained on {row.response!r})")
    last = fitted.getHistory()[-1]
    print(f"epoch {last['epoch']:.0f}: loss {last['loss']:.4f} perplexity {last['perplexity']:.2f}")
    right = sum(row.prediction == row.response for row in rows) / len(rows)
    print(f"Answers written right: {right:.2f}")
    spark.stop()
    return right


if __name__ == "__main__":
    main()
