"""Real Spark servers on 127.0.0.1 from the pip-installed pyspark, for examples, benchmarks and tests,
started as processes and stopped by process id:

- a standalone cluster: one master and N workers (each with its own cores and SPARK_WORKER_DIR);
- a Spark Connect server (pyspark >= 3.5 ships its jar), for sessions made with `builder.remote(url)`.

    with LocalStandaloneCluster(workers=2, cores=1) as cluster:
        spark = SparkSession.builder.master(cluster.master_url).getOrCreate()
        cluster.wait_for_executors(spark)

    with LocalConnectServer(master="local[2]") as server:
        spark = SparkSession.builder.remote(server.url).getOrCreate()
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: Any, seconds: float = 90) -> None:
    """Wait until something listens on 127.0.0.1:port; fail early if `process` exits first."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            output = process.stdout.read()[-2000:] if process.stdout else ""
            raise RuntimeError(f"the server exited with {process.returncode}: {output}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on port {port} after {seconds} s")


def stop_processes(processes: Any) -> None:
    """Terminate them in order, then wait for each (killed after 30 s)."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class LocalStandaloneCluster:
    def __init__(self, workers: int = 2, cores: int = 1, memory: str = "2g", base_dir: Optional[str] = None):
        self.workers, self.cores, self.memory = workers, cores, memory
        self._own_dir = base_dir is None
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="spark-standalone-")
        self.processes: List[subprocess.Popen] = []
        self.master_url = ""

    def worker_dir(self, index: int) -> str:
        return os.path.join(self.base_dir, f"worker{index}")

    def start(self) -> "LocalStandaloneCluster":
        import pyspark

        home = os.path.dirname(pyspark.__file__)
        env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=self.base_dir,
                   SPARK_NO_DAEMONIZE="1", PYSPARK_PYTHON=os.environ.get("PYSPARK_PYTHON", sys.executable))
        spark_class = os.path.join(home, "bin", "spark-class")
        port = free_port()
        try:
            master = self._spawn("master", env, spark_class, "org.apache.spark.deploy.master.Master", "--host",
                                 "127.0.0.1", "--port", str(port), "--webui-port", str(free_port()))
            wait_for_port(port, master)
            self.master_url = f"spark://127.0.0.1:{port}"
            for i in range(self.workers):
                work_dir = self.worker_dir(i)
                os.makedirs(work_dir, exist_ok=True)  # else the worker writes into site-packages
                self._spawn(f"worker{i}", dict(env, SPARK_WORKER_DIR=work_dir), spark_class,
                            "org.apache.spark.deploy.worker.Worker", self.master_url, "--host", "127.0.0.1",
                            "--cores", str(self.cores), "--memory", self.memory, "--work-dir", work_dir,
                            "--webui-port", str(free_port()))
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, env: dict, *command: str) -> subprocess.Popen:
        with open(os.path.join(self.base_dir, f"{name}.log"), "w") as log:
            process = subprocess.Popen(list(command), env=env, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def wait_for_executors(self, spark: Any, count: Optional[int] = None, seconds: float = 120) -> int:
        """Block until `count` executors (default: one per worker) have registered; a barrier stage
        launched earlier would see fewer task slots."""
        count = self.workers if count is None else count
        deadline = time.time() + seconds
        while True:
            registered = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1  # minus the driver
            if registered >= count:
                return registered
            if time.time() > deadline:
                raise RuntimeError(f"{registered} of {count} executors registered within {seconds:.0f} s; see the "
                                   f"logs in {self.base_dir}")
            time.sleep(0.5)

    def stop(self) -> None:
        stop_processes(reversed(self.processes))  # workers first, then the master
        self.processes = []
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> "LocalStandaloneCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LocalConnectServer:
    """A Spark Connect server (`SparkConnectServer` through spark-submit) with its own master, on a free port."""

    @staticmethod
    def available() -> bool:
        """pip's pyspark ships the Connect server's jar from 4.0 on (3.5 has only the client)."""
        import glob

        import pyspark

        return bool(glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "spark-connect_*.jar")))

    def __init__(self, master: str = "local[2]", conf: Optional[Dict[str, str]] = None,
                 base_dir: Optional[str] = None):
        self.master, self.conf = master, dict(conf or {})
        self._own_dir = base_dir is None
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="spark-connect-")
        self.process: Optional[subprocess.Popen] = None
        self.url = ""

    @property
    def log_path(self) -> str:
        return os.path.join(self.base_dir, "connect-server.log")

    def start(self, seconds: float = 180) -> "LocalConnectServer":
        import pyspark

        if not self.available():
            raise RuntimeError(f"pyspark {pyspark.__version__} ships no Spark Connect server jar: use pyspark >= 4.0.")
        home = os.path.dirname(pyspark.__file__)
        port = free_port()
        env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", SPARK_CONNECT_MODE="0",
                   PYSPARK_PYTHON=os.environ.get("PYSPARK_PYTHON", sys.executable))
        env.pop("SPARK_REMOTE", None)
        command = [os.path.join(home, "bin", "spark-submit"), "--class",
                   "org.apache.spark.sql.connect.service.SparkConnectServer", "--name", "Spark Connect server",
                   "--master", self.master, "--conf", f"spark.connect.grpc.binding.port={port}",
                   "--conf", "spark.connect.grpc.binding.address=127.0.0.1"]
        for key, value in self.conf.items():
            command += ["--conf", f"{key}={value}"]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=self.base_dir)
        try:
            wait_for_port(port, self.process, seconds)
        except BaseException:
            self.stop()
            raise
        self.url = f"sc://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        stop_processes([self.process] if self.process is not None else [])
        self.process = None
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> "LocalConnectServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
