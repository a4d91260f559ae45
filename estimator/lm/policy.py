"""GRPO's policy loss over sampled completions (estimator.train.objectives.grpo), as TRL's GRPOTrainer computes it
(trl 1.16, `_compute_loss`): per completion token, the ratio r of its probability under the policy to that under
the policy that sampled it, the clipped surrogate -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A) with the
completion's advantage A, plus beta times the KL estimate exp(ref - logp) - (ref - logp) - 1 to the reference.

The loss types differ in what the tokens' losses are averaged over, and each is written here as a sum with the
weight it is divided by (the loop divides the gradients by the weights of a whole accumulation window on every
rank, estimator.train.weighting.PerWeight), so that k ranks of b prompts train what one process of k b does:
- 'dapo' (TRL's default): every completion token of the window alike (weight: the tokens);
- 'grpo': each completion's mean token loss, then the mean over completions (weight: the completions);
- 'dr_grpo': each completion's summed token loss over max_new_tokens, then the mean over completions (weight: the
  completions).
torch only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")


@dataclass(frozen=True)
class PolicyLoss:
    """A batch's policy loss (a sum, for backward), the weight it is divided by, and its sums for the history: the
    clipped tokens' counts (TRL's clip_ratio/low_mean, high_mean, region_mean: over the completion tokens) and the
    KL estimate's sum over them (None without a reference)."""

    loss: torch.Tensor
    weight: torch.Tensor
    tokens: torch.Tensor
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    region_clipped: torch.Tensor
    kl: Optional[torch.Tensor]


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                loss_type: str, epsilon_low: float, epsilon_high: float, beta: float = 0.0,
                ref_logps: Optional[torch.Tensor] = None, max_new_tokens: Optional[int] = None) -> PolicyLoss:
    """`logps`, `old_logps`, `ref_logps`, `mask`: (completions, positions), the completion tokens' log-probabilities
    under the policy, the sampling policy and the reference, and 1 at each completion token; `advantages`: one per
    completion."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    advantage = advantages.to(logps.dtype).unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("policy_loss with beta != 0 needs the reference's log-probabilities")
        gap = ref_logps - logps
        per_token_kl = torch.exp(gap) - gap - 1
        per_token = per_token + beta * per_token_kl
        kl = (per_token_kl.detach() * mask).sum()
    tokens = mask.sum()
    completions = torch.tensor(float(logps.shape[0]), dtype=logps.dtype, device=logps.device)
    if loss_type == "dapo":
        loss, weight = (per_token * mask).sum(), tokens
    elif loss_type == "grpo":
        loss, weight = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum(), completions
    elif loss_type == "dr_grpo":
        if not max_new_tokens:
            raise ValueError("policy_loss with loss_type='dr_grpo' needs max_new_tokens")
        loss, weight = (per_token * mask).sum() / max_new_tokens, completions
    else:
        raise ValueError(f"loss_type={loss_type!r}: one of {list(LOSS_TYPES)}")
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (advantage < 0)
        high = (ratio > 1 + epsilon_high) & (advantage > 0)
        counts = [((c.to(mask.dtype)) * mask).sum() for c in (low, high, low | high)]
    return PolicyLoss(loss, weight, tokens, *counts, kl)
