"""Two runs on one prefix, transient I/O errors, and a prefix whose every epoch is damaged."""

from __future__ import annotations

import errno

import fsspec
import numpy as np
import pytest

from caffe2ckpt import (
    CheckpointCorruptedError,
    CheckpointFencedError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
)
from caffe2ckpt.example import build_job
from caffe2ckpt.metadata import ZarrMetadataHandler
from tests.faultfs import FaultyFileSystem


def saver(prefix: str) -> tuple[LocalSession, MultiNodeCheckpointManager]:
    session = LocalSession()
    session.workspace("n")["w"] = np.arange(4.0)
    cm = MultiNodeCheckpointManager(prefix)
    session.run(cm.init(["n"]))
    return session, cm


def test_an_older_claim_is_fenced_and_commits_nothing(prefix):
    (old_session, old), (new_session, new) = saver(prefix), saver(prefix)
    old_claim = old.claim({"run": "old"})
    new_claim = new.claim({"run": "new"})
    assert old_claim < new_claim  # numbered in creation order, not by clock
    with pytest.raises(CheckpointFencedError, match="newer run") as info:
        old_session.run(old.save(1, claim=old_claim))
    assert "'run': 'new'" in str(info.value)
    assert old.store.epochs_with_records(["n"]) == []
    new_session.run(new.save(1, claim=new_claim))
    assert new.store.latest_epoch(["n"]) == 1


def test_a_fenced_runner_stops_even_when_warning(prefix):
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())

    def intruder(ws):  # another run claims the prefix during epoch 2
        if int(ws["epoch"]) == 1:
            cm.store.claim({"run": "intruder"})
    job = build_job(4)
    job.epoch_group.tasks[0].fn = lambda ws, f=job.epoch_group.tasks[0].fn: (intruder(ws), f(ws))
    runner = JobRunner(job, cm)  # on_save_error="warn" does not apply to fencing
    with pytest.raises(CheckpointFencedError):
        runner.train(LocalSession())
    assert cm.store.latest_epoch(["trainer_0", "trainer_1"]) == 1


def test_an_io_error_while_reading_is_not_taken_for_corruption(memory_fs):
    JobRunner(build_job(3), MultiNodeCheckpointManager(
        "memory://io", metadata_handler=ZarrMetadataHandler())).train(LocalSession())
    faulty = FaultyFileSystem(fsspec.filesystem("memory"))
    faulty.arm("read", 1, errno.EIO, sticky=True)
    cm = MultiNodeCheckpointManager("/io", filesystem=faulty,
                                    metadata_handler=ZarrMetadataHandler())
    runner = JobRunner(build_job(5), cm)
    with pytest.raises(OSError) as info:  # no silent fall back to an older epoch
        runner.train(LocalSession())
    assert not isinstance(info.value, CheckpointCorruptedError)
    assert runner.resumed_from is None


def test_every_epoch_damaged_refuses_to_start_over(prefix, memory_fs):
    JobRunner(build_job(2), MultiNodeCheckpointManager(prefix)).train(LocalSession())
    fs, root = fsspec.core.url_to_fs(prefix)
    for epoch in range(3):
        fs.pipe_file(f"{root}/trainer_0.{epoch}/zarr.json", b"{}")
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    with pytest.raises(CheckpointCorruptedError, match=r"damaged: \[0, 1, 2\]"):
        JobRunner(build_job(2), cm).train(LocalSession())


def test_nodes_given_as_a_string_are_rejected(prefix):
    from caffe2ckpt import JobDefinitionError
    with pytest.raises(JobDefinitionError, match="list of node names"):
        MultiNodeCheckpointManager(prefix).init("ab")


def test_claims_past_twelve_digits_are_ordered_by_number(prefix):
    session, cm = saver(prefix)
    loc = cm.store.location
    loc.create_exclusive(loc.path("_claims", "claim-999999999999.json"), b"{}")  # planted
    loc.create_exclusive(loc.path("_claims", "claim-².json"), b"{}")  # not a claim number
    first = cm.claim({"run": "first"})
    assert first == "claim-1000000000000.json"  # sorts *before* 999999999999 as a string
    session.run(cm.save(1, claim=first))  # the newest claim is not fenced
    assert cm.store.latest_epoch(["n"]) == 1
    second = cm.claim({"run": "second"})
    assert second == "claim-1000000000001.json"
    with pytest.raises(CheckpointFencedError, match="claim-1000000000001"):
        session.run(cm.save(2, claim=first))
    for _ in range(9):  # pruning keeps the newest claims by number
        last = cm.store.claim(keep=2)
    names = loc.list_names(loc.path("_claims"))
    assert sorted(n for n in names if n != "claim-².json") == [
        "claim-1000000000009.json", "claim-1000000000010.json"] and last.endswith("10.json")


def test_a_stalled_fenced_save_never_retires_a_newer_runs_commit(prefix, monkeypatch):
    """Run A passes its last claim check, stalls; run B claims, saves and commits the same
    epoch; A wakes up: it must not retire B's record or remove B's group (found by review)."""
    from caffe2ckpt.store.protocol import CheckpointStore, SaveInfo, claim_generation
    from caffe2ckpt.store.records import new_save_id
    from caffe2ckpt.fs.location import Location
    a, b = CheckpointStore(Location(prefix)), CheckpointStore(Location(prefix))
    claim_a = a.claim()

    def info(claim):
        return SaveInfo(save_id=new_save_id(claim_generation(claim)), nodes=["n"], claim=claim)
    original, checks = CheckpointStore.check_claim, []

    def stall_after_the_last_check(self, claim):
        original(self, claim)
        if self is a:
            checks.append(claim)
            if len(checks) == 2:  # A's check before moving into place: B runs meanwhile
                b.save_node("n", 2, {"w": np.full(4, 222.0)}, info(b.claim()))
    monkeypatch.setattr(CheckpointStore, "check_claim", stall_after_the_last_check)
    with pytest.raises(CheckpointFencedError):
        a.save_node("n", 2, {"w": np.full(4, 111.0)}, info(claim_a))
    monkeypatch.undo()
    assert b.load_node("n", 2)["w"].tolist() == [222.0] * 4


def test_a_save_that_cannot_claim_fails_instead_of_saving_unfenced(prefix):
    """Saving without a claim would commit epochs of no generation, which the lineage ranks
    below every claimed run's: a save must claim or fail (found by review)."""
    from caffe2ckpt import CheckpointWriteError
    session, cm = saver(prefix)
    fs, root = fsspec.core.url_to_fs(prefix)
    fs.makedirs(f"{root}/_claims", exist_ok=True)
    fs.pipe_file(f"{root}/_claims/claim-999999999999999999.json", b"{}")  # the highest number
    with pytest.raises(CheckpointWriteError, match="highest number a claim may have"):
        session.run(cm.save(1))
    assert cm.store.epochs_with_records(["n"]) == []
