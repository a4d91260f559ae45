"""Models and data helpers for the tests. This module exists only on the driver (it is not
installed), so every model here also exercises pickling of driver-only classes by value."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, inputs: int = 64, hidden: int = 32, outputs: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))

    def forward(self, x):
        return self.net(x)


class BreakingMLP(MLP):
    """A graph break in forward: torch.compile(fullgraph=True) refuses it, so the refusal shows compile ran."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return super().forward(x)


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class BlockMLP(nn.Module):
    """An MLP of residual blocks in an nn.ModuleList: the shape strategy='fsdp' shards block by block."""

    def __init__(self, inputs: int = 64, width: int = 48, blocks: int = 4, outputs: int = 10):
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList([Residual(width) for _ in range(blocks)])
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 10))

    def forward(self, x):
        return self.head(self.conv(x))


class TwoInputs(nn.Module):
    """forward(pixels, bias): two feature columns map to two forward() arguments in order."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(64, 10)
        self.scale = nn.Linear(1, 10)

    def forward(self, pixels, extra):
        return self.body(pixels) + self.scale(extra.reshape(-1, 1))


class TwoOutputs(nn.Module):
    """A digit classifier head and a regression head ('is the digit >= 5', as a float)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.classes = nn.Linear(32, 10)
        self.big = nn.Linear(32, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.classes(h), self.big(h)


def pretrained_mlp(path, hidden=32):
    """A "pretrained" MLP: built, then its weights loaded from `path` (as from_pretrained does); each call appends
    the calling process's id to `path + '.calls'`."""
    with open(path + ".calls", "a") as calls:
        calls.write(f"{os.getpid()}\n")
    model = MLP(64, hidden, 10)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model


def write_parquet(path: str, features: np.ndarray, labels: np.ndarray, rows_per_group: int) -> None:
    table = pa.table({"features": pa.array(list(features)), "label": pa.array(labels)})
    pq.write_table(table, path, row_group_size=rows_per_group)


def seeded(model_cls, *args, seed: int = 0):
    torch.manual_seed(seed)
    return model_cls(*args)


def make_spec(store, digits, model, optimizer, *, train_rows, val_rows, batch=64, epochs=2, run="r", losses=None,
              model_factory=None, weights_folder=None, metrics=("accuracy",), train_fn=None, **spec_fields):
    """A TrainSpec over digits written as Parquet into `store` (for LocalLauncher tests, no Spark)."""
    from torch import nn

    from estimator.core.pickling import dumps, user_objects
    from estimator.core.spec import DataSpec, TrainSpec
    from estimator.data.parquet import list_pieces
    from estimator.train.objectives.classic import Objective

    X, y = digits
    store.makedirs(store.path("train"))
    store.makedirs(store.path("val"))
    write_parquet(store.path("train", "part.parquet"), X[:train_rows], y[:train_rows], rows_per_group=300)
    write_parquet(store.path("val", "part.parquet"), X[-val_rows:], y[-val_rows:], rows_per_group=40)
    data = DataSpec(store, list_pieces(store, store.path("train")), list_pieces(store, store.path("val")),
                    ("features",), ("label",))
    chosen = dict(objective=Objective) if train_fn is None else dict(objective=None, train_fn=train_fn)
    objs = user_objects(model, optimizer, losses or [nn.CrossEntropyLoss()], [1.0], list(metrics),
                        model_factory=model_factory, weights_folder=weights_folder, **chosen)
    return TrainSpec(data, dumps(objs, "model", roots=[model_factory or model]), store.run(run), batch, 50, epochs,
                     seed=3, **spec_fields)


TIMING_KEYS = ("data_wait",)  # history keys that measure time, not the model: they differ between equal runs


def metrics(row):
    """A history row without its timing keys."""
    return {k: v for k, v in row.items() if k not in TIMING_KEYS}


class RecordingSGD(torch.optim.SGD):
    """SGD that appends the global gradient norm of every step to the file `RecordingSGD.path` (the class
    travels to the rank pickled by value: a file is what the test and the rank share)."""

    path = None

    def step(self, closure=None):
        grads = [p.grad.detach().flatten() for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        with open(self.path, "a") as record:
            record.write(f"{float(torch.cat(grads).norm())}\n")
        return super().step(closure)


def source_copy(root, dest):
    """The checkout's files as git sees them (tracked, and untracked but not ignored), copied to `dest`: a build
    there sees no egg-info or build/ folder left by earlier builds. Without git, the tree less those folders."""
    import os
    import shutil
    import subprocess

    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True)
    if listed.returncode != 0:
        ignore = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".venv*", ".cache", ".git")
        shutil.copytree(root, dest, ignore=ignore, dirs_exist_ok=True)
        return str(dest)
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = os.path.join(root, name)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(dest, name))
    return str(dest)
