"""What a LoRA fit and its transform cost the driver as the base grows (issue 53): the driver's peak RSS above
its value before fit, during fit and during transform (psutil, sampled every 5 ms), the bytes transform hands to
Spark (the closures pyspark pickles and the files added), and the first and second transform's seconds (the
executors' Python workers build the base in the first and keep it), at bases 4x apart. Each size runs in a
process of its own (local[2], two ranks), after a warm-up fit and transform of a tiny base in that process (what
a first fit costs whatever the model: imports, Spark's first jobs). Numbers, not assertions (RESULTS.md).

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_lm_size.py [--sizes 512:12,1024:12] [--json F]
                                                                       [--full] [--strategy fsdp] [--built-save]

`--full`: a full fine-tune (no peft_config: each checkpoint is the whole model and AdamW's state, left in the run
and read where the model is built); `--strategy`: the fit's (fsdp: the checkpoint a folder of shards); `--dpo`:
preference tuning (issue 56: objective=DPO(beta=0.1) on (prompt, chosen, rejected) rows, the chosen answer the
fact, the rejected one another colour; the reference the adapters off, or with --full precomputed by the ranks).
Then `save` and `save_pretrained` of the fitted model, `TorchModel.load` of the saved one and a transform of
it, the driver's peak RSS and anonymous memory (RssAnon: a mapped file's pages are reclaimable, not counted
there) during each; `--built-save`: a full fine-tune saved as before (the model built whole on the driver),
the saved optimizer read whole at load and the loaded model a module sent whole by transform. `--weights-folder
read`: the factory builds on the meta device and the fit's weights_folder holds its weights (`built`: the
driver builds the model whole from the folder, as before this change); with --full, the driver's fit peak.

A size is hidden:layers of a Llama (intermediate 2x hidden, 4 heads, 2 key/value heads) saved in float32 with
save_pretrained (the example's builder, notebooks/sft_example.py); LoRA r=4 on q_proj and v_proj.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))
sys.path.insert(0, os.path.dirname(HERE))


class Peak:
    """This process's peak RSS above its value at the start, in MB."""

    def __enter__(self):
        import psutil

        self.process, self.done = psutil.Process(), False
        self.start = self.peak = self.process.memory_info().rss
        self.began = time.perf_counter()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        self.anon_start = self.anon_peak = anonymous()
        while not self.done:
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.anon_peak = max(self.anon_peak, anonymous())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.done = True
        self.seconds = time.perf_counter() - self.began
        self.thread.join()

    @property
    def mb(self):
        return (self.peak - self.start) / 2 ** 20

    @property
    def anon_mb(self):
        """The peak of the anonymous part (RssAnon: what a file's mapped pages are not) above its start."""
        return (self.anon_peak - self.anon_start) / 2 ** 20


def anonymous() -> int:
    """This process's resident anonymous memory in bytes (/proc/self/status RssAnon)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def on_meta(folder: str):
    """The saved Llama's shape, its parameters on the meta device (--weights-folder's factory)."""
    import transformers

    from estimator import parameters_on_meta

    with parameters_on_meta():
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))


def one_size(hidden: int, layers: int, work: str, full: bool = False, strategy: str = "ddp", dpo: bool = False,
             built_save: bool = False, weights_folder: str = "") -> dict:
    import torch
    import transformers
    from peft import LoraConfig
    from pyspark import serializers
    from pyspark.sql import SparkSession

    import estimator
    import estimator.model
    from estimator import DPO, TorchEstimator
    from sft_example import COLORS, color_facts, save_pretrained_llama
    from store import LocalStore

    texts = [p + r for p, r in color_facts()] * 4
    base = save_pretrained_llama(os.path.join(work, "base"), texts, hidden=hidden, layers=layers, positions=64)
    small = save_pretrained_llama(os.path.join(work, "small"), texts)
    weights = sum(os.path.getsize(os.path.join(base, f)) for f in os.listdir(base) if f.endswith(".safetensors"))
    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    rows = [(p, r) for p, r in color_facts()[:16]]
    if dpo:  # the rejected answer: the fact with the next colour
        pairs = [(p, r, r.replace(c, COLORS[(COLORS.index(c) + 1) % len(COLORS)]))
                 for p, r in rows for c in [next(c for c in COLORS if c in r)]]
        df = spark.createDataFrame(pairs, "prompt string, chosen string, rejected string").cache()
    else:
        df = spark.createDataFrame(rows, "prompt string, response string").cache()
    asked = spark.createDataFrame([(p,) for p, _ in rows[:6]], "prompt string").repartition(2).cache()
    df.count(), asked.count()

    if weights_folder == "built":  # as before: the driver builds the model whole from the folder
        import estimator.estimator

        model_of = estimator.estimator.model_of
        estimator.estimator.model_of = lambda value, folder, whole=True: model_of(value, folder, folder is not None)

    def fit(folder, run):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        factory = functools.partial(transformers.AutoModelForCausalLM.from_pretrained, folder)
        meta = {"model": functools.partial(on_meta, folder), "weights_folder": folder} if weights_folder else {}
        return TorchEstimator(
            num_proc=2, store=LocalStore(os.path.join(work, "runs")), run_id=run, tokenizer=tokenizer,
            **{"model": factory, **meta},
            peft_config=None if full else lora, strategy=strategy,
            optimizer=functools.partial(torch.optim.AdamW, lr=5e-4 if full else 5e-3), feature_cols=["prompt"],
            label_cols=["chosen", "rejected"] if dpo else ["response"], objective=DPO(beta=0.1) if dpo else None,
            batch_size=4, epochs=1, max_new_tokens=6, random_seed=1, verbose=0).fit(df)

    fit(small, "warm").transform(asked).collect()
    with Peak() as fitting:
        fitted = fit(base, "sized")
    sent = []
    dumps, ship = serializers.CloudPickleSerializer.dumps, estimator.model.ship_file

    def counted_dumps(serializer, obj):
        data = dumps(serializer, obj)
        sent.append(len(data))
        return data

    def counted_ship(session, path):
        sent.append(os.path.getsize(path))
        return ship(session, path)

    serializers.CloudPickleSerializer.dumps, estimator.model.ship_file = counted_dumps, counted_ship
    seconds = []
    with Peak() as transforming:
        for _ in range(2):
            started = time.perf_counter()
            fitted.transform(asked).collect()
            seconds.append(time.perf_counter() - started)
    handle = getattr(fitted, "getModelHandle", lambda: None)()  # None: a release before the handle
    if built_save:  # save and load as before: the model built whole on the driver, the run's state read into
        import io  # it; a saved optimizer read whole

        import estimator.predict.weights
        from estimator.core.handle import ModelHandle
        import estimator.predict.persistence
        ModelHandle.mapped = lambda self, skeleton, optimizer: None
        estimator.predict.weights.mapped_file = lambda fs, path: torch.load(io.BytesIO(fs.cat(path)),
                                                                           weights_only=True)
        estimator.predict.persistence.held_saved = lambda fs, root: None
    with Peak() as saving:
        fitted.write().save(os.path.join(work, "saved"))
    with Peak() as exporting:
        fitted.save_pretrained(os.path.join(work, "exported"))
    del fitted
    with Peak() as loading:
        loaded = estimator.TorchModel.load(os.path.join(work, "saved"))
    sent.clear()
    with Peak() as loaded_transform:
        loaded.transform(asked).collect()
    loaded_sent = sum(sent)
    spark.stop()
    return {"hidden": hidden, "layers": layers, "full": full, "strategy": strategy, "dpo": dpo,
            "weights_folder": weights_folder,
            "weights_mb": weights / 2 ** 20, "fit_s": fitting.seconds,
            "fit_driver_peak_mb": fitting.mb, "transform_driver_peak_mb": transforming.mb,
            "transform_sent_mb_each": sum(sent) / 2 ** 20 / 2, "adapters_mb": len(handle.trained) / 2 ** 20 if handle and handle.trained else None,
            "first_transform_s": seconds[0], "second_transform_s": seconds[1], "built_save": built_save,
            "save_s": saving.seconds, "save_driver_peak_mb": saving.mb, "save_driver_anon_mb": saving.anon_mb,
            "save_pretrained_s": exporting.seconds, "save_pretrained_driver_peak_mb": exporting.mb,
            "save_pretrained_driver_anon_mb": exporting.anon_mb, "load_s": loading.seconds,
            "load_driver_peak_mb": loading.mb, "load_driver_anon_mb": loading.anon_mb,
            "loaded_transform_s": loaded_transform.seconds, "loaded_transform_driver_anon_mb": loaded_transform.anon_mb,
            "loaded_transform_driver_peak_mb": loaded_transform.mb, "loaded_transform_sent_mb": loaded_sent / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="512:12,1024:12", help="hidden:layers,... (4x apart by default)")
    parser.add_argument("--json")
    parser.add_argument("--full", action="store_true", help="a full fine-tune: no peft_config")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--dpo", action="store_true", help="preference tuning: objective=DPO(beta=0.1)")
    parser.add_argument("--built-save", action="store_true",
                        help="save a full fine-tune as before: the model built whole on the driver")
    parser.add_argument("--weights-folder", choices=("", "read", "built"), default="",
                        help="the factory builds on the meta device, its weights the fit's weights_folder; "
                             "'built': the driver builds the model whole from it, as before")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        hidden, layers = map(int, args.one.split(":"))
        with tempfile.TemporaryDirectory() as work:
            print("RESULT " + json.dumps(one_size(hidden, layers, work, args.full, args.strategy, args.dpo,
                                                        args.built_save, args.weights_folder)),
                  flush=True)
        return
    results = []
    for size in args.sizes.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", size, "--strategy", args.strategy,
                              *(["--full"] if args.full else []), *(["--dpo"] if args.dpo else []),
                              *(["--built-save"] if args.built_save else []),
                              *(["--weights-folder", args.weights_folder] if args.weights_folder else [])],
                             capture_output=True, text=True, check=True,
                             cwd=tempfile.gettempdir())
        results.append(json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:]))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
