"""Differential saves through JobRunner: tasks hint the rows they change (or rows are
compared), a resume restores bit-exact and starts a run whose first save is whole, a job whose
workspace holds empty blobs saves differentially from its second epoch on, and a damaged group
makes the automatic resume fall back past every epoch built on it."""

from __future__ import annotations

import numpy as np
import pytest

from caffe2ckpt import (
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    StepCheckpointManager,
    StepManagerOptions,
    Task,
    epoch_limiter,
)
from caffe2ckpt.history.scan import scan
from tests.stores import open_store

ROWS = 4096
NODES = ("trainer_0", "trainer_1")


def table_after(node: str, epoch: int) -> np.ndarray:
    """The table a node holds after ``epoch`` epochs (each changes 2% of its rows)."""
    rng = np.random.default_rng(hash(node) % 1000)
    table = rng.random((ROWS, 32), dtype=np.float32)
    for e in range(1, epoch + 1):
        table[rows_of(node, e)] = np.float32(e)
    return table


def rows_of(node: str, epoch: int) -> np.ndarray:
    return np.random.default_rng(epoch * 10 + len(node)).choice(ROWS, ROWS // 50, replace=False)


def make_job(limit: int, hints: bool) -> Job:
    with Job(name="embeddings") as job:
        for node in NODES:
            def init(ws, node=node):
                ws["table"] = table_after(node, 0)
                ws["seen"] = np.int64(0)  # epochs this node ran (checkpointed)

            def epoch(ws, node=node):
                e = int(ws["seen"]) + 1
                ws["seen"] = np.int64(e)
                rows = rows_of(node, e)
                ws["table"][rows] = np.float32(e)
                if hints:
                    ws.mark_changed("table", rows)

            with Node(node):
                with job.init_group:
                    Task(init, name="init")
                Task(epoch, name="epoch")
        with Node(NODES[0]):
            epoch_limiter(job, limit)
    return job


def options(detection: str, **kw) -> StepManagerOptions:
    return StepManagerOptions(delta_saves=True, delta_detection=detection,
                              delta_min_bytes=64 << 10, **kw)


def kinds(prefix: str) -> dict[int, int]:
    """Per committed epoch of trainer_0: its delta depth (0: whole)."""
    return {r.epoch: r.delta.depth if r.delta else 0
            for r in scan(open_store(prefix)).records() if r.node == NODES[0]}


@pytest.mark.parametrize("detection", ["hints", "compare"])
def test_a_job_saves_deltas_and_resumes_bit_exact(prefix, detection):
    runner = JobRunner(make_job(5, detection == "hints"), MultiNodeCheckpointManager(prefix),
                       options=options(detection, max_delta_chain=2))
    assert runner.train(LocalSession()) == 5
    assert kinds(prefix) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5}
    seen = {}
    session = LocalSession()
    again = JobRunner(make_job(8, detection == "hints"), MultiNodeCheckpointManager(prefix),
                      options=options(detection, max_delta_chain=2))
    assert again.train(session) == 8 and again.resumed_from == 5
    for node in NODES:
        seen[node] = session.workspace(node)["table"]
        assert np.array_equal(seen[node], table_after(node, 8))
    # the resumed run's first save is whole (a delta builds only on its own run's saves)
    assert kinds(prefix) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 0, 7: 1, 8: 2}
    with StepCheckpointManager(prefix, handle_preemption=False) as reader:
        for epoch in reader.all_steps():
            got = reader.restore(epoch)
            for node in NODES:
                assert np.array_equal(got[node]["table"], table_after(node, epoch)), epoch


def test_a_save_every_n_epochs_sees_the_union_of_the_hints(prefix):
    runner = JobRunner(make_job(6, True), MultiNodeCheckpointManager(prefix),
                       options=options("hints", save_interval_steps=3))
    assert runner.train(LocalSession()) == 6
    assert kinds(prefix) == {0: 0, 3: 1, 6: 2}
    with StepCheckpointManager(prefix, handle_preemption=False) as reader:
        assert np.array_equal(reader.restore(6)[NODES[1]]["table"], table_after(NODES[1], 6))


def test_resume_falls_back_past_every_epoch_built_on_a_damaged_group(prefix):
    runner = JobRunner(make_job(5, False), MultiNodeCheckpointManager(prefix),
                       options=options("compare", max_delta_chain=2))
    runner.train(LocalSession())
    store = open_store(prefix)
    chunk = store.location.path(f"{NODES[1]}.3", "_span.table", "c.0.0")
    data = bytearray(store.location.read_bytes(chunk, limit=1 << 30))
    data[7] ^= 0x40
    store.location.replace_file(chunk, bytes(data))  # the span that 4 and 5 still read
    session = LocalSession()
    again = JobRunner(make_job(6, False), MultiNodeCheckpointManager(prefix),
                      options=options("compare", max_delta_chain=2))
    assert again.train(session) == 6 and again.resumed_from == 2
    assert np.array_equal(session.workspace(NODES[1])["table"], table_after(NODES[1], 6))


def test_a_job_with_empty_blobs_saves_differentially_without_a_warning(prefix, caplog):
    """Review D1: a save whose small blobs are all empty has no packed array; its commit
    crashed the differential state update (a bare KeyError after the record was written, a
    WARNING and a whole rewrite every epoch)."""
    with Job(name="empty") as job:
        def init(ws):  # a table of its own array (2 MiB), and an empty small blob: nothing
            ws["table"] = np.zeros((4 * ROWS, 32), np.float32)  # else to pack
            ws["ids"] = np.zeros((0, 4), np.int64)

        def epoch(ws):
            ws["table"][rows_of(NODES[1], 1)] += 1

        with Node(NODES[1]):
            with job.init_group:
                Task(init, name="init")
            Task(epoch, name="epoch")
        with Node(NODES[0]):  # the epoch counter lives here
            epoch_limiter(job, 3)
    with caplog.at_level("WARNING", logger="caffe2ckpt"):
        runner = JobRunner(job, MultiNodeCheckpointManager(prefix), options=options("compare"))
        assert runner.train(LocalSession()) == 3
    assert runner.saved_epochs == [0, 1, 2, 3] and not runner.failed_saves
    assert [r.message for r in caplog.records if r.levelname == "WARNING"] == []
    depths = {r.epoch: r.delta.depth if r.delta else 0
              for r in scan(open_store(prefix)).records() if r.node == NODES[1]}
    assert depths == {0: 0, 1: 1, 2: 2, 3: 3}
