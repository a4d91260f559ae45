"""The objectives the built-in loop knows, in the order they are tried (estimator.train.objectives)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from estimator.train.objectives.lightning import LightningObjective
from estimator.train.objectives.base import own_loop_param
from estimator.train.objectives.classic import Objective
from estimator.train.objectives.grpo import GRPO
from estimator.train.objectives.preference import DPO
from estimator.train.objectives.tokens import TokenObjective
from estimator.train.objectives.step import StepObjective

# In order: the first whose applies(p) is true is the fit's objective (the last applies to every fit).
OBJECTIVES: Dict[str, Any] = {
    "train_step": StepObjective,  # the user's step returns the loss and its metrics
    "lightning": LightningObjective,  # a LightningModule's training_step and logged numbers
    "preference": DPO,  # objective=DPO(...): a causal LM tuned on preference pairs
    "grpo": GRPO,  # objective=GRPO(...): a causal LM reinforced by rewards of its sampled completions
    "tokens": TokenObjective,  # a causal LM's next-token loss over its labelled tokens
    "losses": Objective,  # the loss param's losses and metrics, or the model's own loss from labels=
}


def add_objective(name: str, cls: Any) -> None:
    """`cls` registered ahead of the objectives there are (tried first), in place: one line in a notebook."""
    ahead = {name: cls, **{k: v for k, v in OBJECTIVES.items() if k != name}}
    OBJECTIVES.clear()
    OBJECTIVES.update(ahead)


def choose_objective(p: Mapping[str, Any]) -> Any:
    """The fit's objective class (the `objective` param's instance where that is the one chosen); None for a
    train_fn (its own loop computes its loss). An `objective` param that another objective would override is
    refused by name."""
    given = p.get("objective")
    if p.get("train_fn") is not None:
        chosen = None
    else:
        chosen = next(cls for cls in OBJECTIVES.values() if cls.applies(p))
    if given is None:
        return chosen
    if chosen is None or not isinstance(given, chosen):
        overriding = own_loop_param(p)
        raise ValueError(f"objective={given!r} is what the built-in loop trains with, and "
                         + (f"{overriding} is set too: leave {overriding} unset." if overriding else
                            f"the {'model' if p.get('tokenizer') is not None else 'fit'} cannot take it: it "
                            "tunes a causal LM that generates (AutoModelForCausalLM, or its factory) with its "
                            "tokenizer."))
    return given
