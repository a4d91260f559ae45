"""Rows of a causal language model's fine-tuning (SFT) as token arrays, with the labels that say which tokens
the loss covers. numpy and the user's tokenizer only, no torch: it runs where text columns are tokenized (the
reader's workers, after transformation_fn).

The rule, for a prompt column and a string label column (the response):
    tokens = tokenizer(prompt)  +  tokenizer(response, add_special_tokens=False)  +  [eos]
    labels = -100 for every prompt token,   the response's tokens and eos as they are
tokenized apart, so that the prompt's tokens are exactly what generation is given in transform; the whole is cut at
max_length (the response loses its end first). For a chat column (a list of {role, content} messages, no label
column), the tokenizer's chat template renders the conversation; the tokens of each assistant turn (up to and
with its end-of-turn marker) are labelled, everything else is -100. Padding (to the batch's longest row, on the
right) is -100 too and has attention_mask 0. The loss is then the model's next-token cross entropy over the
labelled tokens, summed and divided by their count over the accumulation window and all ranks
(estimator.train.objectives): k ranks of batch b train as one process of batch k*b.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from estimator.core.spec import LMSpec
from estimator.data.text import SEP, Tokenize, length_limit

Arrays = Dict[str, np.ndarray]
IGNORE = -100  # labels the loss skips (torch's cross_entropy ignore_index, Hugging Face's convention)
REFERENCE = "__reference_logps"  # preference pairs: each row's answer log-probability under the reference model

CHAT_TYPE = "array<struct<role:string,content:string>>"  # a chat column's messages, as Spark writes the type


def token_ids(encoded: Any) -> List[int]:
    """A tokenizer's or apply_chat_template's ids for one text (a list, or a dict/BatchEncoding with input_ids)."""
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


def eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(f"The tokenizer {type(tokenizer).__name__} has no eos token: a fine-tuned causal LM learns "
                         "to end its response with it. Set one (tokenizer.eos_token = '</s>' or the model's).")
    return int(eos)


def pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else eos_id(tokenizer)


def plain_value(value: Any) -> Any:
    """A message field as a chat template reads it: Arrow's lists (numpy arrays) as lists, structs as dicts."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {k: plain_value(v) for k, v in value.items()}
    return value


def messages_of(row: Any, column: str) -> List[Dict[str, Any]]:
    """A chat row as the list of message dicts chat templates take: role and content (a string; empty in an
    assistant's message that only calls tools), and every other field it holds that is not null (tool_calls,
    name, tool_call_id: the template renders them; fit refuses a field the template never reads)."""
    out = []
    for message in list(row):
        if not hasattr(message, "get") or message.get("role") is None or (
                message.get("content") is None and message.get("tool_calls") is None):
            raise ValueError(f"Column {column!r} holds a message {message!r}: each message of a chat column must be "
                             "a struct with 'role' and 'content' (array<struct<role:string, content:string>>; "
                             "an assistant's message may hold tool_calls instead of content).")
        extra = {k: plain_value(v) for k, v in message.items() if k not in ("role", "content") and v is not None}
        content = message.get("content")
        out.append({"role": str(message["role"]), "content": "" if content is None else str(content), **extra})
    return out


def render(tokenizer: Any, messages: Sequence[Dict[str, Any]], generation_prompt: bool,
           tools: Optional[Sequence[Any]] = None) -> List[int]:
    """A conversation's tokens, as the tokenizer's chat template renders it (with `tools`: chat_tools)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"The tokenizer {type(tokenizer).__name__} has no chat template (tokenizer.chat_template): "
                         "a chat column is rendered with it. Use the model's tokenizer, or set a template.")
    extra = {"tools": list(tools)} if tools else {}
    return token_ids(tokenizer.apply_chat_template(list(messages), tokenize=True,
                                                   add_generation_prompt=generation_prompt, **extra))


def answer_tokens(tokenizer: Any, prompt: Sequence[Dict[str, Any]], answer: Sequence[Dict[str, Any]], column: str,
                  tools: Optional[Sequence[Any]] = None) -> Tuple[List[int], List[int]]:
    """(ids, labels) of a conversation's prompt messages followed by an answer's (preference pairs of message
    lists): the answer's tokens labelled, the prompt's (its earlier assistant turns too) not."""
    before, ids = render(tokenizer, prompt, True, tools), render(tokenizer, [*prompt, *answer], False, tools)
    if ids[:len(before)] != before:
        raise ValueError(f"The chat template of {type(tokenizer).__name__} renders a conversation differently from "
                         f"its beginning (column {column!r}): the answer's tokens cannot be told apart from the "
                         "prompt's. Use a template whose rendering of the first turns is a prefix of the whole's.")
    return ids, [IGNORE] * len(before) + ids[len(before):]


def chat_tokens(tokenizer: Any, messages: Sequence[Dict[str, Any]], column: str,
                tools: Optional[Sequence[Any]] = None) -> Tuple[List[int], List[int]]:
    """(ids, labels) of one conversation: each assistant turn's tokens labelled (its tool calls too), found as
    the difference between the conversation rendered up to the turn's generation prompt and up to the turn's
    end."""
    ids = render(tokenizer, messages, False, tools)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix, upto = render(tokenizer, messages[:i], True, tools), render(tokenizer, messages[:i + 1], False, tools)
        start, end = len(prefix), len(upto)
        if ids[:end] != upto or upto[:start] != prefix:
            raise ValueError(f"The chat template of {type(tokenizer).__name__} renders a conversation differently "
                             f"from its beginning (column {column!r}, turn {i}): the assistant's tokens cannot be "
                             "told apart. Use a template whose rendering of the first turns is a prefix of the "
                             "whole's.")
        labels[start:end] = ids[start:end]
    return ids, labels


class CausalLMTokenize:
    """The batch with the prompt (or chat, or text) column as `<column>.input_ids` / `.attention_mask` and the
    labels at `spec.labels_key` (int64, IGNORE where no loss), padded on the right to the batch's longest row: the
    rows as their format tokenizes them (estimator.data.rows), every token labelled where the spec says so, each
    cut at max_length (the answer loses its end first)."""

    def __init__(self, tokenizer: Any, spec: LMSpec, max_length: Optional[int], reference: Any = None):
        self.tokenizer, self.spec, self.max_length = tokenizer, spec, length_limit(tokenizer, max_length)
        self.reference = reference  # preference pairs: their stored reference log-probabilities (data.reference)

    def __call__(self, batch: Arrays) -> Arrays:
        spec = self.spec
        rows = self.rows(batch)
        out = {k: v for k, v in batch.items() if k not in spec.rows.read}
        if self.reference is not None:  # looked up by the pairs' content, before they are tokenized
            out[REFERENCE] = self.reference(batch, spec.rows)
        if spec.packed:
            return {**out, **packed(rows, pad_id(self.tokenizer), spec)}
        width = max((len(ids) for ids, _ in rows), default=0)
        ids = np.full((len(rows), width), pad_id(self.tokenizer), dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, (row_ids, row_labels) in enumerate(rows):
            ids[i, :len(row_ids)], labels[i, :len(row_ids)], mask[i, :len(row_ids)] = row_ids, row_labels, 1
        out[f"{spec.column}{SEP}input_ids"], out[f"{spec.column}{SEP}attention_mask"] = ids, mask
        payload = spec.rows.payload(batch)  # prompts alone: what the rewards read, in place of token labels
        out[spec.labels_key] = labels if payload is None else payload
        return out

    def rows(self, batch: Arrays) -> List[Tuple[List[int], List[int]]]:
        """Each row's tokens and labels, as the format gives them, then every token labelled
        (completion_only_loss=False), then the cut at max_length."""
        rows = self.spec.rows.tokens(self.tokenizer, batch)
        if self.spec.every_token:
            rows = [(ids, list(ids)) for ids, _ in rows]
        limit = self.max_length
        return [(ids[:limit], labels[:limit]) if limit else (ids, labels) for ids, labels in rows]


def packed(rows: Sequence[Tuple[List[int], List[int]]], pad: int, spec: LMSpec) -> Dict[str, np.ndarray]:
    """packing=True: the batch's rows one after another in a single sequence, no padding (each row already within
    max_length), each row's positions from 0, and the rows' boundaries as cumulative lengths (`cu_seq_lens_q`,
    the name transformers' models pass on to their attention): the packed attention
    (estimator.lm.packed_attention) keeps each row to itself at the cost of its own length. Each
    row's first label is IGNORE: the last position of the row before it would otherwise learn to predict it
    (alone, no position does). A row's count is its positions equal to 0."""
    lengths = [len(ids) for ids, _ in rows]
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    total = int(bounds[-1])
    ids = np.full((1, total), pad, dtype=np.int64)
    labels = np.full((1, total), IGNORE, dtype=np.int64)
    positions = np.zeros((1, total), dtype=np.int64)
    for (row_ids, row_labels), at, n in zip(rows, bounds[:-1], lengths):
        ids[0, at:at + n], labels[0, at:at + n] = row_ids, row_labels
        labels[0, at] = IGNORE
        positions[0, at:at + n] = np.arange(n)
    return {f"{spec.column}{SEP}input_ids": ids, f"{spec.column}{SEP}position_ids": positions,
            f"{spec.column}{SEP}cu_seq_lens_q": bounds, spec.labels_key: labels}


def packed_rows(features: Any) -> Any:
    """The rows a packed batch holds (a tensor, on the batch's device: no read), None for a batch not packed."""
    positions = features.get("position_ids") if isinstance(features, dict) else None
    return None if positions is None else (positions == 0).sum()


def response_starts(tokenizer: Any, spec: LMSpec, batch: Arrays) -> np.ndarray:
    """Per row, the position of its first labelled token (the format's: the prompt's token count, where a chat's
    first assistant turn begins, -1 for a chat with none; 0 when every token is labelled): a row keeps a labelled
    token after the cut at max_length only when 0 <= start < max_length."""
    if spec.every_token:  # every token labelled (the first is context: the second is learned)
        return np.zeros(len(batch[spec.column]), dtype=np.int64)
    return spec.rows.starts(tokenizer, batch)


def prompt_ids(tokenizer: Any, chat: bool, values: Sequence[Any], column: str,
               tools: Optional[Sequence[Any]] = None) -> List[List[int]]:
    """What generation continues: the prompt's tokens, or a conversation rendered up to the assistant's turn (a
    last assistant message, the reference answer, left out)."""
    if not chat:
        return [list(ids) for ids in tokenizer([str(t) for t in values], add_special_tokens=True)["input_ids"]]
    out = []
    for row in values:
        messages = messages_of(row, column)
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        out.append(render(tokenizer, messages, True, tools))
    return out


def batch_tokenizer(tokenizer: Any, data: Any, reference: Any = None) -> Any:
    """What tokenizes a batch of `data` (a DataSpec): the causal LM's rows with their labels (preference pairs:
    with `reference`, their stored reference log-probabilities), the text columns, or nothing (None)."""
    if data.lm is not None:
        return CausalLMTokenize(tokenizer, data.lm, data.max_length, reference)
    return Tokenize(tokenizer, data.text_cols, data.max_length) if data.text_cols else None


def json_chats(values: Any, first: int = 8) -> bool:
    """Whether the first strings of a column are chats written as JSON text: lists of objects with a role and a
    content each, as json.dumps writes a chat's messages."""
    found = [v for v in list(values[:first]) if isinstance(v, str)]
    for value in found:
        text = value.strip()
        if not (text.startswith("[") and text.endswith("]")):
            return False
        try:
            messages = json.loads(text)
        except ValueError:
            return False
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
            return False
    return bool(found)


def json_chats_refusal(column: str, values: Any, what: str) -> Optional[str]:
    """The refusal of a string column whose first values are chats written as JSON text (`json_chats`), saying
    `what` would be done with the JSON; None for any other column."""
    if not json_chats(values):
        return None
    start = str(values[0])[:40]
    return (f"Column {column!r} holds chats written as JSON text ({start!r}...): a string column is read as text, "
            f"and {what}. Parse it into a chat column first: df.withColumn({column!r}, F.from_json({column!r}, "
            f"'{CHAT_TYPE}')).")
