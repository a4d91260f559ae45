"""What continuing an epoch on another rank count costs a new rank before its first batch: finding which rows the
old ranks had trained on (their readers' draws replayed over row ids, estimator.data.remainder) and taking its
part of the rest. Not a test: numbers, not assertions. No Spark: the planning runs the same on every rank.

    .venv/bin/python benchmarks/bench_resume.py [--rows 1000000,10000000] [--repeat 3] [--json benchmarks/results_resume.json]

Data: `rows` rows of one int64 column in row groups of 125,000 (the planning reads footers only, so the row width
does not matter). Old layout: 4 ranks of batch 128, half the epoch done; new: 2 ranks (rank 0 timed). For the
in-memory and the streaming reader's order (default shuffle buffer), and for an epoch of train_steps_per_epoch
(in memory, 4,000 steps of 128 rows per rank). Also: peak traced memory of the planning (tracemalloc).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1000000,10000000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "results_resume.json"))
    args = parser.parse_args()

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from estimator.core.spec import DataSpec, ReaderSpec, TrainSpec
    from estimator.data.parquet import list_pieces
    from estimator.data.remainder import Remainder
    from store import Store

    results = []
    with tempfile.TemporaryDirectory() as root:
        store = Store.create(root)
        for rows in (int(r) for r in args.rows.split(",")):
            name = f"train-{rows}"
            store.makedirs(store.path(name))
            pq.write_table(pa.table({"label": pa.array(np.arange(rows))}), store.path(name, "part.parquet"),
                           row_group_size=125_000)
            data = DataSpec(store, list_pieces(store, store.path(name)), (), (), ("label",))
            spec = TrainSpec(data, b"", store.run("r"), 256, 256, 1, seed=3, reader=ReaderSpec())
            half = rows // 4 // 128 // 2
            cases = {"in memory": ([128, 4, 1, 1, 0], spec, half), "streaming": ([128, 4, 0, 1, 0], spec, half),
                     "train_steps_per_epoch": ([128, 4, 1, 1, 4000], dataclasses.replace(spec), 2000)}
            for case, (layout, case_spec, done) in cases.items():
                seconds = []
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    part = Remainder.plan(case_spec, rows, 1, layout, done, 0, 2)
                    seconds.append(time.perf_counter() - started)
                tracemalloc.start()
                Remainder.plan(case_spec, rows, 1, layout, done, 0, 2)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                result = {"rows": rows, "case": case, "seconds": statistics.median(seconds),
                          "range": [min(seconds), max(seconds)], "peak_mb": peak / 2**20, "part_rows": len(part.rows)}
                print(json.dumps(result))
                results.append(result)
    with open(args.json, "w") as out:
        json.dump(results, out, indent=1)
    print(f"| rows | old ranks' order | planning, s (median of {args.repeat}) | peak MB | rank 0's part, rows |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']:,} | {r['case']} | {r['seconds']:.2f} ({r['range'][0]:.2f}-{r['range'][1]:.2f}) | "
              f"{r['peak_mb']:.0f} | {r['part_rows']:,} |")


if __name__ == "__main__":
    main()
