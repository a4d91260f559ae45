"""packing=True's attention (issue 54): a batch's rows in one sequence with no padding (estimator.data.lm.packed),
each row attending to itself only, at the cost of its own length.

transformers' own packed-sequence mask (sdpa, eager) is exact but computes attention over the whole packed width:
one sequence of the batch's 850 tokens costs what 850 tokens attending to each other cost, and padding rows to a
common width wastes the rest. This function attends within each row: on a GPU in half precision (or under
autocast to it) torch's variable-length flash attention (`torch.nn.attention.varlen`, the rows' boundaries as
cumulative lengths), else PyTorch's scaled dot-product attention row by row, causal. The boundaries come with the batch
(`cu_seq_lens_q`, transformers' name for them, which its model classes pass on to the attention function), so
nothing is read back from the device.

A rank whose batches are packed switches the model's attention implementation to this one by name
(`use_packed_attention`, in transformers' AttentionInterface); the model the driver and transform hold keeps its
own. Models that do not dispatch their attention through that interface are refused on the driver
(estimator.fit.language.packing); what the function cannot reproduce (logit soft-capping, attention sinks) it
refuses by name on the first batch. torch only."""
from __future__ import annotations

import inspect
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F

NAME = "estimator_packed"  # the attention implementation's name in transformers' registry
UNSUPPORTED = ("softcap", "s_aux")  # attention arguments that change the scores: not reproduced here


def use_packed_attention(model: Any) -> None:
    """Registers the packed attention with transformers and makes it the attention of every transformers model
    inside `model` (a peft wrapper, DDP's or FSDP's module)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_attention)
    for module in model.modules():
        if hasattr(module, "set_attn_implementation") and getattr(module, "config", None) is not None:
            if module.config._attn_implementation != NAME:
                module.set_attn_implementation(NAME)


def packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                     scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                     cu_seq_lens_q: Optional[torch.Tensor] = None, **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (batch, heads, tokens, dim), key and value (batch, kv
    heads, tokens, dim); returns (batch, tokens, heads, dim) and no weights. The batch is one packed sequence whose
    rows start at `cu_seq_lens_q` (cumulative, the total last)."""
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"packing=True: {type(module).__name__}'s attention uses {name!r}, which the packed "
                             "attention does not reproduce. Leave packing=False for this model.")
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError("The packed attention was given a batch that is not one packed sequence with its rows' "
                         "boundaries (cu_seq_lens_q): its rows would attend to each other. This is a bug of the "
                         "estimator's packing (estimator.data.lm.packed).")
    dropout = dropout if module.training else 0.0
    half = half_dtype(query)
    if half is not None and sliding_window is None:
        out = flash_rows(*(t.to(half) for t in (query, key, value)), cu_seq_lens_q, scaling, dropout)
        if out is not None:
            return out, None
    return sdpa_rows(query, key, value, host_bounds(cu_seq_lens_q), scaling, dropout, sliding_window), None


def sdpa_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: List[int],
              scaling: Optional[float], dropout: float, window: Optional[int]) -> torch.Tensor:
    """Causal scaled dot-product attention of each row to itself (a sliding window's mask where a row is longer
    than the window), the rows' outputs concatenated."""
    key, value = kv_heads(key, query.shape[1]), kv_heads(value, query.shape[1])
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        n = end - start
        if window is not None and n > window:
            at = torch.arange(n, device=query.device)
            keep = (at[None, :] <= at[:, None]) & (at[None, :] > at[:, None] - window)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout, scale=scaling))
        else:
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def flash_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
               scaling: Optional[float], dropout: float) -> Optional[torch.Tensor]:
    """torch's variable-length flash attention over the rows (None where this torch has none, or for dropout,
    which it does not take): (tokens, heads, dim) in and out, the longest row bounded by the sequence's length
    (no read of the boundaries)."""
    varlen = varlen_attention()
    if varlen is None or dropout:
        return None
    heads = query.shape[1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    params = inspect.signature(varlen).parameters
    extra: dict = {"scale": scaling}
    if key.shape[1] != heads:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (k, v))
    if "is_causal" in params:
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    cu = cu_seq_lens.to(dtype=torch.int32)
    total = q.shape[0]
    out = varlen(q, k, v, cu, cu, total, total, **extra)
    return out.unsqueeze(0)


def half_dtype(query: torch.Tensor) -> Optional[torch.dtype]:
    """The half precision a CUDA attention runs in: the tensors' own, or autocast's (which casts
    scaled_dot_product_attention's inputs, but not those of the variable-length attention); None otherwise."""
    if not query.is_cuda:
        return None
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in (torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype("cuda")
    return None


def varlen_attention() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def kv_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention's key or value heads repeated to the query's."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


_bounds: List[Any] = [None, None]  # the last boundaries read from a device: one read per forward, not per layer


def host_bounds(cu_seq_lens: torch.Tensor) -> List[int]:
    """The rows' boundaries as ints (a CPU tensor's for free; a device tensor read once for all the layers)."""
    if cu_seq_lens.device.type == "cpu":
        return cu_seq_lens.tolist()
    if _bounds[0] is not cu_seq_lens:
        _bounds[0], _bounds[1] = cu_seq_lens, cu_seq_lens.tolist()
    return _bounds[1]
