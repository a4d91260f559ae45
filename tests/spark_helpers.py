import json
import os
import urllib.request
import uuid

import numpy as np


def jobs_run_by(spark, action):
    """Run `action` and return the ids of the Spark jobs it started (on a Connect session: the jobs the
    server's application ran meanwhile, from its UI's REST API; the tests run one at a time)."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        before = _server_jobs()
        action()
        return sorted(_server_jobs() - before)
    sc = spark.sparkContext
    group = f"probe-{uuid.uuid4().hex}"
    sc.setJobGroup(group, group)
    try:
        action()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return list(sc.statusTracker().getJobIdsForGroup(group))


def digits_frame(spark, digits, partitions=2):
    """features array<float>, label, ink (a scalar feature), big (digit >= 5, float), weight, is_val."""
    X, y = digits
    rows = [(x.tolist(), int(t), float(x.sum() / 64), float(t >= 5), 1.0 + float(t % 2), bool(i % 10 == 0))
            for i, (x, t) in enumerate(zip(X, y))]
    schema = "features array<float>, label long, ink double, big double, weight double, is_val boolean"
    return spark.createDataFrame(rows, schema).repartition(partitions)


def outputs_of(df, column):
    return np.array([r[0] for r in df.select(column).collect()], dtype=np.float64)


def _server_jobs():
    ui = os.environ["SPARK_TEST_CONNECT_UI"]  # set by the `spark` fixture

    def get(path):
        with urllib.request.urlopen(ui + "/api/v1/applications" + path, timeout=30) as response:
            return json.loads(response.read())

    app = get("")[0]["id"]
    return {job["jobId"] for job in get(f"/{app}/jobs")}
