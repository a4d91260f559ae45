import torch
from torch import nn

from estimator.train.objectives.classic import Objective, adapt_target
from estimator.train.sums import split


def test_float_class_labels_are_cast_for_class_index_losses():
    out = torch.randn(4, 3)
    target = torch.tensor([0.0, 2.0, 1.0, 1.0])
    assert adapt_target(nn.CrossEntropyLoss(), out, target).dtype == torch.int64
    assert adapt_target(nn.MSELoss(), torch.randn(4, 1), target).shape == (4, 1)


def test_unweighted_sums_are_row_weighted():
    objective = Objective([nn.MSELoss()], [1.0], [], ["y"], weighted=False)
    out = torch.tensor([[0.0], [1.0], [2.0]])
    target = torch.tensor([0.0, 0.0, 0.0])
    loss, sums = objective((out,), (target,), None)
    assert torch.isclose(loss, torch.tensor(5.0 / 3))
    assert sums[0].item() == 5.0 and sums[1].item() == 3 and sums[2].item() == 3


def test_weighted_loss_is_weighted_mean_of_row_losses():
    """The batch's loss is the weighted sum of its row losses; what it is divided by (the weight of the window's
    batches on every rank) is the PerWeight weighting's: one rank of one batch divides by the batch's weight."""
    from estimator.train.sums import Sums
    from estimator.train.weighting import PerWeight

    objective = Objective([nn.MSELoss()], [1.0], [], ["y"], weighted=True)
    out = torch.tensor([[1.0], [3.0]])
    target = torch.tensor([0.0, 0.0])
    weights = torch.tensor([3.0, 1.0])
    loss, sums = objective((out,), (target,), weights)
    assert torch.isclose(loss, torch.tensor(3 * 1 + 1 * 9.0))
    assert objective.weighting is PerWeight and objective.weight_of(((out,), (target,), weights)).item() == 4.0
    weighting = objective.weighting(1, 1, Sums.of_loss())
    weighting.begin(objective, ((out,), (target,), weights))
    assert torch.isclose(weighting.scale(loss), torch.tensor((3 * 1 + 1 * 9) / 4.0))
    assert sums[0].item() == 12.0 and sums[1].item() == 4.0
    summary = objective.summarize(*split(objective.layout, sums.tolist() * 2, with_val=True))
    assert summary == {"loss": 3.0, "val_loss": 3.0}


def test_several_outputs_combine_losses_with_weights_and_name_metrics_per_label():
    objective = Objective([nn.CrossEntropyLoss(), nn.MSELoss()], [1.0, 0.5], ["accuracy"], ["digit", "big"],
                          weighted=False)
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
    reg = torch.tensor([[1.0], [1.0]])
    loss, sums = objective((logits, reg), (torch.tensor([0, 1]), torch.tensor([1.0, 3.0])), None)
    expected = nn.CrossEntropyLoss()(logits, torch.tensor([0, 1])) + 0.5 * 2.0
    assert torch.isclose(loss, expected)
    names = [name for name, _, _ in objective.metrics]
    assert names == ["digit_accuracy"]  # not for the regression label
