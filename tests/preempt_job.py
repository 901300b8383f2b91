"""A job for the preemption tests, run as a subprocess: ``python preempt_job.py PREFIX EPOCHS``.

Every epoch touches ``<PREFIX>.started.<epoch>`` and then works for a while, so the test can
send SIGTERM in the middle of a known epoch. Exit code 75 means "preempted, rerun to resume".
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

import numpy as np

from caffe2ckpt import (
    Job,
    JobPreemptedError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    epoch_limiter,
)
from caffe2ckpt.metadata import ZarrMetadataHandler

NODES = ["trainer_0", "trainer_1"]


def build(prefix: str, epochs: int) -> Job:
    with Job(name="preempt") as job:
        for node in NODES:
            with Node(node):
                with job.init_group:
                    Task(lambda ws: ws.update(w=np.zeros(8), e=np.int64(0)), name="init")

                def step(ws, node=node):
                    ws["e"] = ws["e"] + 1
                    if node == NODES[0]:
                        pathlib.Path(f"{prefix}.started.{int(ws['e'])}").touch()
                        time.sleep(0.5)  # the window in which the test sends SIGTERM
                    ws["w"] = ws["w"] * 0.5 + ws["e"]
                Task(step, name="step")
        epoch_limiter(job, epochs)
    return job


def sigterm_in_epoch(proc: subprocess.Popen, prefix: str, epoch: int,
                     timeout: float = 120) -> None:
    """Send SIGTERM to ``proc`` (running this job on ``prefix``) once ``epoch`` has started."""
    marker = pathlib.Path(f"{prefix}.started.{epoch}")
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"the job never reached epoch {epoch}"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)


def main() -> int:
    prefix, epochs = sys.argv[1], int(sys.argv[2])
    session = LocalSession()
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    runner = JobRunner(build(prefix, epochs), cm)
    try:
        final = runner.train(session)
    except JobPreemptedError as exc:
        print(f"PREEMPTED epoch={exc.epoch} committed={exc.committed}: {exc}", flush=True)
        return 75
    print(f"FINISHED epoch={final} resumed_from={runner.resumed_from} "
          f"w={session.workspace(NODES[1])['w'].tolist()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
