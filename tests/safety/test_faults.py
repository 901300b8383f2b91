"""Fault injection: every write, delete (and stat) of a multi-node save fails in turn, on real
filesystems (fsspec memory and a local temp dir) reached through :class:`FaultyFileSystem`; a
full disk (ENOSPC on that write and every later one, leaving truncated files) is tried too.

For each failing operation n the tests check that (a) the save raises a clear error naming the
epoch, the node and the injected OS error, (b) every epoch committed before the fault still
loads bit-exact and nothing else became "committed", (c) a fresh runner without faults resumes
from the right epoch and ends bit-identical to an uninterrupted run.

Scenarios (the job is ``caffe2ckpt.example.build_job`` on two nodes: ``data/x`` is a 128 KiB
blob stored as its own array, the other blobs are packed):

- ``fresh``: epochs 0..1 committed; a resumed run saves epoch 2 for the first time.
- ``resave``: epochs 0..3 committed; ``resume_from_epoch=1`` re-saves the committed epoch 2.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from faultfs import FaultyFileSystem
from fsspec.implementations.local import LocalFileSystem

from caffe2ckpt import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Task,
)
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.records import list_records
from tests.stores import load, newest_epoch, records_at

NODES = ["trainer_0", "trainer_1"]
LAST = 3  # epochs of the uninterrupted run
SAVED = 2  # the epoch whose save is faulted
BATCHES = 4

State = dict[str, dict[str, np.ndarray]]  # node -> blob -> array


def make_job(epochs: int, hook=None):
    """The example job; ``hook()`` runs at the end of every epoch's computation, just before the
    runner saves that epoch (used to arm faults and counters for exactly that save)."""
    job = build_job(epochs, len(NODES), batches_per_epoch=BATCHES)
    if hook is not None:
        Task(lambda ws: hook(), name="before_save", group=job.epoch_group, node=NODES[0])
    return job


def snapshot(session: LocalSession) -> State:
    return {n: {b: np.array(v, copy=True) for b, v in session.workspace(n).items()} for n in NODES}


@functools.cache
def reference() -> tuple[State, ...]:
    """The workspaces after epoch 0 (init only), 1, ..., LAST of runs without checkpoints."""
    session = LocalSession()
    session.run(make_job(1).init_group)
    states = [snapshot(session)]
    for epochs in range(1, LAST + 1):
        session = LocalSession()
        assert JobRunner(make_job(epochs)).train(session) == epochs
        states.append(snapshot(session))
    return tuple(states)


def checkpointed(epoch: int) -> State:
    """The checkpointed blobs (those present after init) of the reference at ``epoch``."""
    names = {n: set(reference()[0][n]) for n in NODES}
    return {n: {b: a for b, a in reference()[epoch][n].items() if b in names[n]} for n in NODES}


def differences(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> list[str]:
    """Bit-level differences between two blob dicts (empty when identical)."""
    out = []
    if set(actual) != set(expected):
        out.append(f"blob names differ: {sorted(set(actual) ^ set(expected))}")
    for name in sorted(set(actual) & set(expected)):
        a, e = np.asarray(actual[name]), expected[name]
        if a.dtype != e.dtype or a.shape != e.shape or a.tobytes() != e.tobytes():
            out.append(f"{name}: {a.dtype}{a.shape} != expected {e.dtype}{e.shape} or bytes differ")
    return out


def assert_state(actual: State, expected: State, what: str) -> None:
    problems = [f"{n}: {p}" for n in NODES for p in differences(actual[n], expected[n])]
    assert not problems, f"{what}: " + "; ".join(problems)


def train(fs, path: str, epochs: int, resume: int | None = None,
          hook=None) -> tuple[JobRunner, LocalSession]:
    cm = MultiNodeCheckpointManager(path, filesystem=fs, metadata_handler=ZarrMetadataHandler())
    runner = JobRunner(make_job(epochs, hook), cm, resume_from_epoch=resume, on_save_error="raise")
    session = LocalSession()
    runner.train(session)
    return runner, session


def clone(inner, src: str, dst: str) -> None:
    """Copy a whole prefix byte for byte through the inner filesystem."""
    for f in inner.find(src):
        inner.pipe_file(dst + f[len(src):], inner.cat_file(f))


def check_epoch(store: CheckpointStore, epoch: int, *, may_be_uncommitted: bool = False) -> str:
    """Assert ``epoch`` loads bit-exact; if allowed, it may instead be uncommitted (but every node
    checkpoint that still loads must then be exact too). Returns "exact" or "uncommitted"."""
    expected = checkpointed(epoch)
    if records_at(store, NODES, epoch) is None:
        assert may_be_uncommitted, f"epoch {epoch} is no longer committed"
        for node in NODES:
            try:
                data = load(store, node, epoch)
            except (CheckpointNotFoundError, CheckpointCorruptedError):
                continue
            problem = differences(data, expected[node])
            assert not problem, f"uncommitted epoch {epoch} of {node} loads WRONG data: {problem}"
        return "uncommitted"
    loaded = {node: load(store, node, epoch) for node in NODES}
    assert_state(loaded, expected, f"committed epoch {epoch}")
    return "exact"


@dataclass(frozen=True)
class Scenario:
    name: str
    setup_epochs: int  # epochs 0..setup_epochs committed cleanly first
    resume: int | None  # resume_from_epoch of the faulted run (None: automatic)
    kept: tuple[int, ...]  # committed epochs that must survive bit-exact
    latest_after_fault: int  # what automatic resume must pick after the fault


FRESH = Scenario("fresh", setup_epochs=1, resume=None, kept=(0, 1), latest_after_fault=1)
# RESAVE goes back to epoch 1 and saves 2 again: its run claimed the prefix from epoch 1 before
# the save, but a run supersedes only once it commits, so while the new save of 2 is not
# committed the first run's 2 and 3 stay current
RESAVE = Scenario("resave", setup_epochs=LAST, resume=1, kept=(0, 1, 2, 3),
                  latest_after_fault=LAST)


@pytest.fixture(params=["memory", "local"])
def inner(request, tmp_path, memory_fs):
    """(inner filesystem, root path on it)."""
    if request.param == "memory":
        return memory_fs, "/faults"
    return LocalFileSystem(auto_mkdir=True), str(tmp_path)


def check_error(exc: BaseException, failed: list[tuple[str, str, str]], err: int) -> None:
    """(a): a CheckpointWriteError/OSError naming the epoch, the node and the OS error."""
    _kind, method, path = failed[0]
    msg = str(exc)
    assert isinstance(exc, OSError), f"expected an OSError subclass, got {type(exc).__name__}: {msg}"
    assert f"epoch {SAVED}" in msg, f"error does not name epoch {SAVED}: {type(exc).__name__}: {msg!r}"
    if len(failed) == 1:  # one failed op: the error must name its node (if it has one)
        for node in NODES:
            if f"{node}." in path:
                assert node in msg, f"error does not name node {node} ({method} {path}): {msg!r}"
    elif any(f"{node}." in p for _k, _m, p in failed for node in NODES):  # sticky: any node
        assert any(node in msg for node in NODES), f"error names no node: {msg!r}"
    chain, e = [], exc
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(getattr(e, "errno", None) == err for e in chain) or os.strerror(err) in msg, (
        f"error hides the cause ({errno.errorcode[err]} in {method} {path}): {msg!r}"
    )


@dataclass(frozen=True)
class Fault:
    kind: str  # "write", "delete" or "stat" (see faultfs)
    err: int = errno.EIO
    sticky: bool = False  # every later op of the kind fails too (a full disk)
    torn: bool = False  # a failing write leaves half its bytes behind
    every_n: bool = True  # False: only the first, middle and last op
    # only ops for which match(method, path) is true count towards n (see FaultyFileSystem.arm)
    match: Callable[[str, str], bool] | None = field(default=None, compare=False)
    label: str = ""  # names the matched class of ops

    def __str__(self) -> str:
        return (f"{self.kind}-{errno.errorcode[self.err]}{'-torn' if self.torn else ''}"
                f"{'-' + self.label if self.label else ''}")


def run_case(inner, root: str, template: str, sc: Scenario, fault: Fault, n: int) -> str:
    """One fault: the n-th ``fault.kind`` op of the save of epoch SAVED fails."""
    path = f"{root}/{sc.name}-{fault}-{n}"
    clone(inner, template, path)
    try:
        return _fault_and_recover(inner, path, sc, fault, n)
    finally:  # keeps the (process-global) memory store small: its listings scan all of it
        inner.rm(path, recursive=True)


def _fault_and_recover(inner, path: str, sc: Scenario, fault: Fault, n: int) -> str:
    fs = FaultyFileSystem(inner)
    cm = MultiNodeCheckpointManager(path, filesystem=fs, metadata_handler=ZarrMetadataHandler())
    job = make_job(SAVED, lambda: fs.arm(fault.kind, n, fault.err, sticky=fault.sticky,
                                         torn=fault.torn, match=fault.match))
    runner = JobRunner(job, cm, resume_from_epoch=sc.resume, on_save_error="raise")
    error = None
    try:
        runner.train(LocalSession())
    except Exception as exc:  # noqa: BLE001 - checked below
        error = exc
    assert fs.failed, f"the run failed before the fault was injected: {error!r}"
    failed_op = f"{fs.failed[0][1]} {fs.failed[0][2].removeprefix(path)}"
    store = CheckpointStore(Location(path, filesystem=inner))
    # every record there is vouches for its data: none was written before the data was whole
    for ref in list_records(store.location):
        record = store.read_or_reason(ref)
        if ref.epoch == SAVED and not isinstance(record, str):
            problem = differences(store.load_node(record), checkpointed(SAVED)[record.node])
            assert not problem, f"after {failed_op} failed, the record {ref} names {problem}"
    unclear = None
    if error is None:  # only a harmless stat fault may leave the save successful, or a fault
        # of the run log's mark that the run has committed (written after the commit, and
        # its committed save says the same)
        assert fault.kind == "stat" or all("/_runs" in p for _k, _m, p in fs.failed), (
            f"the save succeeded although {fs.failed} failed")
        assert check_epoch(store, SAVED) == "exact"
        latest = SAVED
    else:
        try:
            check_error(error, fs.failed, fault.err)
        except AssertionError as exc:  # reported at the end: (b) and (c) are checked regardless
            unclear = exc
        assert runner.failed_saves == [SAVED], f"failed_saves={runner.failed_saves}"
        latest = sc.latest_after_fault
    # (b) committed epochs intact (a save that committed supersedes the epochs above it); the
    # faulted epoch exact or not committed, never wrong
    for epoch in (sc.kept if error is not None else [e for e in sc.kept if e < SAVED]):
        check_epoch(store, epoch)
    outcome = check_epoch(store, SAVED, may_be_uncommitted=True)
    assert newest_epoch(store, NODES) == latest, f"latest committed epoch: {newest_epoch(store, NODES)}"
    # (c) a fresh manager without faults resumes and ends like an uninterrupted run
    clean = FaultyFileSystem(inner)
    resumed, session = train(clean, path, SAVED if sc.resume is None else LAST)
    assert resumed.resumed_from == latest, f"resumed from {resumed.resumed_from}, not {latest}"
    if sc.resume is not None:  # the job was finished at epoch 3: then retry the re-save
        assert_state({n: {b: session.workspace(n)[b] for b in checkpointed(LAST)[n]}
                      for n in NODES}, checkpointed(LAST), "workspace resumed from epoch 3")
        resumed, session = train(clean, path, SAVED, resume=sc.resume)
        assert resumed.resumed_from == sc.resume
    if resumed.resumed_from == SAVED:  # the save had committed: the recovery only loads it
        assert_state({n: {b: session.workspace(n)[b] for b in checkpointed(SAVED)[n]}
                      for n in NODES}, checkpointed(SAVED), "workspace resumed after the save")
    else:
        assert_state(snapshot(session), reference()[SAVED], "final workspaces after recovery")
    check_epoch(store, SAVED)  # the recovery's save; earlier epochs were checked above
    # the recovery went on from sc.resume: the older run's later epochs are superseded
    assert newest_epoch(store, NODES) == SAVED
    if unclear is not None:
        raise unclear
    return f"{'saved' if error is None else 'failed'}, epoch {SAVED} {outcome} ({failed_op})"


DISK_FULL = Fault("write", errno.ENOSPC, sticky=True, torn=True, every_n=False)
CASES = [
    pytest.param(FRESH, Fault("write"), id="fresh-write-EIO"),
    pytest.param(RESAVE, Fault("write"), id="resave-write-EIO"),
    # the fence check is a stat: a fault there must fail the save, never go unnoticed
    pytest.param(FRESH, Fault("stat"), id="fresh-stat-EIO"),
    pytest.param(RESAVE, Fault("stat"), id="resave-stat-EIO"),
    pytest.param(FRESH, DISK_FULL, id="fresh-diskfull-ENOSPC"),
    pytest.param(RESAVE, DISK_FULL, id="resave-diskfull-ENOSPC"),
]


@pytest.mark.parametrize("sc", [FRESH, RESAVE], ids=["fresh", "resave"])
def test_a_save_lists_deletes_and_reads_nothing(inner, sc: Scenario):
    """Storage model 3: a save (a first one or a re-save of a committed epoch) writes its group
    once at a path of its own and its record; it lists and deletes nothing, and reads back
    nothing but, on a re-save, the ``zarr.json`` at ``<node>.<epoch>`` its exclusive create
    found there (another save's: the path is taken)."""
    fs_inner, root = inner
    template = f"{root}/template-{sc.name}"
    train(FaultyFileSystem(fs_inner), template, sc.setup_epochs)
    counter = FaultyFileSystem(fs_inner)
    train(counter, template, SAVED, resume=sc.resume, hook=counter.reset)
    assert [counter.counts[kind] for kind in ("list", "delete")] == [0, 0], (
        counter.ops("list"), counter.ops("delete"))
    taken = {f"{template}/{node}.{SAVED}/zarr.json" for node in NODES} if sc is RESAVE else set()
    assert sorted(p for _m, p in counter.ops("read")) == sorted(taken), counter.ops("read")
    assert counter.counts["write"] > 0


@pytest.mark.parametrize(("sc", "fault"), CASES)
def test_faults_of_a_save(inner, sc: Scenario, fault: Fault):
    fs_inner, root = inner
    kind = fault.kind
    template = f"{root}/template-{sc.name}"
    train(FaultyFileSystem(fs_inner), template, sc.setup_epochs)

    # count the ops of the save without faults (and check that the save is right)
    probe = f"{root}/probe-{sc.name}"
    clone(fs_inner, template, probe)
    counter = FaultyFileSystem(fs_inner)
    runner, _ = train(counter, probe, SAVED, resume=sc.resume, hook=counter.reset)
    assert runner.resumed_from == (sc.resume if sc.resume is not None else sc.setup_epochs)
    check_epoch(CheckpointStore(Location(probe, filesystem=fs_inner)), SAVED)
    writes = counter.ops("write")
    for node in NODES:  # zarr's chunk writes and the records really go through the wrapper
        assert any(m == "pipe_file" and f"{node}.{SAVED}" in p and "/c." in p for m, p in writes)
        assert any(m == "open(xb)" and f".{node}." in p for m, p in writes)
    total = counter.counts[kind]
    for node in NODES:  # the comparisons can tell epochs apart
        assert differences(checkpointed(SAVED - 1)[node], checkpointed(SAVED)[node])
    assert total >= (8 if kind == "write" else 1), counter.ops(kind)

    # one op past the last: no fault fires, the save succeeds (the count is exact)
    clone(fs_inner, template, f"{root}/past-{sc.name}")
    past = FaultyFileSystem(fs_inner)
    train(past, f"{root}/past-{sc.name}", SAVED, resume=sc.resume, hook=lambda: past.arm(
        kind, total + 1, fault.err, sticky=fault.sticky, torn=fault.torn))
    assert past.failed == []
    fs_inner.rm([probe, f"{root}/past-{sc.name}"], recursive=True)

    numbers = range(1, total + 1) if fault.every_n else sorted({1, (total + 1) // 2, total})
    failures, outcomes = [], []
    for n in numbers:
        try:
            outcomes.append(f"n={n}: {run_case(fs_inner, root, template, sc, fault, n)}")
        except Exception as exc:  # noqa: BLE001 - every n is reported, then the test fails
            failures.append(f"n={n}/{total}: {type(exc).__name__}: {exc}")
    print("\n".join(outcomes))
    assert not failures, (f"{len(failures)} of {len(numbers)} faults ({kind} ops of the save: "
                          f"{total}) broke the protocol:\n" + "\n".join(failures))
    assert len(outcomes) == len(numbers)


def test_a_full_disk_at_each_exclusive_create_tears_nothing(inner):
    """A re-save's exclusive create at the first save's path fails (the path is taken): on a
    full disk that create, and every exclusive create after it, fails; the committed save found
    there stays whole and every other check of :func:`run_case` holds."""
    fs_inner, root = inner
    template = f"{root}/template-exclusive"
    train(FaultyFileSystem(fs_inner), template, RESAVE.setup_epochs)
    probe = f"{root}/probe-exclusive"
    clone(fs_inner, template, probe)
    counter = FaultyFileSystem(fs_inner)
    train(counter, probe, SAVED, resume=RESAVE.resume, hook=counter.reset)
    creates = [p for m, p in counter.ops("write") if m == "open(xb)"]
    assert any(p.endswith(f"/{NODES[0]}.{SAVED}/zarr.json") for p in creates), creates
    fault = Fault("write", errno.ENOSPC, sticky=True, torn=True, label="exclusive",
                  match=lambda method, _path: method == "open(xb)")
    for n in range(1, len(creates) + 1):
        run_case(fs_inner, root, template, RESAVE, fault, n)
