"""Distributed PyTorch training as a Spark ML Estimator."""
from estimator.estimator import TorchEstimator
from estimator.model import TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
