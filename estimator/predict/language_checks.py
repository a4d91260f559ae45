"""The checks of a language model's params that fit and transform share, before any job: max_length and
max_new_tokens within the model's positions, a tokenizer whose ids the model can embed, and the length texts are
cut at. Here, below fit/, so that TorchModel (estimator.model) and the output kinds (estimator.predict.kinds)
use them without importing the driver's fit; estimator.fit.language imports them from here. No pyspark: the
output kinds that call these travel to the executors."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from estimator.core.adapters import base_config, model_positions
from estimator.data.text import length_limit
from estimator.lm.continuous import continuous_refusal, unsupported

# The owner a message names when the caller names none: fit's checks (estimator.fit.language) call these bare
OWNER = "TorchEstimator"


def check_max_length(p: Dict[str, Any], owner: str = OWNER) -> None:
    """max_length within the model's positions (a longer one fails on the ranks, deep in the model)."""
    config = base_config(p["model"])
    positions = model_positions(p["model"])
    if p.get("max_length") is not None and positions is not None and p["max_length"] > positions:
        raise ValueError(f"The 'max_length' parameter of {owner} is {p['max_length']}, beyond the "
                         f"{positions} positions of the model ({type(config).__name__}.max_position_embeddings): "
                         f"set max_length <= {positions}.")


def check_vocabulary(p: Dict[str, Any], owner: str = OWNER) -> None:
    """A Hugging Face tokenizer whose token ids fit the model's input embeddings (a larger vocabulary fails on the
    ranks with an IndexError that names neither)."""
    tokenizer, embeddings = p.get("tokenizer"), getattr(p["model"], "get_input_embeddings", None)
    # its own vocabulary, which any text draws from (tokens added to it, a chat's markers, may go unused)
    tokens = getattr(tokenizer, "vocab_size", None)
    if not isinstance(tokens, int) or embeddings is None:
        return
    try:
        rows = getattr(embeddings(), "num_embeddings", None)
    except NotImplementedError:  # a model without token embeddings
        return
    if isinstance(rows, int) and tokens > rows:
        raise ValueError(f"The tokenizer of {owner} has {tokens} tokens, and the model's input embeddings "
                         f"{rows} rows: token ids past {rows - 1} have no embedding. Use the tokenizer saved with the "
                         "model, or resize its embeddings first (model.resize_token_embeddings(len(tokenizer))).")


def effective_max_length(p: Dict[str, Any]) -> Optional[int]:
    """max_length; unset, the tokenizer's model maximum capped at the model's positions (a tokenizer saved without a
    maximum cuts nothing, and a longer text then fails on the ranks, deep in the model's position embedding)."""
    positions = model_positions(p["model"])
    if p.get("max_length") is not None or p.get("tokenizer") is None or positions is None:
        return p.get("max_length")
    known = length_limit(p["tokenizer"], None)
    return positions if known is None else min(known, positions)


def check_max_new_tokens(p: Dict[str, Any], owner: str = OWNER) -> None:
    """max_new_tokens below the model's positions (the prompt needs one at least): past them a model's text is
    garbage (transformers only warns) or its position embedding fails on the executors."""
    positions = model_positions(p["model"])
    if positions is not None and p["max_new_tokens"] >= positions:
        raise ValueError(f"The 'max_new_tokens' parameter of {owner} is {p['max_new_tokens']} (the most tokens "
                         f"transform generates a row; 64 unless set), and the model has {positions} positions for the "
                         f"prompt and the generated tokens together: set max_new_tokens < {positions} (at most "
                         f"{positions} minus the longest prompt's tokens).")


def check_text_column(p: Dict[str, Any], owner: str = "TorchModel") -> None:
    """A model whose output kind reads one text (or chat) column, tokenized with its tokenizer."""
    kind = p["output_kind"]
    if p["tokenizer"] is None:
        raise ValueError(f"{owner} with output_kind={kind!r} tokenizes its feature column: set tokenizer (the "
                         "model's Hugging Face tokenizer).")
    if len(p["feature_cols"]) != 1:
        raise ValueError(f"{owner} with output_kind={kind!r} reads one column (the text, or a chat's "
                         f"messages); got feature_cols={list(p['feature_cols'])}.")


def check_chat_fields(tokenizer: Any, column: str, fields: Sequence[str], tools: Any) -> None:
    """Every field of a chat column's messages and chat_tools reach the chat template: a field (tool_calls, name,
    tool_call_id) or the tools its template's text never names would vanish from what the model reads."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return  # none (refused where a conversation is rendered), or one per name: not read here
    unread = [f for f in fields if f not in ("role", "content") and f not in template]
    if unread:
        raise ValueError(f"Column {column!r}'s messages hold {unread}, and the chat template of "
                         f"{type(tokenizer).__name__} never reads them: they would be dropped from what the model "
                         "reads. Use a tokenizer whose template renders tool calls (Llama 3.1, Qwen 2.5, Mistral's), "
                         "or drop those fields from the messages first.")
    if tools and "tools" not in template:
        raise ValueError(f"chat_tools is set, and the chat template of {type(tokenizer).__name__} never reads "
                         "'tools': the model would not see them. Use a tokenizer whose template renders tools, or "
                         "leave chat_tools unset.")


def check_generation_batching(p: Dict[str, Any], owner: str = OWNER) -> None:
    """generation_batching='continuous' only where continuous batching can honour the model and generate_kwargs
    ('auto' falls back to model.generate there instead)."""
    if p["generation_batching"] != "continuous":
        return
    why = continuous_refusal(p["generate_kwargs"]) or unsupported(p["model"])
    if why:
        raise ValueError(f"The 'generation_batching' parameter of {owner} is 'continuous', and {why}: set "
                         "generation_batching='padded' (or 'auto', which takes model.generate where continuous "
                         "batching cannot serve).")
