"""Fault injection while a run resumes, and a read-only location.

Resume: epochs 0..2 of the 2-node example job are committed; a new run resumes (automatically
from epoch 2, or explicitly from epoch 1) through :class:`FaultyFileSystem`, and the n-th read,
listing, stat, write or delete of the resume — everything the runner does before it trains the
first epoch: claim the prefix, find the newest committed epoch, read records, manifests,
metadata and chunks — fails with EIO, for every n (and, as an outage, that op and every later
one of its kind). After each fault:

- the run either fails with an ``OSError`` that carries the injected error, names a file under
  the prefix and is not taken for corruption or a missing checkpoint (an I/O error never makes
  a run fall back to an older epoch; an outage that lasts into the first save fails that save),
  or it resumes from exactly the epoch it should (the fault hit something it can do
  without, e.g. the claim) and ends bit-identical to an uninterrupted run;
- every committed epoch still loads bit-exact, and nothing else became committed;
- a fresh run without faults resumes from the newest committed epoch and ends bit-identical.

Read-only: every write and delete fails with EROFS. A run resumes (reads work), its saves fail
with a clear error naming the epoch and EROFS (raised, or logged and listed in
``failed_saves``), not one byte under the prefix changes, and a later writable run resumes from
the newest committed epoch.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

import pytest
from faultfs import FaultyFileSystem
from fsspec.implementations.local import LocalFileSystem

from caffe2ckpt import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
)
from caffe2ckpt.fs.location import Location
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.safety.test_faults import (
    LAST,
    NODES,
    assert_state,
    check_epoch,
    checkpointed,
    clone,
    make_job,
    reference,
    snapshot,
)
from tests.stores import newest_epoch

KINDS = ("read", "list", "stat", "write", "delete")
COMMITTED = 2  # epochs 0..COMMITTED are committed before the faulted resume


@pytest.fixture(params=["memory", "local"])
def inner(request, tmp_path, memory_fs):
    """(inner filesystem, root path on it)."""
    if request.param == "memory":
        return memory_fs, "/resume-faults"
    return LocalFileSystem(auto_mkdir=True), str(tmp_path)


def manager(fs, path: str) -> MultiNodeCheckpointManager:
    return MultiNodeCheckpointManager(path, filesystem=fs, metadata_handler=ZarrMetadataHandler())


@dataclass(frozen=True)
class Resume:
    name: str
    resume_from_epoch: int | None  # None: automatic (the newest committed epoch)
    expected: int  # the epoch the run must resume from


AUTO = Resume("auto", None, COMMITTED)
EXPLICIT = Resume("explicit", 1, 1)


def resume_run(fs, path: str, sc: Resume, hook=None) -> tuple[JobRunner, LocalSession]:
    """Resume ``sc`` and train to epoch LAST (``hook()`` runs before each epoch's save)."""
    runner = JobRunner(make_job(LAST, hook), manager(fs, path),
                       resume_from_epoch=sc.resume_from_epoch, on_save_error="raise")
    session = LocalSession()
    runner.train(session)
    return runner, session


def resume_op_counts(inner_fs, template: str, root: str, sc: Resume) -> dict[str, int]:
    """How many ops of each kind a clean resume does before the first epoch's save."""
    probe = f"{root}/probe-{sc.name}"
    clone(inner_fs, template, probe)
    counter = FaultyFileSystem(inner_fs)
    counts: dict[str, int] = {}

    def first_hook():
        if not counts:
            counts.update({k: counter.counts[k] for k in KINDS})
    runner, session = resume_run(counter, probe, sc, first_hook)
    assert runner.resumed_from == sc.expected
    assert_state(snapshot(session), reference()[LAST], "clean resume")
    inner_fs.rm(probe, recursive=True)
    return counts


def chain(exc: BaseException) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def fault_resume_and_recover(inner_fs, path: str, sc: Resume, kind: str, n: int,
                             sticky: bool) -> str:
    fs = FaultyFileSystem(inner_fs)
    fs.arm(kind, n, errno.EIO, sticky=sticky)
    runner = JobRunner(make_job(LAST), manager(fs, path), resume_from_epoch=sc.resume_from_epoch,
                       on_save_error="raise")
    session, error = LocalSession(), None
    try:
        runner.train(session)
    except Exception as exc:  # noqa: BLE001 - checked below
        error = exc
    assert fs.failed, f"no fault fired (n={n}): {error!r}"
    failed_op = f"{fs.failed[0][1]} {fs.failed[0][2].removeprefix(path)}"
    store = CheckpointStore(Location(path, filesystem=inner_fs))
    if error is not None:
        assert isinstance(error, OSError), f"{failed_op}: not an OSError: {error!r}"
        assert not isinstance(error, (CheckpointCorruptedError, CheckpointNotFoundError)), (
            f"{failed_op}: an I/O error was taken for a damaged/missing checkpoint: {error!r}")
        assert any(getattr(e, "errno", None) == errno.EIO for e in chain(error)) or \
            os.strerror(errno.EIO) in str(error), f"{failed_op}: the cause is hidden: {error!r}"
        assert path in str(error) or any(path in str(e) for e in chain(error)), (
            f"{failed_op}: the error names no file under the prefix: {error!r}")
        if runner.resumed_from is not None:  # an outage that lasted into the first save
            assert sticky and isinstance(error, CheckpointWriteError), (
                f"{failed_op}: failed after resuming: {error!r}")
            assert runner.resumed_from == sc.expected
            assert runner.failed_saves == [sc.expected + 1], runner.failed_saves
        latest = COMMITTED
    else:  # the fault hit something the run can do without: it must not fall back
        assert runner.resumed_from == sc.expected, (
            f"{failed_op}: resumed from {runner.resumed_from}, not {sc.expected}")
        assert_state(snapshot(session), reference()[LAST], f"{failed_op}: final workspaces")
        latest = LAST
    for epoch in range(latest + 1):
        check_epoch(store, epoch)
    assert newest_epoch(store, NODES) == latest
    runner, session = resume_run(FaultyFileSystem(inner_fs), path, AUTO)
    assert runner.resumed_from == latest
    assert_state({n: {b: session.workspace(n)[b] for b in checkpointed(LAST)[n]} for n in NODES},
                 checkpointed(LAST), f"{failed_op}: recovery")
    return f"{'resumed' if error is None else type(error).__name__} ({failed_op})"


@pytest.mark.parametrize("sc", [AUTO, EXPLICIT], ids=lambda s: s.name)
def test_faults_while_resuming(inner, sc: Resume):
    inner_fs, root = inner
    template = f"{root}/template"
    JobRunner(make_job(COMMITTED), manager(FaultyFileSystem(inner_fs), template)).train(
        LocalSession())
    counts = resume_op_counts(inner_fs, template, root, sc)
    assert counts["read"] >= 8 and counts["list"] >= 1, counts
    cases = [(kind, n, False) for kind in KINDS for n in range(1, counts[kind] + 1)]
    cases += [(kind, 1, True) for kind in KINDS if counts[kind]]  # outages
    failures, outcomes = [], []
    for kind, n, sticky in cases:
        path = f"{root}/{sc.name}-{kind}-{n}{'-sticky' if sticky else ''}"
        clone(inner_fs, template, path)
        try:
            outcomes.append(f"{kind} n={n}{' sticky' if sticky else ''}: "
                            + fault_resume_and_recover(inner_fs, path, sc, kind, n, sticky))
        except Exception as exc:  # noqa: BLE001 - every case is reported, then the test fails
            failures.append(f"{kind} n={n}/{counts[kind]}{' sticky' if sticky else ''}: "
                            f"{type(exc).__name__}: {exc}")
        finally:
            inner_fs.rm(path, recursive=True)
    print(f"{len(cases)} cases, ops of a clean resume: {counts}")
    print("\n".join(outcomes))
    assert not failures, f"{len(failures)} of {len(cases)} resume faults broke the protocol:\n" + \
        "\n".join(failures)


class ReadOnlyFileSystem(FaultyFileSystem):
    """Every write and delete fails with EROFS (a read-only mount or bucket policy)."""

    def _count(self, kind, method, path, torn_data=None):
        super()._count(kind, method, path, torn_data)
        if kind in ("write", "delete"):
            with self._lock:
                self.failed.append((kind, method, str(path)))
            raise OSError(errno.EROFS, f"{os.strerror(errno.EROFS)} ({method})", str(path))


def tree(fs, root: str) -> dict[str, bytes]:
    return {p: fs.cat_file(p) for p in fs.find(root)}


@pytest.mark.parametrize("on_save_error", ["raise", "warn"])
def test_a_read_only_location_loses_nothing(inner, on_save_error, caplog):
    inner_fs, root = inner
    path = f"{root}/ro"
    JobRunner(make_job(1), manager(FaultyFileSystem(inner_fs), path)).train(LocalSession())
    before = tree(inner_fs, path)
    ro = ReadOnlyFileSystem(inner_fs)
    runner = JobRunner(make_job(LAST), manager(ro, path), on_save_error=on_save_error)
    session = LocalSession()
    if on_save_error == "raise":
        with pytest.raises(CheckpointWriteError) as info:
            runner.train(session)
        msg = str(info.value)
        assert "epoch 2" in msg and os.strerror(errno.EROFS) in msg, msg
        assert path in msg, msg
        assert runner.failed_saves == [2]
    else:
        with caplog.at_level(logging.WARNING, logger="caffe2ckpt"):
            assert runner.train(session) == LAST
        assert runner.failed_saves == [2, 3]
        assert_state(snapshot(session), reference()[LAST], "training went on")
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("epoch 2" in m and os.strerror(errno.EROFS) in m for m in warned), warned
        assert any("NOT saved" in m and "[2, 3]" in m for m in warned), warned
    assert runner.resumed_from == 1
    assert ro.failed and {k for k, _m, _p in ro.failed} <= {"write", "delete"}
    assert tree(inner_fs, path) == before, "a read-only location was changed"
    store = CheckpointStore(Location(path, filesystem=inner_fs))
    for epoch in (0, 1):
        check_epoch(store, epoch)
    assert newest_epoch(store, NODES) == 1
    runner, session = resume_run(FaultyFileSystem(inner_fs), path, AUTO)
    assert runner.resumed_from == 1
    assert_state(snapshot(session), reference()[LAST], "writable again")
