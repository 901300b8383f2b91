"""Preemption: SIGTERM sent to a training subprocess in the middle of an epoch. The epoch
finishes, is committed, no further epoch runs, the process exits with the "preempted" code, and
the next run resumes from that epoch and ends with the uninterrupted result."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

import preempt_job
import pytest

from caffe2ckpt import (
    JobPreemptedError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    StepManagerOptions,
    Task,
)
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.stores import committed_epochs

JOB = pathlib.Path(preempt_job.__file__)


def run(prefix: str, epochs: int, *, kill_in_epoch: int | None = None) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, str(JOB), prefix, str(epochs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if kill_in_epoch is not None:
        preempt_job.sigterm_in_epoch(proc, prefix, kill_in_epoch)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def committed(prefix: str) -> list[int]:
    return committed_epochs(CheckpointStore(Location(prefix)), preempt_job.NODES)


@pytest.mark.slow
def test_sigterm_mid_epoch_commits_that_epoch_and_the_rerun_resumes(tmp_path):
    reference = str(tmp_path / "reference")
    code, out = run(reference, 6)
    assert code == 0, out
    expected = out.strip().splitlines()[-1].split(" w=")[1]

    prefix = str(tmp_path / "ckpt")
    code, out = run(prefix, 6, kill_in_epoch=3)
    assert code == 75, out
    assert "PREEMPTED epoch=3 committed=True" in out and "SIGTERM" in out, out
    assert committed(prefix) == [0, 1, 2, 3]
    assert not pathlib.Path(f"{prefix}.started.4").exists()  # no further epoch ran

    code, out = run(prefix, 6)
    assert code == 0, out
    last = out.strip().splitlines()[-1]
    assert "FINISHED epoch=6 resumed_from=3" in last, out
    assert last.split(" w=")[1] == expected
    assert committed(prefix) == list(range(7))


def test_in_process_preemption_saves_even_an_epoch_the_policy_skips(tmp_path):
    prefix = str(tmp_path / "ckpt")
    job = preempt_job.build(prefix, 6)
    sent: list[bool] = []

    def signal_in_epoch_2(ws):  # the process signals itself while epoch 2 runs
        # this node's own epoch counter (its "step" ran just before): trainer_0's marker file
        # of the same epoch may not exist yet, since the nodes of a group run concurrently
        if int(ws["e"]) == 2 and not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGTERM)
    Task(signal_in_epoch_2, name="preempt", group=job.epoch_group, node="trainer_1")
    runner = JobRunner(job, MultiNodeCheckpointManager(prefix),
                       options=StepManagerOptions(save_interval_steps=5))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(JobPreemptedError, match="stopped by SIGTERM after epoch 2") as err:
        runner.train(LocalSession())
    assert err.value.epoch == 2 and err.value.committed
    assert committed(prefix) == [0, 2]  # epoch 2 saved although the policy says every 5th
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is restored
