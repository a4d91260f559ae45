"""strategy='fsdp' against 'ddp': the parameter and optimizer-state bytes each rank holds at the end of a fit
(WorkerResult.state_bytes: a DTensor counts its own shard only), on 1, 2 and 4 ranks, the training time and the
epoch's rows/s (DDP as fits run it on CPU: gradients averaged in shared memory; fsdp on one rank trains whole).
Ranks are local processes (estimator.launch.LocalLauncher: the ranks' own code, no Spark), on this machine's CPUs
over gloo. Numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_fsdp.py [--width 1024] [--blocks 8] [--json benchmarks/results_fsdp.json]
    .venv/bin/python benchmarks/bench_fsdp.py --build [--width 2048] [--blocks 24] [--json ...]

--build: each rank's peak resident memory (WorkerResult.peak_rss_mb, fresh processes) in a sharded fit whose model
a factory builds either with its weights (loaded whole from a safetensors file, as from_pretrained does, then
sharded) or on the meta device with weights_folder (each rank reads its own shards); one epoch of 512 rows.

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
    from estimator.train.objectives.classic import Objective
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
    objs = user_objects(model, torch.optim.Adam(model.parameters(), lr=1e-3), [nn.CrossEntropyLoss()], [1.0], [],
                        objective=Objective)
    return TrainSpec(data, dumps(objs, "model", roots=[model]), store.run(f"{strategy}-{ranks}-{time.time_ns()}"),
                     256 // ranks, 256, 1, strategy=strategy, verbose=0), model


def whole_blocks(folder: str, width: int, blocks: int) -> nn.Module:
    """The model with its weights, as from_pretrained builds it: every rank holds it whole once."""
    from safetensors.torch import load_model

    model = Blocks(width, blocks)
    load_model(model, os.path.join(folder, "model.safetensors"))
    return model


def meta_blocks(width: int, blocks: int) -> nn.Module:
    from estimator import parameters_on_meta

    with parameters_on_meta():
        return Blocks(width, blocks)


def _build_peak(rank: int, how: str, ranks: int, folder: str, width: int, blocks: int, port: int, out: str) -> None:
    """One rank: the model built (whole, or on meta), sharded and filled, then this process's peak resident memory
    and its memory now - before any training allocates."""
    import resource

    import psutil
    import torch.distributed as dist

    from estimator.train.sharding import shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model = whole_blocks(folder, width, blocks) if how == "whole" else meta_blocks(width, blocks)
    shard(model, None, "32", torch.device("cpu"), ranks, weights_folder=None if how == "whole" else folder)
    import gc

    gc.collect()
    with open(os.path.join(out, f"{how}-{ranks}-{rank}.json"), "w") as f:
        json.dump({"before_mb": before, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "now_mb": psutil.Process().memory_info().rss / 2**20}, f)
    dist.destroy_process_group()


def build_memory(args: argparse.Namespace) -> dict:
    import socket

    import torch.multiprocessing as mp
    from safetensors.torch import save_model

    folder, out = tempfile.mkdtemp(prefix="bench-fsdp-weights-"), tempfile.mkdtemp(prefix="bench-fsdp-build-")
    torch.manual_seed(0)
    save_model(Blocks(args.width, args.blocks), os.path.join(folder, "model.safetensors"))
    params = sum(p.numel() for p in Blocks(args.width, 1).parameters()) + (args.blocks - 1) * (
        args.width * args.width + 3 * args.width)
    print(f"model: {params / 1e6:.1f}M parameters, {params * 4 / 1e6:.0f} MB in float32")
    results = {}
    for ranks in (2, 4):
        for how in ("whole", "meta"):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            mp.spawn(_build_peak, args=(how, ranks, folder, args.width, args.blocks, port, out), nprocs=ranks)
            seen = [json.load(open(os.path.join(out, f"{how}-{ranks}-{r}.json"))) for r in range(ranks)]
            grew = max(s["peak_mb"] - s["before_mb"] for s in seen)
            peak = max(s["peak_mb"] for s in seen)
            results[f"{how} x{ranks}"] = {"peak_mb": round(peak), "peak_growth_mb": round(grew),
                                          "rss_after_mb": [round(s["now_mb"]) for s in seen]}
            print(f"{how:5s} build on {ranks} ranks: peak resident memory {peak:.0f} MB per rank (+{grew:.0f} MB "
                  f"while building and sharding), {max(s['now_mb'] for s in seen):.0f} MB resident after")
    return {"parameters": params, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--json")
    parser.add_argument("--build", action="store_true", help="peak memory: a factory with weights vs on meta")
    args = parser.parse_args()
    if args.build:
        found = build_memory(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), **found}, f, indent=1)
        return

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
            loop = max(r.train_loop_seconds for r in ranks_results)
            results[f"{strategy} x{ranks}"] = {"state_mb_per_rank": [round(h, 2) for h in held],
                                               "train_s": round(max(r.seconds for r in ranks_results), 2),
                                               "epoch_rows_per_s": round(args.rows / loop),
                                               "allreduce": ranks_results[0].allreduce,
                                               "launch_s": round(seconds, 2)}
            table[(strategy, ranks)] = max(held)
            print(f"{strategy:4s} on {ranks} rank(s): {max(held):8.2f} MB of parameters and optimizer state per "
                  f"rank, training {max(r.seconds for r in ranks_results):6.2f} s, the epoch at "
                  f"{args.rows / loop:,.0f} rows/s ({ranks_results[0].allreduce})")
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
