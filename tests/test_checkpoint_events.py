"""Checkpoint events without Prefect: what subscribers hear, and that nothing they do can fail
the operation an event reports."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from caffe2ckpt import (
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    StepCheckpointManager,
    StepManagerOptions,
    events,
)
from caffe2ckpt.example import build_job


class Collected:
    def __init__(self, *, fail: bool = False, active: bool = True) -> None:
        self.events: list[events.CheckpointEvent] = []
        self.fail, self.is_active = fail, active

    def active(self) -> bool:
        return self.is_active

    def __call__(self, event: events.CheckpointEvent) -> None:
        if self.fail:
            raise RuntimeError("the events server is down")
        self.events.append(event)

    def flush(self) -> None:
        pass


@pytest.fixture
def subscribed(request):
    subscriber = Collected(**getattr(request, "param", {}))
    unsubscribe = events.subscribe(subscriber)
    yield subscriber
    unsubscribe()


def _save_two_and_restore(url: str) -> None:
    with StepCheckpointManager(url, handle_preemption=False,
                               options=StepManagerOptions(max_to_keep=3)) as mgr:
        mgr.save(0, {"a": {"w": np.zeros(4)}}, metrics={"loss": float("nan")})
        mgr.save(1, {"a": {"w": np.ones(4)}})
        mgr.restore(0)


def test_a_step_manager_publishes_commits_and_restores(tmp_path, subscribed):
    _save_two_and_restore(str(tmp_path / "ck"))
    names = [(e.name, e.payload["epoch"]) for e in subscribed.events]
    assert names == [(events.EPOCH_COMMITTED, 0), (events.EPOCH_COMMITTED, 1),
                     (events.RUN_RESUMED, 0)]
    first = subscribed.events[0]
    assert first.url == "file://" + str(tmp_path / "ck") and first.job is None
    assert first.payload["metrics"] == {"loss": "nan"}
    assert [e.payload.get("kept") for e in subscribed.events[:2]] == [1, 2]  # from retention
    assert subscribed.events[2].payload["reason"] == "going back"


@pytest.mark.parametrize("subscribed", [{"fail": True}], indirect=True)
def test_a_failing_subscriber_never_fails_a_save(tmp_path, subscribed, caplog):
    with caplog.at_level(logging.WARNING, logger="caffe2ckpt.events"):
        _save_two_and_restore(str(tmp_path / "ck"))
    assert "could not publish event caffe2ckpt.epoch.committed" in caplog.text
    with StepCheckpointManager(str(tmp_path / "ck"), handle_preemption=False) as mgr:
        assert mgr.all_steps() == [0, 1]


@pytest.mark.parametrize("subscribed", [{"active": False}], indirect=True)
def test_no_payload_is_built_when_no_subscriber_listens(subscribed):
    def payload():
        raise AssertionError("built")
    events.publish(events.GC_FINISHED, "memory://x", payload)
    assert subscribed.events == []


@pytest.mark.parametrize(("url", "public"), [
    ("s3://key:secret@bucket/ck?token=abc#frag", "s3://bucket/ck"),
    ("https://user:pw@host:9000/a/b?X-Amz-Signature=1", "https://host:9000/a/b"),
    ("/data/ck?x", "/data/ck?x"),  # a path without a scheme is a path
    ("memory:///run?sig=1#f", "memory:///run"),
    ("file:///data/ck", "file:///data/ck"),
])
def test_an_event_url_carries_no_credentials_or_query(url, public):
    assert events.public_url(url) == public


def _lists(with_subscriber: bool) -> tuple[int, int]:
    """LISTs of five more saves of a step manager and of a resumed JobRunner's five epochs."""
    from fsspec.implementations.memory import MemoryFileSystem

    from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager
    from caffe2ckpt.example import build_job
    from tests.faultfs import FaultyFileSystem

    unsubscribe = events.subscribe(Collected()) if with_subscriber else (lambda: None)
    try:
        fs = FaultyFileSystem(MemoryFileSystem())
        root = f"/lists-{with_subscriber}"
        with StepCheckpointManager(root + "/steps", filesystem=fs,
                                   handle_preemption=False) as mgr:
            mgr.save(0, {"a": {"w": np.zeros(10)}})
            fs.reset()
            for step in range(1, 6):
                mgr.save(step, {"a": {"w": np.full(10, step)}})
            steps = fs.counts["list"]
        JobRunner(build_job(1), MultiNodeCheckpointManager(root + "/job", filesystem=fs)).train(
            LocalSession())
        fs.reset()
        JobRunner(build_job(6), MultiNodeCheckpointManager(root + "/job", filesystem=fs)).train(
            LocalSession())
        return steps, fs.counts["list"]
    finally:
        unsubscribe()
        MemoryFileSystem.store.clear()


def test_an_event_costs_no_listing():
    assert _lists(with_subscriber=True) == _lists(with_subscriber=False)


def test_a_committed_event_id_is_fixed_by_prefix_epoch_and_save():
    one = events.committed_event_id("s3://bucket/ck", 4, "s1")
    assert one == events.committed_event_id("s3://key:secret@bucket/ck?token=t", 4, "s1")
    assert len({one, events.committed_event_id("s3://bucket/other", 4, "s1"),
                events.committed_event_id("s3://bucket/ck", 5, "s1"),
                events.committed_event_id("s3://bucket/ck", 4, "s2")}) == 4


def test_a_resume_sends_the_committed_event_of_its_epoch_again(tmp_path):
    """A run resuming from an epoch re-creates that epoch's committed event (its first run's
    events never left: here, no subscriber heard them), with the same id."""
    url = "file://" + str(tmp_path / "ck")
    JobRunner(build_job(2), MultiNodeCheckpointManager(url)).train(LocalSession())
    heard = Collected()
    unsubscribe = events.subscribe(heard)
    try:
        JobRunner(build_job(3), MultiNodeCheckpointManager(url)).train(LocalSession())
    finally:
        unsubscribe()
    committed = [e for e in heard.events if e.name == events.EPOCH_COMMITTED]
    assert [(e.payload["epoch"], e.resent) for e in committed] == [(2, True), (3, False)]
    save_id = committed[0].payload["save_id"]
    assert committed[0].id == events.committed_event_id(url, 2, save_id)
    assert committed[0].payload["nodes"] == ["trainer_0", "trainer_1"]
    assert committed[0].payload["kept"] is None and committed[0].job == "regression"
    assert committed[1].id == events.committed_event_id(url, 3, committed[1].payload["save_id"])
