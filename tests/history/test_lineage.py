"""The lineage of runs: a run that resumes from an earlier epoch supersedes the later epochs of
the run it went back on, for resume, fallback, retention, the step manager and the CLI (on
memory, a local dir and the S3 server)."""

from __future__ import annotations

import json

import fsspec
import numpy as np
import pytest

from caffe2ckpt import (
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    StepCheckpointManager,
    StepManagerOptions,
)
from caffe2ckpt.cli import main as cli_main
from caffe2ckpt.example import InjectedFailure, build_job
from caffe2ckpt.history.lineage import History
from caffe2ckpt.history.scan import scan
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.format.paths import new_save_id
from caffe2ckpt.store.format.records import CommitRecord, RecordRef
from tests.stores import newest_epoch

NODES = ["trainer_0", "trainer_1"]


def epochs(store, nodes=NODES) -> tuple[list[int], list[int]]:
    """The family's lineage epochs and superseded epochs, each sorted."""
    family = scan(store, nodes).families.get(frozenset(nodes))
    if family is None:
        return [], []
    return sorted(s.epoch for s in family.lineage), sorted(s.epoch for s in family.superseded)


def workspaces(session: LocalSession) -> dict:
    return {n: {k: v.tobytes() for k, v in session.workspace(n).items()} for n in NODES}


def train(prefix: str, num_epochs: int, **kwargs) -> tuple[JobRunner, LocalSession, int]:
    fail_at = kwargs.pop("fail_at_epoch", None)
    runner = JobRunner(build_job(num_epochs, fail_at_epoch=fail_at),
                       MultiNodeCheckpointManager(prefix), **kwargs)
    session = LocalSession()
    return runner, session, runner.train(session)


def go_back_to_2(prefix: str, **kwargs) -> None:
    """Epochs 0..5 by a first run; a second run resumes from 2, commits 3 (at a path of its
    own) and dies in 4: the first run's 3, 4 and 5 are superseded (off the new lineage)."""
    train(prefix, 5)
    with pytest.raises(InjectedFailure):
        train(prefix, 4, resume_from_epoch=2, fail_at_epoch=4, **kwargs)


@pytest.fixture(scope="module")
def reference_4(tmp_path_factory) -> dict:
    _, session, final = train(str(tmp_path_factory.mktemp("ref") / "ckpt"), 4)
    assert final == 4
    return workspaces(session)


def test_resume_after_going_back_follows_the_new_lineage(prefix, reference_4):
    go_back_to_2(prefix)
    cm = MultiNodeCheckpointManager(prefix)
    cm.set_params(nodes=NODES)
    assert newest_epoch(cm.store, NODES) == 3  # not the older run's 5
    assert epochs(cm.store) == ([0, 1, 2, 3], [3, 4, 5])
    assert cm.lineage_save(3).generation > cm.lineage_save(2).generation
    runner, session, final = train(prefix, 4)  # the automatic retry
    assert (runner.resumed_from, final) == (3, 4)
    assert workspaces(session) == reference_4


def test_retention_keeps_the_new_lineage_and_drops_the_superseded(prefix, reference_4):
    go_back_to_2(prefix, options=StepManagerOptions(max_to_keep=1))
    cm = MultiNodeCheckpointManager(prefix)
    # 3 (the newest of the lineage) and 2 (resumed from); the old 0, 1 and the superseded 4, 5
    # are gone
    assert epochs(cm.store) == ([2, 3], [])
    runner, session, final = train(prefix, 4, options=StepManagerOptions(max_to_keep=1))
    assert (runner.resumed_from, final) == (3, 4)
    assert workspaces(session) == reference_4
    assert epochs(cm.store) == ([3, 4], [])  # the newest, and the one resumed from


def test_fallback_never_goes_to_a_superseded_epoch(prefix, reference_4):
    go_back_to_2(prefix)
    fs, root = fsspec.core.url_to_fs(prefix)
    group = MultiNodeCheckpointManager(prefix).current(nodes=NODES).lineage_save(3)
    group = group.records["trainer_0"].group  # the second run's epoch 3: a path of its own
    chunk = next(p for p in fs.find(f"{root}/{group}") if p.rpartition("/")[2].startswith("c."))
    data = bytearray(fs.cat_file(chunk))
    data[0] ^= 0xFF
    fs.pipe_file(chunk, bytes(data))
    runner, session, final = train(prefix, 4)
    assert (runner.resumed_from, final) == (2, 4)  # epoch 3 is damaged: back to its parent 2
    assert workspaces(session) == reference_4


def test_step_manager_restoring_an_earlier_step_starts_a_new_lineage(prefix):
    with StepCheckpointManager(prefix, options=StepManagerOptions(max_to_keep=2),
                               handle_preemption=False) as mgr:
        for step in range(7):
            mgr.save(step, {"n": {"w": np.full(3, step)}})
        assert mgr.all_steps() == [5, 6]
    with StepCheckpointManager(prefix, options=StepManagerOptions(max_to_keep=2),
                               handle_preemption=False) as mgr:
        assert mgr.restore(5)["n"]["w"].tolist() == [5, 5, 5]
        mgr.save(6, {"n": {"w": np.full(3, 60)}}, force=True)  # a re-save from 5
        mgr.save(7, {"n": {"w": np.full(3, 70)}})
        assert mgr.all_steps() == [5, 6, 7] and mgr.latest_step() == 7  # 5: restored
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert mgr.restore()["n"]["w"].tolist() == [70, 70, 70]


def test_step_manager_saving_below_the_latest_supersedes_the_later_steps(prefix):
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        for step in range(5):
            mgr.save(step, {"n": {"w": np.full(2, step)}})
    with StepCheckpointManager(prefix, options=StepManagerOptions(max_to_keep=3),
                               handle_preemption=False) as mgr:
        mgr.restore(1)
        mgr.save(2, {"n": {"w": np.full(2, 20)}}, force=True)
        assert mgr.all_steps() == [0, 1, 2] and mgr.latest_step() == 2  # 3 and 4: superseded
    assert epochs(mgr._store, ["n"]) == ([0, 1, 2], [])  # retention deleted them


def test_cli_marks_superseded_epochs_and_gc_removes_them(prefix, capsys):
    go_back_to_2(prefix)
    capsys.readouterr()  # the training's own output
    assert cli_main(["ls", prefix, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    states = sorted((row["epoch"], row["state"]) for row in doc["epochs"])
    assert states == [(0, "committed"), (1, "committed"), (2, "committed"), (3, "committed"),
                      (3, "superseded"), (4, "superseded"), (5, "superseded")]
    assert doc["superseded_epochs"] == [3, 4, 5]
    assert cli_main(["show", prefix, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epoch"] == 3  # the newest of the lineage
    assert cli_main(["gc", prefix, "--keep-last", "2", "--yes", "--json"]) == 0
    deleted = [d["epoch"] for d in json.loads(capsys.readouterr().out)["delete"]]
    assert deleted == [0, 1, 3, 4, 5]  # 3: the first run's, superseded


# -- the walk itself, on records made here ---------------------------------------------------


def _records(*saves: tuple[int, int, tuple[int, int] | None]) -> dict[RecordRef, CommitRecord]:
    """(epoch, generation, parent) per save of one node "n"."""
    out = {}
    for epoch, generation, parent in saves:
        record = CommitRecord(epoch=epoch, node="n", save_id=new_save_id(generation), nodes=["n"],
                              nbytes=0, blob_count=0, seconds=0.0, parent=parent)
        out[record.ref] = record
    return out


def _lineage(records: dict[RecordRef, CommitRecord]) -> list[tuple[int, int]]:
    history = History(list(records), ["n"], records.__getitem__, lambda generation: None)
    return [(s.epoch, s.generation) for s in history.lineage()]


def test_the_walk_follows_parents_across_generations():
    # run 1 saved 0..6; run 2 went back to 2 and re-saved 3 and 4 (replacing run 1's); run 3
    # explicitly resumed from run 1's superseded 5 and re-saved 6
    records = _records(*[(e, 1, None) for e in (0, 1, 2, 5)], (3, 2, (2, 1)), (4, 2, (2, 1)),
                       (6, 3, (5, 1)))
    assert _lineage(records) == [(6, 3), (5, 1), (2, 1), (1, 1), (0, 1)]


def test_what_a_run_supersedes_is_the_lineage_it_leaves_not_only_the_epochs_above_it():
    """History.left_behind, which a run's first commit reports in an INFO line (issue 34 item
    5.4): the lineage minus the chain from where the run starts, read only until they meet."""
    records = _records(*[(e, 1, None) for e in (0, 1, 2, 5)], (3, 2, (2, 1)), (4, 2, (2, 1)))
    read: list[int] = []

    def left(generations, parent):
        refs = [r for r in records if r.generation in generations]
        history = History(refs, ["n"], lambda ref: read.append(ref.epoch) or records[ref],
                          lambda generation: None)
        return [(s.epoch, s.generation) for s in history.left_behind(parent)]

    assert left({1}, None) == [(5, 1), (2, 1), (1, 1), (0, 1)]  # a fresh start: all of it
    assert left({1}, (5, 1)) == []  # continuing the newest save
    assert left({1}, (2, 1)) == [(5, 1)]  # run 2 goes back to 2 (run 1's 3, 4 were replaced)
    read.clear()
    # run 3 resumes from run 1's 5, which run 2 superseded: it leaves run 2's 3 and 4 behind,
    # below where it starts; the lineage and the chain from 5 meet at 2: 1 and 0 are not read
    assert left({1, 2}, (5, 1)) == [(4, 2), (3, 2)]
    assert not {0, 1} & set(read), read


def test_a_run_that_committed_nothing_is_not_the_head():
    records = _records(*[(e, 1, None) for e in range(4)])
    partial = CommitRecord(epoch=2, node="n", save_id=new_save_id(2), nodes=["n", "m"], nbytes=0,
                           blob_count=0, seconds=0.0, parent=(1, 1))  # node m's record missing
    records[partial.ref] = partial
    assert _lineage(records) == [(3, 1), (2, 1), (1, 1), (0, 1)]


def test_an_unreadable_record_uncommits_only_its_save_and_a_bad_parent_ends_the_walk():
    records: dict = _records((0, 1, None), (1, 1, None), (2, 2, (1, 1)), (3, 2, (1, 1)))
    bad = next(r for r in records if r.epoch == 3)
    records[bad] = "unreadable"
    assert _lineage(records) == [(2, 2), (1, 1), (0, 1)]
    loop = _records((0, 5, None), (1, 6, (0, 9)))  # a parent that is not older: stop there
    assert _lineage(loop) == [(1, 6)]


# -- found by review: gaps in the chain, a run going back within itself ---------------------


def test_a_run_whose_saves_retention_deleted_does_not_cut_the_history(prefix):
    """keep_period keeps 0 and 5 while max_to_keep deletes the runs in between: the walk must
    go on past those runs, so 0 and 5 stay in the lineage (kept, and fallback points)."""
    options = StepManagerOptions(max_to_keep=1, keep_period=5)
    for steps in (range(6), [6, 7], [8, 9], [10]):
        with StepCheckpointManager(prefix, options=options, handle_preemption=False) as mgr:
            for step in steps:
                mgr.save(step, {"n": {"w": np.full(2, step)}}, force=True)
    assert epochs(mgr._store, ["n"]) == ([0, 5, 10], [])


def test_restoring_an_earlier_step_in_the_same_manager_supersedes_the_later_ones(prefix):
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        for step in range(7):
            mgr.save(step, {"n": {"w": np.full(2, step)}})
        mgr.restore(3)  # the loss diverged after 3: go back
        mgr.save(4, {"n": {"w": np.full(2, 40)}}, force=True)
        assert mgr.all_steps() == [0, 1, 2, 3, 4] and mgr.latest_step() == 4
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert mgr.restore()["n"]["w"].tolist() == [40, 40]


def test_a_record_name_with_a_non_ascii_digit_is_not_a_record(prefix):
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        mgr.save(1, {"n": {"w": np.ones(2)}})
    fs, root = fsspec.core.url_to_fs(prefix)
    fs.pipe_file(f"{root}/_commits/00000000000\u00b2.n.g1-abcdefgh.json", b"{}")
    assert newest_epoch(MultiNodeCheckpointManager(prefix).store, ["n"]) == 1
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [1]


# -- the hint: the newest save in O(1) requests, never trusted blindly ----------------------------

def _counting_store(prefix: str):
    from caffe2ckpt.fs.location import Location
    from caffe2ckpt.store.commit.protocol import CheckpointStore
    from tests.faultfs import FaultyFileSystem

    fs, root = fsspec.core.url_to_fs(prefix)
    counter = FaultyFileSystem(fs)
    return counter, CheckpointStore(Location(root, filesystem=counter))


@pytest.mark.parametrize("prefix", ["memory", "local"], indirect=True)
def test_after_a_resume_that_saved_nothing_the_newest_save_is_found_in_a_few_requests(prefix):
    """A run that resumes and saves nothing (its job had finished) vouches for the save it
    resumed from in the family's hint, so the next lookup reads a few files and lists once (the
    records from the hinted epoch on: on S3 one request whatever the history)."""
    from caffe2ckpt.history.scan import family_history, newest_save

    train(prefix, 3)
    runner, _, final = train(prefix, 3)
    assert final == 3 and runner.resumed_from == 3 and runner.saved_epochs == []
    counter, store = _counting_store(prefix)
    newest = newest_save(store, NODES)
    assert newest == family_history(store, NODES).newest() and newest.epoch == 3
    counter.reset()
    newest_save(store, NODES)
    assert counter.counts["list"] == 1 and counter.counts["read"] <= 4, counter.counts


@pytest.mark.parametrize("prefix", ["memory", "local"], indirect=True)
def test_a_hint_that_does_not_hold_is_ignored(prefix):
    """Hints that name a superseded save on behalf of the newest run, or a run that does not
    exist, or a save of an older run, never decide: the records do."""
    from caffe2ckpt.history.scan import newest_save
    from caffe2ckpt.store.format.paths import HINTS_DIR, hint_name

    go_back_to_2(prefix)  # lineage 0, 1, 2, 3 (the second run's); the first run's 3..5 superseded
    counter, store = _counting_store(prefix)
    truth = newest_save(store, NODES)
    assert truth.epoch == 3 and truth.generation == 2
    superseded = max(scan(store, NODES).families[frozenset(NODES)].superseded,
                     key=lambda s: s.epoch)
    assert superseded.epoch == 5 and superseded.generation == 1
    path = store.location.path(HINTS_DIR, hint_name(NODES))
    forgeries = [{"epoch": 5, "save_id": superseded.save_id, **run}  # {}: its own, older run
                 for run in ({"run": 2}, {"run": 3}, {"run": 10**6}, {})]
    forgeries.append({"epoch": 4, "save_id": new_save_id(2), "run": 2})  # no record of it
    other = runs.claim(store.location, nodes=["other"], parent=(truth.epoch, truth.generation))
    # the newest run is another family's, which says it started from this family's save
    forgeries.append({"epoch": truth.epoch, "save_id": truth.save_id, "run": other.generation})
    for forged in forgeries:
        store.location.replace_file(path, json.dumps({"nodes": NODES, **forged}).encode())
        counter.reset()
        assert newest_save(store, NODES) == truth, forged
        assert counter.counts["list"] > 0, forged  # the records decided, not the hint


@pytest.mark.parametrize("prefix", ["memory", "local"], indirect=True)
def test_a_run_that_cannot_write_its_hint_claims_again(prefix):
    """A run that resumed vouches for its parent in the hint; if that write fails it may still
    land later, after the run's own saves: the run claims once more, so such a late hint
    speaks for a fenced run and is ignored."""
    from caffe2ckpt.history.scan import newest_save
    from caffe2ckpt.store.commit.protocol import CheckpointStore
    from caffe2ckpt.store.format.paths import HINTS_DIR, hint_name
    from tests.faultfs import FaultyFileSystem

    train(prefix, 3)
    fs, root = fsspec.core.url_to_fs(prefix, auto_mkdir=True)
    faulty = FaultyFileSystem(fs)
    faulty.arm("write", 1, match=lambda _method, path: "/_hints/" in path)
    cm = MultiNodeCheckpointManager(root, filesystem=faulty)
    runner = JobRunner(build_job(5), cm)
    runner.train(LocalSession())
    assert faulty.failed and runner.resumed_from == 3 and runner.saved_epochs == [4, 5]
    store = CheckpointStore(cm.store.location)
    late = {"nodes": NODES, "epoch": 3, "save_id": cm.save_of(3).save_id,
            "run": cm.run.generation - 1}  # the first claim's vouch, landing now
    store.location.replace_file(store.location.path(HINTS_DIR, hint_name(NODES)),
                                json.dumps(late).encode())
    assert cm.run.parent == (3, 1) and runs.read_run(store.location, late["run"]).parent == (3, 1)
    assert newest_save(store, NODES).epoch == 5
