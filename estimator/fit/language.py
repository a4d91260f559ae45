"""The driver's side of a causal language model's fit: its columns and its checks before any job. A fit is one when
its objective has rows (estimator.train.objectives: `rows`, the name of a reader in ROWS here), which read the
schema into a row format (estimator.data.rows): for SFT (estimator.train.objectives.tokens) a prompt column with a
string label column (the response), a chat column (array<struct<role, content>>) without labels, or a text column
alone; for preference pairs a prompt and two answers. The checks transform shares (max_length,
max_new_tokens, the vocabulary) are in estimator.predict.language_checks, and is_chat in estimator.predict.schema:
TorchModel uses them without importing fit."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Set, Tuple

import numpy as np
from pyspark.sql.types import StringType, StructType

from estimator.core.adapters import can_generate, model_positions
from estimator.core.spec import DataSpec, LMSpec
from estimator.data.lm import json_chats_refusal, messages_of, response_starts
from estimator.data.parquet import Span, read_span
from estimator.data.rows import Chat, Pairs, PromptResponse, Prompts, RowFormat, Text
from estimator.data.text import length_limit
from estimator.predict.language_checks import check_chat_fields
from estimator.predict.schema import CHAT_TYPE, chat_of_maps, is_chat
from estimator.train.losses import loss_kind
from estimator.train.objectives.base import built_in_loop

CHAT_FIELDS = ("role", "content")
CHUNK_ROWS = 8192  # rows tokenized at a time by check_room


def string_label_error(column: str, p: Dict[str, Any]) -> str:
    losses = p.get("loss") if isinstance(p.get("loss"), (list, tuple)) else [p.get("loss")]
    if any(loss_kind(fn) == "regression" for fn in losses if fn is not None):
        return (f"Column {column!r} (from label_cols) holds strings, and the loss regresses numbers: cast the "
                f"column first (F.col({column!r}).cast('double')); for classes, index it (StringIndexer).")
    if p.get("loss") is not None and p.get("tokenizer") is not None and can_generate(p.get("model")):
        return (f"Column {column!r} (from label_cols) holds strings: the response this causal LM would be fine-tuned "
                "to write, a fit that trains on the model's own next-token loss: leave loss unset (loss=None). For "
                "a classifier instead, index the labels first (StringIndexer).")
    if p.get("loss") is not None:
        return (f"Column {column!r} (from label_cols) holds strings: index the labels first (StringIndexer, whose "
                "index column CrossEntropyLoss takes), or cast numbers kept as text (.cast('double')). A string label "
                "trains only a causal language model's fine-tuning: no loss, a tokenizer (docs/language-models.md).")
    why = ("its loss is set: a causal LM trains on its own next-token loss over the response, so leave loss unset"
           if not built_in_loop(p) else "no tokenizer is set" if p["tokenizer"] is None
           else f"the model ({type(p['model']).__name__}) cannot generate (it is no causal LM)")
    return (f"Column {column!r} (from label_cols) holds strings. A string label is the response a causal language "
            f"model is fine-tuned to write after the prompt column, and here {why}. For a classifier, index the labels "
            "first (StringIndexer); for supervised fine-tuning, give an AutoModelForCausalLM (or its factory) and "
            "its tokenizer (docs/language-models.md).")


def lm_spec(p: Mapping[str, Any], schema: StructType, rows: str) -> LMSpec:
    """The LMSpec of a causal LM's fit: its rows as the objective reads them (`rows`, the objective's: a reader of
    ROWS), what applies to every format; a fit that half is one is refused by name."""
    return LMSpec(ROWS[rows](p, schema), every_token=not p["completion_only_loss"], packed=packing(p))


def sft_rows(p: Mapping[str, Any], schema: StructType) -> RowFormat:
    """Supervised fine-tuning's rows, by the schema: a chat column, a prompt with a response column, or a text
    column alone."""
    features, labels = list(p["feature_cols"]), list(p["label_cols"])
    if len(features) != 1:
        raise ValueError(f"Fine-tuning a causal LM takes one feature column (the prompt, or a chat's messages); got "
                         f"feature_cols={features}. Join the prompt's parts into one string column first "
                         "(concat_ws).")
    column, dtype = features[0], schema[features[0]].dataType
    maps = chat_of_maps(column, dtype)
    if maps is not None:
        raise ValueError(maps)
    if is_chat(dtype):
        message_fields(column, dtype, p)
        if labels:
            raise ValueError(f"Column {column!r} is a chat (its assistant turns are what the model learns to write), "
                             f"so it takes no label column; got label_cols={labels}. Leave label_cols unset.")
        return Chat(column, tuple(p["chat_tools"]) if p["chat_tools"] else None)
    if p["chat_tools"]:
        raise ValueError(f"chat_tools are given to the chat template with each conversation of a chat column; "
                         f"{column!r} is a {dtype.simpleString()} column. Leave chat_tools unset, or train on a "
                         f"chat column ({CHAT_TYPE}, with tool_calls in the assistant's messages).")
    if not isinstance(dtype, StringType):
        raise ValueError(f"Fine-tuning a causal LM reads a prompt (a string column) with a response (a string label "
                         f"column), or a chat column ({CHAT_TYPE}); {column!r} has type {dtype.simpleString()}.")
    if not labels:  # continued pretraining: the texts themselves are learned
        return Text(column)
    if len(labels) != 1:
        raise ValueError(f"Fine-tuning a causal LM on the prompt column {column!r} takes the response as one string "
                         f"label column (label_cols=['response']), or none to learn the texts themselves; got "
                         f"label_cols={labels}. A chat's messages are a column of {CHAT_TYPE} (from a JSON string: "
                         f"F.from_json(column, '{CHAT_TYPE}')).")
    label_type = schema[labels[0]].dataType
    if not isinstance(label_type, StringType):
        raise ValueError(f"Column {labels[0]!r} (from label_cols) has type {label_type.simpleString()}; the response a "
                         "causal LM is fine-tuned to write after the prompt is a string column: cast it first "
                         f"(F.col({labels[0]!r}).cast('string')).")
    return PromptResponse(column, labels[0])


def message_fields(column: str, dtype: Any, p: Mapping[str, Any]) -> Any:
    """A message-list column's struct fields, checked: role and content, and what the chat template reads."""
    names = dtype.elementType.names
    missing = [f for f in CHAT_FIELDS if f not in names]
    if missing:
        raise ValueError(f"Column {column!r} is a list of structs with fields {names}, and a chat column's messages "
                         f"need {list(CHAT_FIELDS)} (missing: {missing}): array<struct<role:string, content:string>>, "
                         "as chat datasets hold them.")
    check_chat_fields(p["tokenizer"], column, names, p["chat_tools"])
    return names


def pairs_rows(p: Mapping[str, Any], schema: StructType) -> RowFormat:
    """Preference pairs (an objective whose rows are 'preference'): a prompt column and two label columns, the
    chosen answer's and the rejected one's, three strings or three message lists; the table of reference
    log-probabilities the objective names (objective.reference_table), if any."""
    objective, features, labels = p["objective"], list(p["feature_cols"]), list(p["label_cols"])
    if len(features) != 1 or len(labels) != 2:
        raise ValueError(f"objective={objective!r} reads preference pairs: feature_cols=['prompt'] (one string "
                         "column) and label_cols=['chosen', 'rejected'] (two string columns: the preferred answer's, "
                         f"then the other's); got feature_cols={features}, label_cols={labels}.")
    chats = [is_chat(schema[c].dataType) for c in features + labels]
    for column, chat in zip(features + labels, chats):
        dtype = schema[column].dataType
        if any(chats) and not all(chats) or not any(chats) and not isinstance(dtype, StringType):
            raise ValueError(f"Column {column!r} has type {dtype.simpleString()}; objective={objective!r} reads the "
                             "prompt and both answers as three string columns, or as three message lists "
                             f"({CHAT_TYPE}: the prompt's messages, then each answer's); got "
                             + ", ".join(f"{c!r} {schema[c].dataType.simpleString()}" for c in features + labels)
                             + ".")
        if chat:
            message_fields(column, dtype, p)
    if p["chat_tools"] and not all(chats):
        raise ValueError(f"objective={objective!r} with chat_tools={p['chat_tools']!r}: the rows are strings, and "
                         "tools are given to the chat template with message lists.")
    return Pairs(features[0], labels[0], labels[1], all(chats), tuple(p["chat_tools"]) if p["chat_tools"] else None,
                 objective.reference_table(p))


REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")  # what a reward function is given besides columns


def prompt_rows(p: Mapping[str, Any], schema: StructType) -> RowFormat:
    """Prompts alone (an objective whose rows are 'prompts': GRPO's): one string or message-list column, and the
    label columns its rewards read (any types, none at all too)."""
    objective, features, labels = p["objective"], list(p["feature_cols"]), list(p["label_cols"])
    if len(features) != 1:
        raise ValueError(f"objective={objective!r} samples completions of one prompt column: feature_cols=['prompt'] "
                         f"(a string column, or a chat's messages {CHAT_TYPE}); got feature_cols={features}. Join "
                         "the prompt's parts into one string column first (concat_ws).")
    column, dtype = features[0], schema[features[0]].dataType
    taken = [c for c in labels if c in REWARD_ARGUMENTS]
    if taken:
        raise ValueError(f"objective={objective!r}: label_cols {taken} would shadow the reward functions' own "
                         f"arguments {list(REWARD_ARGUMENTS)}: rename those columns first (withColumnRenamed).")
    chat = is_chat(dtype)
    if chat:
        message_fields(column, dtype, p)
    elif not isinstance(dtype, StringType):
        raise ValueError(f"objective={objective!r} reads its prompts from a string column or a chat column "
                         f"({CHAT_TYPE}); {column!r} has type {dtype.simpleString()}.")
    if p["chat_tools"] and not chat:
        raise ValueError(f"objective={objective!r} with chat_tools: the prompts of {column!r} are strings, and tools "
                         "are given to the chat template with message lists.")
    return Prompts(column, tuple(labels), chat, tuple(p["chat_tools"]) if p["chat_tools"] else None)


# the rows an objective reads (its `rows`), each read from the schema by its reader: a new format is a line here
ROWS = {"sft": sft_rows, "preference": pairs_rows, "prompts": prompt_rows}


def packing(p: Mapping[str, Any]) -> bool:
    """packing=True where it is exact: a transformers model that dispatches its attention through transformers'
    attention interface (the ranks give it the packed attention, estimator.lm.packed_attention);
    refused by name otherwise."""
    if not p["packing"]:
        return False
    model = p["model"]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "_supports_attention_backend", False):
        raise ValueError(f"packing=True puts a batch's rows in one sequence, each row attending to itself through "
                         f"transformers' attention interface (Llama, Qwen, Mistral, Gemma, GPT-2...); "
                         f"{type(base).__name__} ({type(base).__module__}) computes its attention otherwise. "
                         "Leave packing=False for this model.")
    return True


def check_lm_params(p: Dict[str, Any]) -> None:
    """What a causal LM's fine-tuning cannot take, refused by name."""
    for name, why in (("metrics", "its history reports the loss and perplexity over the response tokens"),
                      ("sample_weight_col", "its loss is weighted by the labelled tokens"),
                      ("input_shapes", "the token arrays are as long as each batch's longest row")):
        if p[name]:
            raise ValueError(f"Fine-tuning a causal LM takes no {name} (got {p[name]!r}): {why}.")


def rows_without_room(data: DataSpec, pieces: Any, tokenizer: Any, limit: Optional[int]
                      ) -> Tuple[int, int, int, int, Dict[str, int], Set[str]]:
    """(rows, rows with no response token left, of them chats with no assistant turn, the longest prompt's
    tokens, preference pairs' empty answers per answer column, the roles of the chats with no assistant turn)
    over `pieces`: the prompt (or chat) column, and the pairs' answer columns, read from the store a chunk at a
    time, once."""
    lm = data.lm
    answers = list(lm.rows.answers)
    rows = short = unanswered = longest = 0
    empty, roles = dict.fromkeys(answers, 0), set()
    for piece in pieces:
        for batch in read_span(data.store, Span(piece, 0, piece.num_rows), [lm.column, *answers], CHUNK_ROWS):
            refusal = None if rows else json_chats_refusal(lm.column, batch[lm.column], "the model would learn "
                                                                                        "the JSON")
            if refusal:
                raise ValueError(refusal)
            starts = response_starts(tokenizer, lm, batch)
            rows, unanswered = rows + len(starts), unanswered + int((starts < 0).sum())
            if lm.rows.messages and (starts < 0).any():
                roles.update(m["role"] for i in np.flatnonzero(starts < 0)
                             for m in messages_of(batch[lm.column][i], lm.column))
            short += int(((starts < 0) | (starts >= (limit or np.iinfo(np.int64).max))).sum())
            longest = max(longest, int(starts.max(initial=0)))
            for column in answers:
                empty[column] += sum(1 for v in batch[column] if lm.rows.blank(v))
    return rows, short, unanswered, longest, empty, roles


def check_room(data: DataSpec, tokenizer: Any, model: Any, completion_tokens: int = 0) -> None:
    """Every training and validation row keeps a response token after the cut at max_length (estimator.data.lm),
    counted over the whole table in the store before any rank starts: a row without one trains nothing, and a user
    who set max_length for the responses' sake would not know. Reads and tokenizes the prompt column only, on the
    driver: 6.6 s for 100,000 prompts of about 40 tokens (one row group; 2 busy cores, the tests' tokenizer).
    `completion_tokens`: what a completion sampled on the ranks may add to a prompt (the objective's), within the
    model's positions with the longest prompt."""
    limit, found, blanks, longest_of_all, roles = length_limit(tokenizer, data.max_length), [], [], 0, set()
    for name, pieces in (("training", data.train), ("validation", data.val)):
        rows, short, unanswered, longest, empty, unread = rows_without_room(data, pieces, tokenizer, limit)
        roles |= unread
        longest_of_all = max(longest_of_all, longest)
        if short:
            found.append((name, rows, short, unanswered, longest))
        blanks += [f"{n} of {rows} {name} rows in column {c!r}" for c, n in empty.items() if n]
    if blanks:  # preference pairs: an empty answer compares nothing the prompt asked
        raise ValueError(f"Preference pairs with an empty answer: {'; '.join(blanks)}. Each pair compares two "
                         "answers to its prompt: drop those rows first.")
    positions = model_positions(model)
    if not found and completion_tokens and positions is not None and longest_of_all + completion_tokens > positions:
        fixes = f"Drop or shorten the prompts longer than {positions - completion_tokens} tokens" + (
            f", or set max_new_tokens to at most {positions - longest_of_all}" if positions > longest_of_all else "")
        raise ValueError(f"The longest prompt of column {data.lm.column!r} takes {longest_of_all} tokens, and a "
                         f"completion of max_new_tokens={completion_tokens} after it passes the model's {positions} "
                         f"positions: past them the completions are garbage or the model fails. {fixes}.")
    if not found:
        return
    told = "; ".join(f"{short} of {rows} {name} rows" + (f" ({unanswered} of them chats with no assistant turn)"
                                                           if unanswered else "")
                     for name, rows, short, unanswered, _ in found)
    fixes = ["drop those rows first"]
    if any(short > unanswered for _, _, short, unanswered, _ in found):  # prompts at or beyond the cut
        longest, positions = max(f[4] for f in found), model_positions(model)
        fixes.insert(0, f"raise max_length above {longest} (the longest prompt's tokens)" if positions is None or
                     longest < positions else f"shorten the prompts (the longest takes {longest} tokens, and the "
                     f"model has {positions} positions)")
    raise ValueError(f"Rows of column {data.lm.column!r} leave no {data.lm.rows.room} after the cut at "
                     f"max_length={limit}: {told}. Such a row trains nothing: {' or '.join(fixes)}."
                     + other_roles(data.lm.column, roles))


CHAT_ROLES = ("system", "user", "assistant", "tool")  # what chat templates render; the 'assistant' turns train


def other_roles(column: str, roles: Set[str]) -> str:
    """The fix for chats whose roles are not a chat template's (ShareGPT's 'human' and 'gpt'), or ''."""
    other = sorted(roles - set(CHAT_ROLES))
    if not other:
        return ""
    names = {"gpt": "assistant", "human": "user", "bot": "assistant", "model": "assistant"}
    renamed = [(r, names[r]) for r in other if r in names] or [(other[0], "assistant")]
    cases = "".join(f".when(m.role == {old!r}, {new!r})" for old, new in renamed)  # F.when(...).when(...)
    return (f" Those chats' roles include {', '.join(map(repr, other))}; the assistant's turns are those of role "
            f"'assistant' (chat templates take {', '.join(map(repr, CHAT_ROLES))}): rename the roles first, e.g. "
            f"F.transform({column!r}, lambda m: m.withField('role', F{cases}.otherwise(m.role))).")
