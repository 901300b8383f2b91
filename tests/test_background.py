"""Async (background) saves: snapshots isolate the next epoch, errors are never lost."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
from faultfs import FaultyFileSystem

from caffe2ckpt import (
    CheckpointManager,
    CheckpointWriteError,
    Job,
    JobDefinitionError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    StepCheckpointManager,
    StepManagerOptions,
    Task,
    epoch_limiter,
)
from caffe2ckpt.background import BackgroundSaves
from caffe2ckpt.example import build_job
from caffe2ckpt.manager import _nodeops as nodeops
from caffe2ckpt.metadata import ZarrMetadataHandler
from tests.stores import load, newest_epoch

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
        data = load(cm.store, "n", epoch)
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
    assert not load(cm.store, "n", 1)["big"].any()


def test_async_run_equals_sync_run(tmp_path):
    finals = []
    for mode in (False, True):
        session = LocalSession()
        cm = MultiNodeCheckpointManager(str(tmp_path / f"async-{mode}"), async_save=mode,
                                        metadata_handler=ZarrMetadataHandler())
        JobRunner(build_job(5), cm).train(session)
        finals.append({n: {k: v.tobytes() for k, v in session.workspace(n).items()}
                       for n in ("trainer_0", "trainer_1")})
        assert newest_epoch(cm.store, ["trainer_0", "trainer_1"]) == 5
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
    with pytest.raises(CheckpointWriteError, match="epoch 2"):  # it cannot even claim there
        session.run(cm.save(2))
    assert cm.pending_epoch is None and cm.wait_until_finished() == {}


# -- a snapshot buffer belongs to one save until its write is waited for ------------------------

class GatedFileSystem(FaultyFileSystem):
    """Chunk writes wait until :attr:`gate` opens: a background save is still reading its
    snapshot."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate = threading.Event()

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        if "/c." in str(path):
            assert self.gate.wait(timeout=60)
        return super().pipe_file(path, value, mode, **kwargs)


def test_two_save_runnables_built_before_running_never_share_buffers(memory_fs):
    session = LocalSession()
    ws = session.workspace("n")
    ws["big"] = np.zeros(BIG)
    ws["small"] = np.zeros(7, np.int64)
    fs = GatedFileSystem(memory_fs)
    cm = MultiNodeCheckpointManager("/gated", filesystem=fs, async_save=True)
    session.run(cm.init(["n"]))
    s1, s2 = cm.save(1), cm.save(2)
    session.run(s1)  # epoch 1 is now written from the snapshot buffers (held at the gate)
    ws["big"][:] = 2.0
    ws["small"][:] = 2
    with pytest.raises(CheckpointWriteError, match=r"epoch 1 .*saving epoch 2"):
        session.run(s2)  # refused before it touches the buffers epoch 1 is written from
    fs.gate.set()
    assert cm.wait_until_finished()["n"].epoch == 1
    data = load(cm.store, "n", 1)
    assert not data["big"].any() and not data["small"].any()
    session.run(s2)  # once epoch 1 is done, the same runnable saves epoch 2
    cm.close()
    assert np.array_equal(load(cm.store, "n", 2)["big"], np.full(BIG, 2.0))


def test_step_manager_async_saves_never_share_buffers(prefix):
    opts = StepManagerOptions(enable_async_checkpointing=True)
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        big = np.zeros(BIG)
        for step in range(3):
            big[:] = step
            mgr.save(step, {"n": {"big": big}})
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        for step in range(3):
            assert np.array_equal(mgr.restore(step)["n"]["big"], np.full(BIG, float(step)))


def save_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("caffe2ckpt-save")]


def test_async_managers_leave_no_idle_threads(tmp_path):
    managers = []  # kept alive and never closed: still no thread may be left behind
    for i in range(12):
        session = LocalSession()
        session.workspace("n")["x"] = np.arange(3)
        cm = MultiNodeCheckpointManager(str(tmp_path / f"m{i}"), async_save=True)
        session.run(cm.init(["n"]))
        session.run(cm.save(1))
        cm.wait_until_finished()
        managers.append(cm)
    for thread in save_threads():
        thread.join(timeout=10)  # a save's thread may still be returning from its last call
    assert save_threads() == []
    with MultiNodeCheckpointManager(str(tmp_path / "ctx"), async_save=True) as cm:
        session = LocalSession()
        session.workspace("n")["x"] = np.arange(3)
        session.run(cm.init(["n"]))
        session.run(cm.save(4))
    assert cm.pending_epoch is None and newest_epoch(cm.store, ["n"]) == 4  # exit waited


def test_a_manager_collected_while_its_thread_holds_the_registry_does_not_deadlock():
    """A manager never closed is forgotten by a finalizer, which the garbage collector can run
    inside any allocation: once it ran in ``release_saves`` while that thread held the
    registry's lock, and the test suite hung (seen under load). Here the thread holding the
    lock forgets a key itself; the key is dropped by the registry's next user."""
    key, other = f"gone-{uuid.uuid4().hex}", f"live-{uuid.uuid4().hex}"
    nodeops.saves_for(key, "n")

    def finalizer_inside_locked_section():
        with nodeops._saves_lock:
            nodeops.forget_saves(key)
    thread = threading.Thread(target=finalizer_inside_locked_section, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "forget_saves waited for the lock its own thread holds"
    assert (key, "n") in nodeops._saves  # left to the registry's next user
    nodeops.saves_for(other, "n")
    assert (key, "n") not in nodeops._saves and (other, "n") in nodeops._saves
    nodeops.forget_saves(other)  # with the lock free: dropped at once
    assert (other, "n") not in nodeops._saves


def unstageable(memory_fs) -> FaultyFileSystem:
    """A filesystem where a run can claim the prefix but no chunk can be written."""
    fs = FaultyFileSystem(memory_fs)
    fs.arm("write", 1, sticky=True, match=lambda method, path: "/c." in path)
    return fs


@pytest.mark.parametrize("manager", ["multi", "single"])
def test_close_raises_a_background_failure(memory_fs, manager):
    session = LocalSession()
    session.workspace("n")["x"] = np.arange(3)
    fs = unstageable(memory_fs)
    if manager == "multi":
        cm = MultiNodeCheckpointManager("/ckpt", filesystem=fs, async_save=True)
        session.run(cm.init(["n"]))
    else:
        cm = CheckpointManager("/ckpt", "n", filesystem=fs, async_save=True)
        session.run(cm.init())
    session.run(cm.save(3))
    with pytest.raises(CheckpointWriteError, match="epoch 3 failed on node 'n'"):
        cm.close()
    cm.close()  # raised once, never dropped, never twice
    session.run(cm.save(4))
    with pytest.raises(CheckpointWriteError, match="epoch 4"):
        with cm:
            pass


def test_background_saves_close_raises_instead_of_dropping():
    saves = BackgroundSaves()

    def fail(copies):
        raise OSError(28, "No space left on device")

    saves.submit(5, "n", {"x": np.arange(3)}, fail)
    with pytest.raises(CheckpointWriteError, match="epoch 5 failed on node 'n'.*No space"):
        saves.close()
    assert saves.pending_epoch is None


def test_enable_async_checkpointing_given_to_a_job_runner_is_its_managers_async_save(prefix,
                                                                                       caplog):
    """Issue 34 item 5.6: Orbax's name in JobRunner's options was ignored (every save
    synchronous). It is an alias of the manager's async_save; a manager made with
    async_save=False is a contradiction, refused before anything runs."""
    options = StepManagerOptions(enable_async_checkpointing=True)
    with caplog.at_level("INFO", logger="caffe2ckpt.runner"):
        cm = MultiNodeCheckpointManager(prefix)
        assert JobRunner(build_job(3), cm, options=options).train(LocalSession()) == 3
    background = [r.getMessage() for r in caplog.records if "in the background" in r.getMessage()]
    assert len(background) == 4, background  # epochs 0-3, each written in the background
    assert newest_epoch(cm.store, ["trainer_0", "trainer_1"]) == 3
    with pytest.raises(JobDefinitionError, match="async_save=False") as caught:
        JobRunner(build_job(4), MultiNodeCheckpointManager(prefix, async_save=False),
                  options=options).train(LocalSession())
    assert "enable_async_checkpointing=True" in str(caught.value)
    assert newest_epoch(cm.store, ["trainer_0", "trainer_1"]) == 3  # nothing ran
