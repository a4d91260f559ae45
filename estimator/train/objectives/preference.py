"""Preference tuning of a causal LM from pairs of answers: DPO (Rafailov et al. 2023, arXiv 2305.18290) and its
IPO variant (Azar et al. 2023, arXiv 2310.12036).

A batch of b pairs is 2b rows (estimator.data.rows.Pairs): each pair's prompt with its chosen answer,
then with its rejected one, the prompt's tokens carrying no label, so both answers of a pair are scored by the
same weights in one forward. An answer's score is its labelled tokens' log-probabilities summed, under the policy
and under the reference model, the model before tuning (`reference`): the same model with its adapters off (peft's
`disable_adapter()`), in eval mode and without gradients, so no second copy of the base is held; or read with the
rows from a table the ranks computed before training (estimator.train.objectives.reference: the model as built,
one forward per step); or a frozen copy of the model.

With h = (policy chosen - policy rejected) - (reference chosen - reference rejected), a pair's loss is
-log sigmoid(beta h) (DPO) or (h - 1 / (2 beta))^2 (IPO, h over each answer's mean token log-probability instead
of the sum, as TRL computes it). The loss for backward is the batch's sum over its pairs
(`weighting = PerWeight`, the weight being the pairs): the gradients are divided by the pairs of the whole
accumulation window over all ranks, so 2 ranks of 4 pairs train what one process of 8 pairs does. The history
reports TRL's numbers, means over the pairs: the rewards beta x (policy - reference) of the chosen and rejected
answers, how often the chosen one's is higher (`rewards/accuracies`) and their difference (`rewards/margins`).
torch only, no pyspark."""
from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

from estimator.core.adapters import can_generate
from estimator.core.outputs import forward, logits_of
from estimator.data.lm import IGNORE
from estimator.lm.logprobs import answer_logps, answer_sums, row_index
from estimator.train.objectives.base import BuiltIn, built_in_loop
from estimator.train.objectives.tokens import check_packed, dry_tokens
from estimator.train.sums import Sums
from estimator.train.weighting import PerWeight

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
LOSS_TYPES = ("sigmoid", "ipo")
# where the reference log-probabilities come from: the trained model with its adapters off, a table computed once
# before training and kept in the store (estimator.train.objectives.reference), or a frozen copy held beside it
REFERENCES = ("adapters", "precomputed", "copy")


class DPO(BuiltIn):
    """Direct preference optimization: `objective=DPO(beta=0.1)` tunes a causal LM on a table of prompts with a
    preferred and a rejected answer (`feature_cols=["prompt"]`, `label_cols=["chosen", "rejected"]`: three string
    columns, or three message lists). docs/language-models.md 'Tune on preference pairs (DPO)'.

    Args:
        beta: How far the policy may move from the reference (TRL's default 0.1; larger keeps it closer).
        loss_type: 'sigmoid' (DPO's loss) or 'ipo' (IPO's squared loss over each answer's mean token
            log-probability, as TRL computes it).
        sft_weight: Adds that many times each chosen answer's mean token negative log-likelihood to its pair's loss
            (RPO; TRL's loss_type=['sigmoid', 'sft'] averages over the batch's chosen tokens instead). DPO alone
            may make the chosen answers less likely too, and write worse text.
        reference: Where the reference model's log-probabilities come from. 'adapters': the trained model with
            its LoRA adapters off (the default under peft_config). 'precomputed': computed once before training
            by the model as built, on the ranks, and kept in the store beside the rows, reused by later fits of
            them and by retries (the default without adapters: one model in memory, one forward per step).
            'copy': a frozen copy of the model beside it (twice the memory; not with fsdp).
    """

    weighting = PerWeight
    layout = Sums.of_loss(METRICS)
    transform_output = "generate"  # after preference tuning, transform writes text as after SFT
    gradient_clip_val = 1.0  # 'auto' clips as TRL's DPOTrainer does (max_grad_norm=1.0)
    driver_forward = False
    rows = "preference"  # pairs of answers: label_cols the chosen and the rejected (estimator.data.rows.Pairs)

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", sft_weight: float = 0.0,
                 reference: Optional[str] = None):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 0:
            raise ValueError(f"DPO(beta={beta!r}): beta scales the log-probability ratios in the loss and must be a "
                             "number > 0 (TRL's default is 0.1; larger keeps the model closer to the reference).")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"DPO(loss_type={loss_type!r}): one of {list(LOSS_TYPES)} ('sigmoid' is DPO's loss, "
                             "'ipo' the squared loss of IPO over the answers' mean log-probabilities).")
        if isinstance(sft_weight, bool) or not isinstance(sft_weight, (int, float)) or not (
                math.isfinite(sft_weight) and sft_weight >= 0):
            raise ValueError(f"DPO(sft_weight={sft_weight!r}): the weight of the chosen answers' own loss (their "
                             "mean token negative log-likelihood, RPO's term; TRL's loss_type=['sigmoid', 'sft']) "
                             "must be a number >= 0; 0 leaves it out.")
        if reference is not None and reference not in REFERENCES:
            raise ValueError(f"DPO(reference={reference!r}): one of {list(REFERENCES)}, or None (the adapters under "
                             "peft_config, else 'precomputed').")
        self.beta, self.loss_type, self.sft_weight = float(beta), loss_type, float(sft_weight)
        self.reference = reference
        self._copy: Any = None  # reference='copy': the frozen model, on the rank
        self._checked = False  # packed pairs: the first batch checks that each row attends to itself only

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_copy": None, "_checked": False}

    def __repr__(self) -> str:
        extra = f", sft_weight={self.sft_weight!r}" if self.sft_weight else ""
        extra += f", reference={self.reference!r}" if self.reference is not None else ""
        return f"DPO(beta={self.beta!r}, loss_type={self.loss_type!r}{extra})"

    def reference_for(self, adapters: bool) -> str:
        """Where this fit's reference log-probabilities come from (`adapters`: the fit trains LoRA adapters)."""
        return self.reference or ("adapters" if adapters else "precomputed")

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, *self._key()))

    def _key(self) -> Tuple[float, str, float, Optional[str]]:
        return self.beta, self.loss_type, self.sft_weight, self.reference

    @classmethod
    def applies(cls, p: Mapping[str, Any]) -> bool:
        """objective=DPO(...), in the built-in loop (no loss, train_step or train_fn), over a model that generates
        with a tokenizer."""
        return (isinstance(p.get("objective"), cls) and built_in_loop(p)
                and p.get("tokenizer") is not None and can_generate(p.get("model")))

    @classmethod
    def history_keys(cls, p: Mapping[str, Any]) -> List[str]:
        return [m.key for m in cls.layout.means]

    @classmethod
    def dry_run(cls, model: Any, data: Any, arrays: Any, rows: int) -> List[tuple]:
        """The pairs' labelled tokens counted (or their SFT loss, where the driver holds the weights)."""
        return dry_tokens(model, data, arrays, rows)

    @classmethod
    def check_fit(cls, p: Mapping[str, Any], shards_checkpoints: bool) -> None:
        """Where this fit's reference comes from (`p["objective"]`: the DPO given), refused by name where it cannot:
        the adapters off without adapters, a table beside rows never materialized, a copy of a sharded model."""
        self, reference = p["objective"], p["objective"].reference_for(p["peft_config"] is not None)
        for name, value, why in (("peft_config", reference == "adapters" and p["peft_config"] is None,
                                  "reference='adapters' is the trained model with its adapters off: set peft_config "
                                  "(LoraConfig(task_type='CAUSAL_LM')), or leave reference unset (computed once "
                                  "before training, 'precomputed')"),
                                 ("data_mode", reference == "precomputed" and p["data_mode"] == "direct",
                                  "the precomputed reference log-probabilities are kept beside the materialized rows "
                                  "in the store: set data_mode='materialize', or reference='copy'"),
                                 ("strategy", reference == "copy" and shards_checkpoints, "a frozen copy of a "
                                  "sharded model is not built: leave reference unset (precomputed before training)"),
                                 ("completion_only_loss", not p["completion_only_loss"], "the answers are scored on "
                                  "their own tokens")):
            if value:
                raise ValueError(f"objective={self!r} with {name}={p[name]!r}: {why}.")

    @classmethod
    def reference_table(cls, p: Mapping[str, Any]) -> Optional[str]:
        """The name of the table of reference log-probabilities the ranks compute before training and read with
        the rows ('precomputed': reference_key), else None."""
        from estimator.train.objectives.reference import reference_key

        precomputed = p["objective"].reference_for(p["peft_config"] is not None) == "precomputed"
        return reference_key(p) if precomputed else None

    @classmethod
    def before_training(cls, spec: Any, ctx: Any, objs: Any, model: Any) -> None:
        """The reference, from the model as built (before any step or restored checkpoint): its log-probabilities
        computed into the store ('precomputed'), or a frozen copy of it ('copy'), kept by the DPO given
        (`objs.objective`, which for_rank hands to the loop)."""
        self = objs.objective
        mode = self.reference_for(hasattr(unwrapped(model), "disable_adapter"))
        if mode == "precomputed":
            from estimator.train.objectives.reference import precompute

            precompute(spec, ctx, objs, model, reference_scores)
        elif mode == "copy":
            self._copy = copy.deepcopy(model).eval().requires_grad_(False)

    @classmethod
    def for_rank(cls, spec: Any, objs: Any, model: Any, trainer: Any) -> "DPO":
        self = objs.objective  # the user's instance, as given (with before_training's copy)
        mode = self.reference_for(hasattr(unwrapped(model), "disable_adapter"))
        if mode == "adapters" and not hasattr(unwrapped(model), "disable_adapter"):
            raise ValueError(f"{self!r} takes its reference model as the trained model with its adapters off: set "
                             "peft_config (e.g. LoraConfig(task_type='CAUSAL_LM')), or reference='precomputed'.")
        return self

    def on_batch(self, model: Any, tensors: Any, ctx: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
        features, labels, _ = tensors
        stored = labels[1] if len(labels) > 1 else None  # 'precomputed': read with the rows
        labels = labels[0]
        rows = row_index(features[0])  # packed pairs: each position's row, and the rows
        if rows is not None and not self._checked:
            check_packed(model, features[0])
            self._checked = True
        tokens = answer_sums((labels[:, 1:] != IGNORE).to(torch.float32), rows).clamp(min=1)
        if stored is not None:
            reference = stored.to(torch.float32)
        else:
            with torch.no_grad():
                reference = (scores(self._copy, features, labels) if self._copy is not None
                             else reference_scores(model, features, labels))
        policy = scores(model, features, labels)
        pairs = policy.shape[0] // 2
        ratios = policy - reference  # per row: the answer's log-probability over the reference's
        if self.loss_type == "ipo":  # over each answer's mean token log-probability, as TRL's
            h = ratios[:pairs] / tokens[:pairs] - ratios[pairs:] / tokens[pairs:]
            losses = (h - 1 / (2 * self.beta)) ** 2
        else:
            losses = -F.logsigmoid(self.beta * (ratios[:pairs] - ratios[pairs:]))
        if self.sft_weight:  # the chosen answers kept likely: each one's mean token NLL, per pair
            losses = losses - self.sft_weight * policy[:pairs] / tokens[:pairs]
        chosen_rewards, rejected_rewards = (self.beta * ratios.detach()).split(pairs)  # TRL's: summed, any loss
        loss = losses.sum()
        count = torch.full((1,), float(pairs), dtype=torch.float64, device=loss.device)
        sums = torch.cat([loss.detach().double().reshape(1), count, count,
                          torch.stack([chosen_rewards.sum(), rejected_rewards.sum(),
                                       (chosen_rewards > rejected_rewards).sum().to(chosen_rewards.dtype),
                                       (chosen_rewards - rejected_rewards).sum()]).double()])
        return loss, sums

    def weight_of(self, tensors: Any) -> torch.Tensor:
        """The pairs of a batch (what its loss is summed over)."""
        labels, rows = tensors[1][0], row_index(tensors[0][0])
        return torch.tensor((labels.shape[0] if rows is None else rows[1]) // 2, device=labels.device)


def scores(model: Any, features: Any, labels: torch.Tensor) -> torch.Tensor:
    """Each row's answer scored by `model`: its labelled tokens' log-probabilities summed (rows packed in one
    sequence: each row's own)."""
    rows = row_index(features[0])
    if rows is not None:  # no KV cache: transformers confines attention to each packed row only without one
        features = [dict(features[0], use_cache=False), *features[1:]]
    return answer_logps(logits_of(forward(model, features)), labels, rows)


def reference_scores(model: Any, features: Any, labels: torch.Tensor) -> torch.Tensor:
    """The reference's scores: the model with its adapters off (a model without adapters: as it is, which before
    training is the reference), in eval mode (no dropout), no gradients; through the wrapped module (no DDP hooks
    for a forward without backward)."""
    inner = unwrapped(model)
    training = inner.training
    inner.eval()
    try:
        with torch.no_grad(), (inner.disable_adapter() if hasattr(inner, "disable_adapter")
                               else contextlib.nullcontext()):
            return scores(inner, features, labels)
    finally:
        inner.train(training)


def unwrapped(model: Any) -> Any:
    """The peft model: the model itself (fsdp shards in place), or the module a wrapper holds (DDP's `.module`)."""
    return model if hasattr(model, "disable_adapter") else getattr(model, "module", model)
