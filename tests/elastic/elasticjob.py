"""A job whose nodes hold shares of one table (``emb``, split by rows) and the same weights
(``w``, replicated): each epoch adds the epoch's number to every row of the table, row by
row in global numbering, and scales the weights, so a save restored on another node count
can be checked against the reference (the table and weights computed whole)."""

from __future__ import annotations

import numpy as np

from caffe2ckpt import Job, Layout, Node, Task, epoch_limiter
from caffe2ckpt.sharding import new_rows

LAYOUT_BLOBS = {"rows": ["emb", "emb_*"], "replicated": ["w"]}  # epoch_limiter's: by default
ROWS, COLS = 1000, 8


def layout(partition: str = "range") -> Layout:
    return Layout(partition=partition, **LAYOUT_BLOBS)


def reference(epochs: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole table and the weights after ``epochs`` epochs."""
    table = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    weights = np.full((4, 4), 1.0)
    for _ in range(epochs):
        table += np.arange(ROWS, dtype=np.float32)[:, None] % 7
        weights = weights * 1.5
    return table, weights


def share(table: np.ndarray, partition: str, index: int, count: int) -> np.ndarray:
    rows = new_rows(partition, index, count, table.shape[0])
    return table[rows.start:rows.stop:rows.step]


def build(num_nodes: int, epochs: int, partition: str = "range") -> Job:
    """The job on ``num_nodes`` nodes ``trainer_0 ..``, stopping after ``epochs`` epochs."""
    with Job(name="elastic") as job:
        for k in range(num_nodes):
            node = f"trainer_{k}"
            rows = new_rows(partition, k, num_nodes, ROWS)

            def init(ws, rows=rows):
                table, weights = reference(0)
                ws["emb"] = table[rows.start:rows.stop:rows.step].copy()
                ws["w"] = weights

            def train(ws, rows=rows):
                # the share's global row numbers come from the workspace's rows: the table's
                # first column holds row * COLS + epoch sums, so use the stored ids instead
                ws["emb"] = ws["emb"] + (np.arange(ROWS, dtype=np.float32)[
                    rows.start:rows.stop:rows.step][:, None] % 7)
                ws["w"] = ws["w"] * 1.5

            with Node(node):
                with job.init_group:
                    Task(init, name="init")
                Task(train, name="train")
        epoch_limiter(job, epochs)
    return job


def assert_holds_reference(session, partition: str, count: int, epochs: int) -> None:
    """Each of the ``count`` nodes ``trainer_k`` of ``session`` holds its share of the table
    after ``epochs`` epochs, bit-exact, and the weights."""
    table, weights = reference(epochs)
    for k in range(count):
        ws = session.workspace(f"trainer_{k}")
        assert ws["emb"].tobytes() == share(table, partition, k, count).tobytes()
        assert np.array_equal(ws["w"], weights)

