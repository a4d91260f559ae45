"""strategy='fsdp' against 'ddp': the parameter and optimizer-state bytes each rank holds at the end of a fit
(WorkerResult.state_bytes: a DTensor counts its own shard only), on 1, 2 and 4 ranks, and the training time.
Ranks are local processes (estimator.launch.LocalLauncher: the ranks' own code, no Spark), on this machine's CPUs
over gloo. Numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_fsdp.py [--width 1024] [--blocks 8] [--json benchmarks/results_fsdp.json]

The model: an MLP of residual blocks in an nn.ModuleList (LayerNorm, Linear width x width, tanh), 64 inputs, 10
classes; Adam (two state tensors per parameter: 3x the parameters' bytes in all). 4,096 random rows, batch 256
in all (split over the ranks), 1 epoch; the first fit of each rank count warms the processes' imports.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class Blocks(nn.Module):
    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList([Residual(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_spec(store, width, blocks, strategy, ranks, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from estimator.core.pickling import dumps, user_objects
    from estimator.core.spec import DataSpec, TrainSpec
    from estimator.data.parquet import list_pieces

    folder = store.path("train")
    if not store.exists(folder):
        store.makedirs(folder)
        rng = np.random.default_rng(0)
        features = rng.standard_normal((rows, 64), dtype=np.float32)
        table = pa.table({"features": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), 64),
                          "label": pa.array(rng.integers(0, 10, rows))})
        pq.write_table(table, store.path("train", "part.parquet"), row_group_size=1024)
    data = DataSpec(store, list_pieces(store, folder), (), ("features",), ("label",))
    torch.manual_seed(0)
    model = Blocks(width, blocks)
    objs = user_objects(model, torch.optim.Adam(model.parameters(), lr=1e-3), [nn.CrossEntropyLoss()], [1.0], [])
    return TrainSpec(data, dumps(objs, "model", roots=[model]), store.run(f"{strategy}-{ranks}-{time.time_ns()}"),
                     256 // ranks, 256, 1, strategy=strategy, shared_memory_allreduce=False, verbose=0), model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--json")
    args = parser.parse_args()

    from estimator.launch.local import LocalLauncher
    from store import Store

    store = Store.create(tempfile.mkdtemp(prefix="bench-fsdp-"))
    table, results = {}, {}
    for ranks in (1, 2, 4):
        for strategy in ("ddp", "fsdp"):
            spec, model = make_spec(store, args.width, args.blocks, strategy, ranks, args.rows)
            if strategy == "ddp":
                LocalLauncher(use_processes=True).run(spec, ranks)  # warm-up
            started = time.perf_counter()
            ranks_results = LocalLauncher(use_processes=True).run(spec, ranks)
            seconds = time.perf_counter() - started
            held = [r.state_bytes / 1e6 for r in ranks_results]
            results[f"{strategy} x{ranks}"] = {"state_mb_per_rank": [round(h, 2) for h in held],
                                               "train_s": round(max(r.seconds for r in ranks_results), 2),
                                               "launch_s": round(seconds, 2)}
            table[(strategy, ranks)] = max(held)
            print(f"{strategy:4s} on {ranks} rank(s): {max(held):8.2f} MB of parameters and optimizer state per "
                  f"rank, training {max(r.seconds for r in ranks_results):6.2f} s")
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters ({params * 4 / 1e6:.1f} MB in float32; with Adam's state "
          f"{params * 12 / 1e6:.1f} MB)")
    for ranks in (1, 2, 4):
        print(f"{ranks} rank(s): fsdp holds {table[('fsdp', ranks)] / table[('ddp', ranks)]:.3f}x of ddp's per rank")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "parameters": params, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
