"""output_kind 'score': each row's log-likelihood under a causal LM (estimator.lm.scoring), in four columns:
`logprob` (the scored tokens' log-probabilities summed), `tokens` (how many were scored), `perplexity` (exp of
minus logprob over tokens; null where none was) and `truncated` (the row was cut at max_length).

A preference table (`label_cols=[chosen, rejected]`, as a DPO fit names it) has each answer scored given the
prompt: `chosen_logprob`, `rejected_logprob`, `chosen_tokens`, `rejected_tokens`, and each answer's log-ratio to
the reference DPO trains against, the model with its adapters off (`chosen_logratio`, `rejected_logratio`: DPO's
implicit rewards over beta, whose comparison is TRL's rewards/accuracies; null for a model without adapters, whose
reference is not kept), and `truncated` (either answer cut).

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

from estimator.core.adapters import can_generate, is_adapted
from estimator.data.lm import json_chats_refusal, pad_id
from estimator.data.rows import scored
from estimator.data.text import Tokenize
from estimator.lm.scoring import score_rows
from estimator.predict.language_checks import (check_max_length, check_text_column, check_vocabulary,
                                               effective_max_length)
from estimator.predict.predictor import Added, Predictor

COLUMNS = (("logprob", pa.float64(), False), ("tokens", pa.int64(), False), ("perplexity", pa.float64(), True),
           ("truncated", pa.bool_(), False))
PAIR_COLUMNS = (("chosen_logprob", pa.float64(), False), ("rejected_logprob", pa.float64(), False),
                ("chosen_tokens", pa.int64(), False), ("rejected_tokens", pa.int64(), False),
                ("chosen_logratio", pa.float64(), True), ("rejected_logratio", pa.float64(), True),
                ("truncated", pa.bool_(), False))


@dataclass(frozen=True, kw_only=True)
class Score(Predictor):
    rows: Any = None  # the rows' format (estimator.data.rows.scored): their tokens and those scored
    max_length: Optional[int] = None
    chat_tools: Optional[Tuple[Any, ...]] = None

    accepts_chat: ClassVar[bool] = True
    reads_text: ClassVar[bool] = True

    @classmethod
    def check(cls, p: Dict[str, Any]) -> None:
        check_text_column(p, "TorchModel")
        if not can_generate(p["model"]):
            raise ValueError(f"TorchModel with output_kind='score' needs a causal LM (AutoModelForCausalLM): it "
                             f"scores each row's tokens by the model's next-token probabilities; "
                             f"{type(p['model']).__name__} is not one.")
        if len(p["label_cols"] or ()) > 2:
            raise ValueError(f"TorchModel with output_kind='score' scores one response column given the prompt "
                             f"(label_cols=[response]), the two answers of a preference pair (label_cols=[chosen, "
                             f"rejected]), or the whole text (label_cols=[]); got label_cols="
                             f"{list(p['label_cols'])}.")
        check_max_length(p, "TorchModel")
        check_vocabulary(p, "TorchModel")

    @classmethod
    def build(cls, p: Dict[str, Any], outputs: List[str], torch_threads: Optional[int] = None) -> "Score":
        cls.check(p)
        tools = tuple(p["chat_tools"]) if p["chat_tools"] else None
        rows = scored(p["feature_cols"][0], tuple(p["label_cols"] or ()), False, tools)
        added = [Added(name, name, nullable=nullable) for name, _, nullable in columns_of(rows)]
        tokenize = Tokenize(p["tokenizer"], (), None)
        return cls(**cls.shared(p, added, torch_threads, tokenize), rows=rows, max_length=effective_max_length(p),
                   chat_tools=tools)

    def bind_chat(self, chat: bool) -> "Score":
        return dataclasses.replace(self, rows=scored(self.rows.column, self.rows.answers, True, self.chat_tools)) \
            if chat else self

    def input_cols(self) -> Tuple[str, ...]:
        return self.rows.read

    def arrow_type(self) -> pa.StructType:
        return pa.struct([pa.field(name, dtype, nullable=nullable) for name, dtype, nullable in columns_of(self.rows)])

    def predict(self, model: Any, columns: Sequence[np.ndarray], device: str) -> List[pa.Array]:
        if not self.rows.messages:  # a string column: chats kept as JSON text in it are refused
            refusal = json_chats_refusal(self.rows.column, columns[0], "its JSON would be scored as the text")
            if refusal:
                raise ValueError(refusal)
        tokenizer = self.tokenize.tokenizer
        whole = self.rows.tokens(tokenizer, dict(zip(self.rows.read, columns)))
        limit = self.max_length
        cut = [(ids[:limit], labels[:limit]) if limit else (ids, labels) for ids, labels in whole]
        logprob, tokens = score_rows(model, cut, pad_id(tokenizer), self.batch_size, device)
        truncated = np.array([bool(limit) and len(ids) > limit for ids, _ in whole], dtype=bool)
        if self.rows.answers:  # pairs: the chosen answers' rows, then the rejected ones'
            return pair_arrays(model, cut, logprob, tokens, truncated, self, device)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            perplexity = np.exp(-logprob / tokens)
        return [pa.array(logprob, pa.float64()), pa.array(tokens, pa.int64()),
                pa.array(perplexity, pa.float64(), mask=tokens == 0), pa.array(truncated, pa.bool_())]


def columns_of(rows: Any) -> Tuple[Tuple[str, pa.DataType, bool], ...]:
    """The added columns (name, Arrow type, nullable) for rows of this format: pairs' or one answer's."""
    return PAIR_COLUMNS if rows.answers else COLUMNS


def pair_arrays(model: Any, cut: Any, logprob: np.ndarray, tokens: np.ndarray, truncated: np.ndarray,
                kind: Score, device: str) -> List[pa.Array]:
    """PAIR_COLUMNS' arrays from the 2n rows' scores (the chosen answers first); the log-ratios from the same rows
    scored again with the adapters off (none without adapters)."""
    pairs = len(cut) // 2
    ratios: Any = None
    if is_adapted(model):
        with model.disable_adapter():
            reference, _ = score_rows(model, cut, pad_id(kind.tokenize.tokenizer), kind.batch_size, device)
        ratios = logprob - reference
    nulls = np.ones(pairs, dtype=bool)
    logratio = [pa.array(np.zeros(pairs), pa.float64(), mask=nulls) if ratios is None
                else pa.array(ratios[half], pa.float64()) for half in (slice(0, pairs), slice(pairs, None))]
    return [pa.array(logprob[:pairs], pa.float64()), pa.array(logprob[pairs:], pa.float64()),
            pa.array(tokens[:pairs], pa.int64()), pa.array(tokens[pairs:], pa.int64()), *logratio,
            pa.array(truncated[:pairs] | truncated[pairs:], pa.bool_())]
