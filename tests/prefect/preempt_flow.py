"""The preemption job of ``tests/preempt_job.py`` as a Prefect flow, run as a subprocess:
``python preempt_flow.py PREFIX EPOCHS`` (against the server in ``PREFECT_API_URL``)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: preempt_job

from preempt_job import build
from prefect import flow

from caffe2ckpt import MultiNodeCheckpointManager
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.prefect import run_job  # before prefect: routes caffe2ckpt logs to the run


@flow(name="preempt", retries=2, retry_delay_seconds=0)
def preempt(prefix: str, epochs: int) -> int:
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    return run_job(build(prefix, epochs), cm)


if __name__ == "__main__":
    print(f"FINISHED epoch={preempt(sys.argv[1], int(sys.argv[2]))}", flush=True)
