"""transform's embeddings batched by tokens (estimator.lm.embeddings), without Spark: each text's vector is the one
it gets alone, back in the rows' order, and every forward stays within its rows and its token budget."""
import numpy as np
import pyarrow as pa
import pytest
import torch

from estimator.data.text import Tokenize
from estimator.lm import embeddings as module
from estimator.predict import inference
from estimator.predict.kinds.embedding import Embedding, pooled
from text_helpers import save_pretrained_bert, topic_texts


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from transformers import AutoModel, AutoTokenizer

    texts = [t for t, _ in topic_texts(40, seed=5)]
    path = save_pretrained_bert(str(tmp_path_factory.mktemp("bert")), texts, dropout=0.0)
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), texts


def mixed(texts):
    """Texts of 1 to about 50 tokens (the tiny BERT has 64 positions), long and short mixed in the table's order."""
    return np.array([" ".join(texts[i:i + (i * 7) % 5 + 1]) if i % 3 else texts[i].split()[0]
                     for i in range(len(texts))], dtype=object)


def test_each_texts_vector_is_its_own_alone_in_the_rows_order(bert):
    model, tokenizer, texts = bert
    rows = mixed(texts)
    got = module.embed_texts(model, Tokenize(tokenizer, ()), rows, 8, "cpu", read=pooled, budget=120)[0]
    with torch.no_grad():
        alone = np.stack([module.embeddings(model(**tokenizer(t, return_tensors="pt")), None)[0].numpy()
                          for t in rows])
    assert got.shape == (len(rows), model.config.hidden_size)
    np.testing.assert_allclose(got, alone, atol=2e-5)


def test_every_forward_holds_at_most_its_rows_and_its_tokens(bert, monkeypatch):
    model, tokenizer, texts = bert
    rows = mixed(texts)
    shapes = []
    real = module.forward
    monkeypatch.setattr(module, "forward", lambda m, batch: shapes.append(tuple(batch[0]["input_ids"].shape))
                        or real(m, batch))
    module.embed_texts(model, Tokenize(tokenizer, ()), rows, 8, "cpu", read=pooled, budget=120)
    lengths = Tokenize(tokenizer, ()).encode(rows)["attention_mask"].sum(axis=1)
    assert sum(r for r, _ in shapes) == len(rows) and len(shapes) > len(rows) // 8
    assert all(r <= 8 and (r == 1 or r * w <= 120) for r, w in shapes), shapes
    padded = sum(r * w for r, w in shapes)
    assert padded < 1.3 * lengths.sum() < len(rows) * lengths.max()  # sorted: little padding; unsorted: much


def test_transforms_embedding_kind_batches_by_tokens_and_keeps_the_order(bert, monkeypatch):
    model, tokenizer, texts = bert
    rows = mixed(texts)
    monkeypatch.setattr(module, "EMBED_TOKENS", 120)
    layout = Embedding(feature_cols=("text",), batch_size=1024, use_gpu=False, tokenize=Tokenize(tokenizer, ()))
    inference._CACHE[("embedding-test", "cpu")] = model
    try:
        out = inference.predict_arrow("embedding-test", b"", layout, pa.array(list(rows), pa.string()))
    finally:
        inference._CACHE.pop(("embedding-test", "cpu"), None)
    got = np.array(out.field(0).to_pylist(), dtype=np.float32)
    with torch.no_grad():
        batch = tokenizer(list(rows), padding=True, return_tensors="pt")
        expected = module.embeddings(model(**batch), batch["attention_mask"]).numpy()
    np.testing.assert_allclose(got, expected, atol=2e-5)
