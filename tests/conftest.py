import os
import sys

import numpy as np
import pytest

# Spark must not guess network interfaces, and executors must run this interpreter (with torch).
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("spark-torch-estimator-tests")
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def store(tmp_path):
    from store import Store

    return Store.create(str(tmp_path / "store"))


@pytest.fixture(scope="session")
def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int64)
