"""The row formats of a causal language model's fit, each a small named type: what the rows hold and how one batch
of them becomes tokens with their labels (estimator.data.lm.CausalLMTokenize applies the cut at max_length, the
labelling of every token and the packing to every format alike). numpy and the user's tokenizer only.

- `Text`: a string column, every token learned (continued pretraining).
- `PromptResponse`: a prompt column and a string response column; the response's tokens are learned.
- `Chat`: a column of message lists; each assistant turn's tokens are learned.
- `Pairs`: preference pairs, a prompt with a chosen and a rejected answer (three strings or three message
  lists); a batch of b pairs is 2b rows, the chosen answers' first.
- `Prompts`: prompts alone (a string or a message list), with the columns GRPO's rewards read carried as values
  (`payload`); the completions are sampled on the ranks.

The driver picks a format from the schema (estimator.fit.language, by the objective's `rows`); the ranks, the
driver's checks and the balancing of packed batches ask it, and branch on none of its kinds. A new format is one
class here and one reader there."""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from estimator.data.lm import (IGNORE, answer_tokens, chat_tokens, eos_id, messages_of, plain_value, prompt_ids,
                               render)

Arrays = Dict[str, np.ndarray]
Rows = List[Tuple[List[int], List[int]]]  # each row's token ids and labels (IGNORE where no loss)


@dataclass(frozen=True)
class RowFormat:
    """A format's column (the prompt, the text or the chat); the rest is each format's."""

    column: str

    @property
    def read(self) -> Tuple[str, ...]:
        """The columns a row is tokenized from (they leave the batch as tokens)."""
        return (self.column,)

    @property
    def answers(self) -> Tuple[str, ...]:
        """Columns whose values are answers the fit compares (an empty one is refused): none but pairs'."""
        return ()

    @property
    def labels_key(self) -> str:
        """Where the batch holds the labels: `<column>.labels`, or the response's (chosen answer's) column."""
        return f"{self.column}.labels"

    @property
    def messages(self) -> bool:
        """Whether its prompts are message lists, rendered by the chat template (generation's prompts too)."""
        return False

    @property
    def tools(self) -> Optional[Tuple[Any, ...]]:
        """chat_tools: given to the chat template with each conversation; None for strings."""
        return None

    @property
    def stored_key(self) -> Optional[str]:
        """The key of the stored reference log-probabilities the rows are read with (estimator.data.reference);
        None: none stored (only pairs may have one)."""
        return None

    @property
    def room(self) -> str:
        """What a row cut at max_length before its first labelled token has no room for (the driver's message)."""
        return "response token to learn"

    def blank(self, answer: Any) -> bool:
        """Whether a value of an answers column holds no text (refused by the fit)."""
        return not str(answer).strip()

    def tokens(self, tokenizer: Any, batch: Arrays) -> Rows:
        """Each row's tokens and labels, whole (before the cut at max_length)."""
        raise NotImplementedError

    def payload(self, batch: Arrays) -> Optional[np.ndarray]:
        """What the batch carries at labels_key instead of token labels (None: the token labels): prompts'."""
        return None

    def starts(self, tokenizer: Any, batch: Arrays) -> np.ndarray:
        """Per row, the position of its first labelled token, or -1 for a row with none at all: a row keeps a
        labelled token after the cut at max_length only when 0 <= start < max_length."""
        return np.array([len(p) for p in prompt_ids(tokenizer, self.messages, batch[self.column], self.column,
                                                    self.tools)], dtype=np.int64)

    def lengths(self, batch: Arrays) -> np.ndarray:
        """Per row, the characters it is tokenized from (close enough to order rows by length, never a count)."""
        return sum((np.array([len(str(v)) for v in batch[c]], dtype=np.int64) for c in self.read[1:]),
                   np.array([len(str(v)) for v in batch[self.column]], dtype=np.int64))


@dataclass(frozen=True)
class Text(RowFormat):
    """A text column and no label: every token, then the EOS, learned (the model learns the texts and where they
    end)."""

    def tokens(self, tokenizer: Any, batch: Arrays) -> Rows:
        eos = eos_id(tokenizer)
        texts = tokenizer([str(t) for t in batch[self.column]], add_special_tokens=True)["input_ids"]
        return [(list(t) + [eos], list(t) + [eos]) for t in texts]

    def starts(self, tokenizer: Any, batch: Arrays) -> np.ndarray:
        return np.zeros(len(batch[self.column]), dtype=np.int64)  # the first token is context, the second learned


@dataclass(frozen=True)
class PromptResponse(RowFormat):
    """A prompt column with a string response column: prompt + response + EOS, tokenized apart (the prompt's
    tokens exactly what generation is given in transform), the response's and the EOS labelled."""

    response: str = ""

    @property
    def read(self) -> Tuple[str, ...]:
        return (self.column, self.response)

    @property
    def labels_key(self) -> str:
        return self.response

    def tokens(self, tokenizer: Any, batch: Arrays) -> Rows:
        eos = eos_id(tokenizer)
        prompts = tokenizer([str(t) for t in batch[self.column]], add_special_tokens=True)["input_ids"]
        responses = tokenizer([str(t) for t in batch[self.response]], add_special_tokens=False)["input_ids"]
        return [(list(p) + list(r) + [eos], [IGNORE] * len(p) + list(r) + [eos]) for p, r in zip(prompts, responses)]


@dataclass(frozen=True)
class Chat(RowFormat):
    """A column of message lists (array<struct<role, content, ...>>) rendered by the chat template; each assistant
    turn's tokens (its tool calls too, up to its end-of-turn marker) labelled."""

    chat_tools: Optional[Tuple[Any, ...]] = None

    @property
    def messages(self) -> bool:
        return True

    @property
    def tools(self) -> Optional[Tuple[Any, ...]]:
        return self.chat_tools

    def tokens(self, tokenizer: Any, batch: Arrays) -> Rows:
        return [chat_tokens(tokenizer, messages_of(m, self.column), self.column, self.tools)
                for m in batch[self.column]]

    def starts(self, tokenizer: Any, batch: Arrays) -> np.ndarray:
        """Where a chat's first assistant turn begins; -1 for a chat with no assistant turn."""
        starts = np.full(len(batch[self.column]), -1, dtype=np.int64)
        for row, value in enumerate(batch[self.column]):
            messages = messages_of(value, self.column)
            first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
            if first is not None:
                starts[row] = len(render(tokenizer, messages[:first], True, self.tools))
        return starts

    def lengths(self, batch: Arrays) -> np.ndarray:
        return np.array([sum(len(m["content"]) for m in messages_of(row, self.column)) for row in batch[self.column]],
                        dtype=np.int64)


@dataclass(frozen=True)
class Pairs(RowFormat):
    """Preference pairs: a prompt with its chosen and its rejected answer, three strings or three message lists
    (`as_messages`: the prompt's messages, then each answer's). A batch of b pairs is 2b rows, each pair's prompt
    with its chosen answer first, then with its rejected one; the labels lie at the chosen answer's column.
    `reference`: the key of the stored reference log-probabilities the rows are read with
    (estimator.data.reference), None where they are computed live."""

    chosen: str = ""
    rejected: str = ""
    as_messages: bool = False
    chat_tools: Optional[Tuple[Any, ...]] = None
    reference: Optional[str] = None

    @property
    def read(self) -> Tuple[str, ...]:
        return (self.column, self.chosen, self.rejected)

    @property
    def answers(self) -> Tuple[str, ...]:
        return (self.chosen, self.rejected)

    @property
    def labels_key(self) -> str:
        return self.chosen

    @property
    def messages(self) -> bool:
        return self.as_messages

    @property
    def stored_key(self) -> Optional[str]:
        return self.reference

    @property
    def tools(self) -> Optional[Tuple[Any, ...]]:
        return self.chat_tools

    def tokens(self, tokenizer: Any, batch: Arrays) -> Rows:
        return self.answered(tokenizer, batch, self.chosen) + self.answered(tokenizer, batch, self.rejected)

    def answered(self, tokenizer: Any, batch: Arrays, answer: str) -> Rows:
        """The prompts each with its answer in column `answer`, the answer's tokens labelled."""
        if self.as_messages:
            return [answer_tokens(tokenizer, messages_of(p, self.column), messages_of(a, answer), answer, self.tools)
                    for p, a in zip(batch[self.column], batch[answer])]
        return PromptResponse(self.column, answer).tokens(tokenizer, batch)

    def blank(self, answer: Any) -> bool:
        """An answer with no text: an empty string, or no message (or only empty ones) in a message list."""
        if not self.as_messages:
            return not str(answer).strip()
        return not any(str((m.get("content") if hasattr(m, "get") else "") or "").strip() or
                       (hasattr(m, "get") and m.get("tool_calls") is not None) for m in list(answer))


@dataclass(frozen=True)
class Prompts(RowFormat):
    """Prompts alone (GRPO, estimator.train.objectives.grpo): a string column, or message lists rendered up to the
    assistant's turn (`as_messages`), and the columns the rewards read (`columns`, label_cols). No token is
    labelled: the ranks sample the completions. The batch carries, at labels_key, each row's prompt as given and
    its columns' values (`payload`: pickled, one row of bytes each, read back by `rows_of`)."""

    columns: Tuple[str, ...] = ()
    as_messages: bool = False
    chat_tools: Optional[Tuple[Any, ...]] = None

    @property
    def read(self) -> Tuple[str, ...]:
        return (self.column, *self.columns)

    @property
    def room(self) -> str:
        return "room for a completion (the prompt fills it)"

    @property
    def messages(self) -> bool:
        return self.as_messages

    @property
    def tools(self) -> Optional[Tuple[Any, ...]]:
        return self.chat_tools

    def tokens(self, tokenizer: Any, batch: Arrays) -> Rows:
        found = prompt_ids(tokenizer, self.as_messages, batch[self.column], self.column, self.chat_tools)
        return [(ids, [IGNORE] * len(ids)) for ids in found]

    def payload(self, batch: Arrays) -> np.ndarray:
        """Each row's {'prompt': the prompt as given (a string, or its messages as dicts), column: value, ...},
        pickled: (rows, 8 + the longest) uint8, each row's length in its first 8 bytes."""
        blobs = [pickle.dumps({"prompt": plain_value(batch[self.column][i]),
                               **{c: plain_value(batch[c][i]) for c in self.columns}}, protocol=4)
                 for i in range(len(batch[self.column]))]
        out = np.zeros((len(blobs), 8 + max((len(b) for b in blobs), default=0)), dtype=np.uint8)
        for i, blob in enumerate(blobs):
            out[i, :8] = np.frombuffer(np.int64(len(blob)).tobytes(), dtype=np.uint8)
            out[i, 8:8 + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        return out


def scored(column: str, answers: Tuple[str, ...], chat: bool, tools: Optional[Tuple[Any, ...]] = None) -> RowFormat:
    """The rows transform's output_kind='score' reads (a fit's, scored on what its loss counts): preference pairs
    (`answers`: the chosen and the rejected column; strings, or message lists where `chat`), a chat column's
    conversations, a prompt with its response column (`answers`: that one), or a whole text (none)."""
    if len(answers) == 2:
        return Pairs(column, answers[0], answers[1], as_messages=chat, chat_tools=tools)
    if chat:
        return Chat(column, tools)
    return PromptResponse(column, answers[0]) if answers else Text(column)


def rows_of(payload: np.ndarray) -> List[Dict[str, Any]]:
    """The rows a Prompts payload carries (host bytes: a tensor's .cpu().numpy())."""
    out = []
    for row in payload:
        size = int(np.frombuffer(row[:8].tobytes(), dtype=np.int64)[0])
        out.append(pickle.loads(row[8:8 + size].tobytes()))
    return out
