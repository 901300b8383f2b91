"""Two runs of one job writing the same prefix at once (e.g. a duplicated Prefect retry), on
memory://, a local directory and S3 (moto, see conftest.py).

What is guaranteed (and tested here): claims are numbered and created exclusively, so racing
runs always get distinct claims and the newest one wins; an older run is fenced off
(``CheckpointFencedError``) at its next save, and the newest run is never fenced; every epoch
that counts as committed holds the data of exactly one save of one run, on every node — a
committed epoch never mixes two runs' data, and a damaged one is detected, never loaded.

Late writes of an overtaken run: a save writes its group once at a path only it owns (the
first save of an epoch takes ``<node>.<epoch>`` by creating its ``zarr.json`` exclusively, a
later one writes at ``<node>.<epoch>.<save id>``), so the older run's writes that are already
under way when the newer run claims the prefix land in the older run's own group and never on
the newer run's (``test_a_late_write_of_a_fenced_run_is_detected_never_loaded``).
"""

from __future__ import annotations

import random
import sys
import threading
import time

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

from caffe2ckpt import (
    CheckpointCorruptedError,
    CheckpointFencedError,
    CheckpointNotFoundError,
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    epoch_limiter,
)
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.scan import scan
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.faultfs import FaultyFileSystem
from tests.s3server import NOT_ON_S3, prefix_kind
from tests.stores import newest_epoch, record_of

NODES = ["trainer_0", "trainer_1"]
EPOCHS = 4
SIZE = 1 << 14  # float64: 128 KiB per node, its own Zarr array


def run_job(run: int, epochs: int = EPOCHS, on_epoch=None) -> Job:
    """Every node's blobs say which run wrote them: ``tag`` is ``run * 1000 + step``."""
    with Job(name="race") as job:
        for node in NODES:
            with Node(node):
                with job.init_group:
                    Task(lambda ws, r=run: ws.update({"run": np.int64(r), "step": np.int64(0),
                                                      "tag": np.full(SIZE, r * 1000.0)}),
                         name="init")

                def epoch(ws, r=run, node=node):
                    step = int(ws["step"]) + 1
                    ws.update({"run": np.int64(r), "step": np.int64(step),
                               "tag": np.full(SIZE, r * 1000.0 + step)})
                    if on_epoch is not None:
                        on_epoch(node, step)
                Task(epoch, name="train")
        epoch_limiter(job, epochs)
    return job


def manager(url: str, **kw) -> MultiNodeCheckpointManager:
    return MultiNodeCheckpointManager(url, metadata_handler=ZarrMetadataHandler(), **kw)


def audit(store: CheckpointStore) -> dict[int, int | str]:
    """For every epoch of the lineage: the run whose data it holds, or "damaged". Fails the test
    if any committed save (superseded ones too) loads data that mixes runs or steps."""
    out: dict[int, int | str] = {}
    family = scan(store, NODES).families.get(frozenset(NODES))
    current = family.current() if family is not None else {}
    for save in family.saves() if family is not None else []:
        try:
            loaded = {node: store.load_node(save.records[node]) for node in NODES}
        except CheckpointCorruptedError:
            if current.get(save.epoch) is save:
                out[save.epoch] = "damaged"
            continue
        runs = {int(d["run"]) for d in loaded.values()}
        assert len(runs) == 1, f"epoch {save.epoch} mixes runs {runs} across nodes"
        for node, data in loaded.items():  # all three blobs were set together in one epoch
            step, run, tag = int(data["step"]), int(data["run"]), np.unique(data["tag"])
            assert step == save.epoch, f"epoch {save.epoch} of {node} holds step {step}"
            assert tag.tolist() == [run * 1000.0 + step], (
                f"epoch {save.epoch} of {node} (run {run}) holds tags {tag[:4]} of other saves")
        if current.get(save.epoch) is save:
            out[save.epoch] = runs.pop()
    return dict(sorted(out.items()))


def test_two_runs_racing_on_one_prefix_never_mix_data(prefix):
    """Run 2 starts while run 1 is somewhere in its epochs (after its epoch 1, 2, 3 in three
    rounds; one round on S3, where a round takes seconds); both train with jitter. The older
    claimant is fenced, the newer one finishes, every committed epoch is one run's data, and a
    third run resumes from the newest epoch."""
    for round_ in range(1 if prefix_kind(prefix) == "s3" else 3):
        race(f"{prefix}/round-{round_}", round_)


def race(prefix: str, round_: int) -> None:
    rng = random.Random(f"{prefix_kind(prefix)}-{round_}")
    jitter = 0.002 if prefix_kind(prefix) != "s3" else 0.01
    start_second = threading.Event()
    results: dict[int, object] = {}
    claims: dict[int, str] = {}

    def on_epoch(run):
        def hook(node, step):
            if run == 1 and node == NODES[0] and step == 1 + round_ % EPOCHS:
                start_second.set()
            time.sleep(rng.random() * jitter)
        return hook

    def train(run: int) -> None:
        if run == 2:
            start_second.wait(60)
        runner = JobRunner(run_job(run, on_epoch=on_epoch(run)), manager(prefix))
        try:
            results[run] = runner.train(LocalSession())
        except Exception as exc:  # noqa: BLE001 - checked below
            results[run] = exc
        finally:
            start_second.set()
            current = runner.checkpoint_manager.run
            claims[run] = None if current is None else current.generation

    threads = [threading.Thread(target=train, args=(run,)) for run in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert claims[1] is not None and claims[2] is not None and claims[1] != claims[2]
    newest = max(claims, key=claims.get)
    assert results[newest] == EPOCHS, f"the newest claimant (run {newest}) failed: {results}"
    for run, result in results.items():
        assert result == EPOCHS or isinstance(result, CheckpointFencedError), (
            f"run {run}: {result!r}")
    store = CheckpointStore(Location(prefix))
    holders = audit(store)
    latest = newest_epoch(store, NODES)
    print(f"results {results}, epochs held by runs {holders}")
    assert latest is not None and holders[latest] in (1, 2), holders
    runner, session = JobRunner(run_job(3, EPOCHS + 1), manager(prefix)), LocalSession()
    assert runner.train(session) == EPOCHS + 1 and runner.resumed_from == latest
    assert audit(store)[EPOCHS + 1] == 3


def test_racing_claims_are_distinct_and_the_newest_fences_the_others(prefix):
    cms = [manager(prefix) for _ in range(6)]
    for cm in cms:
        cm.set_params(NODES)
    barrier, claims = threading.Barrier(len(cms)), [None] * len(cms)

    def claim(i):
        barrier.wait()
        claims[i] = cms[i].claim({"run": i})
    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(cms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert None not in claims, claims
    generations = [c.generation for c in claims]
    assert sorted(generations) == list(range(1, len(cms) + 1)), generations  # no gaps
    newest = max(generations)
    for i, generation in enumerate(generations):
        if generation == newest:
            runs.check_fence(cms[i].store.location, generation, "save")
        else:
            with pytest.raises(CheckpointFencedError, match=f"newer run .*run {generation + 1}"):
                runs.check_fence(cms[i].store.location, generation, "save")


def race_exclusive_creates(location: Location, trials: int) -> None:
    """Eight threads create one file at once, ``trials`` times over: exactly one creation
    succeeds each time, the others get FileExistsError, and the file holds the winner's bytes."""
    for trial in range(trials):
        path = location.path("_commits", f"{trial:012d}.n.s.json")
        barrier, results = threading.Barrier(8), []

        def create(i, path=path, barrier=barrier, results=results):
            barrier.wait()
            try:
                location.create_exclusive(path, f"writer {i}".encode())
                results.append(i)
            except FileExistsError:
                results.append(None)
        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [r for r in results if r is not None]
        assert len(results) == 8 and len(winners) == 1, (trial, results)
        assert location.read_bytes(path) == f"writer {winners[0]}".encode()


@NOT_ON_S3  # tests/test_s3.py races creators on the S3 server with a widened window
def test_exclusive_creation_has_exactly_one_winner(prefix):
    """200 races of eight creators, the interpreter switching threads every microsecond
    (memory://'s own "xb" open let 21 of 300 such races have two winners)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        race_exclusive_creates(Location(prefix), 200)
    finally:
        sys.setswitchinterval(interval)


def test_a_late_write_of_a_fenced_run_is_detected_never_loaded(prefix):
    """Run 1 is paused in the middle of its save of epoch 2, once it has taken the path
    ``trainer_0.2``; run 2 claims the prefix, resumes from epoch 1, saves and commits epoch 2
    (at a path of its own) and finishes; then run 1 goes on, and is fenced.

    Run 1's late writes land only in its own group, never on run 2's, so epoch 2 stays run 2's,
    intact."""
    location = Location(prefix)
    paused, resume = threading.Event(), threading.Event()

    class Pausing(FaultyFileSystem):
        def pause(self, path):
            if f"{NODES[0]}.2/" in str(path) and not paused.is_set():
                paused.set()  # run 1 writes its group of epoch 2
                resume.wait(60)

        def pipe_file(self, path, value, **kwargs):
            self.pause(path)
            return super().pipe_file(path, value, **kwargs)

        def open(self, path, mode="rb", **kwargs):
            if "r" not in mode:
                self.pause(path)
            return super().open(path, mode, **kwargs)

    first: dict[str, object] = {}

    def run_first():
        inner = LocalFileSystem(auto_mkdir=True) if location.is_local else location.fs
        cm = MultiNodeCheckpointManager(location.root, filesystem=Pausing(inner),
                                        metadata_handler=ZarrMetadataHandler())
        try:
            first["result"] = JobRunner(run_job(1, 3), cm, on_save_error="raise").train(
                LocalSession())
        except Exception as exc:  # noqa: BLE001
            first["result"] = exc
        finally:
            paused.set()

    thread = threading.Thread(target=run_first)
    thread.start()
    assert paused.wait(60)
    try:
        second = JobRunner(run_job(2, 2), manager(prefix), on_save_error="raise")
        assert second.train(LocalSession()) == 2 and second.resumed_from == 1
    finally:
        resume.set()
        thread.join(60)
    assert isinstance(first["result"], CheckpointFencedError), first
    store = CheckpointStore(Location(prefix))
    holders = audit(store)  # never mixed, whatever happened
    assert holders.get(2) == 2, holders
    assert newest_epoch(store, NODES) == 2


def test_a_fenced_run_deletes_nothing_of_the_newer_run(prefix):
    """The older run, fenced at its next save, must not remove the newer run's data or records
    (its save checks the claim before touching anything)."""
    older = manager(prefix)
    older.set_params(NODES)
    older_claim = older.claim({"run": "older"})
    session = LocalSession()
    assert JobRunner(run_job(2, 2), manager(prefix)).train(session) == 2  # claims anew
    store = CheckpointStore(Location(prefix))
    before = audit(store)
    old_session = LocalSession()
    for node in NODES:
        old_session.workspace(node).update({"run": np.int64(1), "step": np.int64(1),
                                            "tag": np.full(SIZE, 1001.0)})
    old_session.run(older.init(NODES))
    for epoch in (1, 2, 3):  # a re-save of committed epochs and a first save
        with pytest.raises(CheckpointFencedError):
            old_session.run(older.save(epoch, claim=older_claim))
    assert audit(store) == before == {0: 2, 1: 2, 2: 2}
    with pytest.raises(CheckpointNotFoundError):
        record_of(store, NODES[0], 3)
