"""Images the way text is fine-tuned: a ResNet-18 backbone saved with save_pretrained (Hugging Face's
ResNetForImageClassification in ResNet-18's shape, built from a config: no model hub) and loaded from that folder
on every rank by a factory, the PNG bytes decoded by transformation_fn; the fitted model saved as Hugging Face's
folder (no pickled module, no pickled weights) and loaded back predicting identically.

torchvision is not used: its PyPI wheels are built against CUDA torch (its _C needs libtorch_cuda.so), and with
the CPU torch CI installs `import torchvision` fails ("operator torchvision::nms does not exist")."""
import functools
import io
import logging
import os
import re

import numpy as np
import pytest
import torch
from torch import nn
from transformers import ResNetConfig, ResNetForImageClassification

from estimator import TorchEstimator, TorchModel

pytestmark = pytest.mark.spark

SIDE = 32  # the 8x8 digits upscaled, 3 channels: what an ImageNet backbone takes


def png_rows(digits, count):
    from PIL import Image

    X, y = digits
    rows = []
    for x, label in zip(X[:count], y[:count]):
        buffer = io.BytesIO()
        Image.fromarray((x.reshape(8, 8) * 255).astype(np.uint8)).save(buffer, format="PNG")
        rows.append((bytearray(buffer.getvalue()), int(label)))
    return rows


def decode(data: bytes) -> np.ndarray:
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB").resize((SIDE, SIDE))
    return (np.asarray(image, dtype=np.float32) / 255.0).transpose(2, 0, 1).reshape(-1)


def decode_batch(frame):
    frame["image"] = [decode(b) for b in frame["image"]]
    return frame


def save_pretrained_resnet18(folder):
    """ResNet-18's layers (basic blocks, 2-2-2-2, 64..512 channels; 11.2M parameters), 10 classes, seeded."""
    config = ResNetConfig(num_channels=3, embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                          layer_type="basic", num_labels=10)
    torch.manual_seed(0)
    ResNetForImageClassification(config).save_pretrained(folder)
    return folder


def test_a_resnet18_from_a_factory_fine_tunes_on_png_bytes_and_saves_as_safetensors(spark, store, digits, tmp_path,
                                                                                     caplog):
    df = spark.createDataFrame(png_rows(digits, 480), "image binary, label long").repartition(2)
    folder = save_pretrained_resnet18(str(tmp_path / "resnet18-pretrained"))
    factory = functools.partial(ResNetForImageClassification.from_pretrained, folder)
    with caplog.at_level(logging.INFO, logger="estimator"):
        fitted = TorchEstimator(num_proc=2, store=store, model=factory,
                                optimizer=functools.partial(torch.optim.AdamW, lr=3e-3), loss=nn.CrossEntropyLoss(),
                                metrics=["accuracy"], feature_cols=["image"], label_cols=["label"],
                                input_shapes=[[-1, 3, SIDE, SIDE]], transformation_fn=decode_batch, batch_size=16,
                                epochs=3, train_steps_per_epoch=6, validation=0.2, random_seed=2).fit(df)
    weights = sum(t.numel() * t.element_size() for t in factory().state_dict().values())  # 44.8 MB
    spec_bytes = [int(m) for m in re.findall(r"a spec of (\d+) bytes", caplog.text)]
    assert spec_bytes and max(spec_bytes) < weights / 100, (spec_bytes, weights)  # the factory travels
    history = fitted.getHistory()
    assert history[-1]["loss"] < history[0]["loss"], history  # a few steps of fine-tuning move it
    assert fitted.getModelFactory() is factory

    path = str(tmp_path / "resnet")
    fitted.save(path)
    files = sorted(os.listdir(path))
    assert "pretrained" in files and "model.pkl" not in files and "weights.pt" not in files, files
    assert os.path.exists(os.path.join(path, "pretrained", "model.safetensors"))
    os.rename(folder, folder + ".gone")  # rebuilt from the saved folder, not from the path the factory read
    assert os.path.getsize(os.path.join(path, "objects.pkl")) < weights / 100  # weights not pickled, nor the optimizer's
    loaded = TorchModel.load(path)
    for name, value in fitted.getModel().state_dict().items():
        assert torch.equal(loaded.getModel().state_dict()[name], value), name
    assert not loaded.getModel().training
    assert type(loaded.getOptimizer()) is torch.optim.AdamW
    assert loaded.getOptimizer().state_dict()["state"].keys() == fitted.getOptimizer().state_dict()["state"].keys()
    for a, b in zip(loaded.getOptimizer().state_dict()["state"].values(),
                    fitted.getOptimizer().state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])

    rows = png_rows(digits, 40)
    decoded = spark.createDataFrame([(i, decode(bytes(b)).tolist(), label) for i, (b, label) in enumerate(rows)],
                                    "id long, image array<float>, label long")
    expected = fitted.transform(decoded).orderBy("id").select("probability").collect()
    again = loaded.transform(decoded).orderBy("id").select("probability").collect()
    np.testing.assert_allclose([r.probability.toArray() for r in again],
                               [r.probability.toArray() for r in expected], atol=1e-6)


@pytest.mark.connect
def test_a_model_too_large_for_the_udf_reaches_the_executors_as_a_file(spark, digits, monkeypatch, caplog):
    """Spark Connect carries a plan in one gRPC message (128 MB by default): a pickled model over INLINE_BYTES
    goes with the session's files instead. Here every model does (the limit set to 0), on classic and Connect."""
    from estimator.predict import inference
    from helpers import MLP, seeded

    X, y = digits
    df = spark.createDataFrame([(i, X[i].tolist(), int(y[i])) for i in range(64)], "id long, features array<float>, "
                               "label long")
    model = TorchModel(model=seeded(MLP), feature_columns=["features"], label_columns=["label"],
                       input_shapes=[[-1, 64]], output_shapes=[[10]], loss_kinds=["class_index"])
    inline = [r["label__output"] for r in model.transform(df).orderBy("id").collect()]
    monkeypatch.setattr(inference, "INLINE_BYTES", 0)
    with caplog.at_level(logging.INFO, logger="estimator"):
        shipped = [r["label__output"] for r in model.transform(df).orderBy("id").collect()]
    assert "transform sends the model (0 MB pickled) to the executors as a file" in caplog.text
    np.testing.assert_allclose(shipped, inline, atol=1e-6)
    with torch.no_grad():
        np.testing.assert_allclose(shipped, model.getModel()(torch.tensor(X[:64])).numpy(), atol=1e-5)
