"""JobRunner: automatic resume, stop decisions across resumes, metadata handler protocol."""

from __future__ import annotations

import logging
import os
import socket

import numpy as np
import pytest

from caffe2ckpt import (
    CheckpointNotFoundError,
    Job,
    JobDefinitionError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    epoch_limiter,
)
from caffe2ckpt.example import InjectedFailure, build_job
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.store.format.records import list_records, read_record
from tests.s3server import storage_cases
from tests.stores import newest_epoch

NODES = ["trainer_0", "trainer_1"]


def workspaces(session: LocalSession, nodes=("trainer_0", "trainer_1")) -> dict:
    return {n: {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in session.workspace(n).items()}
            for n in nodes}


def run(prefix: str, num_epochs: int, **job_kw) -> tuple[JobRunner, LocalSession, int]:
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    runner, session = JobRunner(build_job(num_epochs, **job_kw), cm), LocalSession()
    return runner, session, runner.train(session)


def reference(tmp_path_factory, num_epochs: int) -> dict:
    _, session, final = run(str(tmp_path_factory.mktemp("ref") / "ckpt"), num_epochs)
    assert final == num_epochs
    return workspaces(session)


@storage_cases("fail_at", [1, 3, 5], s3=[3])
def test_auto_resume_after_failure_is_bit_identical(prefix, fail_at, tmp_path_factory):
    with pytest.raises(InjectedFailure):
        run(prefix, 5, fail_at_epoch=fail_at)
    init_calls = []
    job = build_job(5)
    job.init_group.tasks[0].fn = lambda ws, f=job.init_group.tasks[0].fn: (init_calls.append(1),
                                                                           f(ws))
    runner = JobRunner(job, MultiNodeCheckpointManager(prefix,
                                                       metadata_handler=ZarrMetadataHandler()))
    session = LocalSession()
    assert runner.train(session) == 5
    assert runner.resumed_from == fail_at - 1
    assert init_calls == []  # init ran once overall: in the failed first run
    assert workspaces(session) == reference(tmp_path_factory, 5)


def test_finished_job_runs_no_epoch_and_larger_limit_continues(prefix, tmp_path_factory,
                                                                caplog):
    run(prefix, 3)
    caplog.clear()  # only the second run's records count
    with caplog.at_level("INFO", logger="caffe2ckpt.runner"):
        runner, session, final = run(prefix, 3)
    messages = [r.getMessage() for r in caplog.records]
    assert (final, runner.resumed_from) == (3, 3)
    assert "Job 'regression' had finished at epoch 3 (its stop condition held): no epoch to run" in messages
    assert not [m for m in messages if m.startswith("Running epoch")]
    assert sorted(e for e in {r.epoch for r in list_records(runner.checkpoint_manager.store.location)}) == [0, 1, 2, 3]
    runner, session, final = run(prefix, 5)
    assert (final, runner.resumed_from) == (5, 3)
    assert workspaces(session) == reference(tmp_path_factory, 5)


@pytest.mark.parametrize("prefix", ["memory", "local"], indirect=True)
@pytest.mark.parametrize(("limit", "back_to"), [(10, 10), (9, 9), (8, 9)])
def test_going_back_to_an_epoch_at_or_past_the_limit_trains_nothing(prefix, limit, back_to):
    """A run never goes past its epochs, also when the save it goes back to was not its
    job's last (a longer run wrote it): it stops at the loaded epoch, saving nothing
    (issue 21, item 1: resuming from 9 with epochs=9 trained epoch 10)."""
    run(prefix, 12)
    cm = MultiNodeCheckpointManager(prefix)
    runner = JobRunner(build_job(limit), cm, resume_from_epoch=back_to)
    assert runner.train(LocalSession()) == back_to
    assert runner.resumed_from == back_to and runner.saved_epochs == []


def test_records_carry_stop_decision_and_writer(prefix):
    runner, _, _ = run(prefix, 2)
    location = runner.checkpoint_manager.store.location
    records = [read_record(location, ref) for ref in list_records(location)]
    assert [(r.epoch, r.node) for r in records] == [
        (e, n) for e in range(3) for n in ("trainer_0", "trainer_1")]
    assert [r.stop for r in records] == [False] * 4 + [True] * 2
    assert records[-1].stop_conditions == ["trainer_0:epoch_limiter.0/stop"]
    assert all(r.writer["session"] == "local" and r.nodes == ["trainer_0", "trainer_1"]
               for r in records)
    assert len({r.save_id for r in records}) == 3  # one save id per epoch, shared by nodes


def test_last_epoch_counts_only_saves_of_exactly_the_jobs_nodes(prefix):
    """Each job family (the nodes saved together) has its own history on a shared prefix."""
    run(prefix, 4)  # nodes trainer_0, trainer_1 up to epoch 4
    handler = ZarrMetadataHandler()
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=handler)
    cm.set_params(nodes=["trainer_0", "trainer_1", "trainer_2"])
    assert handler.last_epoch() is None  # trainer_2 never committed anything
    cm.set_params(nodes=["trainer_1"])
    assert handler.last_epoch() is None  # trainer_1 alone is another job
    cm.set_params(nodes=["trainer_1", "trainer_0"])
    assert handler.last_epoch() == 4
    assert handler.last_epoch(user_epoch=2) == 2
    with pytest.raises(CheckpointNotFoundError, match="epoch 7"):
        handler.last_epoch(user_epoch=7)


def test_explicit_missing_epoch_raises_clearly(prefix):
    run(prefix, 2)
    cm = MultiNodeCheckpointManager(prefix)
    with pytest.raises(CheckpointNotFoundError, match="epoch 9"):
        JobRunner(build_job(4), cm, resume_from_epoch=9).train(LocalSession())


class RecordingHandler(ZarrMetadataHandler):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def set_params(self, **kw):
        self.calls.append(("set_params", tuple(kw["node_names"])))
        super().set_params(**kw)

    def last_epoch(self, user_epoch=None):
        self.calls.append(("last_epoch", user_epoch))
        return super().last_epoch(user_epoch)

    def cp_accessible(self, epoch=None):
        self.calls.append(("cp_accessible", epoch))
        return super().cp_accessible(epoch)

    def write(self, epoch):
        self.calls.append(("write", epoch))
        super().write(epoch)

    def report(self, action_name, stats):
        self.calls.append(("report", action_name, len(stats)))
        super().report(action_name, stats)


def test_metadata_handler_call_sequence(prefix):
    handler = RecordingHandler()
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=handler)
    JobRunner(build_job(2), cm).train(LocalSession())
    nodes = ("trainer_0", "trainer_1")
    expected = [("set_params", nodes), ("last_epoch", None)]
    for epoch in range(3):
        expected += [("cp_accessible", epoch), ("write", epoch), ("report", "checkpoint_save", 2)]
    assert handler.calls == expected
    handler.calls.clear()
    JobRunner(build_job(3), cm).train(LocalSession())
    assert handler.calls[:3] == [("set_params", nodes), ("last_epoch", None),
                                 ("report", "checkpoint_load", 2)]


def test_resume_is_the_default(prefix):
    """A re-run with a plain manager resumes from the records and re-saves nothing."""
    run(prefix, 2)
    store = MultiNodeCheckpointManager(prefix).store
    before = {r.filename for r in list_records(store.location)}
    runner = JobRunner(build_job(2), MultiNodeCheckpointManager(prefix))
    assert runner.train(LocalSession()) == 2
    assert runner.resumed_from == 2 and runner.saved_epochs == []
    assert {r.filename for r in list_records(store.location)} == before


def test_auto_resume_off_is_caffe2s_fresh_start_and_supersedes(prefix):
    run(prefix, 4)
    cm = MultiNodeCheckpointManager(prefix, auto_resume=False)
    runner = JobRunner(build_job(2), cm)
    assert runner.train(LocalSession()) == 2
    assert runner.resumed_from is None
    # the old run's epochs 3 and 4 are superseded: the next automatic resume takes the new 2
    assert newest_epoch(cm.store, NODES) == 2
    assert JobRunner(build_job(2), MultiNodeCheckpointManager(prefix)).train(LocalSession()) == 2


def test_epoch_limiter_counts_and_places_tasks():
    with Job() as job:
        with Node("a"):
            with job.init_group:
                Task(lambda ws: ws.__setitem__("x", 0))
        with Node("b"):
            with job.init_group:
                Task(lambda ws: ws.__setitem__("y", 0))
        stop = epoch_limiter(job, 3)
    assert stop.task.node == "a"  # the job's first node, not a node of its own
    assert job.nodes_to_checkpoint() == ["a", "b"]
    assert JobRunner(job).train(LocalSession()) == 3
    with pytest.raises(JobDefinitionError):
        epoch_limiter(job, 0)


def test_save_warning_names_epoch(prefix, caplog):
    cm = MultiNodeCheckpointManager(prefix)
    with Job() as job:
        with Node("n"):
            with job.init_group:
                Task(lambda ws: ws.__setitem__("x", np.zeros(3)))
            Task(lambda ws: ws.__delitem__("x"))  # the checkpointed blob disappears
        epoch_limiter(job, 1)
    runner = JobRunner(job, cm)
    with caplog.at_level(logging.WARNING, logger="caffe2ckpt"):
        assert runner.train(LocalSession()) == 1
    assert runner.failed_saves == [1]
    assert any("epoch 1" in r.message and "'x'" in r.message for r in caplog.records)


def test_the_resume_line_says_in_words_who_wrote_the_epoch(prefix, caplog):
    """Issue 34 item 5.5: the resume line printed the writer as ``host=..., pid=...,
    session=local``."""
    run(prefix, 2)
    caplog.clear()
    with caplog.at_level("INFO", logger="caffe2ckpt.runner"):
        run(prefix, 3)
    host, pid = socket.gethostname(), os.getpid()
    assert (f"Resuming from epoch 2 (written by a local session on host {host}, pid {pid})"
            in [r.getMessage() for r in caplog.records])


@pytest.mark.parametrize(("writer", "phrase"), [
    ({"session": "prefect", "flow_run_id": "1a2b3c4d-0000-4000-8000-000000000000",
      "flow_run_name": "crimson-otter", "flow_name": "regression", "run_count": 2,
      "deployment_id": None, "host": "h", "pid": 7},
     "flow run crimson-otter (1a2b3c4d-0000-4000-8000-000000000000) attempt 2 on host h, pid 7"),
    ({"manager": "StepCheckpointManager", "host": "h", "pid": 7},
     "StepCheckpointManager on host h, pid 7"),
    ({"session": "dask", "host": "w1", "pid": 8, "scheduler": "tcp://s:8786"},
     "a dask session on host w1, pid 8"),
    ({}, "an unknown writer"),
    ({"who": "me"}, "who=me"),
])
def test_writers_are_described_in_words(writer, phrase):
    from caffe2ckpt.units import writer_phrase

    assert writer_phrase(writer) == phrase


def supersede_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "supersedes" in r.getMessage()]


@pytest.mark.parametrize("prefix", ["memory", "local"], indirect=True)
def test_going_back_says_what_it_supersedes_when_it_commits(prefix, caplog):
    """Issue 34 item 5.4: resume_from_epoch=8 superseded epochs 9-25 of three earlier runs
    without a word. The new run's first commit says so in one INFO line (the lineage's own
    answer)."""
    for epochs in (12, 20, 25):  # runs 1, 2, 3: epochs 0-12, 13-20, 21-25
        run(prefix, epochs)
    with caplog.at_level("INFO", logger="caffe2ckpt"):
        cm = MultiNodeCheckpointManager(prefix)
        assert JobRunner(build_job(10), cm, resume_from_epoch=8).train(LocalSession()) == 10
    assert supersede_lines(caplog) == [
        f"epoch 9 committed under {prefix!r}; it supersedes epochs 9-25 of runs 1, 2, 3 (they "
        "stay on disk until retention or gc removes them)"]
    caplog.clear()
    with caplog.at_level("INFO", logger="caffe2ckpt"):
        run(prefix, 12)  # continues the newest save (epoch 10): supersedes nothing
        cm = MultiNodeCheckpointManager(prefix, auto_resume=False)  # a fresh start
        JobRunner(build_job(1), cm).train(LocalSession())
    assert supersede_lines(caplog) == [
        f"epoch 0 committed under {prefix!r}; it supersedes epochs 0-12 of runs 1, 4, 5 (they "
        "stay on disk until retention or gc removes them)"]
