"""A new process fits the same pipeline output as test_reuse_spark did: `python reuse_job.py PARQUET STORE`.
The estimator's log goes to stderr."""
import logging
import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

from pyspark.sql import SparkSession  # noqa: E402

from store import Store  # noqa: E402
from test_reuse_spark import _est, _prep  # noqa: E402

logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
logging.getLogger("estimator").setLevel(logging.INFO)
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
pixels = spark.read.parquet(sys.argv[1])
_est(Store.create(sys.argv[2])).fit(_prep().fit(pixels).transform(pixels))
spark.stop()
