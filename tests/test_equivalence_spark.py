"""Distributed training means what single-process training means: k ranks of batch b take the same steps as
one plain PyTorch loop of batch k*b over the same rows in the same order (shuffle off, no dropout)."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from helpers import MLP, seeded, write_parquet

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_two_ranks_of_batch_b_equal_one_plain_loop_of_batch_2b(spark, store, digits, momentum):
    X, y = digits
    ranks, batch, steps, epochs = 2, 16, 10, 2
    rows = ranks * batch * steps  # each rank's half of the rows is `steps` whole batches
    X, y = X[:rows], y[:rows]
    store.makedirs(store.path("train"))
    for f in range(4):  # several files and row groups: the global order is theirs, concatenated
        part = slice(f * rows // 4, (f + 1) * rows // 4)
        write_parquet(store.path("train", f"part-{f}.parquet"), X[part], y[part], rows_per_group=30)
    model = seeded(MLP)
    fitted = TorchEstimator(num_proc=ranks, store=store, model=model, loss=nn.CrossEntropyLoss(),
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                            feature_cols=["features"], label_cols=["label"], batch_size=batch, epochs=epochs,
                            shuffle=False, random_seed=3, verbose=0).fit_on_parquet("train")

    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=momentum)
    features, labels = torch.from_numpy(X), torch.from_numpy(y)
    half = rows // ranks
    losses = []
    for _ in range(epochs):
        total = 0.0
        for step in range(steps):  # step s: batch s of every rank, together
            idx = np.concatenate([np.arange(r * half + step * batch, r * half + (step + 1) * batch)
                                  for r in range(ranks)])
            optimizer.zero_grad()
            loss = nn.CrossEntropyLoss()(plain(features[idx]), labels[idx])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        losses.append(total / rows)

    trained = fitted.getModel().state_dict()
    for name, value in plain.state_dict().items():
        assert torch.allclose(trained[name], value, atol=1e-5), (name, (trained[name] - value).abs().max())
    assert not torch.allclose(model.state_dict()["net.0.weight"], trained["net.0.weight"])  # it did train
    assert [row["loss"] for row in fitted.getHistory()] == pytest.approx(losses, rel=1e-5)  # exact over rows
