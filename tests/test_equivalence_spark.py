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


@pytest.mark.parametrize("every", [1, 2])
def test_two_ranks_with_sample_weights_equal_one_plain_loop_of_the_weighted_mean_over_2b_rows(spark, store, digits,
                                                                                             every):
    """With sample_weight_col each rank's batch carries its own total weight: the gradient is the weighted mean over
    the rows of every rank's batch (of the accumulation window's batches with backward_passes_per_step), as one
    process computes it, not the mean of the ranks' weighted means (which weighs a light batch as much as a heavy
    one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    X, y = digits
    ranks, batch, steps, epochs = 2, 16, 8, 2
    rows = ranks * batch * steps
    X, y = X[:rows], y[:rows]
    w = np.random.default_rng(7).uniform(0.05, 3.0, rows).astype(np.float32)
    w[: rows // 2] *= 0.2  # rank 0's half is much lighter than rank 1's: the ranks' weighted means differ
    store.makedirs(store.path("train"))
    pq.write_table(pa.table({"features": pa.array(list(X)), "label": pa.array(y), "w": pa.array(w)}),
                   store.path("train", "part-0.parquet"), row_group_size=40)
    model = seeded(MLP)
    fitted = TorchEstimator(num_proc=ranks, store=store, model=model, loss=nn.CrossEntropyLoss(),
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.2),
                            feature_cols=["features"], label_cols=["label"], sample_weight_col="w",
                            batch_size=batch, epochs=epochs, backward_passes_per_step=every, shuffle=False,
                            random_seed=3, verbose=0).fit_on_parquet("train")

    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.2)
    features, labels, weights = torch.from_numpy(X), torch.from_numpy(y), torch.from_numpy(w)
    half, per_row = rows // ranks, nn.CrossEntropyLoss(reduction="none")
    losses = []
    for _ in range(epochs):
        total = 0.0
        for first in range(0, steps, every):  # a window: `every` batches of every rank, as one weighted batch
            idx = np.concatenate([np.arange(r * half + s * batch, r * half + (s + 1) * batch)
                                  for s in range(first, first + every) for r in range(ranks)])
            optimizer.zero_grad()
            loss = (per_row(plain(features[idx]), labels[idx]) * weights[idx]).sum() / weights[idx].sum()
            loss.backward()
            optimizer.step()
            total += loss.item() * weights[idx].sum().item()
        losses.append(total / weights.sum().item())

    trained = fitted.getModel().state_dict()
    for name, value in plain.state_dict().items():
        assert torch.allclose(trained[name], value, atol=1e-5), (name, (trained[name] - value).abs().max())
    assert [row["loss"] for row in fitted.getHistory()] == pytest.approx(losses, rel=1e-5)  # weighted, exact
