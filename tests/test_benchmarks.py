"""A seconds-long smoke run of the benchmarks, so they keep working (numbers are not checked)."""

from __future__ import annotations

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
    for expected in ("| caffe2ckpt |", "| raw |", "W3", "blocking", "latest-epoch lookup",
                     "| DaskSession (actors) |", "workers x one process"):
        assert expected in out.stdout, expected
