"""The Caffe2 reference job of checkpoint_test.py, with numpy tasks (shared by test modules).

Each node has ten records 0..9 and a running ``total`` starting at 100; every epoch reads at most
three records into the total, and the job stops after the epoch in which the reader ran dry.
Totals after epochs 1..4: 103, 115, 136, 145.
"""

from __future__ import annotations

import numpy as np

from caffe2ckpt import Job, Node, Task

EXPECTED_TOTALS = [103, 115, 136, 145]


class Counter:
    """Counts calls of the init tasks, to prove init_group is skipped on resume."""

    def __init__(self) -> None:
        self.init_calls = 0


def build_pipeline(job: Job, node_id: int, counter: Counter | None = None) -> str:
    """Add one node's reader/total pipeline to ``job``; return the total's blob name."""
    node = f"trainer_{node_id}"
    total, val, cursor = f"{node}/total", f"{node}/val", f"{node}/cursor"

    def init(ws):
        if counter is not None:
            counter.init_calls += 1
        ws[val] = np.arange(10, dtype=np.int64)
        ws[cursor] = np.int64(0)
        ws[total] = np.array([100], dtype=np.int64)

    def read_three(ws):
        read = 0
        while read < 3 and int(ws[cursor]) < ws[val].size:
            ws[total] = ws[total] + ws[val][int(ws[cursor])]
            ws[cursor] = ws[cursor] + 1
            read += 1
        ws["data_finished"] = read < 3  # the reader ran dry before its limit

    with Node(node):
        with job.init_group:
            Task(init, name="init")
        task = Task(read_three, name="pipe", outputs=["data_finished"])
        job.add_stop_condition(task.outputs()[0])
    return total


def make_job(node_ids=(0,), counter: Counter | None = None) -> tuple[Job, list[str]]:
    with Job(name="pipeline") as job:
        totals = [build_pipeline(job, i, counter) for i in node_ids]
    return job, totals


def fetch(session, node: str, name: str) -> int:
    return int(session.workspace(node)[name][0])
