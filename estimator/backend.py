"""SparkBackend: Horovod's `backend=` object, so that Horovod code runs with only imports changed.

It says how many processes to run (`num_processes()`) and where the per-epoch lines of the run go
(`stdout`, optionally prefixed with a timestamp). Training itself always runs as Spark barrier tasks.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Dict, Optional, TextIO


class SparkBackend:
    def __init__(self, num_proc: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
                 prefix_output_with_timestamp: bool = False, start_timeout: Optional[int] = None,
                 verbose: int = 1, nics: Any = None, **kwargs: Any):
        self._num_proc = num_proc
        self.env = dict(env or {})
        self.stdout = stdout
        self.stderr = stderr
        self.prefix_output_with_timestamp = prefix_output_with_timestamp
        self.start_timeout = start_timeout
        self.verbose = verbose

    def num_processes(self) -> int:
        if self._num_proc is not None:
            return self._num_proc
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
        if spark is None:
            raise RuntimeError("SparkBackend(num_proc=None) needs an active SparkSession to count task slots.")
        from estimator.launch.session import default_num_proc

        return default_num_proc(spark)

    def write(self, line: str) -> None:
        """One line of run output, to `stdout` (sys.stdout when none was given)."""
        stream = self.stdout or sys.stdout
        if self.prefix_output_with_timestamp:
            line = time.strftime("%a %b %d %H:%M:%S %Y") + " " + line
        stream.write(line + "\n")
        stream.flush()

    def __getstate__(self) -> Dict[str, Any]:  # streams do not pickle (a saved estimator keeps the rest)
        state = self.__dict__.copy()
        state["stdout"] = state["stderr"] = None
        return state
