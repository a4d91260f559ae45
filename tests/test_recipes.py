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


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.out = nn.Linear(6, 12, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(4), persistent=False)

    def forward(self, x):
        return self.out(self.embed(x))


def on_meta(build, shared_buffers=True):
    from estimator import parameters_on_meta

    with parameters_on_meta() if shared_buffers else torch.device("meta"):
        return build()


def test_a_factory_on_the_meta_device_is_read_from_its_folder_or_refused_by_name(tmp_path):
    """model_of reads what the factory left on the meta device whole (the driver's copy); what is not there, or of
    another shape, or not readable at all, is refused before any job with the names and the fix."""
    from safetensors.torch import save_file, save_model

    folder = tmp_path / "tied"
    folder.mkdir()
    source = seeded(Tied)
    save_model(source, str(folder / "model.safetensors"))  # the tied weight once, under one of its names
    built, _ = model_of(functools.partial(on_meta, Tied), str(folder))
    assert built.out.weight is built.embed.weight and torch.equal(built.embed.weight, source.embed.weight)
    assert torch.equal(built.positions, torch.arange(4))
    mlp = tmp_path / "mlp"
    mlp.mkdir()
    save_file({k: v for k, v in MLP().state_dict().items() if k != "net.2.bias"}, str(mlp / "a.safetensors"))
    save_file({"net.2.bias": torch.zeros(5)}, str(mlp / "b.safetensors"))
    empty = tmp_path / "empty"
    empty.mkdir()
    refusals = [
        (functools.partial(on_meta, MLP), None, r"has 4 weights on the meta device \(no values: net.0.weight, "
         r"net.0.bias, net.2.weight \.\.\.\): name the folder of .safetensors files holding them with weights_folder"),
        (functools.partial(on_meta, Tied, False), str(folder), r"buffers on the meta device that no weights file "
         r"holds \(non-persistent: positions\).* estimator.parameters_on_meta\(\)"),
        (MLP, str(folder), r"names the weights of what the model factory leaves on the meta device, and the model it "
         r"built has every weight: drop weights_folder"),
        (functools.partial(on_meta, MLP), str(folder), r"4 weights the model leaves on the meta device are not in "
         r".*: net.0.weight, net.0.bias, net.2.weight, net.2.bias\. Build those with values"),
        (functools.partial(on_meta, MLP), str(mlp), r"do not have the model's shapes: net.2.bias \(5,\) in the folder, "
         r"\(10,\) in the model"),
        (functools.partial(on_meta, MLP), "s3://bucket/weights", r"must be a folder of .safetensors files on the "
         r"driver's and every executor's file system"),
        (functools.partial(on_meta, MLP), str(empty), r"holds no .safetensors files"),
        (on_meta(MLP), None, r"is a module on the meta device \(no weights\): give the callable that builds it"),
    ]
    for model, weights, message in refusals:
        with pytest.raises(ValueError, match=message):
            model_of(model, weights)


def test_a_base_models_folder_fills_a_model_with_a_head_as_from_pretrained_reads_it(tmp_path):
    """transformers' base_model_prefix, as from_pretrained applies it: a BertModel's folder (encoder...) fills a
    BertForSequenceClassification built on the meta device (bert.encoder...) whose new head is built with values;
    a BertForMaskedLM's folder (bert..., cls...) fills a BertModel. The weights read are from_pretrained's; a head
    left on the meta device is refused by name."""
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel

    from estimator import parameters_on_meta

    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(tmp_path / "base")
    BertForMaskedLM(config).save_pretrained(tmp_path / "mlm")

    def classifier():
        with parameters_on_meta():
            model = BertForSequenceClassification(config)
        model.classifier = nn.Linear(16, 2)  # a new head, with values
        return model

    built, _ = model_of(classifier, str(tmp_path / "base"))
    reference = BertForSequenceClassification.from_pretrained(tmp_path / "base").bert.state_dict()
    assert set(built.bert.state_dict()) == set(reference)
    for name, value in reference.items():
        assert torch.equal(built.bert.state_dict()[name], value), name
    base, _ = model_of(functools.partial(on_meta, functools.partial(BertModel, config, add_pooling_layer=False)),
                       str(tmp_path / "mlm"))
    for name, value in BertModel.from_pretrained(tmp_path / "mlm", add_pooling_layer=False).state_dict().items():
        assert torch.equal(base.state_dict()[name], value), name
    with pytest.raises(ValueError, match=r"2 weights the model leaves on the meta device are not in .*: "
                                         r"classifier.weight, classifier.bias\. Build those with values"):
        model_of(functools.partial(on_meta, functools.partial(BertForSequenceClassification, config)),
                 str(tmp_path / "base"))


def test_parameters_on_meta_in_one_thread_leaves_the_modules_other_threads_build_and_ends_whole():
    """Fits of a grid build their skeletons side by side (estimator.fit.grid): a thread inside parameters_on_meta
    puts only its own modules' parameters on meta, and when every thread has left, register_parameter is
    nn.Module's own (before, two overlapping blocks could leave it patched: every later model on meta)."""
    import threading

    from estimator.core.meta import parameters_on_meta

    original, inside, left = nn.Module.register_parameter, threading.Event(), threading.Event()
    built = {}

    def on_meta():
        with parameters_on_meta():
            built["first"] = nn.Linear(2, 2)
            inside.set()
            left.wait(10)  # the other thread enters and builds while this one is inside
        built["after"] = nn.Linear(2, 2)

    thread = threading.Thread(target=on_meta)
    thread.start()
    inside.wait(10)
    plain = nn.Linear(2, 2)  # this thread, outside any block
    with parameters_on_meta():
        second = nn.Linear(2, 2)
        left.set()
        thread.join(10)
    assert built["first"].weight.is_meta and second.weight.is_meta
    assert not plain.weight.is_meta and not built["after"].weight.is_meta
    assert nn.Module.register_parameter is original and not nn.Linear(2, 2).weight.is_meta
