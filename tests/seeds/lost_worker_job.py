"""A fit on a standalone cluster of two one-core workers that loses one of them in its third epoch: the worker's
JVM and its executor (with the executor's Python workers) are killed with SIGKILL, as when a preemptible node
goes away. With min_num_proc=1 the retry goes on with the one slot left, from the last checkpoint, keeping the
global batch. Prints one JSON line of what happened (the test reads it).

    python tests/seeds/lost_worker_job.py <folder>
"""
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def descendants(pid):
    rows = [line.split() for line in subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True,
                                                    text=True).stdout.splitlines()[1:]]
    children = [int(child) for child, parent in rows if int(parent) == pid]
    return children + [grandchild for child in children for grandchild in descendants(child)]


def main(folder):
    import numpy as np
    import torch
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits
    from torch import nn

    from estimator import TorchEstimator
    from estimator.cluster import LocalStandaloneCluster
    from estimator.core.faults import ENV
    from estimator.train.checkpoint import load_checkpoint
    from gpu_jobs import kept_log_lines
    from store import Store

    lines = kept_log_lines()
    # every epoch of rank 0 takes a second longer: the kill lands inside the fit, whatever this machine's speed
    os.environ[ENV] = json.dumps([{"point": "epoch", "rank": 0, "action": "sleep", "seconds": 1.0}])
    os.makedirs(os.path.join(folder, "cluster"), exist_ok=True)
    with LocalStandaloneCluster(workers=2, cores=1, memory="2g", base_dir=os.path.join(folder, "cluster")) as cluster:
        spark = (SparkSession.builder.master(cluster.master_url).appName("lost-worker")
                 .config("spark.executor.memory", "1g").config("spark.ui.showConsoleProgress", "false")
                 .getOrCreate())
        cluster.wait_for_executors(spark)
        digits = load_digits()
        rows = [((x / 16.0).astype(np.float32).tolist(), int(t)) for x, t in zip(digits.data, digits.target)]
        df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2)
        store = Store.create(os.path.join(folder, "store"))
        run_id, killed = "lost-worker", {}

        def kill_a_worker_in_epoch_3():
            progress, checkpoint = store.run(run_id).progress, store.run(run_id).checkpoint
            while not (store.exists(checkpoint) and load_checkpoint(store, checkpoint)["epoch"] >= 2):
                time.sleep(0.1)  # epoch 2's checkpoint is written (in the background): the retry resumes from it
            worker = cluster.processes[2].pid  # worker1's JVM
            victims = [worker] + descendants(worker)  # its executor, and that executor's Python workers
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            killed.update(after_epochs=len(json.loads(store.read_bytes(progress))), processes=len(victims))

        threading.Thread(target=kill_a_worker_in_epoch_3, daemon=True).start()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        fitted = TorchEstimator(num_proc=2, min_num_proc=1, max_retries=2, store=store, run_id=run_id, model=model,
                                optimizer=torch.optim.Adam(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss(),
                                metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                                batch_size=32, epochs=6, validation=0.2, random_seed=3).fit(df)
        slots = spark.sparkContext._jsc.sc().maxNumConcurrentTasks(
            spark.sparkContext._jsc.sc().resourceProfileManager().defaultResourceProfile())
        print(json.dumps({"history": fitted.getHistory(), "killed": killed, "slots_after": int(slots),
                          "log": [line for line in lines if "task slot" in line or "failed on attempt" in line
                                  or "continues from" in line or "Trained run" in line]}))
        spark.stop()


if __name__ == "__main__":
    logging.getLogger("py4j").setLevel(logging.WARNING)
    main(sys.argv[1])
