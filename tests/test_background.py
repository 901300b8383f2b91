"""Async (background) saves: snapshots isolate the next epoch, errors are never lost."""

from __future__ import annotations

import numpy as np
import pytest

from caffe2ckpt import (
    CheckpointWriteError,
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    epoch_limiter,
)
from caffe2ckpt.example import build_job
from caffe2ckpt.metadata import ZarrMetadataHandler

BIG = 1 << 22  # float64 elements: 32 MiB, so the background write takes a while


def in_place_job(num_epochs: int) -> Job:
    """Each epoch adds 1 to every element of two blobs *in place* (no new arrays)."""
    with Job(name="in-place") as job:
        with Node("n"):
            with job.init_group:
                def init(ws):
                    ws["big"] = np.zeros(BIG)
                    ws["small"] = np.zeros(7, np.int64)
                Task(init)

            def bump(ws):
                ws["big"] += 1.0  # mutates the array a background save may still be writing
                ws["small"] += 1
            Task(bump)
        epoch_limiter(job, num_epochs)
    return job


def test_next_epoch_never_leaks_into_the_snapshot(prefix):
    cm = MultiNodeCheckpointManager(prefix, async_save=True)
    assert JobRunner(in_place_job(4), cm).train(LocalSession()) == 4
    assert cm.pending_epoch is None  # train waited for the last save
    for epoch in range(5):
        data = cm.store.load_node("n", epoch)
        assert np.array_equal(data["big"], np.full(BIG, float(epoch))), epoch
        assert np.array_equal(data["small"], np.full(7, epoch)), epoch


def test_snapshot_is_taken_before_save_returns(prefix):
    session = LocalSession()
    ws = session.workspace("n")
    ws["big"] = np.zeros(BIG)
    cm = MultiNodeCheckpointManager(prefix, async_save=True)
    session.run(cm.init(["n"]))
    session.run(cm.save(1))
    assert cm.pending_epoch == 1
    ws["big"][:] = 7.0  # while epoch 1 may still be written
    records = cm.wait_until_finished()
    assert set(records) == {"n"} and records["n"].epoch == 1
    assert not cm.store.load_node("n", 1)["big"].any()


def test_async_run_equals_sync_run(tmp_path):
    finals = []
    for mode in (False, True):
        session = LocalSession()
        cm = MultiNodeCheckpointManager(str(tmp_path / f"async-{mode}"), async_save=mode,
                                        metadata_handler=ZarrMetadataHandler())
        JobRunner(build_job(5), cm).train(session)
        finals.append({n: {k: v.tobytes() for k, v in session.workspace(n).items()}
                       for n in ("trainer_0", "trainer_1")})
        assert cm.store.latest_epoch(["trainer_0", "trainer_1"]) == 5
    assert finals[0] == finals[1]


def unwritable(tmp_path) -> str:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    return str(blocker / "ckpt")


def test_background_failure_is_raised_at_the_next_save(tmp_path):
    cm = MultiNodeCheckpointManager(unwritable(tmp_path), async_save=True)
    runner = JobRunner(build_job(3), cm, on_save_error="raise")
    with pytest.raises(CheckpointWriteError) as info:
        runner.train(LocalSession())
    assert info.value.epoch == 0 and "epoch 0" in str(info.value)
    assert runner.failed_saves == [0]


def test_background_failures_are_reported_with_warn(tmp_path, caplog):
    runner = JobRunner(build_job(3), MultiNodeCheckpointManager(unwritable(tmp_path),
                                                                async_save=True))
    assert runner.train(LocalSession()) == 3
    assert runner.failed_saves == [0, 1, 2, 3]  # the last one found at the end of train
    assert sum("Unable to write checkpoint" in r.message for r in caplog.records) == 4


def test_explicit_wait_raises_then_clears(tmp_path):
    session = LocalSession()
    session.workspace("n")["x"] = np.arange(3)
    cm = MultiNodeCheckpointManager(unwritable(tmp_path), async_save=True)
    session.run(cm.init(["n"]))
    session.run(cm.save(2))
    with pytest.raises(CheckpointWriteError, match="epoch 2"):
        cm.wait_until_finished()
    assert cm.pending_epoch is None and cm.wait_until_finished() == {}
