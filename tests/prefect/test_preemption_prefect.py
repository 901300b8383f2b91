"""Preemption of a Prefect flow run: SIGTERM in the middle of an epoch. The epoch finishes and
is committed, no further epoch runs, and the signal goes back to Prefect, which ends the run
*Crashed* (not retried in the doomed process; the crash-retry automation would resume it); a
new run resumes from that epoch."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
from conftest import poll
from preempt_job import sigterm_in_epoch
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_URL

from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.stores import committed_epochs

FLOW = pathlib.Path(__file__).with_name("preempt_flow.py")
NODES = ["trainer_0", "trainer_1"]


def start(prefix: str, epochs: int) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    return subprocess.Popen([sys.executable, str(FLOW), prefix, str(epochs)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_sigterm_mid_epoch_commits_it_and_prefect_ends_the_run_crashed(tmp_path, client):
    prefix = str(tmp_path / "ckpt")
    proc = start(prefix, 6)
    sigterm_in_epoch(proc, prefix, 3)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, out  # Prefect re-raised the signal
    assert "stopped by SIGTERM after epoch 3" in out, out
    assert "Retry" not in out and "FINISHED" not in out, out  # no in-process retry
    assert committed_epochs(CheckpointStore(Location(prefix)), NODES) == [0, 1, 2, 3]
    assert not pathlib.Path(f"{prefix}.started.4").exists()

    runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["preempt"])),
                                 sort=FlowRunSort.START_TIME_DESC, limit=1)
    run = poll(lambda: client.read_flow_run(runs[0].id), lambda r: r.state.is_final())
    assert run.state.is_crashed(), run.state
    assert run.run_count == 1

    proc = start(prefix, 6)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "Resuming from epoch 3" in out and "FINISHED epoch=6" in out, out
