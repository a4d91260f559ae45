"""output_kind 'score': each row's log-likelihood under a causal LM (estimator.lm.scoring), in four columns:
`logprob` (the scored tokens' log-probabilities summed), `tokens` (how many were scored), `perplexity` (exp of
minus logprob over tokens; null where none was) and `truncated` (the row was cut at max_length).

The rows are read as a fit reads them (estimator.data.rows), and scored on the tokens its loss counts: with a
string label column (`label_cols=[response]`, as an SFT fit names it) the response given the prompt, and its EOS;
a chat column, each assistant turn; a text column and no label, every token after the first, and the EOS. A row
longer than max_length (unset: the tokenizer's maximum within the model's positions) is cut there as a fit cuts it
(the end goes), scored on what is left, and flagged in `truncated`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from estimator.core.adapters import can_generate
from estimator.data.lm import pad_id
from estimator.data.rows import scored
from estimator.data.text import Tokenize
from estimator.lm.scoring import score_rows
from estimator.predict.language_checks import (check_max_length, check_text_column, check_vocabulary,
                                               effective_max_length)
from estimator.predict.predictor import Added, Predictor

COLUMNS = (("logprob", pa.float64(), False), ("tokens", pa.int64(), False), ("perplexity", pa.float64(), True),
           ("truncated", pa.bool_(), False))


@dataclass(frozen=True, kw_only=True)
class Score(Predictor):
    rows: Any = None  # the rows' format (estimator.data.rows.scored): their tokens and those scored
    max_length: Optional[int] = None
    chat_tools: Optional[Tuple[Any, ...]] = None

    accepts_chat: ClassVar[bool] = True

    @classmethod
    def check(cls, p: Dict[str, Any]) -> None:
        check_text_column(p, "TorchModel")
        if not can_generate(p["model"]):
            raise ValueError(f"TorchModel with output_kind='score' needs a causal LM (AutoModelForCausalLM): it "
                             f"scores each row's tokens by the model's next-token probabilities; "
                             f"{type(p['model']).__name__} is not one.")
        if len(p["label_cols"] or ()) > 1:
            raise ValueError(f"TorchModel with output_kind='score' scores one response column given the prompt "
                             f"(label_cols=[response]), or the whole text (label_cols=[]); got label_cols="
                             f"{list(p['label_cols'])}.")
        check_max_length(p, "TorchModel")
        check_vocabulary(p, "TorchModel")

    @classmethod
    def build(cls, p: Dict[str, Any], outputs: List[str], torch_threads: Optional[int] = None) -> "Score":
        cls.check(p)
        tools = tuple(p["chat_tools"]) if p["chat_tools"] else None
        rows = scored(p["feature_cols"][0], p["label_cols"][0] if p["label_cols"] else None, False, tools)
        added = [Added(name, name, nullable=nullable) for name, _, nullable in COLUMNS]
        tokenize = Tokenize(p["tokenizer"], (), None)
        return cls(**cls.shared(p, added, torch_threads, tokenize), rows=rows, max_length=effective_max_length(p),
                   chat_tools=tools)

    def bind_chat(self, chat: bool) -> "Score":
        return dataclasses.replace(self, rows=scored(self.rows.column, None, True, self.chat_tools)) if chat else self

    def input_cols(self) -> Tuple[str, ...]:
        return self.rows.read

    def arrow_type(self) -> pa.StructType:
        return pa.struct([pa.field(name, dtype, nullable=nullable) for name, dtype, nullable in COLUMNS])

    def predict(self, model: Any, columns: Sequence[np.ndarray], device: str) -> List[pa.Array]:
        tokenizer = self.tokenize.tokenizer
        whole = self.rows.tokens(tokenizer, dict(zip(self.rows.read, columns)))
        limit = self.max_length
        cut = [(ids[:limit], labels[:limit]) if limit else (ids, labels) for ids, labels in whole]
        logprob, tokens = score_rows(model, cut, pad_id(tokenizer), self.batch_size, device)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            perplexity = np.exp(-logprob / tokens)
        truncated = np.array([bool(limit) and len(ids) > limit for ids, _ in whole], dtype=bool)
        return [pa.array(logprob, pa.float64()), pa.array(tokens, pa.int64()),
                pa.array(perplexity, pa.float64(), mask=tokens == 0), pa.array(truncated, pa.bool_())]
