import uuid

import numpy as np


def jobs_run_by(spark, action):
    """Run `action` and return the ids of the Spark jobs it started."""
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
