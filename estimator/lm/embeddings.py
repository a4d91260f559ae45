"""A vector per text for transform's output_kind='embedding', from a model whose output is hidden states: the
model's `sentence_embedding` when it returns one (a sentence-transformers module), else the mean of
`last_hidden_state` (or its first output) over the attention mask, in float32.

Batched by tokens: the Arrow batch's texts are tokenized once, sorted by their token counts, and run in forwards of
at most `batch_size` rows whose rows x longest stays within EMBED_TOKENS, each cut to its own longest row, so a
forward pads little and its memory is bounded by tokens, not rows; the vectors come back in the rows' order. With
right padding (encoders' default) a row's vector is what it is alone: the mask keeps the other rows out of it. A
tokenizer that is not Hugging Face's (its padding side unknown) keeps batches of `batch_size` rows in the table's
order. torch only, no pyspark."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import torch

from estimator.core.outputs import forward
from estimator.data.text import is_hugging_face

EMBED_TOKENS = 16_384  # rows x their longest row's tokens per forward (2 CPU cores, a tiny Llama: 1.07x the hand
# loop at 16,384, 0.75-0.84x at 65,536; on a GPU a 1B model's forward of 16k tokens keeps it busy)


def token_batches(lengths: Sequence[int], batch_size: int, budget: int) -> List[List[int]]:
    """The rows of each forward, shortest first: at most `batch_size` rows, and rows x the longest within `budget`
    (one row at least)."""
    out: List[List[int]] = []
    for i in np.argsort(np.asarray(lengths), kind="stable"):
        longest = max(int(lengths[i]), 1)  # the batch's longest so far: rows come shortest first
        if out and len(out[-1]) < batch_size and (len(out[-1]) + 1) * longest <= budget:
            out[-1].append(int(i))
        else:
            out.append([int(i)])
    return out


def embed_texts(model: Any, tokenize: Any, texts: np.ndarray, batch_size: int, device: str,
                read: Callable[[Any, Sequence[Any]], Sequence[torch.Tensor]],
                budget: Optional[int] = None) -> Optional[List[np.ndarray]]:
    """Each output `read` gives, (rows, width) float32 in the rows' order; None where the tokenizer is not Hugging
    Face's or gives no attention mask (the caller batches by rows)."""
    if not is_hugging_face(tokenize.tokenizer):
        return None
    encoded = tokenize.encode(texts)
    mask = encoded.get("attention_mask")
    if mask is None:
        return None
    lengths = mask.sum(axis=1)
    width = mask.shape[1]
    left = getattr(tokenize.tokenizer, "padding_side", "right") == "left"
    found: List[np.ndarray] = []
    with torch.inference_mode():
        for rows in token_batches(lengths, batch_size, budget or EMBED_TOKENS):
            longest = max(int(lengths[rows].max()), 1)
            columns = slice(width - longest, width) if left else slice(0, longest)
            batch = {k: torch.from_numpy(np.ascontiguousarray(v[rows, columns])).to(device)
                     for k, v in encoded.items()}
            outputs = read(forward(model, [batch]), [batch])
            for j, out in enumerate(outputs):
                values = out.detach().float().reshape(out.shape[0], -1).cpu().numpy()
                if len(found) <= j:
                    found.append(np.empty((len(texts), values.shape[1]), dtype=np.float32))
                found[j][rows] = values
    return found


def embeddings(raw: Any, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """One vector per row from a forward's output (see the module's doc)."""
    found = raw.get("sentence_embedding") if hasattr(raw, "get") else None
    if isinstance(found, torch.Tensor):
        return found.float()
    hidden = getattr(raw, "last_hidden_state", None)
    if hidden is None:
        hidden = raw[0] if isinstance(raw, (tuple, list)) else raw.get("last_hidden_state") if hasattr(raw, "get") \
            else raw
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        raise ValueError(f"output_kind='embedding' reads hidden states (batch, tokens, width) from the model's "
                         f"output; it returned {type(raw).__name__}. Use a model whose output is hidden states (an "
                         "AutoModel, a sentence-transformers module).")
    if hidden.dim() == 2:  # already one vector per row
        return hidden.float()
    if attention_mask is None:
        return hidden.float().mean(dim=1)
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    return (hidden.float() * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
