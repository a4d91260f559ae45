"""output_kind 'generate': the text a causal LM generates for each prompt (or chat), as a string in every output
column and in prediction_col (estimator.lm.generation.generate_texts: continuous batching, or sorted, left-padded
batches through the model's own generate(), by generation_batching)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from estimator.core.adapters import can_generate
from estimator.data.lm import json_chats_refusal
from estimator.data.text import Tokenize
from estimator.lm.generation import generate_texts
from estimator.predict.language_checks import (check_generate_kwargs, check_generation_batching, check_max_length,
                                               check_max_new_tokens, check_text_column, check_vocabulary,
                                               effective_max_length)
from estimator.predict.predictor import PREDICTION_FIELD, Added, Predictor, output_fields


@dataclass(frozen=True, kw_only=True)
class Generate(Predictor):
    outputs: Tuple[str, ...] = ("_0",)  # the struct's field of each output column (each holds the same text)
    chat: bool = False  # the feature column holds chats, rendered with the chat template (bind_chat)
    max_new_tokens: int = 64
    generate_kwargs: Optional[Dict[str, Any]] = None
    chat_tools: Optional[Tuple[Any, ...]] = None  # given to the chat template with each conversation
    batching: str = "auto"  # generation_batching (estimator.lm.generation.batching_for)

    accepts_chat: ClassVar[bool] = True
    reads_text: ClassVar[bool] = True
    generates: ClassVar[bool] = True

    @classmethod
    def check(cls, p: Dict[str, Any]) -> None:
        check_text_column(p, "TorchModel")
        if not can_generate(p["model"]):
            raise ValueError(f"TorchModel with output_kind={p['output_kind']!r} needs a model that generates (a "
                             f"causal LM, AutoModelForCausalLM); {type(p['model']).__name__} does not.")
        check_max_length(p, "TorchModel")
        check_vocabulary(p, "TorchModel")
        check_max_new_tokens(p, "TorchModel")
        check_generation_batching(p, "TorchModel")
        check_generate_kwargs(p, "TorchModel")

    @classmethod
    def build(cls, p: Dict[str, Any], outputs: List[str], torch_threads: Optional[int] = None) -> "Generate":
        cls.check(p)
        fields = output_fields(len(outputs))
        added = [Added(name, field, nullable=True) for name, field in zip(outputs, fields)]
        if p["prediction_col"]:
            added.append(Added(p["prediction_col"], PREDICTION_FIELD, nullable=True))
        tokenize = Tokenize(p["tokenizer"], (), effective_max_length(p))
        shared = {**cls.shared(p, added, torch_threads, tokenize), "batch_size": p["inference_batch_size"]}
        return cls(**shared, outputs=fields, max_new_tokens=p["max_new_tokens"], generate_kwargs=p["generate_kwargs"],
                   chat_tools=tuple(p["chat_tools"]) if p["chat_tools"] else None, batching=p["generation_batching"])

    def bind_chat(self, chat: bool) -> "Generate":
        return dataclasses.replace(self, chat=chat)

    def arrow_type(self) -> pa.StructType:
        return pa.struct([pa.field(n, pa.string()) for n in (*self.outputs, PREDICTION_FIELD)])

    def predict(self, model: Any, columns: Sequence[np.ndarray], device: str) -> List[pa.Array]:
        refusal = None if self.chat else json_chats_refusal(self.feature_cols[0], columns[0], "the model would be "
                                                            "given the JSON itself as its prompt")
        if refusal:
            raise ValueError(refusal)
        texts = generate_texts(model, self.tokenize.tokenizer, columns[0], self.chat, self.feature_cols[0],
                               self.batch_size, device, self.max_new_tokens, self.generate_kwargs, self.chat_tools,
                               self.batching)
        text = pa.array(list(texts), pa.string())
        return [text] * (len(self.outputs) + 1)
