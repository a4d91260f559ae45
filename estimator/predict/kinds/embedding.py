"""output_kind 'embedding': a vector per row (array<float>) from a model whose output is hidden states, over one
text column (estimator.lm.embeddings: a sentence-transformers module's own, else the mean of the last hidden state
over the attention mask; forwards of texts sorted by tokens, bounded by tokens)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import torch

from estimator.data.text import Tokenize
from estimator.lm.embeddings import embed_texts, embeddings
from estimator.predict.inference import model_inputs, predict_numpy
from estimator.predict.language_checks import (check_max_length, check_text_column, check_vocabulary,
                                               effective_max_length)
from estimator.predict.predictor import Added, Predictor, arrow_rows, output_fields, rows_type


@dataclass(frozen=True, kw_only=True)
class Embedding(Predictor):
    outputs: Tuple[str, ...] = ("_0",)  # the struct's field of each output column

    reads_text: ClassVar[bool] = True

    @classmethod
    def check(cls, p: Dict[str, Any]) -> None:
        check_text_column(p, "TorchModel")
        check_max_length(p, "TorchModel")
        check_vocabulary(p, "TorchModel")

    @classmethod
    def build(cls, p: Dict[str, Any], outputs: List[str], torch_threads: Optional[int] = None) -> "Embedding":
        cls.check(p)
        fields = output_fields(len(outputs))
        added = [Added(name, field) for name, field in zip(outputs, fields)]
        tokenize = Tokenize(p["tokenizer"], (), effective_max_length(p))
        return cls(**cls.shared(p, added, torch_threads, tokenize), outputs=fields)

    def arrow_type(self) -> pa.StructType:
        return pa.struct([pa.field(n, rows_type(pa.float32())) for n in self.outputs])

    def predict(self, model: Any, columns: Sequence[np.ndarray], device: str) -> List[pa.Array]:
        arrays = model_inputs(columns, self.feature_cols)
        vectors = embed_texts(model, self.tokenize, arrays[0], self.batch_size, device, read=pooled)
        if vectors is None:  # a tokenizer of its own: batches of rows in the table's order
            vectors = predict_numpy(model, arrays, self.batch_size, device, self.tokenize, read=pooled)
        return [arrow_rows(values, pa.float32()) for values in vectors]


def pooled(raw: Any, batch: Sequence[Any]) -> Sequence[torch.Tensor]:
    """One vector per row from a forward's result, pooled over the tokens its text column's attention mask keeps."""
    masks = [b["attention_mask"] for b in batch if isinstance(b, dict) and "attention_mask" in b]
    return (embeddings(raw, masks[0] if masks else None),)
