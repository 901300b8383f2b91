"""StepCheckpointManager: every method of Orbax's AbstractCheckpointManager interface, against
checkpoints it wrote and checkpoints written by JobRunner (and the reverse), on memory:// and a
local directory."""

from __future__ import annotations

import errno
import gc
import math
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from faultfs import FaultyFileSystem

from caffe2ckpt import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    InvalidBlobError,
    InvalidLocationError,
    JobDefinitionError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    StepCheckpointManager,
    StepManagerOptions,
)
from caffe2ckpt.example import build_job
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.steps import BlobMetadata, RootMetadata, StepMetadata
from caffe2ckpt.store.format.records import list_records
from tests.stores import gone

NODES = ["trainer_0", "trainer_1"]


def items(step: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(step)
    return {
        "trainer_0": {"w": rng.normal(size=(64, 3)).astype(np.float32), "step": np.int64(step)},
        "trainer_1": {"w": rng.normal(size=(5,)), "names": np.array(["a", "bc"])},
    }


def assert_same(actual, expected) -> None:
    assert set(actual) == set(expected)
    for node in expected:
        assert set(actual[node]) == set(expected[node]), node
        for name, value in expected[node].items():
            value = np.asarray(value)
            got = actual[node][name]
            assert got.dtype == value.dtype and got.shape == value.shape, (node, name)
            assert got.tobytes() == value.tobytes(), (node, name)


def manager(prefix: str, **kwargs) -> StepCheckpointManager:
    return StepCheckpointManager(prefix, handle_preemption=False, **kwargs)


def test_save_list_restore_metadata_round_trip(prefix):
    with manager(prefix, metadata={"model": "linear", "version": 2}) as mgr:
        assert mgr.directory == (prefix if "://" in prefix else Path(prefix))
        assert mgr.all_steps() == [] and mgr.latest_step() is None and mgr.best_step() is None
        for step in (0, 3, 7):
            assert mgr.save(step, items(step), metrics={"loss": 10.0 - step, "acc": step / 10})
        assert mgr.all_steps() == [0, 3, 7] and mgr.latest_step() == 7
        assert_same(mgr.restore(3), items(3))
        assert_same(mgr.restore(), items(7))  # default: the latest step
        part = mgr.restore(3, nodes=["trainer_1"], blobs=["w"])
        assert_same(part, {"trainer_1": {"w": items(3)["trainer_1"]["w"]}})
        assert mgr.metrics(3) == {"loss": 7.0, "acc": 0.3}
        meta = mgr.item_metadata(7)
        assert meta["trainer_0"]["w"] == BlobMetadata("<f4", (64, 3), 64 * 3 * 4)
        assert meta["trainer_1"]["names"] == BlobMetadata("<U2", (2,), 16)
        step_meta = mgr.metadata(7)
        assert isinstance(step_meta, StepMetadata)
        assert step_meta.nodes == NODES and step_meta.metrics == {"loss": 3.0, "acc": 0.7}
        assert step_meta.nbytes == sum(np.asarray(v).nbytes for n in items(7).values()
                                       for v in n.values())
        assert step_meta.writer["manager"] == "StepCheckpointManager"
        root = mgr.metadata()
        assert root == RootMetadata(directory=prefix, steps=[0, 3, 7],
                                    custom={"model": "linear", "version": 2})
    again = manager(prefix)  # a new manager sees what the first one committed
    assert again.all_steps() == [0, 3, 7] and again.metadata().custom["model"] == "linear"
    again.close()


def test_best_step_uses_best_fn_and_mode(prefix):
    losses = {1: 0.5, 2: float("nan"), 3: 0.2, 4: 0.9}
    with manager(prefix, options=StepManagerOptions(best_fn="loss", best_mode="min")) as mgr:
        for step, loss in losses.items():
            mgr.save(step, items(step), metrics={"loss": loss})
        assert mgr.best_step() == 3
        assert math.isnan(mgr.metrics(2)["loss"])  # NaN round-trips through the record
    with manager(prefix, options=StepManagerOptions(best_fn=lambda m: m["loss"],
                                                   best_mode="max")) as mgr:
        assert mgr.best_step() == 4  # NaN is never best
    with manager(prefix) as mgr:  # no best_fn: the latest step, as in Orbax
        assert mgr.best_step() == 4


def test_should_save_follows_the_policy_and_never_repeats_a_step(prefix):
    with manager(prefix, options=StepManagerOptions(save_interval_steps=3,
                                                   save_on_steps=[4])) as mgr:
        wanted = [s for s in range(10) if mgr.should_save(s)]
        assert wanted == [0, 3, 4, 6, 9]
        saved = [s for s in range(10) if mgr.save(s, items(s))]
        assert saved == wanted and mgr.all_steps() == wanted
        assert not mgr.should_save(3)  # committed already
        assert mgr.save(3, items(30), force=True)  # force re-saves it
        assert_same(mgr.restore(3), items(30))


def test_steps_at_or_below_the_latest_are_not_saved_unless_forced_as_in_orbax(prefix):
    with manager(prefix, options=StepManagerOptions(save_interval_steps=3)) as mgr:
        for step in range(7):
            mgr.save(step, items(step))
        assert mgr.all_steps() == [0, 3, 6]
        # Orbax's rule: nothing at or below the latest step, whatever the policy says
        assert [s for s in range(13) if mgr.should_save(s)] == [9, 12]
        assert not mgr.save(4, items(4)) and not mgr.save(6, items(60))  # False, as Orbax
        assert mgr.all_steps(read=True) == [0, 3, 6] and mgr.latest_step() == 6
        assert_same(mgr.restore(6), items(6))
        # force below the latest goes back: a new run from step 3 (the newest step below 4),
        # so step 6 is superseded and every API agrees that 4 is the latest
        assert mgr.save(4, items(4), force=True)
        assert mgr.all_steps() == [0, 3, 4] and mgr.latest_step() == 4
        assert mgr.all_steps(read=True) == [0, 3, 4] and mgr.latest_step() == 4


def test_after_preemption_should_save_is_still_false_at_or_below_the_latest(prefix):
    with StepCheckpointManager(prefix) as mgr:
        mgr.save(2, items(2))
        signal.raise_signal(signal.SIGTERM)  # only sets the flag
        assert mgr.reached_preemption(2)
        assert [s for s in range(5) if mgr.should_save(s)] == [3, 4]


def test_delete_removes_records_then_data_of_its_nodes(prefix):
    with manager(prefix) as mgr:
        for step in range(3):
            mgr.save(step, items(step))
        mgr.delete(1)
        assert mgr.all_steps() == [0, 2] and mgr.all_steps(read=True) == [0, 2]
        assert not any(r.epoch == 1 for r in list_records(mgr._store.location))
        assert gone(mgr._store.location, "trainer_0.1")
        with pytest.raises(CheckpointNotFoundError, match=r"step 1 is not committed .*\[0, 2\]"):
            mgr.restore(1)
        with pytest.raises(CheckpointNotFoundError, match="step 5"):
            mgr.delete(5)


def test_manager_owning_some_nodes_never_touches_others(prefix):
    with manager(prefix) as both:
        both.save(0, items(0))
    with manager(prefix, nodes=["trainer_1"], options=StepManagerOptions(max_to_keep=1)) as one:
        assert one.all_steps() == []  # step 0 is the two-node job's, not trainer_1 alone's
        one.save(1, {"trainer_1": items(1)["trainer_1"]})
        one.save(2, {"trainer_1": items(2)["trainer_1"]})
        assert one.all_steps() == [2]
        with pytest.raises(CheckpointNotFoundError, match="step 0"):  # not its job's step
            one.delete(0)
        with pytest.raises(InvalidLocationError, match="saves nodes"):
            one.save(3, items(3))
    with manager(prefix, nodes=NODES) as both:  # retention never deleted half of step 0
        assert both.all_steps(read=True) == [0] and both.metadata(0).nodes == NODES
        assert_same(both.restore(0), items(0))
    with manager(prefix) as anyone:  # without nodes: every job's current steps
        assert anyone.all_steps() == [0, 2]


def test_reload_sees_steps_written_elsewhere(prefix):
    reader = manager(prefix)
    with manager(prefix) as writer:
        writer.save(4, items(4))
    assert reader.all_steps() == []  # cached
    assert reader.all_steps(read=True) == [4]
    writer2 = manager(prefix)
    writer2.save(5, items(5))
    writer2.close()
    reader.reload()
    assert reader.latest_step() == 5
    reader.close()


def test_bad_input_is_refused_before_anything_is_written(prefix):
    with manager(prefix) as mgr:
        with pytest.raises(InvalidLocationError, match="epoch -1 is out of range"):
            mgr.save(-1, items(0))
        with pytest.raises(InvalidLocationError, match="'3'"):
            mgr.save("3", items(0))
        with pytest.raises(InvalidLocationError, match="non-empty mapping"):
            mgr.save(1, {})
        with pytest.raises(InvalidLocationError, match=r"node name '\.\.'"):
            mgr.save(1, {"..": {"w": np.zeros(2)}})
        with pytest.raises(InvalidBlobError, match="obj"):
            mgr.save(1, {"a": {"obj": np.array([object()])}})
        assert not mgr._store.location.exists(mgr._store.location.root)  # nothing written
        with pytest.raises(CheckpointNotFoundError, match=r"no nodes \['nope'\]"):
            mgr.save(0, items(0))
            mgr.restore(0, nodes=["nope"])
        with pytest.raises(CheckpointNotFoundError, match=r"no blobs \['nope'\]"):
            mgr.restore(0, blobs=["nope"])
        assert mgr.all_steps(read=True) == [0]
    with pytest.raises(JobDefinitionError, match="keep_best needs best_fn"):
        StepManagerOptions(keep_best=2)
    with pytest.raises(JobDefinitionError, match="max_to_keep"):
        StepManagerOptions(max_to_keep=0)


def test_async_saves_commit_in_the_background_and_report_errors(prefix):
    opts = StepManagerOptions(enable_async_checkpointing=True, max_to_keep=2)
    with manager(prefix, options=opts) as mgr:
        data = items(1)
        assert mgr.save(1, data)
        data["trainer_0"]["w"][:] = -1  # changed after save() returned: not in the snapshot
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        assert_same(mgr.restore(1), items(1))
        for step in (2, 3):
            mgr.save(step, items(step))
        mgr.check_for_errors()
    # close() waited and retention ran; step 1 was restored, so it is protected (resumed from)
    assert manager(prefix).all_steps() == [1, 2, 3]



def step_1_then_failing_writes(memory_fs) -> tuple[FaultyFileSystem, StepCheckpointManager]:
    """An async manager with step 1 committed, and every write from the third on failing."""
    fs = FaultyFileSystem(memory_fs)
    mgr = StepCheckpointManager("/async", filesystem=fs, handle_preemption=False,
                                options=StepManagerOptions(enable_async_checkpointing=True))
    mgr.save(1, items(1))
    mgr.wait_until_finished()
    fs.arm("write", 3, sticky=True)
    return fs, mgr


def test_restoring_another_step_leaves_a_failed_background_save_to_be_raised_later(memory_fs):
    """restore(k) waits for the save in flight, but that save's failure is its own error:
    raised by restore only for that step, else once by the next wait (found by review)."""
    fs, mgr = step_1_then_failing_writes(memory_fs)
    assert mgr.save(2, items(2))
    assert_same(mgr.restore(1), items(1))
    assert_same(mgr.restore(1), items(1))  # the failure is not this step's either
    fs.reset()
    with pytest.raises(CheckpointWriteError, match="epoch 2"):
        mgr.wait_until_finished()
    mgr.check_for_errors()  # raised once
    assert mgr.all_steps(read=True) == [1]
    mgr.close()


def test_a_failed_background_save_is_raised_once_and_commits_nothing(memory_fs):
    fs, mgr = step_1_then_failing_writes(memory_fs)
    assert mgr.save(2, items(2))  # returns after the snapshot; the writes fail later
    with pytest.raises(CheckpointWriteError, match="epoch 2") as err:
        mgr.wait_until_finished()
    assert "injected" in str(err.value.__cause__)
    fs.reset()
    mgr.check_for_errors()  # already raised: not raised twice
    assert mgr.all_steps(read=True) == [1]
    assert_same(mgr.restore(1), items(1))
    mgr.close()


def test_steps_written_by_jobrunner_are_visible_and_restorable(prefix):
    session = LocalSession()
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    JobRunner(build_job(3, 2, batches_per_epoch=2), cm).train(session)
    with manager(prefix) as mgr:
        assert mgr.all_steps() == [0, 1, 2, 3]
        restored = mgr.restore(3)
        names = cm.blob_list()  # the blobs present after init are the checkpointed ones
        assert_same(restored, {n: {b: session.workspace(n)[b] for b in names[n]} for n in NODES})
        loss = float(session.workspace("trainer_0")["loss"])
        assert mgr.metrics(3) == {"loss": pytest.approx(loss)}  # the example job's metric
        assert mgr.metrics(0) is None
        assert mgr.metadata(3).stop and not mgr.metadata(2).stop
        assert mgr.metadata(3).writer == cm.lineage_save(3).records["trainer_0"].writer
        meta = mgr.item_metadata(2)
        ws = session.workspace("trainer_1")
        assert meta["trainer_1"]["model/w"] == BlobMetadata(ws["model/w"].dtype.str,
                                                            ws["model/w"].shape, ws["model/w"].nbytes)
        assert set(meta["trainer_0"]) == set(names["trainer_0"])
    with manager(prefix, options=StepManagerOptions(best_fn="loss")) as mgr:
        losses = {e: mgr.metrics(e)["loss"] for e in (1, 2, 3)}
        assert mgr.best_step() == min(losses, key=losses.get)
        mgr.delete(1)
        assert mgr.latest_step() == 3 and mgr.all_steps() == [0, 2, 3]
    # the job sees the deletion too: resuming explicitly from epoch 1 now fails clearly
    with pytest.raises(CheckpointNotFoundError, match="epoch 1 is not committed"):
        JobRunner(build_job(3, 2, batches_per_epoch=2), MultiNodeCheckpointManager(
            prefix, metadata_handler=ZarrMetadataHandler()), resume_from_epoch=1).train(LocalSession())


def test_jobrunner_resumes_from_a_step_saved_by_the_manager(prefix):
    reference = LocalSession()
    JobRunner(build_job(4, 2, batches_per_epoch=2)).train(reference)
    first = LocalSession()
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    JobRunner(build_job(2, 2, batches_per_epoch=2), cm).train(first)
    with manager(prefix) as mgr:  # re-save step 2's workspaces under a new save as step 2
        state = mgr.restore(2)
        mgr.delete(2)
        mgr.save(2, state, force=True)
    session = LocalSession()
    runner = JobRunner(build_job(4, 2, batches_per_epoch=2),
                       MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler()))
    assert runner.train(session) == 4 and runner.resumed_from == 2
    assert_same({n: dict(session.workspace(n).items()) for n in NODES},
                {n: dict(reference.workspace(n).items()) for n in NODES})


def test_preemption_flag_is_set_by_sigterm_and_restored_on_close(prefix):
    before = signal.getsignal(signal.SIGTERM)
    mgr = StepCheckpointManager(prefix)
    assert not mgr.reached_preemption(0)
    signal.raise_signal(signal.SIGTERM)  # only sets the flag
    assert mgr.reached_preemption(0) and mgr.should_save(1)
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("order", ["creation", "reverse"])
def test_sigterm_handler_comes_back_whatever_the_closing_order(prefix, order):
    before = signal.getsignal(signal.SIGTERM)
    first, second = StepCheckpointManager(prefix), StepCheckpointManager(prefix)
    for mgr in (first, second) if order == "creation" else (second, first):
        mgr.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_handler_comes_back_when_an_unclosed_manager_is_collected(prefix):
    before = signal.getsignal(signal.SIGTERM)
    mgr = StepCheckpointManager(prefix)
    mgr.save(0, {"n": {"w": np.zeros(2)}})
    del mgr
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is before


def test_preemption_reaches_every_open_manager_during_a_save_loop(prefix):
    before = signal.getsignal(signal.SIGTERM)
    with StepCheckpointManager(f"{prefix}-other") as other:
        with StepCheckpointManager(prefix) as mgr:
            other.close()  # closed first: must not take mgr's handler away
            for step in range(5):
                mgr.save(step, {"n": {"w": np.full(2, step)}})
                if step == 2:
                    signal.raise_signal(signal.SIGTERM)  # only sets the flag
                if mgr.reached_preemption(step):
                    break
            assert step == 2 and mgr.all_steps() == [0, 1, 2]
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("where", ["under a file", "disk full"])
def test_a_synchronous_save_failure_names_step_and_node(tmp_path, memory_fs, where):
    if where == "under a file":
        (tmp_path / "a_file").write_text("not a directory")
        mgr = StepCheckpointManager(str(tmp_path / "a_file" / "ckpt"), handle_preemption=False)
        match = r"step 1.*a_file/ckpt"
    else:
        fs = FaultyFileSystem(memory_fs)
        mgr = StepCheckpointManager("/full", filesystem=fs, handle_preemption=False)
        mgr.save(0, {"trainer_0": {"w": np.zeros(2)}})
        fs.arm("write", 1, errno.ENOSPC, sticky=True, match=lambda method, path: "_hints" not in path)
        match = r"saving step 1 of node 'trainer_0' to '/full/trainer_0.1' failed"
    with pytest.raises(CheckpointWriteError, match=match) as info:
        mgr.save(1, {"trainer_0": {"w": np.ones(2)}})
    assert isinstance(info.value.__cause__, OSError)
    mgr.close()


def test_questions_after_a_restore_read_the_prefix_once(memory_fs):
    """A step manager keeps its view of the steps until reload(), as Orbax's does: questions
    after a restore (which starts a new run) read the prefix once, not once per question
    (found by review: every should_save re-read every record)."""
    fs = FaultyFileSystem(memory_fs)
    with StepCheckpointManager("/steady", filesystem=fs, handle_preemption=False) as mgr:
        for step in range(20):
            mgr.save(step, items(step))
    mgr = StepCheckpointManager("/steady", filesystem=fs, handle_preemption=False)
    mgr.restore(19)
    fs.reset()
    for step in range(20, 30):
        assert mgr.should_save(step) and mgr.latest_step() == 19
        assert mgr.all_steps() == list(range(20))
    assert fs.counts["list"] <= 3, fs.ops("list")
    mgr.close()


def test_a_new_runs_async_save_listed_before_its_commit_survives_its_retention(prefix):
    """A manager goes back (a new run) with an async save; before the save is waited for, a
    listing reads the prefix, where the save has already committed. The run's first commit must
    not count that save among the ones it supersedes: retention keeps it (found by the model
    check: seed 13 deleted the newest step)."""
    from caffe2ckpt.store.format.records import list_records

    with manager(prefix) as first:
        for step in (3, 6):
            first.save(step, items(step))
    options = StepManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
    with manager(prefix, options=options) as mgr:
        assert mgr.save(9, items(9), force=True)
        mgr.delete(9)
        assert mgr.save(9, items(90))  # a new run: its parent is 6
        deadline = time.monotonic() + 30
        while len([r for r in list_records(mgr._store.location) if r.epoch == 9]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert mgr.latest_step() == 9  # a listing after the background commit
    with manager(prefix) as check:
        assert check.all_steps() == [9]
        assert_same(check.restore(9), items(90))


def test_a_forced_save_below_the_newest_says_what_it_supersedes(prefix, caplog):
    """Issue 34 item 5.4: the first commit of a run that goes back names what it supersedes
    (INFO)."""
    items = {"n0": {"w": np.arange(4.0)}}
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        for step in range(6):
            mgr.save(step, items)
    with caplog.at_level("INFO", logger="caffe2ckpt"):
        with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
            assert mgr.save(3, items, force=True) and mgr.save(4, items)
            assert mgr.all_steps() == [0, 1, 2, 3, 4]
    assert [r.getMessage() for r in caplog.records if "supersedes" in r.getMessage()] == [
        f"epoch 3 committed under {prefix!r}; it supersedes epochs 3-5 of run 1 (they stay on "
        "disk until retention or gc removes them)"]
