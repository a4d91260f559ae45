"""Distributed PyTorch training as a Spark ML Estimator.

The package imports its submodules lazily: Spark's Python workers import `estimator.predict.inference` or
`estimator.launch.spark` to run a task, and should not pay for pyspark.ml (about a second) to do so.
"""
from typing import Any as _Any

__version__ = "0.3.0.dev0"  # the one place the version is written (setup.cfg reads it)
__all__ = ["TorchEstimator", "TorchModel", "TrainContext", "StepContext", "Batch", "DPO", "GRPO", "LanguageModelEvaluator",
           "parameters_on_meta",
           "__version__"]


def __getattr__(name: str) -> _Any:
    if name == "TorchEstimator":
        from estimator.estimator import TorchEstimator

        return TorchEstimator
    if name == "TorchModel":
        from estimator.model import TorchModel

        return TorchModel
    if name == "TrainContext":  # what train_fn receives (help(TrainContext) lists what it holds)
        from estimator.train.train_fn import TrainContext

        return TrainContext
    if name in ("StepContext", "Batch"):  # what train_step receives
        from estimator.train import steps

        return getattr(steps, name)
    if name == "DPO":  # objective=DPO(beta=0.1): preference tuning of a causal LM
        from estimator.train.objectives.preference import DPO

        return DPO
    if name == "GRPO":  # objective=GRPO(reward_funcs=...): reinforcement of a causal LM by rewards
        from estimator.train.objectives.grpo import GRPO

        return GRPO
    if name == "LanguageModelEvaluator":  # perplexity, exactMatch, tokenF1: a Spark ML Evaluator
        from estimator.evaluation import LanguageModelEvaluator

        return LanguageModelEvaluator
    if name == "parameters_on_meta":  # for a model factory whose weights a weights_folder gives
        from estimator.core.meta import parameters_on_meta

        return parameters_on_meta
    raise AttributeError(f"module 'estimator' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + __all__)
