"""Group Relative Policy Optimization (GRPO; Shao et al. 2024, arXiv 2402.03300) of a causal LM from a table of
prompts and reward functions, with TRL's names and defaults (trl 1.16's GRPOConfig and GRPOTrainer).

A batch of b prompts (estimator.data.rows.Prompts: their tokens, and at the labels' place the prompts as given with
the columns the rewards read) becomes, in `prepare`, b x G completions: each prompt's G sampled by the policy
under a seed of its own (the run's seed, the epoch, the step and the prompt's tokens: k ranks sample what one
process does, estimator.lm.generation.sampled_groups), scored by the reward functions
(estimator.train.objectives.rewards), each completion's advantage taken within its prompt's group (a group is
never split across ranks). `on_batch` scores the completion tokens under the policy and takes the clipped
surrogate loss (estimator.lm.policy), a sum over what its loss type averages over (`weighting = PerWeight`).
With num_iterations=1 the sampling policy is the policy: the ratio is 1 and nothing is clipped, as in TRL. With
num_iterations=mu (TRL's), the loop takes mu optimizer steps on each sampled batch (`iterations`): the first
forward's log-probabilities, under the weights that sampled, are the old policy's for the ratio of the next ones
(clipped at 1 +- epsilon); the rewards are counted once a batch, the loss and clipping at every step. With
backward_passes_per_step=k as well, the loop samples k batches before it steps, then each of the mu steps
accumulates over all k (TRL's generation batch: estimator.train.loop). With beta > 0, the reference is the
model with its adapters off (the KL estimate per token).

Validation samples one completion per prompt greedily and reports the rewards (val_reward, the monitored key by
default); it has no loss (no val_loss). torch only, no pyspark."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from estimator.core.adapters import can_generate, model_positions
from estimator.core.outputs import forward, logits_of
from estimator.data.lm import IGNORE, eos_id, pad_id
from estimator.data.rows import rows_of
from estimator.lm.generation import sampled_groups
from estimator.lm.logprobs import token_logps
from estimator.lm.policy import LOSS_TYPES, policy_loss
from estimator.train.objectives.base import BuiltIn, built_in_loop
from estimator.train.objectives.preference import unwrapped
from estimator.train.objectives.rewards import SCALES, Rewards, advantages
from estimator.train.sums import LOSS, ROWS, WEIGHT, Sums, metric_slot, weight_slot
from estimator.train.weighting import PerWeight


def layout_of(names: Sequence[str], kl: bool) -> Sums:
    """The sums: the loss over its weight, the completions as rows, then each number over its own weight, by TRL's
    names (reward's square summed too, for reward_std)."""
    keys = ["reward", "reward_sq", *[f"rewards/{n}/mean" for n in names], "completions/mean_length",
            "completions/clipped_ratio", "frac_reward_zero_std", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean", *(["kl"] if kl else [])]
    return Sums.of_loss(pairs=keys)


# the training keys validation has no value for (it samples one greedy completion a prompt and takes no step)
VALIDATION_LEFT_OUT = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl",
                       "frac_reward_zero_std")

HIDDEN = ("reward_sq",)  # summed, not reported: reward_std is read from it


@dataclass
class Sampled:
    """A batch after prepare: each completion after its prompt, right-padded (`input_ids`, `attention_mask`), the
    completion tokens labelled (`labels`, IGNORE elsewhere), each completion's advantage, and the batch's sums
    known before the forward (rewards, lengths); `reference`: the completion tokens' log-probabilities under the
    reference (beta > 0)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    known: Dict[str, float]
    reference: Optional[torch.Tensor] = None
    training: bool = True
    old: Optional[torch.Tensor] = None  # the sampling policy's log-probabilities (set by the batch's first forward)


class GRPO(BuiltIn):
    """GRPO from a table of prompts: `objective=GRPO(reward_funcs=[...])` with `feature_cols=["prompt"]` (a string
    or message-list column) and `label_cols` the columns the reward functions read (none is fine).

    Args:
        reward_funcs: One callable or a list: each takes `prompts`, `completions`, `completion_ids` and the rows'
            label columns as keyword lists (one item per completion) and returns one float, or None, a completion.
        reward_weights: One weight per function (default 1.0 each); a completion's reward is the weighted sum.
        num_generations: Completions sampled per prompt (G, at least 2; TRL's default 8). batch_size counts
            prompts per rank.
        max_new_tokens: The most tokens a completion has (TRL's max_completion_length, 256).
        temperature: The sampling's temperature (TRL's 1.0).
        top_p: The sampling's nucleus (TRL's 1.0: all tokens).
        top_k: The sampling's top-k (TRL's None: all tokens).
        beta: The KL penalty's weight to the reference, the model with its adapters off (TRL's default 0.0).
        epsilon: The clipping's lower bound is 1 - epsilon (TRL's 0.2).
        epsilon_high: The clipping's upper bound is 1 + epsilon_high (default: epsilon).
        loss_type: 'dapo' (TRL's default: every completion token of the step alike), 'grpo' (each completion's
            mean token loss) or 'dr_grpo' (each completion's token losses over max_new_tokens).
        scale_rewards: 'group' (TRL's default: over each group's std), 'batch' or 'none' (Dr. GRPO).
        num_iterations: Optimizer steps on each sampled batch (TRL's mu, default 1): the steps after the first
            weigh each token by its probability now over its probability when sampled, clipped at 1 +- epsilon.
            Each step counts as one (schedules, checkpoint_steps, train_steps_per_epoch counts batches). With
            backward_passes_per_step=k, the k batches of a window are sampled first, and each step accumulates
            over all of them (TRL's generation batch).
    """

    weighting = PerWeight
    transform_output = "generate"
    gradient_clip_val = 1.0  # 'auto' clips as TRL's trainers do (max_grad_norm=1.0)
    driver_forward = False
    rows = "prompts"  # prompts alone, with the rewards' columns (estimator.data.rows.Prompts)
    monitor = "reward"  # the history key monitored by default (val_reward with validation): higher is better

    def __init__(self, reward_funcs: Any, reward_weights: Optional[Sequence[float]] = None, num_generations: int = 8,
                 max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: Optional[int] = None, beta: float = 0.0, epsilon: float = 0.2,
                 epsilon_high: Optional[float] = None, loss_type: str = "dapo", scale_rewards: str = "group",
                 num_iterations: int = 1):
        self.rewards = Rewards.of(reward_funcs, reward_weights)
        self.user_code = self.rewards.funcs  # pickled by value to the ranks where only the driver has their module
        for name, value, ok, what in (
                ("num_generations", num_generations, is_int(num_generations) and num_generations >= 2,
                 "an int >= 2: a group's advantages compare its completions (TRL's default 8)"),
                ("max_new_tokens", max_new_tokens, is_int(max_new_tokens) and max_new_tokens >= 1, "an int >= 1"),
                ("temperature", temperature, number(temperature) and temperature > 0, "a number > 0"),
                ("top_p", top_p, number(top_p) and 0 < top_p <= 1, "a number in (0, 1]"),
                ("top_k", top_k, top_k is None or (is_int(top_k) and top_k >= 0), "an int >= 0 or None"),
                ("beta", beta, number(beta) and beta >= 0, "a number >= 0 (0: no reference)"),
                ("epsilon", epsilon, number(epsilon) and 0 < epsilon < 1, "a number in (0, 1)"),
                ("epsilon_high", epsilon_high, epsilon_high is None or (number(epsilon_high) and epsilon_high > 0),
                 "a number > 0, or None (epsilon)"),
                ("loss_type", loss_type, loss_type in LOSS_TYPES, f"one of {list(LOSS_TYPES)}"),
                ("scale_rewards", scale_rewards, scale_rewards in SCALES, f"one of {list(SCALES)}"),
                ("num_iterations", num_iterations, is_int(num_iterations) and num_iterations >= 1,
                 "an int >= 1: the optimizer steps on each sampled batch (TRL's default 1)")):
            if not ok:
                raise ValueError(f"GRPO({name}={value!r}): {what}.")
        self.num_generations, self.max_new_tokens = int(num_generations), int(max_new_tokens)
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), top_k
        self.beta, self.epsilon = float(beta), float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.loss_type, self.scale_rewards, self.num_iterations = loss_type, scale_rewards, int(num_iterations)
        self.layout = layout_of(self.rewards.names, self.beta > 0)
        self._seed = 0  # the run's (for_rank)
        self._tokenizer: Any = None

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    def __repr__(self) -> str:
        return (f"GRPO(reward_funcs={list(self.rewards.names)}, num_generations={self.num_generations}, "
                f"beta={self.beta!r}, loss_type={self.loss_type!r}"
                + (f", num_iterations={self.num_iterations}" if self.num_iterations > 1 else "") + ")")

    @classmethod
    def applies(cls, p: Mapping[str, Any]) -> bool:
        return (isinstance(p.get("objective"), cls) and built_in_loop(p)
                and p.get("tokenizer") is not None and can_generate(p.get("model")))

    @classmethod
    def history_keys(cls, p: Mapping[str, Any]) -> List[str]:
        return list(summarize_grpo(p["objective"].layout, {}, None, keys_only=True))

    @classmethod
    def dry_run(cls, model: Any, data: Any, arrays: Any, rows: int) -> List[tuple]:
        """No forward on the driver (transform generates text): the ranks' first step samples and scores."""
        return []

    @classmethod
    def check_fit(cls, p: Mapping[str, Any], shards_checkpoints: bool) -> None:
        """What this fit cannot take, by name: packing (the completions are sampled per step), beta > 0 without
        adapters (the reference is the model with them off), and reward functions that cannot take the arguments
        they would be given (the label columns by name)."""
        self = p["objective"]
        for name, value, why in (("packing", p["packing"], "the completions are sampled at each step and batched "
                                  "padded; packing is not built for them: leave packing=False"),
                                 ("peft_config", self.beta > 0 and p["peft_config"] is None,
                                  f"beta={self.beta} weighs the KL to the reference, the model with its adapters "
                                  "off: set peft_config (LoraConfig(task_type='CAUSAL_LM')), or beta=0")):
            if value:
                raise ValueError(f"objective={self!r} with {name}={p[name]!r}: {why}.")
        positions = model_positions(p["model"])
        if positions is not None and self.max_new_tokens >= positions:
            raise ValueError(f"objective={self!r} with max_new_tokens={self.max_new_tokens}: the model has "
                             f"{positions} positions, which a prompt and its completion share: set "
                             f"GRPO(max_new_tokens=...) below {positions} (at most {positions} minus the longest "
                             "prompt's tokens).")
        self.rewards.check_arguments(("prompts", "completions", "completion_ids", *p["label_cols"]))

    @property
    def completion_tokens(self) -> int:
        return self.max_new_tokens

    @classmethod
    def for_rank(cls, spec: Any, objs: Any, model: Any, trainer: Any) -> "GRPO":
        self = objs.objective
        self._seed, self._tokenizer = int(spec.seed or 0), objs.tokenizer
        if self.beta > 0 and not hasattr(unwrapped(model), "disable_adapter"):
            raise ValueError(f"{self!r} takes its reference as the trained model with its adapters off: set "
                             "peft_config (LoraConfig(task_type='CAUSAL_LM')), or beta=0.")
        return self

    def sampling_kwargs(self, training: bool) -> Dict[str, Any]:
        tokenizer = self._tokenizer
        # synced_gpus off: the strategy's generation() gathers a sharded model's weights first, so each rank's
        # forwards need no collective and may run as many generate() calls, of any lengths, as its rows need
        # (transformers would otherwise step every rank until all stop, hanging where their calls differ)
        kwargs: Dict[str, Any] = {"pad_token_id": pad_id(tokenizer), "eos_token_id": eos_id(tokenizer),
                                  "synced_gpus": False}
        if training:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or 0)
        return kwargs

    def prepare(self, generation: Any, batch: Any, ctx: Any) -> Sampled:
        features, labels, _ = batch
        rows = rows_of(labels[0].cpu().numpy())
        ids, mask = features[0]["input_ids"], features[0]["attention_mask"]
        prompts = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
        group = self.num_generations if ctx.training else 1
        device = ids.device
        with generation() as module:
            if ctx.training:
                seeds = [prompt_seed(self._seed, ctx.epoch, ctx.global_step, p) for p in prompts]
                completions = sampled_groups(module, prompts, group, seeds, self.max_new_tokens,
                                             self.sampling_kwargs(True), str(device))
            else:
                completions = greedy(module, prompts, self.max_new_tokens, self.sampling_kwargs(False), str(device))
            sampled = self.scored(prompts, completions, rows, group, device, ctx.training)
            if self.beta > 0 and ctx.training:
                inner = unwrapped(module)
                with torch.no_grad(), inner.disable_adapter():
                    sampled.reference = completion_logps(inner, sampled)
        return sampled

    def scored(self, prompts: List[List[int]], completions: List[List[int]], rows: List[Dict[str, Any]],
               group: int, device: torch.device, training: bool) -> Sampled:
        """The completions after their prompts, scored by the rewards, with their advantages and known sums."""
        tokenizer = self._tokenizer
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        repeated = [rows[i // group] for i in range(len(completions))]
        columns = {k: [r[k] for r in repeated] for k in rows[0] if k != "prompt"} if rows else {}
        scores = torch.from_numpy(self.rewards.score([r["prompt"] for r in repeated], texts, completions, columns))
        weights = torch.tensor(self.rewards.weights, dtype=torch.float64)
        found, rewards, zero = advantages(scores, weights, group, self.scale_rewards)
        width = max(len(prompts[i // group]) + len(c) for i, c in enumerate(completions))
        pad = pad_id(tokenizer)
        input_ids = torch.full((len(completions), width), pad, dtype=torch.long)
        attention = torch.zeros((len(completions), width), dtype=torch.long)
        labels = torch.full((len(completions), width), IGNORE, dtype=torch.long)
        stops = self.sampling_kwargs(False)["eos_token_id"]
        for i, completion in enumerate(completions):
            prompt = prompts[i // group]
            row = prompt + completion
            input_ids[i, :len(row)] = torch.tensor(row)
            attention[i, :len(row)] = 1
            labels[i, len(prompt):len(row)] = torch.tensor(completion, dtype=torch.long)
        scored = ~torch.isnan(rewards)
        clipped = sum(1 for c in completions if len(c) == self.max_new_tokens and c[-1] != stops)
        known = {"reward": float(rewards[scored].sum()), "reward:weight": float(scored.sum()),
                 "reward_sq": float((rewards[scored] ** 2).sum()), "reward_sq:weight": float(scored.sum()),
                 "completions/mean_length": float(sum(len(c) for c in completions)),
                 "completions/clipped_ratio": float(clipped),
                 "frac_reward_zero_std": float(zero.sum()), "count": float(len(completions))}
        for j, name in enumerate(self.rewards.names):
            own = ~torch.isnan(scores[:, j])
            known[f"rewards/{name}/mean"] = float(scores[own, j].sum())
            known[f"rewards/{name}/mean:weight"] = float(own.sum())
        return Sampled(input_ids.to(device), attention.to(device), labels.to(device),
                       found.to(device=device, dtype=torch.float32), known, training=training)

    @property
    def iterations(self) -> int:
        """Optimizer steps the loop takes on each prepared batch (num_iterations)."""
        return self.num_iterations

    def weight_of(self, batch: Sampled) -> torch.Tensor:
        """What the batch's loss sums over: its completion tokens ('dapo') or its completions."""
        if self.loss_type == "dapo":
            return (batch.labels[:, 1:] != IGNORE).sum()
        return torch.tensor(batch.labels.shape[0], device=batch.labels.device)

    def on_batch(self, model: Any, batch: Sampled, ctx: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
        device = batch.input_ids.device
        mask = (batch.labels[:, 1:] != IGNORE)
        first = batch.old is None  # the batch's first step (num_iterations: its later ones reuse the samples)
        if batch.training:
            logps = completion_logps(model, batch)
            if first and self.num_iterations > 1:
                batch.old = logps.detach()
            found = policy_loss(logps, logps.detach() if first else batch.old, batch.advantages, mask,
                                self.loss_type, self.epsilon, self.epsilon_high, self.beta, batch.reference,
                                self.max_new_tokens)
            loss, weight = found.loss, found.weight
            counted = {"clip_ratio/low_mean": found.low_clipped, "clip_ratio/high_mean": found.high_clipped,
                       "clip_ratio/region_mean": found.region_clipped}
            if found.kl is not None:
                counted["kl"] = found.kl
            tokens = found.tokens
        else:  # validation: the rewards of greedy completions, no loss
            loss = torch.zeros((), device=device)
            weight = torch.zeros((), device=device)
            counted, tokens = {}, mask.sum()
        named = dict(batch.known) if first else dict.fromkeys(batch.known, 0.0)  # the rewards: once a batch
        count = named.pop("count")
        values: Dict[str, Any] = {LOSS: loss.detach(), WEIGHT: weight, ROWS: count}
        for key in ("reward", "reward_sq", *[f"rewards/{n}/mean" for n in self.rewards.names]):
            values[metric_slot(key)], values[weight_slot(key)] = named[key], named[f"{key}:weight"]
        for key in ("completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std"):
            values[metric_slot(key)], values[weight_slot(key)] = named[key], count
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                    *(["kl"] if self.beta > 0 else [])):
            values[metric_slot(key)] = counted.get(key, 0.0)
            values[weight_slot(key)] = tokens if key in counted else 0.0
        sums = torch.stack([torch.as_tensor(values[s], dtype=torch.float64, device=device).reshape(())
                            for s in self.layout.slots])
        return loss, sums

    def summarize(self, train: Mapping[str, float], val: Optional[Mapping[str, float]]) -> Dict[str, float]:
        return summarize_grpo(self.layout, train, val)


def summarize_grpo(layout: Sums, train: Mapping[str, float], val: Optional[Mapping[str, float]],
                   keys_only: bool = False) -> Dict[str, float]:
    """The epoch's row: the means, reward_std from the rewards' sums of squares (the std over the epoch's scored
    completions, Bessel's correction), then validation's as val_."""
    def one(named: Mapping[str, float], prefix: str) -> Dict[str, float]:
        if keys_only:
            means = {prefix + m.key: math.nan for m in layout.means}
        else:
            means = layout.means_of(named, prefix)
        if prefix:  # validation scores one greedy completion a prompt: rewards, no loss, nothing clipped, no
            for key in (LOSS, *VALIDATION_LEFT_OUT):  # group to spread over
                means.pop(prefix + key, None)
        reward, square = means.get(prefix + "reward", math.nan), means.pop(prefix + "reward_sq", math.nan)
        n = named.get(weight_slot("reward"), 0.0) if not keys_only else 0.0
        spread = (square - reward ** 2) * n / (n - 1) if n > 1 else math.nan
        out = {}
        for key, value in means.items():
            out[key] = value
            if key == prefix + "reward":
                out[prefix + "reward_std"] = math.sqrt(max(spread, 0.0)) if not math.isnan(spread) else math.nan
        return out

    return {**one(train, ""), **(one(val, "val_") if val is not None else {})}


def prompt_seed(base: int, epoch: int, step: int, ids: Sequence[int]) -> int:
    """A prompt's sampling seed: the run's seed, the epoch, the optimizer step and the prompt's tokens, whatever rank
    draws it or what else shares its batch."""
    key = f"{base}|{epoch}|{step}|{list(ids)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2


def greedy(model: Any, prompts: List[List[int]], max_new_tokens: int, kwargs: Dict[str, Any], device: str
           ) -> List[List[int]]:
    """One greedy completion per prompt (validation), in generate() calls of many prompts, each cut at its stop."""
    return sampled_groups(model, prompts, 1, None, max_new_tokens, kwargs, device)


def completion_logps(model: Any, batch: Sampled) -> torch.Tensor:
    """The log-probability of each position's next token under `model` (rows x positions - 1), in float32."""
    features = [{"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}]
    return token_logps(logits_of(forward(model, features)), batch.labels)


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and math.isfinite(value)
