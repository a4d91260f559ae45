"""GRPO's rewards on a rank (estimator.train.objectives.grpo): the user's reward functions called on a batch's
completions, their scores checked and weighted, and each completion's advantage within its prompt's group, as TRL's
GRPOTrainer computes them (trl 1.16: `_calculate_rewards`, `_generate_and_score_completions`).

A reward function is called as TRL calls one: `func(prompts=..., completions=..., completion_ids=..., **columns)`,
every argument a list with one item per completion (a prompt and its columns repeated for each of its
completions), and returns one number per completion, or None where it does not score that one (a completion no
function scores has no advantage). A function that raises, or returns a wrong count, a NaN, an infinity or a value
that is not a number, fails the fit by name (RewardFailed: never retried, it would fail again). torch and numpy
only, no pyspark."""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from estimator.core.numbers import plain
from estimator.failures import FailureKind

SCALES = ("group", "batch", "none")  # scale_rewards: by each group's std (TRL's default), the batch's, or none
STD_EPSILON = 1e-4  # TRL's: advantages / (std + 1e-4)


class RewardFailed(RuntimeError):
    """A reward function raised, or broke its contract, on a rank: it would again on a retry (a usage failure, as a
    train_fn's broken contract is)."""

    failure_kind = FailureKind.USAGE


def reward_name(func: Any) -> str:
    """A reward function's name in the history (`rewards/<name>/mean`), as TRL names it: its __name__."""
    return getattr(func, "__name__", None) or type(func).__name__


@dataclass(frozen=True)
class Rewards:
    """The reward functions with their weights and names (TRL's `reward_funcs`, `reward_weights`)."""

    funcs: Tuple[Callable[..., Any], ...]
    weights: Tuple[float, ...]
    names: Tuple[str, ...]

    @classmethod
    def of(cls, reward_funcs: Any, reward_weights: Optional[Sequence[float]] = None, owner: str = "GRPO") -> "Rewards":
        """Checked by name: callables, and one finite weight for each (default 1.0 each). Names repeated get _2,
        _3 ... after the first, so that each one's metrics keep their own key."""
        funcs = tuple(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else (reward_funcs,)
        if not funcs:
            raise ValueError(f"{owner}(reward_funcs=[]): give one reward function at least, a callable "
                             "f(prompts, completions, **columns) -> one float (or None) per completion.")
        for i, func in enumerate(funcs):
            if not callable(func):
                raise ValueError(f"{owner}(reward_funcs=...): item {i}, {func!r}, is not callable. A reward function "
                                 "takes prompts, completions and the rows' columns as keyword lists and returns one "
                                 "float (or None) per completion.")
        if reward_weights is None:
            weights = (1.0,) * len(funcs)
        else:
            weights = tuple(reward_weights) if isinstance(reward_weights, (list, tuple)) else (reward_weights,)
            bad = [w for w in weights if isinstance(w, bool) or not isinstance(w, numbers.Real)
                   or not math.isfinite(w)]
            if len(weights) != len(funcs) or bad:
                raise ValueError(f"{owner}(reward_weights={reward_weights!r}): one finite number for each of the "
                                 f"{len(funcs)} reward functions, or None (1.0 each).")
            weights = tuple(float(w) for w in weights)
        names: List[str] = []
        seen: Dict[str, int] = {}
        for func in funcs:
            name = reward_name(func)
            seen[name] = seen.get(name, 0) + 1
            names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
        return cls(funcs, weights, tuple(names))

    def check_arguments(self, given: Sequence[str]) -> None:
        """Each function takes the keyword arguments it will be given (`given`: prompts, completions, completion_ids
        and the label columns), by their names or **kwargs, and needs none else; refused by name before any job."""
        for func, name in zip(self.funcs, self.names):
            try:
                params = list(inspect.signature(func).parameters.values())
            except (TypeError, ValueError):  # a builtin or a C function: nothing to read
                continue
            kinds = {p.name: p.kind for p in params}
            if inspect.Parameter.VAR_KEYWORD not in kinds.values():
                extra = [n for n in given if kinds.get(n) not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                                   inspect.Parameter.KEYWORD_ONLY)]
                if extra:
                    raise ValueError(f"The reward function {name!r} takes no {extra}, and every reward function is "
                                     f"given {list(given)} by name (prompts, completions, completion_ids and the "
                                     "label columns): add **kwargs to its parameters.")
            missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in given
                       and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
            if missing:
                raise ValueError(f"The reward function {name!r} needs {missing}, which nothing gives: it is given "
                                 f"{list(given)} by name (prompts, completions, completion_ids and the label "
                                 "columns). Add those columns to label_cols, or give the parameters defaults.")

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
              columns: Dict[str, Sequence[Any]]) -> np.ndarray:
        """(completions, functions) float64 scores, NaN where a function returned None."""
        count = len(completions)
        out = np.empty((count, len(self.funcs)), dtype=np.float64)
        for j, (func, name) in enumerate(zip(self.funcs, self.names)):
            try:
                got = func(prompts=plain(list(prompts)), completions=list(completions),
                           completion_ids=[plain(list(c)) for c in completion_ids],
                           **{k: plain(list(v)) for k, v in columns.items()})  # Python values, as TRL's
            except Exception as exc:  # noqa: BLE001 - the user's function: typed, never retried
                raise RewardFailed(f"The reward function {name!r} raised on a batch of {count} completions (its "
                                   f"first prompt: {clipped(prompts[0] if len(prompts) else '')}): "
                                   f"{type(exc).__name__}: {exc}") from exc
            out[:, j] = checked_scores(got, count, name, prompts)
        return out


def checked_scores(got: Any, count: int, name: str, prompts: Sequence[Any]) -> np.ndarray:
    """A function's scores as floats (None: NaN), refused by name when they are not one number per completion."""
    try:
        values = list(got)
    except TypeError:
        raise RewardFailed(f"The reward function {name!r} returned {type(got).__name__}, not a list, for a batch "
                           f"whose first prompt is {clipped(prompts[0] if len(prompts) else '')}: return one "
                           f"float (or None) per completion ({count} here).") from None
    if len(values) != count:
        raise RewardFailed(f"The reward function {name!r} returned {len(values)} scores for {count} completions "
                           f"(the batch's first prompt: {clipped(prompts[0] if len(prompts) else '')}): return one "
                           "float (or None) per completion, in their order.")
    out = np.empty(count, dtype=np.float64)
    for i, value in enumerate(values):
        if value is None:
            out[i] = np.nan
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, (numbers.Real, np.bool_)):
            raise RewardFailed(f"The reward function {name!r} returned {value!r} ({type(value).__name__}) for "
                               f"completion {i} of the prompt {clipped(prompts[i])}: return a float, or None where "
                               "it does not score a completion.")
        if not math.isfinite(float(value)):
            raise RewardFailed(f"The reward function {name!r} returned {float(value)} for completion {i} of the "
                               f"prompt {clipped(prompts[i])}: return a finite float, or None where it does not "
                               "score a completion.")
        out[i] = float(value)
    return out


def clipped(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def advantages(scores: torch.Tensor, weights: torch.Tensor, group: int, scale: str
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each completion's advantage from its (completions, functions) scores, the completions in groups of `group`
    (one prompt's, consecutive): the weighted sum of its scores (NaN ones left out; NaN where all are), less its
    group's mean, over its group's std (scale 'group') or the batch's ('batch') plus 1e-4, or not scaled ('none');
    0 for a completion no function scores. Returns (advantages, rewards, the std was zero) per completion, as TRL's
    sum_then_normalize."""
    unscored = torch.isnan(scores).all(dim=1)
    rewards = (scores * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscored] = float("nan")
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
    found = rewards - mean
    if scale != "none":
        found = found / (std + STD_EPSILON)
    return torch.nan_to_num(found, nan=0.0), rewards, torch.isclose(std, torch.zeros_like(std))


def nanstd(values: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The standard deviation without NaNs, with Bessel's correction (NaN for fewer than 2 values), as TRL's."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim)
    count = (~torch.isnan(values)).sum(dim=dim).to(values.dtype)
    correction = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(variance, float("nan")))
    return (variance * correction).sqrt()
