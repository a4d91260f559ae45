"""model= a zero-argument callable and optimizer= a callable(params): the ranks build both, the launch spec
carries the recipes (never the weights), and the training is the same as with the instances."""
import functools
import io
import os
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from estimator.core.pickling import NotAnOptimizer, dumps, optimizer_from_factory, user_objects
from estimator.fit.recipes import check_optimizer, model_of
from estimator.launch.local import LocalLauncher
from helpers import MLP, make_spec, metrics, pretrained_mlp, seeded


def saved(tmp_path, hidden=32):
    path = str(tmp_path / f"mlp{hidden}.pt")
    torch.save(seeded(MLP, 64, hidden, 10).state_dict(), path)
    return path


def test_a_factory_travels_instead_of_its_weights(tmp_path):
    path = saved(tmp_path, hidden=4096)  # 300k parameters, 1.2 MB of weights
    factory = functools.partial(pretrained_mlp, path, 4096)
    model, got = model_of(factory)
    assert got is factory and isinstance(model, MLP)
    optimizer = functools.partial(torch.optim.AdamW, lr=2e-5, weight_decay=0.01)
    by_factory = dumps(user_objects(model, optimizer, [nn.CrossEntropyLoss()], [1.0], [], model_factory=factory),
                       "model", roots=[factory])
    by_instance = dumps(user_objects(model, torch.optim.AdamW(model.parameters()), [nn.CrossEntropyLoss()], [1.0],
                                     []), "model", roots=[model])
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert len(by_instance) > weights > 1_000_000 and len(by_factory) < 20_000, (len(by_factory), weights)
    objs = pickle.loads(by_factory)  # as a rank unpickles it: no model until the factory builds one
    assert objs.model is None
    built = objs.module()
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), model.state_dict().values()))


def test_the_model_and_optimizer_recipes_are_checked_on_the_driver_by_name():
    with pytest.raises(ValueError, match=r"'model' parameter of TorchEstimator is a callable.*raised OSError: gone"):
        model_of(lambda: (_ for _ in ()).throw(OSError("gone")))
    with pytest.raises(TypeError, match=r"'model'.*returned dict"):
        model_of(lambda: {"weights": 1})
    model = MLP()
    check_optimizer(functools.partial(torch.optim.SGD, lr=0.1), model, None)
    with pytest.raises(NotAnOptimizer, match=r"returned list, not a torch.optim.Optimizer.*functools.partial"):
        check_optimizer(lambda params: list(params), model, None)
    with pytest.raises(ValueError, match=r"'optimizer'.*raised TypeError"):
        check_optimizer(functools.partial(torch.optim.SGD, lr=0.1, no_such_option=1), model, None)


def test_an_optimizer_callable_gets_the_lr_param_and_python_numbers():
    optimizer = optimizer_from_factory(functools.partial(torch.optim.Adam, lr=np.float64(0.01),
                                                         betas=(np.float64(0.8), 0.9)), MLP(), lr=None)
    group = optimizer.param_groups[0]
    assert type(group["lr"]) is float and group["lr"] == 0.01 and all(type(b) is float for b in group["betas"])
    assert optimizer_from_factory(torch.optim.Adam, MLP(), lr=0.5).param_groups[0]["lr"] == 0.5


def test_two_ranks_built_from_recipes_train_what_the_instances_train(store, digits, tmp_path):
    """The same initial weights (the factory loads them; the instance is seeded alike), the same Adam: the same
    checkpoint, and the factory ran once on each rank's own process (numpy hyperparameters included)."""
    path = saved(tmp_path)
    model = seeded(MLP)
    instance = make_spec(store, digits, model, torch.optim.Adam(model.parameters(), lr=np.float64(0.01)),
                         train_rows=1001, val_rows=151, run="instance")
    factory = functools.partial(pretrained_mlp, path)
    built, _ = model_of(factory)
    recipe = make_spec(store, digits, built, functools.partial(torch.optim.Adam, lr=np.float64(0.01)),
                       train_rows=1001, val_rows=151, run="recipe", model_factory=factory)
    assert len(recipe.payload) < len(instance.payload)
    a, b = LocalLauncher().run(instance, 2), LocalLauncher().run(recipe, 2)
    assert len(a[0].history) == len(b[0].history) == 2
    for x, y in zip(a[0].history, b[0].history):
        assert metrics(x) == pytest.approx(metrics(y), rel=1e-6)
    load = lambda run: torch.load(io.BytesIO(store.read_bytes(store.run(run).checkpoint)), weights_only=True)  # noqa: E731
    first, second = load("instance"), load("recipe")
    for key, value in first["model"].items():
        assert torch.allclose(value, second["model"][key], atol=1e-6), key
    pids = [int(line) for line in open(path + ".calls").read().split()]
    assert len(pids) == 3 and pids[0] == os.getpid() and len(set(pids[1:])) == 2 and os.getpid() not in pids[1:]


def test_a_factory_that_builds_on_the_meta_device_is_refused_by_name():
    def on_meta():
        with torch.device("meta"):
            return MLP()

    with pytest.raises(ValueError, match=r"built a module on the meta device \(no weights: net.0.weight, net.0.bias, "
                                         r"net.2.weight \.\.\.\); building on the meta device .* not served yet"):
        model_of(on_meta)
