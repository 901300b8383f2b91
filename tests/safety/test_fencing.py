"""Two runs on one prefix, transient I/O errors, and a prefix whose every epoch is damaged."""

from __future__ import annotations

import contextlib
import errno
import os

import fsspec
import numpy as np
import pytest
from fsspec import AbstractFileSystem

from caffe2ckpt import (
    CheckpointCorruptedError,
    CheckpointFencedError,
    CheckpointWriteError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    StepManagerOptions,
)
from caffe2ckpt.example import build_job
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.steps import StepCheckpointManager
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.format.paths import run_name, save_generation
from tests.faultfs import FaultyFileSystem
from tests.s3server import on_one_s3_server
from tests.stores import epochs_with_records, load, newest_epoch


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
    assert old_claim.generation < new_claim.generation  # numbered in creation order
    with pytest.raises(CheckpointFencedError, match="newer run") as info:
        old_session.run(old.save(1, claim=old_claim))
    assert "'run': 'new'" in str(info.value)
    assert epochs_with_records(old.store, ["n"]) == []
    new_session.run(new.save(1, claim=new_claim))
    assert newest_epoch(new.store, ["n"]) == 1


def test_a_fenced_runner_stops_even_when_warning(prefix):
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())

    def intruder(ws):  # another run claims the prefix during epoch 2
        if int(ws["epoch"]) == 1:
            other = MultiNodeCheckpointManager(prefix)
            other.set_params(["trainer_0", "trainer_1"])
            other.claim({"run": "intruder"})
    job = build_job(4)
    job.epoch_group.tasks[0].fn = lambda ws, f=job.epoch_group.tasks[0].fn: (intruder(ws), f(ws))
    runner = JobRunner(job, cm)  # on_save_error="warn" does not apply to fencing
    with pytest.raises(CheckpointFencedError):
        runner.train(LocalSession())
    assert newest_epoch(cm.store, ["trainer_0", "trainer_1"]) == 1


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


@pytest.mark.parametrize("what", ["groups", "records"])
def test_every_epoch_damaged_refuses_to_start_over(prefix, memory_fs, what):
    JobRunner(build_job(2), MultiNodeCheckpointManager(prefix)).train(LocalSession())
    fs, root = fsspec.core.url_to_fs(prefix)
    if what == "groups":  # the records still commit them: each fails to load
        for epoch in range(3):
            fs.pipe_file(f"{root}/trainer_0.{epoch}/zarr.json", b"{}")
        match = r"no committed epoch .* could be loaded: epoch 2: .*epoch 1: .*epoch 0: "
    else:  # no save is committed, but records are there
        for path in fs.find(f"{root}/_commits"):
            if ".trainer_0." in path:
                fs.pipe_file(path, b"{}")
        match = r"damaged: \[0, 1, 2\]"
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    with pytest.raises(CheckpointCorruptedError, match=match):
        JobRunner(build_job(2), cm).train(LocalSession())


def test_nodes_given_as_a_string_are_rejected(prefix):
    from caffe2ckpt import JobDefinitionError
    with pytest.raises(JobDefinitionError, match="list of node names"):
        MultiNodeCheckpointManager(prefix).init("ab")


def test_runs_past_twelve_digits_are_ordered_by_number(prefix):
    """A model-2 prefix whose claims went past 12 digits: the run log continues after them,
    and ``_runs/`` entries compare as numbers, not as strings."""
    session, cm = saver(prefix)
    loc = cm.store.location
    loc.create_exclusive(loc.path("_claims", "claim-999999999999.json"), b"{}")  # model 2
    loc.create_exclusive(loc.path("_claims", "claim-².json"), b"{}")  # not a claim number
    first = cm.claim({"run": "first"})
    assert first.generation == 10**12  # sorts *before* 999999999999 as a string
    session.run(cm.save(1, claim=first))  # the newest run is not fenced
    assert newest_epoch(cm.store, ["n"]) == 1
    second = cm.claim({"run": "second"})
    assert second.generation == 10**12 + 1
    with pytest.raises(CheckpointFencedError, match=r"run 1000000000001\b"):
        session.run(cm.save(2, claim=first))
    assert runs.list_runs(loc) == [10**12, 10**12 + 1]


def test_a_late_record_of_an_overtaken_run_is_superseded(prefix, monkeypatch):
    """Run A passes its fence check and stalls; run B claims (from epoch 1), saves and commits
    epoch 2; A wakes and commits its epoch 2 too. Both saves have paths of their own, and A's
    late save is superseded: B's data is what epoch 2 means, for every reader."""
    from caffe2ckpt.fs.location import Location
    from caffe2ckpt.store.commit.protocol import CheckpointStore, SaveInfo
    from caffe2ckpt.store.format.paths import new_save_id
    a, b = CheckpointStore(Location(prefix)), CheckpointStore(Location(prefix))
    run_a = runs.claim(a.location, nodes=["n"], parent=None)
    a.save_node("n", 1, {"w": np.full(4, 1.0)}, SaveInfo(save_id=new_save_id(1), nodes=["n"]))
    original = runs.check_fence

    def stall_after_the_check(location, generation, doing, *family):
        original(location, generation, doing, *family)
        if generation == run_a.generation and "epoch 2" in doing:
            run_b = runs.claim(b.location, nodes=["n"], parent=(1, run_a.generation))
            b.save_node("n", 2, {"w": np.full(4, 222.0)},
                        SaveInfo(save_id=new_save_id(run_b.generation), nodes=["n"]))
    monkeypatch.setattr(runs, "check_fence", stall_after_the_check)
    a.save_node("n", 2, {"w": np.full(4, 111.0)},
                SaveInfo(save_id=new_save_id(run_a.generation), nodes=["n"]))
    monkeypatch.setattr(runs, "check_fence", original)
    assert newest_epoch(b, ["n"]) == 2
    assert load(b, "n", 2)["w"].tolist() == [222.0] * 4
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [1, 2] and mgr.restore(2)["n"]["w"].tolist() == [222.0] * 4


@contextlib.contextmanager
def _claimed_while_stalled(monkeypatch, other: StepCheckpointManager, step: int, items):
    """Within: the first save of ``step`` stalls after its fence check while ``other`` claims
    the prefix by a save of ``items`` whose writes fail (it commits nothing) and lists its steps;
    yields ``[that listing]`` once it happened."""
    original, listed = runs.check_fence, []

    def stall(location, generation, doing, *family):
        original(location, generation, doing, *family)
        if f"epoch {step}" in doing and not listed:
            with monkeypatch.context() as patch:
                patch.setattr(other._store, "save_node", _raise_eio)
                with pytest.raises(CheckpointWriteError):
                    other.save(step, items)
            listed.append(other.all_steps())
    with monkeypatch.context() as patch:
        patch.setattr(runs, "check_fence", stall)
        yield listed


def _raise_eio(*args, **kwargs):
    raise OSError(errno.EIO, "injected: the save fails after its claim")


def _last_epoch(prefix: str, nodes: list[str]) -> int | None:
    handler = ZarrMetadataHandler()
    handler.set_params(db_prefix=prefix, db_type="zarr", node_names=nodes)
    return handler.last_epoch()


@on_one_s3_server("moto")
def test_a_late_differential_record_keeps_its_chain_until_the_new_run_commits(prefix,
                                                                              monkeypatch):
    """Manager A (differential saves) passes its fence check for step 2 and stalls; manager B
    claims the prefix (its save fails before it commits) and lists the steps; A wakes and
    commits step 2, built on step 1. B has not committed, so A's step 2 is current, and when B
    deletes step 1 the groups step 2 builds on stay (B's listing, read before A's record, does
    not know of it): step 2 restores bit-exact (review of e4d82ae, residual suspicion 1)."""
    opts = StepManagerOptions(delta_saves=True, delta_min_bytes=1 << 10)
    table = np.random.default_rng(0).random((4096, 16), dtype=np.float32)
    a = StepCheckpointManager(prefix, options=opts, handle_preemption=False)
    b = StepCheckpointManager(prefix, handle_preemption=False)
    for step in (0, 1):
        table[step * 7] += 1
        a.save(step, {"n": {"t": table}})
    table[100] += 1
    with _claimed_while_stalled(monkeypatch, b, 2, {"n": {"t": np.zeros_like(table)}}) as listed:
        assert a.save(2, {"n": {"t": table}})
    assert listed == [[0, 1]] and a._step(2).records["n"].delta is not None
    assert _last_epoch(prefix, ["n"]) == 2
    b.delete(1)
    with StepCheckpointManager(prefix, handle_preemption=False) as reader:
        assert reader.all_steps() == [0, 2]
        assert reader.restore(2)["n"]["t"].tobytes() == table.tobytes()
    a.close()
    b.close()


@on_one_s3_server("seaweedfs")
def test_a_late_record_of_a_run_the_hint_does_not_name_is_still_the_newest(prefix, monkeypatch):
    """Manager A saves steps 0 and 1; manager A2 (a new run, from step 1) passes its fence check
    for step 2 and stalls; manager B claims from step 1 (its save fails before it commits) and
    vouches for step 1 in the family's hint; A2's record lands. A2's run is the family's head
    (B has not committed), so every lookup says step 2: the hint must not shortcut past a
    record of a run between the hinted save's and B's (found by the model check's late saves)."""
    a = StepCheckpointManager(prefix, handle_preemption=False)
    for step in (0, 1):
        a.save(step, {"n": {"w": np.full(4, float(step))}})
    a2 = StepCheckpointManager(prefix, handle_preemption=False)
    b = StepCheckpointManager(prefix, handle_preemption=False)
    with _claimed_while_stalled(monkeypatch, b, 2, {"n": {"w": np.zeros(4)}}) as listed:
        assert a2.save(2, {"n": {"w": np.full(4, 2.0)}})
    late = save_generation(a2._step(2).save_id)
    assert listed == [[0, 1]] and late < runs.list_runs(a2._store.location)[-1]  # B's is newer
    assert _last_epoch(prefix, ["n"]) == 2
    with StepCheckpointManager(prefix, handle_preemption=False) as reader:
        assert reader.latest_step() == 2 and reader.restore()["n"]["w"].tolist() == [2.0] * 4
    for mgr in (a, a2, b):
        mgr.close()


def test_a_save_that_cannot_claim_fails_instead_of_saving_unfenced(prefix):
    """Saving without a claim would commit epochs of no generation, which the lineage ranks
    below every claimed run's: a save must claim or fail (found by review)."""
    session, cm = saver(prefix)
    fs, root = fsspec.core.url_to_fs(prefix)
    fs.makedirs(f"{root}/_claims", exist_ok=True)
    fs.pipe_file(f"{root}/_claims/claim-999999999999999999.json", b"{}")  # the highest number
    with pytest.raises(CheckpointWriteError, match="highest number a run may have"):
        session.run(cm.save(1))
    assert epochs_with_records(cm.store, ["n"]) == []


class _FsspecExists(FaultyFileSystem):
    """A filesystem that keeps fsspec's own ``exists`` (which answers False on any error)."""

    exists = AbstractFileSystem.exists


@pytest.mark.parametrize("backend", ["fsspec", "local"])
def test_an_io_error_on_the_fence_check_fails_the_save(backend, tmp_path, memory_fs,
                                                        monkeypatch):
    """The fence check asks whether a newer run's entry exists: an I/O error there (EIO,
    EACCES, a timeout) must fail the save, never read as "not fenced" (found by review:
    fsspec's exists() and os.path.lexists() answer False on errors)."""
    newer = run_name(2)
    if backend == "fsspec":
        fs = _FsspecExists(fsspec.filesystem("memory"))
        old, new = (MultiNodeCheckpointManager("/fence-io", filesystem=fs) for _ in range(2))
    else:
        old, new = (MultiNodeCheckpointManager(str(tmp_path / "ckpt")) for _ in range(2))
    session = LocalSession()
    session.workspace("n")["w"] = np.arange(4.0)
    for cm in (old, new):
        session.run(cm.init(["n"]))
    old_claim, new_claim = old.claim({"run": "old"}), new.claim({"run": "new"})
    assert new_claim.generation == 2
    if backend == "fsspec":
        fs.arm("stat", 1, errno.EIO, sticky=True, match=lambda _m, path: path.endswith(newer))
    else:
        real_lstat = os.lstat

        def lstat(path, *args, **kwargs):
            if str(path).endswith(newer):
                raise OSError(errno.EIO, "injected", path)
            return real_lstat(path, *args, **kwargs)
        monkeypatch.setattr(os, "lstat", lstat)
    with pytest.raises(OSError) as info:
        session.run(old.save(1, claim=old_claim))
    assert not isinstance(info.value, CheckpointFencedError)
    assert "epoch 1" in str(info.value) and newer in str(info.value), info.value
    monkeypatch.undo()
    assert epochs_with_records(old.store, ["n"]) == []
