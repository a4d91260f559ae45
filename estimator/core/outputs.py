"""What a model's forward returns, read as its outputs (one per label column): a tensor, or a tuple/list of
tensors in label_cols order; or, as Hugging Face models return them, a `ModelOutput`, a dict or a dataclass with
`logits`, read as its logits. The loss, the metrics, validation, the driver's dry run and transform all read
outputs through `outputs_of`."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Sequence, Tuple


def forward(model: Any, features: Sequence[Any], **keywords: Any) -> Any:
    """model(*features): the feature columns in order, a tokenized text column's tensors (a dict) by keyword."""
    positional = [f for f in features if not isinstance(f, dict)]
    for encoded in (f for f in features if isinstance(f, dict)):
        keywords.update(encoded)
    return model(*positional, **keywords)


def logits_of(raw: Any) -> Any:
    """The `logits` a ModelOutput, a dict or a dataclass carries, else None."""
    if isinstance(raw, Mapping):
        return raw.get("logits")
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        return getattr(raw, "logits", None)
    return None


def outputs_of(raw: Any) -> Tuple[Any, ...]:
    """The outputs as a tuple; a dict without `logits` stays a dict (the driver's dry run refuses it by name)."""
    logits = logits_of(raw)
    if logits is not None:
        return (logits,)
    if isinstance(raw, (tuple, list)):
        return tuple(raw)
    return (raw,)
