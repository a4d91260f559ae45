"""A short (4-epoch) fit through a Spark Connect session, with the package as installed (run by .ci/check-wheel from a
folder outside the checkout): starts a local Connect server, runs the digits example against it, stops it."""
import os
import re
import subprocess
import sys

from estimator.cluster import LocalConnectServer

example, store = sys.argv[1], sys.argv[2]
with LocalConnectServer(master="local[2]", conf={"spark.ui.enabled": "false"}) as server:
    result = subprocess.run([sys.executable, example, "--epochs", "4", "--store", store, "--remote", server.url],
                            capture_output=True, text=True, timeout=600)
if result.returncode != 0:
    sys.exit(f"the Connect fit failed:\n{result.stderr[-6000:]}")
accuracy = float(re.search(r"^Test accuracy: ([0-9.]+)$", result.stdout, re.M).group(1))
assert accuracy >= 0.85, result.stdout
print(f"check-wheel: a 4-epoch fit through Spark Connect ({os.path.basename(example)} --remote): test accuracy "
      f"{accuracy:.4f}")
