"""gradient_checkpointing on a module that is not a Hugging Face model: each item of its nn.ModuleList recomputed
in backward, all of it (True) or selectively ('selective'), with the gradients of the run that kept everything;
a module without such units refused by name. Torch only."""
import copy

import pytest
import torch
from torch import nn

from estimator.train.memory import checkpoint_activations
from helpers import BlockMLP


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_each_unit_recomputed_all_or_selectively_gives_the_gradients_kept_activations_give(autocast):
    torch.manual_seed(0)
    model, x = BlockMLP(64, 128, 4, 10), torch.randn(32, 64)
    got = {}
    for mode in (False, True, "selective"):
        trained = copy.deepcopy(model)
        if mode:
            assert checkpoint_activations(trained, None, mode) == "4 units" + (", selective" if mode == "selective" else "")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = trained(x).float().square().mean()
        loss.backward()
        got[mode] = loss.detach(), {n: p.grad for n, p in trained.named_parameters()}
    for mode in (True, "selective"):
        assert torch.equal(got[mode][0], got[False][0])
        for name, grad in got[False][1].items():
            assert torch.equal(got[mode][1][name], grad), (mode, name)


def test_a_module_without_units_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"gradient_checkpointing='selective' recomputes activations unit by unit, "
                                         r"and Sequential has no unit: .* Put its blocks in an nn.ModuleList"):
        checkpoint_activations(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), None, "selective")


def test_a_module_without_units_is_refused_by_the_fits_checks_before_any_job():
    """A wheel trial's MLP with gradient_checkpointing=True was refused on the ranks, after the table was written;
    the driver has the model, and refuses it with the same words."""
    from estimator.fit.checks import check_params
    from estimator.train.objectives.registry import choose_objective
    from test_outputs import estimator_params

    p = {**dict(estimator_params()), "model": nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "loss": nn.MSELoss(),
         "gradient_checkpointing": True}
    with pytest.raises(ValueError, match=r"gradient_checkpointing=True recomputes .* Sequential has no unit"):
        check_params(p, choose_objective(p))
    p["model"] = BlockMLP(4, 8, 2, 2)
    check_params(p, choose_objective(p))


def test_selective_units_compiled_give_the_gradients_of_the_eager_module():
    """Under torch.compile the checkpoint takes the selective policy's two modes as they are (compile refuses any
    other context), and the compiled module's gradients are the eager one's."""
    torch.manual_seed(0)
    model, x = BlockMLP(32, 64, 2, 4), torch.randn(16, 32)
    got = []
    for compiled in (False, True):
        trained = copy.deepcopy(model)
        checkpoint_activations(trained, None, "selective")
        run = torch.compile(trained, backend="aot_eager") if compiled else trained
        loss = run(x).square().mean()
        loss.backward()
        got.append({n: p.grad for n, p in trained.named_parameters()})
    for name, grad in got[0].items():
        assert torch.allclose(got[1][name], grad, atol=1e-6), name
