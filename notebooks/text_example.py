"""Fine-tune a pretrained Hugging Face model on a text column with 2 Spark barrier tasks; print test accuracy.

    python notebooks/text_example.py [--model FOLDER] [--epochs 3] [--workdir /tmp/text-example]
        [--remote sc://host:15002]        # a Spark Connect server (Databricks: the workspace's Connect URL)

--model: a folder written by save_pretrained (a sequence-classification checkpoint with 2 labels and its
tokenizer) that every executor reads. Without it, a small BERT (a BertConfig, a WordPiece tokenizer trained with
`tokenizers`) is built and saved with save_pretrained first: the stand-in for a downloaded checkpoint, as this
example reaches no model hub. The table: generated sentences about animals or machines (label 1: machines).
The trained model is saved as a folder `from_pretrained` loads, and reloaded outside Spark to classify a sentence.
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
from torch import nn  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

from store import Store  # noqa: E402

ANIMALS = "cat dog horse cow sheep goat mouse bird fish duck lion tiger bear wolf fox deer".split()
MACHINES = "car truck engine motor wheel gear piston train plane rocket tractor drill pump valve crane robot".split()
FILLER = "the a one this that big small old new red blue green and with near under over".split()


def topic_texts(rows, seed=0):
    """(text, label) pairs: label 1 when most of the topic words are machines."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        label = rng.randrange(2)
        own, other = (MACHINES, ANIMALS) if label else (ANIMALS, MACHINES)
        words = [rng.choice(own) for _ in range(rng.randint(3, 7))] + [rng.choice(other)]
        words += [rng.choice(FILLER) for _ in range(rng.randint(2, 8))]
        rng.shuffle(words)
        out.append((" ".join(words), label))
    return out


def save_pretrained_bert(folder, texts, hidden=32, layers=2, dropout=0.1, heads=2, intermediate=None,
                         vocabulary=200):
    """A WordPiece tokenizer trained on `texts` and a BertForSequenceClassification (2 labels, seeded weights),
    both saved to `folder` with save_pretrained (BERT-base: hidden=768, layers=12, heads=12, intermediate=3072)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocabulary, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_max_length=64)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=intermediate or 2 * hidden,
                        max_position_embeddings=64, num_labels=2,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return os.path.abspath(folder)


def main(argv=None) -> float:
    # Spark's imports here: the builders above import without pyspark (benchmarks/bench_gpu.py on a GPU host)
    from pyspark.ml import Pipeline
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.sql import SparkSession

    from estimator import TorchEstimator

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a save_pretrained folder (default: a small BERT built here)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "text-example"))
    parser.add_argument("--remote", help="a Spark Connect URL (sc://...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    builder = SparkSession.builder.remote(args.remote) if args.remote else SparkSession.builder.master("local[2]")
    spark = builder.appName("text-example").getOrCreate()
    rows = topic_texts(1200, seed=0)
    path = args.model or save_pretrained_bert(os.path.join(args.workdir, "pretrained-bert"), [t for t, _ in rows])
    train_df, test_df = spark.createDataFrame(rows, "text string, label long").randomSplit([0.8, 0.2], seed=1)
    epochs, store, saved = args.epochs, Store.create(os.path.join(args.workdir, "runs")), os.path.join(args.workdir, "tuned")
    lr = 2e-5 if args.model else 3e-3  # BERT-base's (docs/training.md); the small BERT built here learns at 3e-3

    # --8<-- [start:finetune]
    est = TorchEstimator(
        num_proc=2, store=store,
        model=functools.partial(
            AutoModelForSequenceClassification.from_pretrained, path),
        optimizer=functools.partial(
            torch.optim.AdamW, lr=lr, weight_decay=0.01),
        # the text is tokenized on the ranks
        tokenizer=AutoTokenizer.from_pretrained(path),
        loss=torch.nn.CrossEntropyLoss(), metrics=["accuracy"],
        feature_cols=["text"], label_cols=["label"],
        batch_size=32, epochs=epochs, validation=0.1,
    )
    # the model is built on each rank from `path`
    pm = Pipeline(stages=[est]).fit(train_df)
    pred = pm.transform(test_df)  # prediction, rawPrediction, probability
    evaluator = MulticlassClassificationEvaluator(labelCol="label")
    accuracy = evaluator.setMetricName("accuracy").evaluate(pred)
    # a from_pretrained folder, tokenizer included
    pm.stages[0].save_pretrained(saved)
    # --8<-- [end:finetune]

    for row in pm.stages[0].getHistory():
        print("epoch {epoch:.0f}: loss {loss:.4f} val_loss {val_loss:.4f} val_accuracy {val_accuracy:.4f}".format(**row))
    tuned, tokenizer = AutoModelForSequenceClassification.from_pretrained(saved), AutoTokenizer.from_pretrained(saved)
    sentence = "the old tractor with a red engine near the crane"
    with torch.no_grad():
        label = tuned(**tokenizer([sentence], return_tensors="pt")).logits.argmax(-1).item()
    print(f"{sentence!r} -> {'machines' if label else 'animals'} (reloaded from {saved})")
    print(f"Test accuracy: {accuracy:.4f}")
    spark.stop()
    return accuracy


if __name__ == "__main__":
    main()
