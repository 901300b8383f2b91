"""The memory tier of DaskSession on a real 3-worker process LocalCluster: a worker killed during
an epoch no longer fails the run; the same ``train()`` call goes back to the newest epoch every
node has a copy of in worker memory, runs on and ends where an uninterrupted run ends, and every
committed epoch is the uninterrupted run's. Without the tier (or without a copy) the loss fails
the run as before. The pure choices (buddies, the epoch chosen) are tested without a cluster."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from caffe2ckpt import JobRunner, MultiNodeCheckpointManager, events
from caffe2ckpt.errors import NodeLostError
from caffe2ckpt.fs.location import Location
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.session import tier_key
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.stores import load
from tests.tierjobs import EPOCHS, NODES, Recoveries, dict_of, job, markers, reference, same

distributed = pytest.importorskip("distributed")
from caffe2ckpt.dask import DaskSession
from caffe2ckpt.dask.memory import Source, buddies, choose
from tests.daskcluster import client_of, die_before_commit, local_cluster, undo_die_before_commit


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(3) as c:
        yield c


@pytest.fixture
def client(cluster):
    with client_of(cluster) as c:
        yield c


def _copies_here() -> int:
    """How many memory-tier copies the actors alive in this worker process keep."""
    import gc

    from caffe2ckpt.dask import tier

    gc.collect()
    return sum(len(store.listing()) for store in tier.alive())


def _kept_here(key: str) -> list[tuple[bool, int]]:
    """Run on a worker: per store of copies it keeps for prefix ``key``, whether its actor is
    gone, and how many copies it holds (no collection of reference cycles first)."""
    from caffe2ckpt.dask import tier

    tier._sweep()
    with tier._kept_lock:
        return [(e.owner is None, len(e.copies.listing())) for (k, _), e in tier._kept.items()
                if k == key]


def _copies_left(client) -> int:
    """The copies left on the cluster's workers, once their actors had a few seconds to go."""
    for _ in range(50):
        left = sum(client.run(_copies_here).values())
        if not left:
            return 0
        time.sleep(0.1)
    return left


@pytest.mark.slow
@pytest.mark.parametrize("interval", [1, 2], ids=["save-every-epoch", "save-every-2"])
def test_a_worker_killed_mid_epoch_costs_that_epoch_not_the_run(tmp_path, client, interval):
    expected, ref = reference(tmp_path)
    url, die = str(tmp_path / "ckpt"), markers(tmp_path, "trainer_1")
    options = StepManagerOptions(save_interval_steps=interval)
    heard = Recoveries()
    unsubscribe = events.subscribe(heard)
    try:
        with DaskSession(client, memory_tier=True) as session:
            runner = JobRunner(job(die), MultiNodeCheckpointManager(url), options=options)
            assert runner.train(session) == EPOCHS
            assert not any(map(os.path.exists, die.values()))  # the worker was killed
            for node in NODES:
                assert same(dict_of(session, node), expected[node]), node
            assert runner.failed_saves == []
            assert sum(client.run(_copies_here).values()) == 0  # the finished job dropped them
    finally:
        unsubscribe()
    (recovered,) = heard.seen
    assert recovered.pop("seconds") < 30
    assert recovered == {"job": "tiered", "epoch": 2, "source": "memory", "stored": 2,
                         "lost": ["trainer_1"], "failed_epoch": 3}
    saved = sorted(set(runner.saved_epochs))
    assert saved == [0, *range(interval, EPOCHS + 1, interval)]
    store = CheckpointStore(Location(url))
    for node in NODES:  # the final epoch's save, read back
        assert same(load(store, node, EPOCHS), load(ref, node, EPOCHS)), node


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_worker_killed_in_a_save_costs_that_epoch_and_its_save_is_made_again(
        tmp_path, client, async_save):
    """The worker dies in epoch 3's save, before its commit record: the save fails, the run
    goes back to epoch 2 from memory, runs epoch 3 again and commits it."""
    expected, ref = reference(tmp_path)
    url, marker = str(tmp_path / "ckpt"), tmp_path / "die"
    marker.touch()
    client.run(die_before_commit, str(marker), "trainer_1", 3)
    try:
        with DaskSession(client, memory_tier=True) as session:
            runner = JobRunner(job(), MultiNodeCheckpointManager(url, async_save=async_save))
            assert runner.train(session) == EPOCHS
            assert not marker.exists()
            assert same(dict_of(session, "trainer_1"), expected["trainer_1"])
    finally:
        undo_die_before_commit(client)
    assert runner.saved_epochs == list(range(EPOCHS + 1)) and runner.failed_saves == []
    store = CheckpointStore(Location(url))
    for node in NODES:
        assert same(load(store, node, 3), load(ref, node, 3)), node


def _fail_in_epoch_5(cluster, client, tmp_path, url, *, close: bool, keep: float = 600.0):
    """A run (saves every 3 epochs) that fails in epoch 5 with its workers alive; then its
    session closes (``close``) or its client goes away without closing it (its flow process
    died). Returns that run."""
    fail = tmp_path / "fail"
    fail.touch()
    first = client if close else distributed.Client(cluster.scheduler_address)
    session = DaskSession(first, memory_tier=True, memory_tier_keep=keep)
    runner = JobRunner(job(fail=str(fail), die_at=5), MultiNodeCheckpointManager(url),
                       options=StepManagerOptions(save_interval_steps=3))
    with pytest.raises(RuntimeError, match="injected"):
        runner.train(session)
    assert runner.saved_epochs == [0, 3]
    session.close() if close else first.close()
    return runner


@pytest.mark.slow
def test_an_async_save_lost_after_its_epoch_was_copied_is_made_again(tmp_path, client):
    """trainer_1's worker dies in epoch 3's background save, once its copy of epoch 3 is at its
    buddy: the run goes back to epoch 3 from memory and saves epoch 3 again, at once (its
    epoch does not run again)."""
    expected, ref = reference(tmp_path)
    url, marker = str(tmp_path / "ckpt"), tmp_path / "die"
    marker.touch()
    client.run(die_before_commit, str(marker), "trainer_1", 3, copied=True)
    heard = Recoveries()
    unsubscribe = events.subscribe(heard)
    try:
        with DaskSession(client, memory_tier=True) as session:
            runner = JobRunner(job(), MultiNodeCheckpointManager(url, async_save=True))
            assert runner.train(session) == EPOCHS
            assert not marker.exists()
            for node in NODES:
                assert same(dict_of(session, node), expected[node]), node
    finally:
        unsubscribe()
        undo_die_before_commit(client)
    assert [(r["source"], r["epoch"]) for r in heard.seen] == [("memory", 3)]
    assert runner.saved_epochs == list(range(EPOCHS + 1)) and runner.failed_saves == []
    store = CheckpointStore(Location(url))
    for node in NODES:
        assert same(load(store, node, 3), load(ref, node, 3)), node


@pytest.mark.slow
@pytest.mark.parametrize("close", [True, False], ids=["run-failed", "process-died"])
def test_the_next_session_resumes_from_worker_memory_and_persists_that_epoch(
        tmp_path, cluster, client, close, caplog):
    """Epoch 4 is in worker memory, storage holds epoch 3: the job's next session (a Prefect
    retry) resumes epoch 4 from memory, commits it before training on, and ends as an
    uninterrupted run does."""
    caplog.set_level(logging.INFO, logger="caffe2ckpt")
    expected, ref = reference(tmp_path)
    url = str(tmp_path / "ckpt")
    _fail_in_epoch_5(cluster, client, tmp_path, url, close=close)
    heard = Recoveries(events.RUN_RESUMED)
    unsubscribe = events.subscribe(heard)
    try:
        with DaskSession(client, memory_tier=True) as session:
            runner = JobRunner(job(), MultiNodeCheckpointManager(url),
                               options=StepManagerOptions(save_interval_steps=3))
            assert runner.train(session) == EPOCHS
            for node in NODES:
                assert same(dict_of(session, node), expected[node]), node
    finally:
        unsubscribe()
    assert "Resuming epoch 4 from worker memory; storage holds epoch 3" in caplog.text
    assert runner.saved_epochs == [4, 6] and runner.resumed_from == 3
    (resumed,) = heard.seen
    assert (resumed["epoch"], resumed["source"], resumed["stored"]) == (4, "memory", 3)
    store = CheckpointStore(Location(url))
    for epoch in (4, 6):
        for node in NODES:
            assert same(load(store, node, epoch), load(ref, node, epoch)), (node, epoch)
    assert _copies_left(client) == 0  # the job finished: its copies went


@pytest.mark.slow
def test_copies_are_kept_for_memory_tier_keep_seconds_then_storage_is_used(
        tmp_path, cluster, client):
    """The dead session's actors go as soon as the scheduler releases them (no collection of
    reference cycles needed, although a task of theirs raised); their copies stay ``keep``
    seconds, then go."""
    url = str(tmp_path / "ckpt")
    key = tier_key(Location(url).canonical_url)
    _fail_in_epoch_5(cluster, client, tmp_path, url, close=False, keep=2.0)
    for _ in range(40):  # the scheduler releases the actors of the client gone
        kept = [entry for entries in client.run(_kept_here, key).values() for entry in entries]
        if kept and all(released for released, _ in kept):
            break
        time.sleep(0.05)
    assert kept and all(released for released, _ in kept), kept
    assert sum(count for _, count in kept) >= 6  # own and held, per node
    time.sleep(2.5)
    assert sum(len(entries) for entries in client.run(_kept_here, key).values()) == 0
    with DaskSession(client, memory_tier=True) as session:
        runner = JobRunner(job(), MultiNodeCheckpointManager(url),
                           options=StepManagerOptions(save_interval_steps=3))
        assert runner.train(session) == EPOCHS
    assert runner.resumed_from == 3 and runner.saved_epochs == [6]


@pytest.mark.slow
def test_copies_of_a_run_another_run_overtook_are_never_resumed(tmp_path, cluster, client,
                                                                caplog):
    """After the failed run (run 1, epoch 4 in memory, 3 in storage), run 2 went back to epoch
    0, committed epochs 1 and 2 and failed in epoch 3: run 1's copies are no longer the
    prefix's history, although newer, and the next session resumes epoch 2 from storage."""
    caplog.set_level(logging.INFO, logger="caffe2ckpt")
    url = str(tmp_path / "ckpt")
    _fail_in_epoch_5(cluster, client, tmp_path, url, close=True)
    fail = tmp_path / "fail-again"
    fail.touch()
    with DaskSession(client) as plain, pytest.raises(RuntimeError, match="injected"):
        JobRunner(job(fail=str(fail), die_at=3), MultiNodeCheckpointManager(url),
                  resume_from_epoch=0).train(plain)
    with DaskSession(client, memory_tier=True) as session:
        runner = JobRunner(job(), MultiNodeCheckpointManager(url))
        assert runner.train(session) == EPOCHS
    assert runner.resumed_from == 2 and runner.saved_epochs == [3, 4, 5, 6]
    assert "not resuming from the worker-memory copies of run 1: run 2 took over" in caplog.text


@pytest.mark.slow
def test_a_copy_that_fails_never_fails_the_epoch_it_follows(tmp_path, client, caplog,
                                                            monkeypatch):
    """Epoch 2's copy fails (not a loss): a WARNING, and training goes on with its checkpoints."""
    from caffe2ckpt.dask.memory import MemoryTier

    snapshot = MemoryTier.snapshot

    def failing(self, epoch, token):
        if epoch == 2:
            raise RuntimeError("injected: out of memory on a worker")
        return snapshot(self, epoch, token)

    monkeypatch.setattr(MemoryTier, "snapshot", failing)
    with DaskSession(client, memory_tier=True) as session:
        runner = JobRunner(job(), MultiNodeCheckpointManager(str(tmp_path / "ckpt")))
        assert runner.train(session) == EPOCHS
    assert runner.saved_epochs == list(range(EPOCHS + 1))
    assert "epoch 2 was not copied to worker memory (RuntimeError: injected" in caplog.text


@pytest.mark.slow
def test_without_the_tier_a_lost_worker_still_fails_the_run(tmp_path, client):
    die = markers(tmp_path, "trainer_1")
    with DaskSession(client) as session, pytest.raises(NodeLostError, match="trainer_1"):
        JobRunner(job(die, buddied=False)).train(session)


@pytest.mark.slow
def test_a_node_lost_with_its_buddy_goes_back_to_storage_in_the_same_run(tmp_path, client,
                                                                          caplog):
    """Two of the three workers die at once in epoch 4: in a ring of three, one of the two
    lost nodes had its copy on the other's worker, so no epoch has a copy of every node, and
    the run goes back to its newest commit (epoch 2: saves every 2 epochs) in the same
    ``train()`` call."""
    expected, ref = reference(tmp_path)
    url = str(tmp_path / "ckpt")
    die = markers(tmp_path, "trainer_1", "trainer_2")
    options = StepManagerOptions(save_interval_steps=2)
    with DaskSession(client, memory_tier=True) as session:
        runner = JobRunner(job(die, die_at=4, buddied=False), MultiNodeCheckpointManager(url),
                           options=options)
        assert runner.train(session) == EPOCHS
        assert not any(map(os.path.exists, die.values()))
        for node in NODES:
            assert same(dict_of(session, node), expected[node]), node
    assert "recovered epoch 2 from storage (storage holds epoch 2)" in caplog.text
    assert runner.saved_epochs == [0, 2, 4, 6]
    store = CheckpointStore(Location(url))
    for node in NODES:
        assert same(load(store, node, EPOCHS), load(ref, node, EPOCHS)), node


# -- the choices, without a cluster --------------------------------------------------------------


def test_buddies_are_on_another_worker_and_another_host_when_there_is_one():
    workers = {"a": "w1", "b": "w2", "c": "w3", "d": "w1"}
    assert buddies(workers, {"w1": "h1", "w2": "h1", "w3": "h2"}) == {
        "a": "c", "b": "c", "c": "a", "d": "c"}
    assert buddies(workers, {}) == {"a": "b", "b": "c", "c": "a", "d": "b"}
    assert buddies({"a": "w1", "b": "w1"}, {}) == {"a": None, "b": None}


def _entry(node, epoch, role, token="t", complete=True, via="x"):
    return {"node": node, "epoch": epoch, "role": role, "token": token, "complete": complete,
            "via": via}


def test_the_newest_epoch_every_node_has_a_complete_copy_of_is_chosen():
    homes = {"a": "w1", "b": "w2"}
    held = {"w1": [_entry("a", 5, "own"), _entry("b", 4, "held"), _entry("c", 5, "held")],
            "w2": [_entry("b", 5, "own"), _entry("a", 4, "held", complete=False)]}
    # c (lost) has 5; a and b have 5: 5, each from its own copy
    assert choose(["a", "b", "c"], held, "t", homes) == (5, {
        "a": Source("w1", "x", "own"), "b": Source("w2", "x", "own"),
        "c": Source("w1", "x", "held")})
    held["w1"][2] = _entry("c", 4, "held")  # c's newest copy is older: all go back to 4 ...
    assert choose(["a", "b", "c"], held, "t", homes) is None  # ... which a lacks (incomplete)
    held["w2"][1] = _entry("a", 4, "held")
    assert choose(["a", "b", "c"], held, "t", homes)[0] == 4
    assert choose(["a", "b", "c"], held, "another run", homes) is None
    assert choose(["a", "b", "c"], held, "t", homes, at_least=5) is None  # storage holds 5


# -- the copies in one process -------------------------------------------------------------------


def _workspace():
    from caffe2ckpt import Workspace

    return Workspace({"f": np.asfortranarray(np.arange(12.0).reshape(3, 4)), "s": np.array("ab"),
                      "u": np.array(["x", "yz"]), "e": np.zeros((0, 3), np.int16)})


def _sent(copy, store, role: str) -> None:
    """What :func:`tier.send` sends, received by ``store``."""
    from caffe2ckpt.dask import tier

    specs = {name: tier.spec_of(arr) for name, arr in copy.arrays.items()}
    store.receive(("begin", copy.node, role, copy.epoch, copy.token, specs))
    for name, arr in copy.arrays.items():
        data = tier.flat(arr)
        for start in range(0, data.size, 5):
            store.receive(("piece", copy.node, role, name, start, data[start:start + 5]))
    store.receive(("end", copy.node, role, copy.epoch, copy.digests))


def test_a_copy_restores_every_blob_as_it_was_and_reuses_its_buffers():
    from caffe2ckpt.dask import tier

    ws, store = _workspace(), tier.Copies("n")
    own = tier.take(store, ws, 4, "run")
    buffers = {name: id(arr) for name, arr in own.arrays.items()}
    tier.seal(own)
    assert tier.take(store, ws, 5, "run") is own and not own.complete
    assert {name: id(arr) for name, arr in own.arrays.items()} == buffers  # reused
    tier.seal(own)
    before = {name: ws[name].copy(order="K") for name in ws}
    ws["f"][0, 0], ws["new"] = -1.0, np.ones(2)
    tier.restore(store, ws, 5, "run")
    assert sorted(ws) == sorted(before)
    assert same(dict(ws), before)
    assert ws["f"] is not own.arrays["f"]  # training on never changes the copy


def test_a_copy_sent_in_pieces_arrives_whole_and_restores():
    from caffe2ckpt.dask import tier

    ws, store, buddy = _workspace(), tier.Copies("n"), tier.Copies("m")
    own = tier.take(store, ws, 3, "run")
    tier.seal(own)
    _sent(own, buddy, "held")
    held = buddy.held("n", "held", 3)
    assert held.complete and held.digests == own.digests
    placed_again = tier.Copies("n")  # as a recovery sends it to the node's new actor
    _sent(held, placed_again, "own")
    restored = _workspace()
    restored["f"][:] = 0
    tier.restore(placed_again, restored, 3, "run")
    assert same(dict(restored), dict(ws))
    buddy.keep_held(set())  # no longer its buddy
    with pytest.raises(Exception, match="has none"):
        buddy.held("n", "held", 3)


@pytest.mark.parametrize("damage", ["token", "epoch", "incomplete", "byte"])
def test_a_copy_that_is_not_this_runs_epoch_intact_is_refused_and_nothing_changes(damage):
    from caffe2ckpt.dask import tier
    from caffe2ckpt.errors import CheckpointCorruptedError

    ws, store = _workspace(), tier.Copies("n")
    own = tier.take(store, ws, 2, "run")
    tier.seal(own)
    token, epoch = "run", 2
    if damage == "token":
        token = "another run"
    elif damage == "epoch":
        epoch = 1
    elif damage == "incomplete":
        own.complete = False
    else:
        tier.flat(own.arrays["f"])[3] ^= 1
    ws["f"][0, 0] = 7.0
    kept = {name: ws[name].copy(order="K") for name in ws}
    with pytest.raises(CheckpointCorruptedError, match=r"copy of node 'n', epoch \d"):
        tier.restore(store, ws, epoch, token)
    assert same(dict(ws), kept)


def test_a_restore_never_writes_through_memory_two_blobs_share():
    """Mid-epoch, "a" became a view of "b" and "c" the same array as "d": copying the copy's
    values into those arrays would make the last one written win for both."""
    from caffe2ckpt import Workspace
    from caffe2ckpt.dask import tier

    ws = Workspace({"a": np.zeros(4), "b": np.ones(8), "c": np.arange(3.0),
                    "d": np.arange(3.0) + 5, "e": np.full(2, 7.0)})
    store = tier.Copies("n")
    tier.seal(tier.take(store, ws, 1, "run"))
    before = {name: ws[name].copy() for name in ws}
    kept_e = ws["e"]
    ws["a"], ws["c"] = ws["b"][:4], ws["d"]
    tier.restore(store, ws, 1, "run")
    assert same(dict(ws), before)
    assert ws["e"] is kept_e  # nothing shares it: restored in place


@pytest.mark.parametrize("keep", [-1, float("nan"), float("inf"), "600", True])
def test_a_keep_that_is_not_seconds_is_refused_before_connecting(keep):
    from caffe2ckpt.errors import JobDefinitionError

    with pytest.raises(JobDefinitionError, match=r"memory_tier_keep must be a number of "
                                                 r"seconds, 0 or more, got"):
        DaskSession("tcp://127.0.0.1:1", memory_tier=True, memory_tier_keep=keep)


# -- the lease of an actor's copies, without a cluster ---------------------------------------------


@pytest.fixture
def kept():
    """The worker side's registry of copies, emptied around a test."""
    from caffe2ckpt.dask import tier

    tier._gone.clear()
    tier._kept.clear()
    yield tier
    tier._gone.clear()
    tier._kept.clear()


def _lease(tier, keep: float = 60.0):
    lease = tier.Lease("trainer_0", keep)
    lease.copies.slot("trainer_0", "own").complete = True
    return lease


def test_copies_outlive_their_actor_for_keep_seconds_then_go(kept, monkeypatch):
    from caffe2ckpt.session import tier_key, tier_token

    clock = [1000.0]
    monkeypatch.setattr(kept, "_clock", lambda: clock[0])
    gone = _lease(kept, keep=30)
    gone.bind(tier_token("file:///ckpt", (3, 1.5)))
    key = tier_key("file:///ckpt")
    gone.release()  # a finalizer: it only queues the lease
    assert kept._kept[(key, "trainer_0")].owner is gone
    clock[0] += 29
    assert len(kept.kept(key)) == 1  # taken in now: 30 s from now
    clock[0] += 29
    assert len(kept.kept(key)) == 1
    clock[0] += 2
    assert kept.kept(key) == []
    assert not _lease(kept).adopt(key)


def test_a_new_actor_adopts_the_copies_and_the_old_lease_keeps_none(kept):
    from caffe2ckpt.session import tier_key, tier_token

    old, new = _lease(kept), _lease(kept)
    old.bind(tier_token("file:///ckpt", (3, 1.5)))
    store, key = old.copies, tier_key("file:///ckpt")
    assert new.adopt(key) and new.copies is store and new.key == key
    assert old.copies is not store and old.key is None  # a zombie writes elsewhere now
    old.release()
    kept._sweep()  # the old actor's release keeps nothing: the store is the new one's
    assert kept._kept[(key, "trainer_0")].owner is new
    assert not new.adopt(key)  # its own
    new.drop()
    assert kept._kept == {} and new.copies is not store


def test_a_lease_that_changes_prefix_or_has_none_leaves_no_entry_behind(kept):
    from caffe2ckpt.session import tier_token

    lease = _lease(kept)
    lease.bind(tier_token("file:///a", (1, 1.0)))
    lease.bind(tier_token("file:///b", (1, 1.0)))
    assert len(kept._kept) == 1
    lease.bind(tier_token("", None))  # a job without a checkpoint manager
    assert kept._kept == {}
    lease.release()
    kept._sweep()
    assert kept._kept == {}


def test_a_token_names_its_prefix_and_run():
    from caffe2ckpt.session import tier_key, tier_token, token_key, token_run

    token = tier_token("s3://b/run?secret=1", (12, 1765150000.123456))
    assert token_key(token) == tier_key("s3://b/run?secret=1") and "secret" not in token
    assert token_run(token) == token_run(token, "s3://b/run?secret=1") == (12, 1765150000.123456)
    assert token_run(token, "s3://b/other") is None
    assert token_run(tier_token("s3://b/run", None)) is None
