"""The GPU rows of the W2 and image benchmarks, without Spark (a GPU host here has no Java): one rank through
LocalLauncher, the per-rank code Spark's barrier tasks run (reader, feed thread, pinned memory, DDP, loop),
against the same model and batches in a plain PyTorch loop over tensors already on the device (the ceiling).
Not a test: numbers. `bash .ci/gpu` runs it after the GPU tests; `--device cpu --quick` runs anywhere.

    python benchmarks/bench_gpu.py [--device cuda] [--quick] [--json benchmarks/results_gpu.json]

  w2:     1M x 64 float32 (MLP 64-128-10, batch 512, SGD), 2 epochs: rows/s and the fraction of the loop spent
          waiting for batches, shard in memory and streamed, against the loop over device tensors.
  images: sklearn's digits as 28x28 PNG bytes (x copies), decoded by transformation_fn (PIL) with the default
          reader (reader_pool_type='auto': processes on a GPU rank), in 2 and 8 threads and in 8 processes,
          against the same pixels pre-decoded (CNN, batch 256), and the device loop.
  bert:   BERT-base (12 layers, 768; built from a BertConfig with a WordPiece tokenizer trained here) fine-tuned
          on generated topic texts tokenized on the rank (padded per batch, at most 64 tokens), bf16-mixed, AdamW,
          batch 32 and 128, strategy 'ddp' and 'fsdp' (one rank: fsdp trains the whole model as ddp; the
          `shard_alone` row shards it anyway, FSDP2 over one GPU), against a plain loop over the same batches
          tokenized before the clock starts, already on the device (rows/s over one epoch: ours after a warm-up
          fit in the same process, the plain loop after a warm-up epoch). --quick: a 2-layer BERT of width 32.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench import local_data, mlp  # noqa: E402


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                  nn.Linear(32 * 7 * 7, 10))

    def forward(self, x):
        return self.body(x.reshape(-1, 1, 28, 28))


def decode(frame):
    from PIL import Image

    frame["image"] = [np.asarray(Image.open(io.BytesIO(b)), dtype=np.float32).reshape(-1) / 255.0
                      for b in frame["image"]]
    return frame


def png_rows(copies: int):
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pngs, pixels = [], []
    for image in digits.images:
        big = Image.fromarray((image * 16).clip(0, 255).astype(np.uint8)).resize((28, 28))
        buffer = io.BytesIO()
        big.save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
        pixels.append(np.asarray(big, dtype=np.float32).reshape(-1) / 255.0)
    return pngs * copies, np.tile(np.stack(pixels), (copies, 1)), np.tile(digits.target.astype(np.int64), copies)


def write(store, folder, columns, files):
    from estimator.data.parquet import list_pieces

    store.makedirs(store.path(folder))
    rows = len(next(iter(columns.values())))
    for i in range(files):
        part = slice(i * rows // files, (i + 1) * rows // files)
        table = pa.table({k: pa.array(list(v[part])) if isinstance(v, list) or v.ndim > 1 else pa.array(v[part])
                          for k, v in columns.items()})
        pq.write_table(table, store.path(folder, f"part-{i}.parquet"), row_group_size=65536)
    return list_pieces(store, store.path(folder))


def fit(store, pieces, model, batch, epochs, device, run, transformation_fn=None, **reader):
    from estimator.core.pickling import dumps, user_objects
    from estimator.core.spec import DataSpec, ReaderSpec, TrainSpec
    from estimator.launch.local import LocalLauncher
    from estimator.train.objectives.classic import Objective

    data = DataSpec(store, pieces, (), ("image",) if transformation_fn else ("features",), ("label",))
    objs = user_objects(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), [nn.CrossEntropyLoss()],
                        [1.0], [], transformation_fn=transformation_fn, objective=Objective)
    spec = TrainSpec(data, dumps(objs, "model", roots=[model]), store.run(run), batch, batch, epochs, seed=1,
                     use_gpu=device == "cuda", verbose=0, reader=ReaderSpec(**reader))
    (result,) = LocalLauncher().run(spec, 1)
    return {"rows_per_s": result.train_rows * epochs / result.train_loop_seconds,
            "data_wait_fraction": result.data_wait_seconds / result.train_loop_seconds, "device": result.device}


def device_loop(model, x, y, batch, epochs, device):
    """The ceiling: the same model, optimizer and batches over tensors already on the device."""
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    started = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(xt), generator=generator).to(device)
        for start in range(0, len(xt), batch):
            index = order[start:start + batch]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(xt[index]), yt[index]).backward()
            optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return {"rows_per_s": len(xt) * epochs / (time.perf_counter() - started), "data_wait_fraction": 0.0,
            "device": device}


def bert_folder(work, quick):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks"))
    from text_example import save_pretrained_bert, topic_texts

    rows = topic_texts(512 if quick else 2048, seed=0)
    size = dict(hidden=32, layers=2) if quick else dict(hidden=768, layers=12, heads=12, intermediate=3072)
    return save_pretrained_bert(os.path.join(work, "bert"), [t for t, _ in rows[:2000]], vocabulary=2000, **size), rows


def bert_fit(store, pieces, path, batch, device, run, **fields):
    import functools

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from estimator.core.pickling import dumps, user_objects
    from estimator.core.spec import DataSpec, TrainSpec
    from estimator.launch.local import LocalLauncher
    from estimator.train.objectives.classic import Objective

    data = DataSpec(store, pieces, (), ("text",), ("label",), text_cols=("text",), max_length=64)
    factory = functools.partial(AutoModelForSequenceClassification.from_pretrained, path)
    objs = user_objects(factory(), functools.partial(torch.optim.AdamW, lr=2e-5), [nn.CrossEntropyLoss()], [1.0], [],
                        model_factory=factory, tokenizer=AutoTokenizer.from_pretrained(path), objective=Objective)
    spec = TrainSpec(data, dumps(objs, "model", roots=[factory]), store.run(run), batch, batch, 1, seed=1,
                     use_gpu=device == "cuda", verbose=0, precision="bf16-mixed", **fields)
    (result,) = LocalLauncher().run(spec, 1)
    return {"rows_per_s": result.train_rows / result.train_loop_seconds, "device": result.device,
            "data_wait_fraction": result.data_wait_seconds / result.train_loop_seconds, "allreduce": result.allreduce}


def bert_plain(path, rows, batch, device, sharded):
    """One process, the same model, optimizer and batches (tokenized before the clock, on the device), bf16
    autocast; `sharded`: fully_shard on each encoder layer, then the model, over a one-rank group."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(path).to(device).train()
    if sharded:
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.bert.encoder.layer:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    tokenizer = AutoTokenizer.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    ready = []
    for start in range(0, len(rows) - batch + 1, batch):
        part = rows[start:start + batch]
        encoded = tokenizer([t for t, _ in part], padding="longest", truncation=True, max_length=64,
                            return_tensors="pt")
        ready.append(({k: v.to(device) for k, v in encoded.items()}, torch.tensor([y for _, y in part]).to(device)))
    try:
        for timed in (False, True):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            for encoded, labels in ready:
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(**encoded).logits.float(), labels)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    finally:
        if sharded:
            import torch.distributed as dist

            dist.destroy_process_group()
    return {"rows_per_s": len(ready) * batch / seconds, "data_wait_fraction": 0.0, "device": device}


def median_of(runs):
    return {"rows_per_s": statistics.median(r["rows_per_s"] for r in runs),
            "data_wait_fraction": statistics.median(r["data_wait_fraction"] for r in runs),
            "runs_rows_per_s": [round(r["rows_per_s"]) for r in runs], "device": runs[0]["device"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (a smoke run)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from store import Store

    repeat = 1 if args.quick else args.repeat
    rows, copies, epochs = (20_000, 2, 1) if args.quick else (1_000_000, 30, 2)
    results = {"device": args.device, "name": torch.cuda.get_device_name(0) if args.device == "cuda" else
               platform.processor(), "torch": torch.__version__, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as work:
        store = Store.create(os.path.join(work, "store"))
        x, y = local_data(rows, 64)
        pieces = write(store, "w2", {"features": x, "label": y}, 8)
        results["w2"] = {"rows": rows, "epochs": epochs}
        for name, cache in (("in memory", True), ("streaming", False)):
            results["w2"][name] = median_of([fit(store, pieces, mlp(64), 512, epochs, args.device, f"w2-{name}-{i}",
                                                 inmemory_cache_all=cache) for i in range(repeat)])
            print("w2", name, results["w2"][name], flush=True)
        results["w2"]["device loop"] = median_of([device_loop(mlp(64), x, y, 512, epochs, args.device)
                                                  for _ in range(repeat)])
        print("w2 device loop", results["w2"]["device loop"], flush=True)
        pngs, pixels, labels = png_rows(copies)
        results["images"] = {"rows": len(pngs), "epochs": epochs}
        png_pieces = write(store, "png", {"image": pngs, "label": labels}, 4)
        array_pieces = write(store, "arrays", {"features": pixels, "label": labels}, 4)
        results["images"]["PNG, default reader"] = median_of([
            fit(store, png_pieces, CNN(), 256, epochs, args.device, f"png-auto-{i}", transformation_fn=decode,
                inmemory_cache_all=True) for i in range(repeat)])
        results["images"]["PNG, 2 decode threads"] = median_of([
            fit(store, png_pieces, CNN(), 256, epochs, args.device, f"png-{i}", transformation_fn=decode,
                inmemory_cache_all=True, pool_type="thread") for i in range(repeat)])
        results["images"]["PNG, 8 decode threads"] = median_of([
            fit(store, png_pieces, CNN(), 256, epochs, args.device, f"png8-{i}", transformation_fn=decode,
                inmemory_cache_all=True, train_workers=8, pool_type="thread") for i in range(repeat)])
        results["images"]["PNG, 8 decode processes"] = median_of([
            fit(store, png_pieces, CNN(), 256, epochs, args.device, f"png8p-{i}", transformation_fn=decode,
                inmemory_cache_all=True, train_workers=8, pool_type="process") for i in range(repeat)])
        results["images"]["pre-decoded"] = median_of([
            fit(store, array_pieces, CNN(), 256, epochs, args.device, f"arrays-{i}", inmemory_cache_all=True)
            for i in range(repeat)])
        results["images"]["device loop"] = median_of([device_loop(CNN(), pixels, labels, 256, epochs, args.device)
                                                      for _ in range(repeat)])
        print("images", json.dumps(results["images"]), flush=True)
        path, texts = bert_folder(work, args.quick)
        text_pieces = write(store, "texts", {"text": [t for t, _ in texts], "label": np.array([y for _, y in texts])}, 1)
        results["bert"] = {"rows": len(texts), "layers": 2 if args.quick else 12}
        bert_fit(store, text_pieces, path, 32, args.device, "bert-warm-up")  # kernels, allocator, imports
        batches = (32,) if args.quick else (32, 128)  # --quick: one batch size (a smoke run)
        for batch in batches:
            for name, fields in (("ddp", {}), ("fsdp", {"strategy": "fsdp"}),
                                 ("fsdp, shard_alone", {"strategy": "fsdp", "shard_alone": True})):
                results["bert"][f"{name}, batch {batch}"] = bert_fit(store, text_pieces, path, batch, args.device,
                                                                     f"bert-{name}-{batch}", **fields)
                print("bert", name, batch, results["bert"][f"{name}, batch {batch}"], flush=True)
            for name, sharded in (("plain", False), ("plain FSDP2", True)):
                results["bert"][f"{name}, batch {batch}"] = bert_plain(path, texts, batch, args.device, sharded)
                print("bert", name, batch, results["bert"][f"{name}, batch {batch}"], flush=True)
    print(f"{results['name']} ({args.device}), torch {torch.__version__}; rows/s (data wait fraction)")
    print("| workload | ours, in memory / PNG | ours, streaming / pre-decoded | device loop |")
    print("|---|---|---|---|")
    cell = lambda r: f"{r['rows_per_s']:,.0f} ({r['data_wait_fraction']:.2f})"  # noqa: E731
    w, i = results["w2"], results["images"]
    print(f"| W2 {rows:,} x 64 | {cell(w['in memory'])} | {cell(w['streaming'])} | {cell(w['device loop'])} |")
    print(f"| images {len(pngs):,} | {cell(i['PNG, default reader'])} | {cell(i['pre-decoded'])} | "
          f"{cell(i['device loop'])} |")
    print(f"| images, 2 decode threads | {cell(i['PNG, 2 decode threads'])} | | |")
    print(f"| images, train_reader_num_workers=8 | {cell(i['PNG, 8 decode threads'])} | | |")
    print(f"| images, 8 workers, reader_pool_type='process' | {cell(i['PNG, 8 decode processes'])} | | |")
    b = results["bert"]
    print("| BERT, text tokenized on the rank | ours ddp | ours fsdp (whole) | ours fsdp sharded | plain | plain FSDP2 |")
    print("|---|---|---|---|---|---|")
    for batch in batches:
        print(f"| batch {batch} | " + " | ".join(cell(b[f"{name}, batch {batch}"]) for name in (
            "ddp", "fsdp", "fsdp, shard_alone", "plain", "plain FSDP2")) + " |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
