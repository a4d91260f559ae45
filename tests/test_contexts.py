"""What users' own loops receive, importable from `estimator`, with help text and misspelling hints (no Spark)."""
import pytest
import torch

import estimator
from estimator import Batch, StepContext, TrainContext


def test_the_contexts_are_public_and_say_what_they_hold():
    assert {"TrainContext", "StepContext", "Batch"} <= set(estimator.__all__) <= set(dir(estimator))
    for cls, names in ((TrainContext, ("train_batches()", "report(metrics", "keep(name, obj)", "should_stop")),
                       (StepContext, ("batch_idx", "global_step", "training")),
                       (Batch, ("features", "labels", "weights", 'batch["column"]'))):
        assert all(name in cls.__doc__ for name in names), cls


def test_a_misspelt_attribute_lists_the_names_there_are():
    batch = Batch([torch.zeros(2)], [torch.ones(2)], None, {"x": torch.zeros(2), "y": torch.ones(2)})
    with pytest.raises(AttributeError, match=r"Batch has no attribute 'lables'. Did you mean 'labels'\? It has: "
                                             r"columns, features, labels, rows, weights."):
        batch.lables
    with pytest.raises(KeyError, match="The batch has no column 'z'; it has x, y"):
        batch["z"]
    ctx = StepContext(0, 2, torch.device("cpu"), 1, True)
    with pytest.raises(AttributeError, match=r"Did you mean 'epoch'\? It has: batch_idx, device, epoch"):
        ctx.epochs
    assert ctx.world_size == 2 and batch.rows == 2
