"""A seconds-long smoke run of the benchmarks, so they keep working (numbers are not checked)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_benchmarks_smoke(tmp_path):
    out = subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), "--smoke", "--dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    expected = ["| caffe2ckpt |", "| raw |", "W3", "blocking", "latest-epoch lookup",
                "| DaskSession (actors) |", "workers x one process",
                "per-epoch cost, last", "resume of the finished job", "| hints |",
                "| groups the table is read from |", "| partition | N -> M |",
                "w replicated (written once)"]
    if all(importlib.util.find_spec(m) for m in ("moto", "flask", "s3fs")):  # the test extra
        expected += ["S3 requests per node-save", "| raw (s3fs pipe/cat) |",
                     "latest-epoch lookup requests on S3"]
    for line in expected:
        assert line in out.stdout, line
