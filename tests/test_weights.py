"""A model built by a factory saved as safetensors (or Hugging Face's folder) with its optimizer, through fsspec
(memory:// stands in for a remote store: the writers' local files are copied there), and loaded back equal."""
import functools
import json

import fsspec
import pytest
import torch
from torch import nn

from estimator.predict.weights import load_module, save_module, save_pretrained_to
from helpers import MLP, pretrained_mlp, seeded


def trained(model, optimizer, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
    return model, optimizer


@pytest.fixture
def memory():
    fs = fsspec.filesystem("memory")
    root = "/weights-test"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_a_factory_model_saves_as_safetensors_and_rebuilds_through_its_factory(tmp_path, memory):
    fs, root = memory
    path = str(tmp_path / "mlp.pt")
    torch.save(seeded(MLP).state_dict(), path)
    factory = functools.partial(pretrained_mlp, path)
    model = factory()
    model, optimizer = trained(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    save_module(model, optimizer, None, fs, root)
    assert json.loads(fs.cat(root + "/module.json"))["format"] == "safetensors"
    assert fs.cat(root + "/model.safetensors")[:8] != b"PK\x03\x04\x00\x00\x08\x08"  # not a torch.save zip
    loaded, restored = load_module(fs, root, factory)
    assert not loaded.training
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert type(restored) is torch.optim.AdamW and restored.param_groups[0]["lr"] == 0.01
    assert [p is q for p, q in zip(restored.param_groups[0]["params"], loaded.parameters())] == [True] * 4
    for a, b in zip(restored.state_dict()["state"].values(), optimizer.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and a["step"] == b["step"]
    assert len(open(path + ".calls").read().split()) == 2  # built once for training, once to load
    with pytest.raises(ValueError, match="not the factory"):
        load_module(fs, root, None)


def meta_mlp():
    from estimator import parameters_on_meta

    with parameters_on_meta():
        return MLP()


def test_a_model_whose_factory_builds_on_the_meta_device_loads_with_the_saved_weights(memory):
    """A weights_folder fit's TorchModel: its factory builds on the meta device, and the saved weights fill it."""
    fs, root = memory
    model = seeded(MLP)
    save_module(model, None, None, fs, root)
    loaded, restored = load_module(fs, root, meta_mlp)
    assert restored is None and all(not t.is_meta for t in loaded.state_dict().values())
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


class Tied(nn.Module):
    """An embedding and an output layer sharing one matrix (as language models tie them)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(self.embed(ids))


def test_tied_weights_are_stored_once_and_stay_tied(memory):
    fs, root = memory
    model = seeded(Tied)
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    save_module(model, None, None, fs, root)
    loaded, optimizer = load_module(fs, root, Tied)
    assert optimizer is None
    assert loaded.out.weight is loaded.embed.weight and torch.equal(loaded.embed.weight, model.embed.weight)


class Stored:
    """A run's trained state as estimator.train.checkpoint.RunState maps it: the model's tensors, the optimizer's
    state (by parameter name here, as fsdp's shards hold it)."""

    key = "stored"

    def __init__(self, tensors, optimizer_state):
        self.tensors, self.optimizer_state = tensors, optimizer_state

    def mapped(self, optimizer=True):
        return self.tensors, self.optimizer_state if optimizer else None


def test_a_full_fine_tunes_state_is_saved_from_its_tensors_without_building_the_model(memory):
    """A full fine-tune held as a handle: save writes the run's tensors for the skeleton (a tied matrix saved
    under either name, a dtype cast to the skeleton's, the optimizer's state by name put in the driver's
    optimizer's order), and the load is the trained model and optimizer; other names or shapes: None (the
    model is then built whole)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from estimator import parameters_on_meta
    from estimator.core.handle import ModelHandle

    fs, root = memory
    model = seeded(Tied)
    model.head = nn.Linear(20, 3)
    optimizer = torch.optim.AdamW([{"params": model.head.parameters()}, {"params": [model.embed.weight],
                                                                          "lr": 0.5}], lr=0.01)
    torch.manual_seed(1)
    for _ in range(3):
        optimizer.zero_grad()
        model.head(model(torch.randint(0, 20, (4, 5)))).square().mean().backward()
        optimizer.step()
    with parameters_on_meta():
        skeleton = Tied()
        skeleton.head = nn.Linear(20, 3)
    driver = torch.optim.AdamW([{"params": skeleton.head.parameters()}, {"params": [skeleton.embed.weight],
                                                                          "lr": 0.5}], lr=0.01)
    tensors = {k: v.to(torch.bfloat16) if k == "head.bias" else v for k, v in model.state_dict().items()
               if k != "embed.weight"}  # the tied matrix under its other name; one tensor in another dtype
    handle = ModelHandle(Tied, None, b"", stored=Stored(tensors, get_optimizer_state_dict(model, optimizer)))
    state = handle.mapped(skeleton, driver)
    assert state is not None and state[0]["head.bias"].dtype == torch.float32
    save_module(skeleton, driver, None, fs, root, state=state)

    def factory():
        built = Tied()
        built.head = nn.Linear(20, 3)
        return built

    loaded, restored = load_module(fs, root, factory)
    assert loaded.out.weight is loaded.embed.weight and torch.equal(loaded.embed.weight, model.embed.weight)
    assert torch.equal(loaded.head.weight, model.head.weight)
    assert torch.equal(loaded.head.bias, model.head.bias.to(torch.bfloat16).float())
    assert [g["lr"] for g in restored.param_groups] == [0.01, 0.5]
    for a, b in zip(restored.state_dict()["state"].values(), optimizer.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and a["step"] == b["step"]
    assert restored.state[loaded.embed.weight]["exp_avg"].shape == (20, 8)

    other = {**tensors, "head.bias": torch.zeros(4)}
    assert ModelHandle(Tied, None, b"", stored=Stored(other, None)).mapped(skeleton, None) is None
    assert ModelHandle(Tied, None, b"", stored=Stored({**tensors, "extra": torch.zeros(1)}, None)).mapped(
        skeleton, None) is None


def test_a_hugging_face_model_saves_its_own_folder_with_the_tokenizer(tmp_path, memory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from text_helpers import save_pretrained_bert, topic_texts

    fs, root = memory
    texts = [t for t, _ in topic_texts(50)]
    folder = save_pretrained_bert(str(tmp_path / "bert"), texts)
    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    model, optimizer = model.train(), torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer.zero_grad()
    model(**tokenizer(texts[:4], padding=True, return_tensors="pt"), labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    optimizer.step()
    model.eval()
    save_module(model, optimizer, tokenizer, fs, root)
    assert json.loads(fs.cat(root + "/module.json"))["class"].endswith(":BertForSequenceClassification")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.rsplit("/", 1)[1] for p in fs.find(root)}
    loaded, restored = load_module(fs, root, None)  # no factory needed, nor the folder it read
    encoded = tokenizer(texts[:6], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(loaded(**encoded).logits, model(**encoded).logits, atol=1e-6)
    assert restored.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()

    save_pretrained_to(model, tokenizer, "memory:///weights-test/hf")  # a store URL
    assert fs.exists(root + "/hf/config.json") and fs.exists(root + "/hf/tokenizer_config.json")
    with pytest.raises(TypeError, match="MLP, not a transformers PreTrainedModel: save it with TorchModel.save"):
        save_pretrained_to(MLP(), None, str(tmp_path / "no"))


def test_a_full_fine_tune_saved_at_a_remote_url_is_held_and_its_weights_read_where_it_is_built(tmp_path, memory,
                                                                                                monkeypatch):
    """A Hugging Face folder at a remote URL (memory:// here): the load reads its config and the weights' headers
    only (the copy's safetensors a hole, no byte of the weights stored); the handle is small and builds the saved
    model where it is called, from one copy a machine; a folder saved over is another key; the optimizer's state
    is read from the remote file."""
    import os
    import pickle

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from estimator.core.meta import meta_tensors
    from estimator.predict import folders
    from estimator.predict.weights import held_saved
    from text_helpers import save_pretrained_bert, topic_texts

    (tmp_path / "machine").mkdir()
    monkeypatch.setattr(folders.tempfile, "tempdir", str(tmp_path / "machine"))  # this machine's temporary folder
    fs, root = memory
    texts = [t for t, _ in topic_texts(20)]
    folder = save_pretrained_bert(str(tmp_path / "bert"), texts)
    model = AutoModelForSequenceClassification.from_pretrained(folder).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model(**tokenizer(texts[:4], padding=True, return_tensors="pt"), labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    optimizer.step()
    save_module(model.eval(), optimizer, tokenizer, fs, root)

    read = []
    monkeypatch.setattr(fs, "get_file", lambda path, *a, **k: read.append(path) or type(fs).get_file(fs, path, *a, **k))
    skeleton, driver_optimizer, handle = held_saved(fs, root)
    assert meta_tensors(skeleton) and repr(handle.factory).startswith("RemoteFolder('memory:///weights-test/")
    assert not [p for p in read if p.endswith((".safetensors", "optimizer.pt"))], read  # headers and groups only
    copies = str(tmp_path / "machine" / folders.FOLDERS)
    [shapes] = [os.path.join(copies, d) for d in os.listdir(copies) if d.endswith("-shapes")]
    weights = os.stat(os.path.join(shapes, "model.safetensors"))
    assert weights.st_size == fs.size(root + "/pretrained/model.safetensors") > 100_000
    assert weights.st_blocks * 512 <= 16_384, weights  # a header's blocks: the rest a hole
    assert len(pickle.dumps(handle)) < 20_000  # what transform sends
    assert driver_optimizer.param_groups[0]["lr"] == 0.01 and not driver_optimizer.state

    built, restored = handle.built_with(driver_optimizer, skeleton)
    encoded = tokenizer(texts[:6], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(built(**encoded).logits, model(**encoded).logits)
    assert torch.equal(restored.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert len(os.listdir(copies)) == 4  # two copies (shapes, weights) and their locks: built again, none more
    handle.build()
    assert len(os.listdir(copies)) == 4
    tensors, state = handle.mapped(skeleton, driver_optimizer)  # save again: the copy's tensors, mapped
    assert torch.equal(tensors["classifier.weight"], model.classifier.weight.detach())

    with torch.no_grad():
        model.classifier.weight.add_(1.0)
    save_module(model, optimizer, tokenizer, fs, root)  # saved over: another model for the executors' cache
    before = set(os.listdir(copies))
    again = held_saved(fs, root)[2]
    assert again.key != handle.key
    with torch.no_grad():
        assert torch.equal(again.build()(**encoded).logits, model(**encoded).logits)
    after = set(os.listdir(copies))  # the new version's two copies in place of the earlier ones
    assert len(after) == 4 and not after & before, (before, after)
    assert handle.factory.without_credentials().fs is None
    fs.rm(root + "/optimizer_groups.pt")  # a save of before that file: the groups read from optimizer.pt
    assert held_saved(fs, root)[1].param_groups[0]["lr"] == 0.01 and any(p.endswith("optimizer.pt") for p in read)


def test_a_standalone_saves_base_at_a_remote_url_is_read_where_the_model_is_built(tmp_path, memory, monkeypatch):
    """write().option('standalone') at a remote URL: the load's factory is the remote base folder, whose skeleton
    reads no weight, and which builds the saved base where it is called."""
    import os

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from estimator.core.meta import meta_tensors
    from estimator.core.recipe import ModelRecipe
    from estimator.predict import folders
    from estimator.predict.weights import standalone_base
    from lm_helpers import color_facts, save_pretrained_llama

    (tmp_path / "machine").mkdir()
    monkeypatch.setattr(folders.tempfile, "tempdir", str(tmp_path / "machine"))  # this machine's temporary folder
    fs, root = memory
    path = save_pretrained_llama(str(tmp_path / "tiny"), [p + r for p, r in color_facts()])
    config = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    save_module(get_peft_model(AutoModelForCausalLM.from_pretrained(path), config), None, None, fs, root,
                standalone=True)
    base = standalone_base(fs, root)
    assert isinstance(base, folders.RemoteFolder)
    assert meta_tensors(ModelRecipe(base, config).build(on_meta=True))
    assert os.listdir(tmp_path / "machine" / folders.FOLDERS) and all(
        d.endswith(("-shapes", ".lock")) for d in os.listdir(tmp_path / "machine" / folders.FOLDERS))
    built, plain = base(), AutoModelForCausalLM.from_pretrained(path)
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), plain.state_dict().values()))


def test_a_saved_optimizer_is_mapped_at_load_and_read_whole_where_its_file_cannot_be_mapped(tmp_path, monkeypatch):
    """load maps optimizer.pt (AdamW's state is twice the weights); a mount that cannot map a file (some FUSE
    ones) has it read whole, the same state."""
    fs = fsspec.filesystem("file")
    model = seeded(MLP)
    model, optimizer = trained(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    save_module(model, optimizer, None, fs, str(tmp_path))
    calls, load = [], torch.load

    def mapped_or_not(*args, **kwargs):
        calls.append(bool(kwargs.get("mmap")))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", mapped_or_not)
    first = load_module(fs, str(tmp_path), MLP)[1]
    assert calls == [True]

    def unmappable(*args, **kwargs):
        if kwargs.get("mmap"):
            raise RuntimeError("mmap is not supported on this file system")
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", unmappable)
    second = load_module(fs, str(tmp_path), MLP)[1]
    for a, b in zip(first.state_dict()["state"].values(), second.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert second.state_dict()["state"] and len(second.state_dict()["state"]) == len(first.state_dict()["state"])


def test_an_optimizer_whose_class_cannot_be_imported_here_is_left_out_with_a_warning(tmp_path, caplog):
    """A model saved with an optimizer of a class defined where it was saved (a notebook's cell) loads here
    without it, saying so: the weights-only load (the model built here) and the held load of a Hugging Face
    folder (a handle) alike; getOptimizer() is then None."""
    import logging

    from transformers import AutoModelForSequenceClassification

    from estimator.predict.weights import OPTIMIZER_FILE, OPTIMIZER_GROUPS_FILE, held_saved
    from text_helpers import save_pretrained_bert, topic_texts

    fs = fsspec.filesystem("file")
    bert = AutoModelForSequenceClassification.from_pretrained(
        save_pretrained_bert(str(tmp_path / "bert"), [t for t, _ in topic_texts(20)]))
    cases = {"safetensors": (seeded(MLP), str(tmp_path / "mlp")), "hugging_face": (bert, str(tmp_path / "hf"))}
    for kind, (model, root) in cases.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        fs.makedirs(root)  # as the model's writer made it (Spark ML's metadata first)
        save_module(model, optimizer, None, fs, root)
        for name in (OPTIMIZER_FILE, OPTIMIZER_GROUPS_FILE):  # a class of the saving notebook's, in both files
            path = f"{root}/{name}"
            saved = torch.load(path, weights_only=True)
            saved["class"] = "notebook_cell_7:MyAdam"
            torch.save(saved, path)
        with caplog.at_level(logging.WARNING, logger="estimator"):
            caplog.clear()
            if kind == "safetensors":
                loaded, restored = load_module(fs, root, functools.partial(seeded, MLP))
                assert restored is None and isinstance(loaded, MLP)
            else:
                skeleton, restored, handle = held_saved(fs, root)
                assert restored is None and handle.stored.optimizer is None
        assert "optimizer class notebook_cell_7:MyAdam cannot be imported here" in caplog.text, kind
        assert "getOptimizer() is None" in caplog.text
