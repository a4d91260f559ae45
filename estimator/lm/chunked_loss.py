"""A causal LM's next-token loss without the vocabulary's logits in float32 (issue 53): the model's forward runs
as the plain path runs it (through DDP or FSDP, with its adapters), but its output head returns the last hidden
states it was given instead of the logits; the head is then applied to the labelled positions only, a chunk of
positions at a time, each chunk's logits cast to float32, its cross entropy summed and its gradients (with
respect to the hidden states and the head's trainable parameters: a LoRA on lm_head included) computed at once
and the chunk dropped. At most one chunk's logits exist at a time, in forward and in backward.

Why the forward is not split into the decoder's call then the head's: the model the loop trains through is a
wrapper (DistributedDataParallel, FSDP2's root), whose forward must run for its gradients to be averaged (DDP's
reducer ignores the gradients of a backward whose forward did not go through it: the ranks would silently
diverge), and a causal LM's forward may pass its decoder more than input_ids and attention_mask.

Why gradients are computed in forward (a custom autograd Function) rather than each chunk recomputed in
backward (torch.utils.checkpoint): the head's matmul is most of a small model's step at a 128k vocabulary, and
recomputing it costs one more matmul per step; benchmarks/bench_chunked_loss.py measures both
(RESULTS.md, 2026-11-27, issue 53).

Where the chunked loss would not be the model's own (its forward transforms the logits: Gemma 2's softcapping,
Cohere's logit_scale; no output head found; a head with hooks, such as an FSDP unit of its own), `output_head`
says so and the plain path runs; a forward that does not return what its head returned is caught at run time
too, and that batch is computed again the plain way (estimator.train.objectives.tokens). torch only."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from estimator.core.adapters import is_adapted
from estimator.core.outputs import forward, logits_of
from estimator.data.lm import IGNORE

# A chunk's float32 logits are at most this many bytes: 261 positions at Llama 3's 128,256 tokens, 1,048 at
# 32,000. A chunk holds about two such buffers (the logits and their log-softmax, made the gradient in place; in
# bf16 the logits and the gradient's cast are half as large). Measured (bench_chunked_loss.py, 128k vocabulary,
# batch 4 x 512, 2 CPU cores; RESULTS.md 2026-11-27): the step's peak above the model 525 / 589 / 1,407 MB and
# 1.08x / 1.13x / 1.26x the plain loop's tokens/s at 32 / 128 / 512 MB. 128 MB keeps the loss's memory well
# under a large model's activations at near the speed of the largest chunks (the plain loss needed 3,337 MB).
CHUNK_BYTES = 128 * 2 ** 20

# Devices where only the labelled positions go through the head (reading their count costs the host nothing).
PICKED_ON = frozenset({"cpu"})

# Config fields of transformers models whose forward changes the head's output before returning it as logits.
SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def positions_per_chunk(vocabulary: int) -> int:
    """How many positions' logits a chunk computes at once (CHUNK_BYTES of float32 logits, at least one)."""
    return max(1, CHUNK_BYTES // (4 * vocabulary))


def output_head(model: Any) -> Tuple[Optional[nn.Module], str]:
    """(the output head the chunked loss applies, "") when the chunked loss is the model's own loss, else (None,
    why not). `model` is what the loop calls: a wrapper with `.module` (DDP, FSDP, one rank's stand-in), a peft
    model, or a transformers causal LM."""
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module  # the strategy's wrapper: its forward is called, its module read
    if is_adapted(model):
        if any(c.is_prompt_learning for c in model.peft_config.values()):
            return None, "a prompt-learning adapter adds positions the labels do not have"
        model = model.get_base_model()
    if not isinstance(model, PreTrainedModel):
        return None, f"{type(model).__name__} is not a transformers model (its forward's logits are all we know)"
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Module):
        return None, f"{type(model).__name__} has no output embeddings (get_output_embeddings)"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scaled = [name for name in SCALED_LOGITS if getattr(config, name, None) is not None]
    if scaled:
        return None, f"{type(model).__name__}'s forward transforms the head's logits ({', '.join(scaled)})"
    if any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
           for m in head.modules()):
        return None, "its output head has hooks (an FSDP unit of its own, a user's hook): it is called once"
    return head, ""


@contextlib.contextmanager
def head_passing_hidden(head: nn.Module) -> Iterator[List[Tuple[torch.Tensor, int]]]:
    """While inside, calling `head` returns its input (the last hidden states) unchanged and records it with its
    version counter (an in-place change to it would show there)."""
    seen: List[Tuple[torch.Tensor, int]] = []
    own = head.__dict__.get("forward")  # accelerate's hooks replace forward on the instance: put it back after

    def passing(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((hidden, hidden._version))
        return hidden

    head.forward = passing
    try:
        yield seen
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def hidden_states(model: Any, features: Sequence[Any], head: nn.Module, rows: Tuple[int, int]) -> Optional[Any]:
    """The model's forward on `features` (estimator.core.outputs.forward, as the plain path calls it) with the head
    passing its input through: the last hidden states (batch, tokens, hidden), or None when the forward did
    something else with the head's output than return it as its logits (the plain path must run instead)."""
    with head_passing_hidden(head) as seen:
        raw = forward(model, features)
    returned = logits_of(raw) if not isinstance(raw, torch.Tensor) else raw
    if len(seen) != 1:
        return None
    hidden, version = seen[0]
    if returned is not hidden or hidden._version != version or tuple(hidden.shape[:2]) != rows:
        return None
    return hidden


def chunked_token_loss(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor,
                       positions: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the cross entropy summed over the labelled tokens, in float32, their count), as token_loss computes it
    from the logits: the hidden state at t predicts the label at t + 1, `positions` at a time (default:
    positions_per_chunk of the head's vocabulary). On the CPU only the labelled positions go through the head;
    on a GPU every position does, the unlabelled ones weighed 0: picking the labelled ones gives a tensor whose
    size only the device knows, and reading it (twice in forward, once more in backward's scatter) made the host
    wait for the GPU three times a step (tests/gpu/test_syncs.py), as the plain loss over all logits does not."""
    target = labels[:, 1:]
    labelled = target != IGNORE
    if hidden.device.type in PICKED_ON:
        picked, targets, masked = hidden[:, :-1][labelled], target[labelled], False  # a gather; backward scatters
    else:
        picked, targets, masked = hidden[:, :-1].reshape(-1, hidden.shape[-1]), target.reshape(-1), True
    if positions is None:
        positions = positions_per_chunk(vocabulary_of(head, picked))
    trained = [p for p in head.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (picked.requires_grad or trained):
        loss = HeadLoss.apply(picked, targets, head, positions, masked, *trained)
    else:
        loss = picked.new_zeros((), dtype=torch.float32)
        call = cast_once(head, picked.device)
        for start in range(0, picked.shape[0], positions):
            loss = loss + chunk_loss(call(picked[start:start + positions]), targets[start:start + positions],
                                     masked=masked)
    return loss, labelled.sum()


def cast_once(head: nn.Module, device: torch.device) -> Any:
    """What each chunk calls for its logits: `head`, or under autocast, a frozen plain Linear's weight cast to the
    autocast dtype once for all the chunks. Autocast caches the cast of a weight that needs a gradient for the
    step, not a frozen one's: a LoRA fit's head (2048 x 128k: 1 GB in float32) was cast again for each of the
    63 chunks of a step on an H100, where the chunked loss ran at 0.76x the plain loss's tokens/s (RESULTS.md,
    2026-11-27; this change not yet measured there). The same numbers: autocast's own cast, done once."""
    kind = device.type
    if (type(head) is not nn.Linear or head.weight.requires_grad or not torch.is_autocast_enabled(kind)):
        return head
    dtype = torch.get_autocast_dtype(kind)
    weight = head.weight.detach().to(dtype)
    bias = head.bias.detach().to(dtype) if head.bias is not None else None

    def call(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(kind, enabled=False):
            return torch.nn.functional.linear(hidden.to(dtype), weight, bias)
    return call


def vocabulary_of(head: nn.Module, hidden: torch.Tensor) -> int:
    """The head's output width: its out_features (peft's layers keep their base layer's), else one position run."""
    width = getattr(head, "out_features", None) or getattr(getattr(head, "base_layer", None), "out_features", None)
    if isinstance(width, int):
        return width
    with torch.no_grad():
        return int(head(hidden[:1]).shape[-1]) if hidden.shape[0] else 1


def chunk_loss(logits: torch.Tensor, targets: torch.Tensor, gradient: bool = False, masked: bool = False) -> Any:
    """The summed cross entropy of a chunk's logits (positions, vocabulary) in float32; with `gradient`, also its
    derivative with respect to the logits, in their dtype (softmax less the one-hot target). log_softmax's fused
    kernel writes one buffer, turned into the softmax in place: logsumexp and a copy cost two more passes over
    the chunk (0.92x the plain loop's tokens/s at 128k, RESULTS.md). `masked`: targets may be IGNORE, whose
    positions add 0 to the loss and to the gradient (no read of how many there are)."""
    logp = torch.log_softmax(logits.detach().float(), dim=-1)  # its own buffer, even for float32 logits
    weight = (targets != IGNORE) if masked else None
    targets = targets.clamp(min=0) if masked else targets
    picked = logp.gather(1, targets[:, None])
    loss = -(picked.squeeze(1) * weight).sum() if masked else -picked.sum()
    if not gradient:
        return loss
    grad = logp.exp_()
    grad[torch.arange(grad.shape[0], device=grad.device), targets] -= 1
    if masked:
        grad *= weight[:, None]
    return loss, grad.to(logits.dtype)


class HeadLoss(torch.autograd.Function):
    """The chunked loss as one autograd node: forward computes each chunk's loss and its gradients with respect to
    the hidden states and the head's trainable parameters (the head called as a module: a peft LoRA on it runs
    its adapters), keeps those gradients (hidden's size, the parameters' size) and drops the chunk's logits;
    backward multiplies them by the incoming gradient (the loss weighting's scale)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, positions: int,
                masked: bool, *params: torch.Tensor) -> torch.Tensor:
        wants = ctx.needs_input_grad
        trained = [p for p, need in zip(params, wants[5:]) if need]
        grad_hidden = torch.zeros_like(hidden) if wants[0] else None
        grads = [torch.zeros_like(p, dtype=torch.float32) for p in trained]  # summed over chunks in float32
        loss = hidden.new_zeros((), dtype=torch.float32)
        call = cast_once(head, hidden.device)
        for start in range(0, hidden.shape[0], positions):
            piece = hidden[start:start + positions].detach().requires_grad_(wants[0])
            with torch.enable_grad():
                logits = call(piece)
            part, grad = chunk_loss(logits, targets[start:start + positions], gradient=True, masked=masked)
            loss += part
            inputs = ([piece] if wants[0] else []) + trained
            found = torch.autograd.grad(logits, inputs, grad, allow_unused=True) if inputs else ()
            del logits, grad
            if wants[0]:
                grad_hidden[start:start + positions] = found[0]
                found = found[1:]
            for total, g in zip(grads, found):
                if g is not None:
                    total += g
        ctx.grad_hidden, ctx.grads = grad_hidden, list(zip(grads, [p.dtype for p in trained]))
        ctx.wants = wants[5:]
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        hidden = ctx.grad_hidden * grad_loss.to(ctx.grad_hidden.dtype) if ctx.grad_hidden is not None else None
        grads = iter(ctx.grads)
        params = tuple(scaled(next(grads), grad_loss) if need else None for need in ctx.wants)
        ctx.grad_hidden = ctx.grads = None
        return (hidden, None, None, None, None, *params)


def scaled(summed: Tuple[torch.Tensor, torch.dtype], grad_loss: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient summed over the chunks (float32) times the incoming gradient, in its dtype."""
    grad, dtype = summed
    return (grad * grad_loss.to(torch.float32)).to(dtype)
