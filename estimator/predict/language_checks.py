"""The checks of a language model's params that fit and transform share, before any job: max_length and
max_new_tokens within the model's positions, a tokenizer whose ids the model can embed, and the length texts are
cut at. Here, below fit/, so that TorchModel (estimator.model) and the output kinds (estimator.predict.kinds)
use them without importing the driver's fit; estimator.fit.language imports them from here. No pyspark: the
output kinds that call these travel to the executors."""
from __future__ import annotations

import difflib
import inspect
from typing import Any, Dict, Optional, Sequence, Set

from estimator.core.adapters import base_config, base_model, can_generate, model_positions
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


# generate_kwargs this package reads itself (estimator.lm.generation): 'seed' seeds each call's sampling
OWN_GENERATE_KWARGS = frozenset({"seed"})


def check_generate_kwargs(p: Dict[str, Any], owner: str = OWNER) -> None:
    """Every key of generate_kwargs one that model.generate takes: a GenerationConfig field, one of generate()'s
    own parameters (tokenizer for stop_strings among them), an input of the model's forward, or this package's
    'seed'. transformers refuses a misspelled one ('temprature') only when generating, on the executors; here it
    is refused before any job, with the nearest name."""
    kwargs = p.get("generate_kwargs") or {}
    inner = base_model(p["model"])
    config = getattr(inner, "config", None)
    if not kwargs or not can_generate(p["model"]) or getattr(config, "is_encoder_decoder", False):
        return
    known = generate_keywords(inner)
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        raise ValueError(f"The 'generate_kwargs' parameter of {owner} holds {unknown[0]!r}, which "
                         f"{type(inner).__name__}.generate does not take (neither a GenerationConfig field nor "
                         "one of generate()'s parameters nor an input of the model's forward): "
                         + (f"did you mean {near[0]!r}?" if near else "remove it.")
                         + " transformers would refuse it only when generating, on the executors.")


def generate_keywords(model: Any) -> Set[str]:
    """The keyword names model.generate takes, as transformers' own check counts them
    (GenerationMixin._validate_model_kwargs and GenerationConfig)."""
    from transformers import GenerationConfig

    known = set(GenerationConfig().to_dict()) | set(OWN_GENERATE_KWARGS) | {"tokenizer", "assistant_tokenizer"}
    known |= named_parameters(type(model).generate)
    prepare = getattr(type(model), "prepare_inputs_for_generation", None)
    taken = named_parameters(prepare, keep_variadic=True) if prepare is not None else set()
    known |= taken
    if "kwargs" in taken or "model_kwargs" in taken:
        known |= named_parameters(type(model).forward)
    try:
        from transformers.utils.generic import TransformersKwargs

        known |= set(getattr(TransformersKwargs, "__optional_keys__", ()))
    except ImportError:  # an older transformers: its models' kwargs are their forward's
        pass
    return known


def named_parameters(function: Any, keep_variadic: bool = False) -> Set[str]:
    """A function's parameter names (without self; *args/**kwargs' names only with keep_variadic)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return set()
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {q.name for q in parameters if q.name != "self" and (keep_variadic or q.kind not in variadic)}
