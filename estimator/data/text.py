"""String feature columns tokenized per batch: padded to the batch's longest text, truncated at max_length, kept
as int64 arrays under `<column>.<key>` (input_ids, attention_mask, token_type_ids: as the tokenizer names them)
until the batch becomes tensors, where they make a dict that forward receives by keyword. Runs where
transformation_fn runs (the reader's workers), after it, and in transform. numpy only, no torch."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

Arrays = Dict[str, np.ndarray]
SEP = "."
UNBOUNDED = 10 ** 6  # Hugging Face's model_max_length when a tokenizer does not know it is about 1e30


def is_hugging_face(tokenizer: Any) -> bool:
    return hasattr(tokenizer, "model_max_length") and hasattr(tokenizer, "pad_token_id")


def length_limit(tokenizer: Any, max_length: Optional[int]) -> Optional[int]:
    """max_length, else the tokenizer's model maximum (None when it has none: no truncation)."""
    if max_length is not None:
        return int(max_length)
    known = getattr(tokenizer, "model_max_length", None)
    return int(known) if isinstance(known, (int, float)) and 0 < known < UNBOUNDED else None


class Tokenize:
    """The batch with each string column replaced by its tokens."""

    def __init__(self, tokenizer: Any, columns: Sequence[str], max_length: Optional[int] = None):
        self.tokenizer, self.columns = tokenizer, tuple(columns)
        self.max_length = length_limit(tokenizer, max_length)

    def __call__(self, batch: Arrays) -> Arrays:
        out = {k: v for k, v in batch.items() if k not in self.columns}
        for column in self.columns:
            for key, values in self.encode(batch[column]).items():
                out[f"{column}{SEP}{key}"] = values
        return out

    def encode(self, texts: np.ndarray) -> Dict[str, np.ndarray]:
        texts = [t if isinstance(t, str) else str(t) for t in texts]
        if is_hugging_face(self.tokenizer):
            encoded = self.tokenizer(texts, padding="longest", truncation=self.max_length is not None,
                                     max_length=self.max_length, return_tensors="np")
        else:
            encoded = self.tokenizer(texts)
        if not hasattr(encoded, "items"):
            raise TypeError(f"The tokenizer returned {type(encoded).__name__}; it must return a dict of arrays "
                            "(input_ids, attention_mask, ...) for a list of strings.")
        out = {}
        for key, values in encoded.items():
            values = values.cpu() if hasattr(values, "cpu") else values
            if isinstance(values, (list, tuple)) and len({len(v) for v in values if hasattr(v, "__len__")}) > 1:
                raise ValueError(f"The tokenizer's {key!r} holds rows of different lengths (a callable tokenizer "
                                 "is called with the batch's texts alone: it pads and cuts them itself): return "
                                 "them padded to one length, e.g. tokenizer(texts, padding='longest', "
                                 "truncation=True, max_length=...), as a Hugging Face tokenizer is called here.")
            values = np.asarray(values)
            if values.ndim != 2 or values.shape[0] != len(texts):
                raise ValueError(f"The tokenizer's {key!r} has shape {values.shape} for {len(texts)} texts; it must "
                                 "be (texts, tokens): pad the texts of a batch to one length.")
            out[key] = np.ascontiguousarray(values.astype(np.int64, copy=False))
        return out


def encoded_keys(batch: Arrays, column: str) -> Dict[str, str]:
    """{tokenizer key: the batch's array name} of a tokenized column."""
    prefix = column + SEP
    return {name[len(prefix):]: name for name in batch if name.startswith(prefix)}
