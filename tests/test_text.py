"""Text columns without Spark: the tokenization step (padding per batch, truncation, the names forward gets, any
callable tokenizer) and the checks that refuse what training could not read, by name."""
import numpy as np
import pytest
from pyspark.sql.types import ArrayType, FloatType, LongType, StringType, StructField, StructType

from estimator.data.text import Tokenize, encoded_keys, length_limit
from estimator.fit.checks import text_columns
from text_helpers import save_pretrained_bert, topic_texts


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = save_pretrained_bert(str(tmp_path_factory.mktemp("bert")), [t for t, _ in topic_texts(200)])
    return AutoTokenizer.from_pretrained(folder)


def test_a_hugging_face_tokenizer_pads_each_batch_to_its_longest_text_and_truncates_at_max_length(tokenizer):
    texts = np.array(["cat", "the old red tractor near a big crane", "dog and fish"], dtype=object)
    batch = Tokenize(tokenizer, ["text"])({"text": texts, "label": np.array([0, 1, 0])})
    names = set(tokenizer(["a"]).keys())  # as the tokenizer names them
    assert {"input_ids", "attention_mask"} <= names and set(batch) == {"label"} | {f"text.{n}" for n in names}
    ids, mask = batch["text.input_ids"], batch["text.attention_mask"]
    assert ids.dtype == np.int64 and ids.shape == mask.shape == (3, ids.shape[1])
    assert ids.shape[1] == len(tokenizer("the old red tractor near a big crane")["input_ids"])  # the longest
    assert mask.sum(1).tolist() == [len(tokenizer(str(t))["input_ids"]) for t in texts]
    assert encoded_keys(batch, "text") == {n: f"text.{n}" for n in names}
    short = Tokenize(tokenizer, ["text"], max_length=4)({"text": texts})
    assert short["text.input_ids"].shape == (3, 4)
    assert length_limit(tokenizer, None) == 64 and length_limit(tokenizer, 5) == 5  # the model maximum, else given


def test_any_callable_returning_a_dict_of_arrays_tokenizes():
    def chars(texts):  # one id per character, padded with 0
        width = max(len(t) for t in texts)
        return {"ids": [[ord(c) for c in t] + [0] * (width - len(t)) for t in texts]}

    batch = Tokenize(chars, ["t"])({"t": np.array(["ab", "c"], dtype=object)})
    assert batch["t.ids"].tolist() == [[97, 98], [99, 0]] and batch["t.ids"].dtype == np.int64
    with pytest.raises(TypeError, match="The tokenizer returned list; it must return a dict of arrays"):
        Tokenize(lambda texts: [1, 2], ["t"])({"t": np.array(["a"], dtype=object)})
    with pytest.raises(ValueError, match=r"'ids' has shape \(1,\) for 2 texts.*pad the texts of a batch"):
        Tokenize(lambda texts: {"ids": [1]}, ["t"])({"t": np.array(["a", "b"], dtype=object)})
    unpadded = lambda texts: {"ids": [[ord(c) for c in t] for t in texts]}  # noqa: E731 - a trial's wrapper
    with pytest.raises(ValueError, match=r"'ids' holds rows of different lengths \(a callable tokenizer is called "
                                         r"with the batch's texts alone.*padding='longest'"):
        Tokenize(unpadded, ["t"])({"t": np.array(["ab", "c"], dtype=object)})


SCHEMA = StructType([StructField("text", StringType()), StructField("title", StringType()),
                     StructField("x", ArrayType(FloatType())), StructField("label", LongType())])


def text_columns_of(p, schema):
    from estimator.train.objectives.classic import Objective

    return text_columns(p, Objective, schema)  # a fit on a loss: its text columns are tokenized per batch


def params(**kw):
    return {"feature_cols": ["text", "x"], "tokenizer": len, "input_shapes": None, "reader": "arrow", **kw}


def test_text_columns_are_refused_by_name_where_training_could_not_read_them():
    assert text_columns_of(params(), SCHEMA) == ("text",)
    with pytest.raises(ValueError, match=r"Column 'text' \(from feature_cols\) holds strings: set tokenizer"):
        text_columns_of(params(tokenizer=None), SCHEMA)
    with pytest.raises(ValueError, match=r"2 string columns \['text', 'title'\].*concat_ws"):
        text_columns_of(params(feature_cols=["text", "title"]), SCHEMA)
    with pytest.raises(ValueError, match=r"input_shapes\[0\] is \[-1, 8\] for the text column 'text'.*None"):
        text_columns_of(params(input_shapes=[[-1, 8], None]), SCHEMA)
    with pytest.raises(ValueError, match="reader='arrow'"):
        text_columns_of(params(reader="petastorm"), SCHEMA)
    with pytest.raises(ValueError, match=r"tokenizer is set, and no column of feature_cols \['x'\] holds strings"):
        text_columns_of(params(feature_cols=["x"]), SCHEMA)


def test_without_max_length_texts_are_cut_at_the_models_positions_when_the_tokenizer_has_no_maximum(tokenizer):
    """A tokenizer saved without a maximum cuts nothing; the model's position embedding then fails on a longer text,
    on the ranks. Unset, max_length is the tokenizer's maximum capped at the model's positions."""
    import copy

    from torch.nn import Linear
    from transformers import BertConfig, BertModel

    from estimator.predict.language_checks import effective_max_length

    model = BertModel(BertConfig(vocab_size=200, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                 intermediate_size=8, max_position_embeddings=40))
    unbounded = copy.deepcopy(tokenizer)
    unbounded.model_max_length = int(1e30)
    assert effective_max_length({"model": model, "tokenizer": unbounded, "max_length": None}) == 40
    assert effective_max_length({"model": model, "tokenizer": tokenizer, "max_length": None}) == 40  # 64 > 40
    assert effective_max_length({"model": model, "tokenizer": unbounded, "max_length": 20}) == 20
    assert effective_max_length({"model": Linear(2, 2), "tokenizer": unbounded, "max_length": None}) is None


def test_a_tokenizer_with_more_tokens_than_the_models_embeddings_is_refused_naming_both(tokenizer):
    import functools

    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from estimator import TorchEstimator

    def bert(vocabulary):
        return BertForSequenceClassification(BertConfig(vocab_size=vocabulary, hidden_size=8, num_hidden_layers=1,
                                                        num_attention_heads=1, intermediate_size=8,
                                                        max_position_embeddings=64))

    def checked(model):  # the driver's checks of fit, before any Spark job
        return TorchEstimator(model=model, tokenizer=tokenizer, optimizer=functools.partial(torch.optim.AdamW),
                              feature_cols=["text"], label_cols=["label"])._checked()

    tokens = tokenizer.vocab_size  # what WordPiece learned of the 200 it was allowed
    with pytest.raises(ValueError, match=f"The tokenizer of TorchEstimator has {tokens} tokens, and the model's "
                                         "input embeddings 50 rows.*resize_token_embeddings"):
        checked(bert(50))
    checked(bert(tokens))

