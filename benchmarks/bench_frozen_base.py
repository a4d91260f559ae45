"""A LoRA fit under precision='bf16-mixed' and ddp, of a base stored in float32: the frozen linear layers kept in
bf16 on the rank (estimator.train.precision: Precision.frozen_linears_cast) against kept in float32 (the cast
turned off here, as before it). One rank in this process (LocalLauncher), a Llama from bench_lm's sizes, LoRA
r=16 on every linear layer, SFT rows of about 20 tokens, the two ways alternated --repeat times. Reports the
rank's parameter bytes, the training loop's tokens/s (medians) and whether the histories were equal. Numbers,
not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_frozen_base.py [--size base] [--rows 256] [--batch 16] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="base", choices=("small", "base"))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    import bench_lm
    from estimator.launch.local import LocalLauncher
    from estimator.train.precision import Precision
    from lm_helpers import lm_train_spec
    from store import Store

    work = tempfile.mkdtemp(prefix="bench-frozen-")
    path = bench_lm.build(os.path.join(work, "llama"), args.size)
    rows = bench_lm.rows_of(args.rows)
    store = Store.create(os.path.join(work, "store"))
    casting = Precision.frozen_linears_cast.__func__
    held = {}

    def patched(cast):
        def frozen_linears_cast(cls, model):
            done = casting(cls, model) if cast else 0
            held[cast] = sum(p.numel() * p.element_size() for p in model.parameters())
            return done
        return classmethod(frozen_linears_cast)

    tokens = None
    speeds, histories = {True: [], False: []}, {}
    for attempt in range(args.repeat):
        for cast in (True, False) if attempt % 2 == 0 else (False, True):
            Precision.frozen_linears_cast = patched(cast)
            run = f"r{attempt}-{cast}"
            spec = lm_train_spec(store, path, rows, batch=args.batch, epochs=1, peft_config=bench_lm.lora(),
                                 lr=1e-4, run=run, precision="bf16-mixed", verbose=0, checkpoint_async=True)
            result = LocalLauncher().run(spec, 1)[0]
            if tokens is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(path)
                tokens = int(bench_lm.tokens_of(tokenizer, rows)["prompt.attention_mask"].sum())
            speeds[cast].append(tokens / result.train_loop_seconds)
            histories.setdefault(cast, [{k: v for k, v in r.items() if k != "data_wait"} for r in result.history])
    Precision.frozen_linears_cast = classmethod(casting)
    print(f"LoRA SFT, Llama '{args.size}' stored in float32, bf16-mixed, 1 rank, {args.rows} rows of batch "
          f"{args.batch}, {tokens} tokens; medians of {args.repeat}, alternated")
    print("| frozen linear layers | the rank's parameters | tokens/s (runs) |")
    print("|---|---|---|")
    for cast in (False, True):
        runs = ", ".join(f"{s:,.0f}" for s in speeds[cast])
        print(f"| {'bf16' if cast else 'float32'} | {held[cast] / 2**20:,.1f} MB | "
              f"{statistics.median(speeds[cast]):,.0f} ({runs}) |")
    ratio = statistics.median(speeds[True]) / statistics.median(speeds[False])
    print(f"bf16 / float32: {ratio:.2f}x tokens/s, {held[True] / held[False]:.2f}x the parameters; histories "
          f"{'equal' if histories[True] == histories[False] else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
