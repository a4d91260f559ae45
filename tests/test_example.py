"""The README's example, run as a user runs it: its own process, its own Spark, real training."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.spark
def test_digits_example_reaches_90_percent(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "notebooks", "digits_example.py"),
                             "--store", str(tmp_path / "runs")], capture_output=True, text=True, timeout=600,
                            cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    match = re.search(r"^Test accuracy: ([0-9.]+)$", result.stdout, re.MULTILINE)
    assert match, result.stdout[-2000:]
    assert float(match.group(1)) >= 0.90
    assert re.search(r"^epoch 8: loss", result.stdout, re.MULTILINE)
