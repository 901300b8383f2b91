"""A flow whose checkpoint storage (an S3 server behind a TcpGate) is unreachable during epochs
2 and 3, run as a user's script (``python outage_flow.py ENDPOINT BUCKET``): its terminal is what
tests/prefect/test_outage_terminal.py counts. Prints the flow run's id last."""

from __future__ import annotations

import sys

import numpy as np
from prefect import flow
from prefect.runtime import flow_run
from s3fs import S3FileSystem

from caffe2ckpt import Job, MultiNodeCheckpointManager, Node, Task, epoch_limiter
from caffe2ckpt.prefect import run_job
from tests.s3server import CREDENTIALS
from tests.tcpgate import TcpGate

host, port = sys.argv[1].removeprefix("http://").rsplit(":", 1)
gate = TcpGate((host, int(port)))
OPTIONS = {**CREDENTIALS, "endpoint_url": f"http://127.0.0.1:{gate.port}",
           "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
S3FileSystem.retries = 1  # s3fs's own retries (5) only make the test slower
DOWN = (2, 3)  # the epochs whose saves find the storage unreachable


def init(ws):
    ws["w"] = np.zeros(1000, np.float32)
    ws["epoch"] = np.int64(0)


def step(ws):
    ws["epoch"] = ws["epoch"] + 1
    ws["w"] = ws["w"] + 1
    gate.open = int(ws["epoch"]) not in DOWN


def build_job() -> Job:
    with Job(name="outage") as job:
        for i in range(2):
            with Node(f"trainer_{i}"):
                with job.init_group:
                    Task(init, name="init")
                Task(step, name="step")
        epoch_limiter(job, 5)
    return job


@flow
def outage(url: str) -> str:
    run_job(build_job(), MultiNodeCheckpointManager(url, storage_options=OPTIONS),
            on_save_error="warn")
    return str(flow_run.id)


if __name__ == "__main__":
    print(outage(f"s3://{sys.argv[2]}/ckpt"))
