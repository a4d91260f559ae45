"""Batched inference on Arrow arrays, without Spark."""
import cloudpickle
import numpy as np
import pyarrow as pa
import torch

from estimator.predict import inference
from estimator.predict.inference import predict_arrow
from estimator.predict.kinds.values import Values
from helpers import MLP, TwoOutputs, seeded


def _layout(**kw):
    base = dict(feature_cols=("features",), input_shapes=None, outputs=("_0",), output_is_vector=(True,),
                head="scores", batch_size=7, use_gpu=False)
    base.update(kw)
    return Values(**base)


def test_outputs_and_argmax_match_a_direct_forward_across_batches():
    model = seeded(MLP).eval()
    x = np.random.default_rng(0).random((20, 64), dtype=np.float32)
    column = pa.array(list(x), pa.list_(pa.float32()))
    result = predict_arrow("k-mlp", cloudpickle.dumps(model), _layout(), column)
    assert result.type == _layout().arrow_type()
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    scores = np.array(result.field("_0").to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(result.field("_prediction").to_numpy(), expected.argmax(1).astype(float))


def test_model_is_unpickled_once_per_worker(monkeypatch):
    loads = []
    real = cloudpickle.loads
    monkeypatch.setattr(inference.pickle, "loads", lambda b: loads.append(1) or real(b))
    blob = cloudpickle.dumps(seeded(MLP))
    column = pa.array([[0.0] * 64] * 3, pa.list_(pa.float32()))
    for _ in range(3):
        predict_arrow("k-once", blob, _layout(), column)
    assert len(loads) == 1


def test_scalar_and_vector_outputs_and_empty_batches():
    layout = _layout(outputs=("_0", "_1"), output_is_vector=(True, False), head=None)
    blob = cloudpickle.dumps(seeded(TwoOutputs))
    column = pa.array([[0.5] * 64] * 4, pa.list_(pa.float32()))
    result = predict_arrow("k-two", blob, layout, column)
    assert result.type.field("_1").type == pa.float64() and len(result) == 4
    empty = predict_arrow("k-two", blob, layout, pa.array([], pa.list_(pa.float32())))
    assert len(empty) == 0 and empty.type == layout.arrow_type()


def test_inference_runs_on_the_gpu_spark_assigned_to_the_task(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert inference.device_for(None, "3") == "cuda:3"
    assert inference.device_for(True, None) == "cuda"  # no assignment: the current CUDA device
    assert inference.device_for(False, "3") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert inference.device_for(None, "3") == "cpu"
    assert inference.task_gpu() is None  # outside a Spark task


def test_inference_uses_the_task_cores_as_torch_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model = seeded(MLP, 4, 3)
        blob = cloudpickle.dumps(model)
        layout = _layout(torch_threads=1)
        predict_arrow("threads", blob, layout, pa.array([[0.0] * 4] * 3, type=pa.list_(pa.float32())))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_spark_workers_import_inference_without_pyspark_ml():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys, estimator.predict.inference, estimator.launch.spark; "
            "print(sorted(m for m in sys.modules if m == 'pyspark.ml' or m == 'estimator.estimator'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=root))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_prediction_columns_follow_what_the_loss_says_the_output_is():
    from estimator.predict.kinds.heads import PREDICTION_FIELD as P, PROBABILITY_FIELD as PR, RAW_FIELD as R
    from estimator.predict.kinds.heads import head_columns, head_of

    assert [head_of(k, s) for k, s in [("class_index", (3,)), ("unknown", (3,)), ("logits", (1,)),
                                       ("probabilities", ()), ("regression", (1,)), ("unknown", ()),
                                       ("logits", (3,)), ("regression", (2,)), ("class_index", (3, 4))]] == \
        ["softmax", "scores", "logit", "probability", "value", "value", None, None, None]
    scores = np.array([[1.0, 3.0, 0.0], [2.0, -1.0, 0.5]])
    soft = head_columns("softmax", scores)
    np.testing.assert_allclose(soft[PR], np.exp(scores) / np.exp(scores).sum(1, keepdims=True))
    assert soft[P].tolist() == [1.0, 0.0] and soft[R] is not None
    assert PR not in head_columns("scores", scores)  # a loss of the user's own: no probabilities
    logit = head_columns("logit", np.array([[-1.0], [2.0]]))
    np.testing.assert_allclose(logit[R], [[1.0, -1.0], [-2.0, 2.0]])
    np.testing.assert_allclose(logit[PR][:, 1], 1 / (1 + np.exp([1.0, -2.0])))
    assert logit[P].tolist() == [0.0, 1.0]
    prob = head_columns("probability", np.array([[0.3], [0.6]]))
    np.testing.assert_allclose(prob[PR], [[0.7, 0.3], [0.4, 0.6]])
    assert prob[P].tolist() == [0.0, 1.0]
    assert head_columns("value", np.array([[2.5], [-1.0]]))[P].tolist() == [2.5, -1.0]


def test_rows_with_non_finite_scores_have_no_predicted_class():
    """NaN scores would argmax to class 0, which an evaluator counts as an answer: the prediction is NaN."""
    from estimator.predict.kinds.heads import PREDICTION_FIELD as P
    from estimator.predict.kinds.heads import head_columns

    scores = np.array([[1.0, 3.0, 0.0], [np.nan, np.nan, np.nan], [0.0, np.inf, 1.0]])
    for head in ("softmax", "scores"):
        predicted = head_columns(head, scores)[P]
        assert predicted[0] == 1.0 and np.isnan(predicted[1:]).all()
    for head in ("logit", "probability"):
        predicted = head_columns(head, np.array([[0.9], [np.nan]]))[P]
        assert predicted[0] == 1.0 and np.isnan(predicted[1])


class MeanOfEmbeddings(torch.nn.Module):
    """A text model: the mean of its tokens' embeddings, read by keyword as a tokenized column reaches forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 3)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        return (self.embed(input_ids) * mask).sum(1) / mask.sum(1)


def characters(texts):
    """A tokenizer as the param takes one: a list of strings to a dict of (texts, tokens) arrays, padded."""
    width = max(len(t) for t in texts)
    ids = np.array([[ord(c) % 64 for c in t] + [0] * (width - len(t)) for t in texts])
    return {"input_ids": ids, "attention_mask": (np.arange(width) < np.array([[len(t)] for t in texts])).astype(int)}


def test_a_pandas_udf_reads_text_and_chat_columns_as_the_arrow_udf_does():
    """pyspark 3.5 has no Arrow UDFs: transform's pandas UDF gets a text column as a Series of strings, which,
    stacked, became a numpy unicode array that no text model reads (every transform of a text column failed on
    Spark 3.5). Its outputs equal the Arrow UDF's; a chat column's rows become lists of messages whatever their
    lengths, as the Arrow path reads them."""
    import pandas as pd

    from estimator.data.arrays import column_to_numpy
    from estimator.data.text import Tokenize

    texts = ["a cat", "dogs bark loudly", "x", "ok"]
    predictor = Values(feature_cols=("text",), outputs=("_0",), output_is_vector=(True,), batch_size=3,
                       use_gpu=False, tokenize=Tokenize(characters, ()))
    blob = cloudpickle.dumps(MeanOfEmbeddings().eval())
    arrow = inference.make_predict("k-text", blob, predictor)(pa.array(texts)).field("_0").to_pylist()
    frame = inference.make_predict_pandas("k-text", blob, predictor)(pd.Series(texts))
    np.testing.assert_array_equal(np.array(list(frame["_0"]), dtype=np.float32), np.array(arrow, dtype=np.float32))
    chats = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a"}, {"role": "assistant",
                                                                                       "content": "b"}]]
    as_pandas = pd.Series([np.array(c, dtype=object) for c in chats])  # what Arrow's to_pandas hands a UDF
    chat_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    expected = column_to_numpy(pa.chunked_array([pa.array(chats, chat_type)]), "chat")
    got = inference.series_values(as_pandas)
    assert got.dtype == object and [list(r) for r in got] == [list(r) for r in expected] == chats


def test_handle_invalid_keep_gives_a_row_with_a_null_null_outputs_in_its_place_in_both_udfs():
    """A null row and an array holding a null: null structs in their places (all of them null in a
    batch of nothing else), the other rows' outputs as without them; without keep, the error names the column and
    the param. The pandas UDF (pyspark 3.5) the same, its null fields as pandas gives them."""
    import pandas as pd
    import pytest

    model = seeded(MLP).eval()
    blob = cloudpickle.dumps(model)
    x = np.random.default_rng(1).random((5, 64), dtype=np.float32)
    rows = [list(x[0]), None, list(x[2]), list(x[3][:63]) + [None], list(x[4])]
    column = pa.array(rows, pa.list_(pa.float32()))
    got = inference.make_predict("k-keep", blob, _layout(), keep=True)(column)
    assert got.is_null().to_pylist() == [False, True, False, True, False]
    clean = predict_arrow("k-keep", blob, _layout(), pa.array([rows[i] for i in (0, 2, 4)], pa.list_(pa.float32())))
    assert got.filter(pa.array([True, False, True, False, True])).equals(clean)
    everything = inference.make_predict("k-keep", blob, _layout(), keep=True)(pa.array([None, None],
                                                                                      pa.list_(pa.float32())))
    assert everything.null_count == 2 and everything.type == _layout().arrow_type()
    with pytest.raises(inference.TransformFailed, match=r"Column 'features' has 2 rows with a null value or an "
                                                        r"array holding a null .*handle_invalid"):
        inference.make_predict("k-keep", blob, _layout())(column)

    series = pd.Series([None if r is None else np.array(r, dtype=object if None in r else np.float32) for r in rows])
    frame = inference.make_predict_pandas("k-keep", blob, _layout(), keep=True)(series)
    assert frame["_prediction"].isna().tolist() == [False, True, False, True, False]
    np.testing.assert_array_equal(frame["_prediction"].dropna().to_numpy(), clean.field("_prediction").to_numpy())
    with pytest.raises(inference.TransformFailed, match=r"Column 'features' has 2 rows with a null value or an "
                                                        r"array holding a null .*handle_invalid"):
        inference.make_predict_pandas("k-keep", blob, _layout())(series)


def test_the_mlflow_pyfunc_gives_a_row_with_a_null_null_outputs_under_handle_invalid():
    """The pyfunc returns a row for each row it is given: with handle_invalid 'keep' (or 'skip') a null feature's
    row gets null outputs, the others what transform gives them; with 'error', the error names the param."""
    import pandas as pd
    import pytest

    pytest.importorskip("mlflow")
    from estimator.predict.pyfunc import TorchModelPyfunc

    blob = cloudpickle.dumps(seeded(MLP).eval())
    x = np.random.default_rng(2).random((3, 64), dtype=np.float32)
    frame = pd.DataFrame({"features": [list(x[0]), None, list(x[2])]})
    kept = TorchModelPyfunc("k-pyfunc", blob, _layout(), ["features"], [("prediction", "_prediction")], keep=True)
    got = kept.predict(None, frame)
    clean = predict_arrow("k-pyfunc", blob, _layout(), pa.array([list(x[0]), list(x[2])], pa.list_(pa.float32())))
    assert got["prediction"].isna().tolist() == [False, True, False]
    np.testing.assert_array_equal(got["prediction"].dropna().to_numpy(), clean.field("_prediction").to_numpy())
    with pytest.raises(ValueError, match=r"Column 'features' has 1 null values .*handle_invalid"):
        TorchModelPyfunc("k-pyfunc", blob, _layout(), ["features"], [("prediction", "_prediction")]).predict(None,
                                                                                                           frame)
