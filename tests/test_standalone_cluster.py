"""A real Spark standalone cluster on loopback, from the pip-installed pyspark: one master and two
workers (1 core each, their own SPARK_WORKER_DIR), started and stopped by process id here. A barrier
stage of 2 tasks on 1-core executors must put one rank on each executor."""
import os
import re
import subprocess
import sys

import pyspark
import pytest

from servers import free_port, wait_for_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = os.path.dirname(pyspark.__file__)
    spark_class = os.path.join(home, "bin", "spark-class")
    base = tmp_path_factory.mktemp("cluster")
    env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               SPARK_LOG_DIR=str(base), SPARK_NO_DAEMONIZE="1")
    port = free_port()
    processes = []

    def start(name, *args, **extra):
        log = open(base / f"{name}.log", "w")
        process = subprocess.Popen([spark_class, *args], env=dict(env, **extra), stdout=log, stderr=subprocess.STDOUT)
        processes.append(process)
        return process

    try:
        master = start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                       "--webui-port", str(free_port()))
        wait_for_port(port, master)
        for i in range(2):
            work_dir = base / f"worker{i}"
            work_dir.mkdir()
            start(f"worker{i}", "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}", "--host",
                  "127.0.0.1", "--cores", "1", "--memory", "2g", "--work-dir", str(work_dir), "--webui-port",
                  str(free_port()), SPARK_WORKER_DIR=str(work_dir))
        yield f"spark://127.0.0.1:{port}", base
    finally:
        for process in reversed(processes):  # stop every process by its id
            process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_fit_and_transform_across_two_executors(cluster):
    master, base = cluster
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "seeds", "cluster_job.py"), master,
                             str(base / "store")], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "executors registered: 2" in result.stdout
    assert "ranks: 2" in result.stdout  # num_proc defaulted to the cluster's two task slots
    assert float(re.search(r"Test accuracy: ([\d.]+)", result.stdout).group(1)) > 0.85
    # each executor ran one Python worker of the barrier stage
    executor_dirs = [p for p in (base / "worker0").glob("app-*/*")] + [p for p in (base / "worker1").glob("app-*/*")]
    assert len(executor_dirs) == 2
