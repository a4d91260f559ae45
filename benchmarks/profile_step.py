"""Where a training step's time goes, one rank on one device (cProfile of the rank's thread): the W2 MLP of
bench_gpu.py, in memory. Not a test.   python benchmarks/profile_step.py [--device cuda] [--rows 300000]"""
import argparse
import cProfile
import os
import pstats
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench import local_data, mlp  # noqa: E402
from bench_gpu import fit, write  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from store import Store

    with tempfile.TemporaryDirectory() as work:
        store = Store.create(os.path.join(work, "store"))
        x, y = local_data(args.rows, 64)
        pieces = write(store, "w2", {"features": x, "label": y}, 8)
        print("warm", fit(store, pieces, mlp(64), 512, 1, args.device, "warm", inmemory_cache_all=True))
        profile = cProfile.Profile()
        profile.enable()
        print("timed", fit(store, pieces, mlp(64), 512, 2, args.device, "timed", inmemory_cache_all=True))
        profile.disable()
        stats = pstats.Stats(profile).sort_stats("tottime")
        stats.print_stats(30)
        stats.sort_stats("cumulative").print_stats(45)
        if args.out:
            stats.dump_stats(args.out)


if __name__ == "__main__":
    main()
