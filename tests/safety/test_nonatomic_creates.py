"""Exclusive creates that are not atomic (review of e4d82ae, D8): on fsspec's local filesystem
behind a wrapper the locations cannot see through (the generic class; likewise sftp, smb, hdfs),
``open(path, "xb")`` makes the file empty at open and fills it at close, so a run log entry or a
commit record being created is visible, empty, for as long as its writer takes.

:class:`HeldCreates` holds one such create between its open and its close (the file exists and
is empty) until the test lets it go, deterministically: readers must take it for a file being
created, not for damage. The bounds of that rule are checked too: an entry that stays empty past
the grace, or was written long ago, still fences (it may be a newer run). A local disk behind
fsspec's ``DirFileSystem`` (``dir::file://``) is the local disk's own class, whose creates are a
hard link of a complete temp file (tests/fs/test_location_contract.py).
"""

from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

from caffe2ckpt import CheckpointFencedError, StepCheckpointManager
from caffe2ckpt.fs import location as location_module
from tests.safety.hookfs import HookFS, register
from tests.safety.test_review_1aeae9c import cli_json

NODES = ["t0", "t1"]
ENTRY = re.compile(r"/_runs/\d{12}\.json$")
RECORD = re.compile(r"/_commits/[^/]+\.json$")


class HeldCreates(HookFS):
    """A pass-through wrapper of a filesystem (opaque to the locations) that holds the next
    exclusive create of a path :meth:`hold_next` accepts between its open and its close: the
    inner filesystem's ``"xb"`` open has made the file, its bytes are written only once
    :attr:`go` is set. :attr:`held` is set (and :attr:`held_path` known) while it waits."""

    def __init__(self, inner, **kwargs):
        super().__init__(inner, **kwargs)
        self._hold: re.Pattern | None = None
        self._hold_lock = threading.Lock()
        self.held = threading.Event()
        self.go = threading.Event()
        self.held_path: str | None = None

    def hold_next(self, pattern: re.Pattern) -> None:
        self._hold = pattern

    def open(self, path, mode="rb", **kwargs):
        f = super().open(path, mode, **kwargs)
        with self._hold_lock:
            take = "x" in mode and self._hold is not None and self._hold.search(str(path))
            if take:
                self._hold = None
        return _HeldFile(f, self, str(path)) if take else f


class _HeldFile:
    """The file of a held create: bytes kept until close, which waits for ``fs.go``."""

    def __init__(self, f, fs: HeldCreates, path: str):
        self._f, self._fs, self._path, self._data = f, fs, path, []

    def write(self, data) -> int:
        self._data.append(bytes(data))
        return len(data)

    def close(self) -> None:
        if self._f.closed:
            return
        self._fs.held_path = self._path
        self._fs.held.set()
        self._fs.go.wait(60)
        self._f.write(b"".join(self._data))
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def items(value: float, nodes=NODES) -> dict:
    return {node: {"w": np.full(4, value)} for node in nodes}


def in_thread(fn) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.fixture
def held(tmp_path):
    """(the held-creates wrapper of the local disk, the prefix's path on it)."""
    fs = HeldCreates(LocalFileSystem(auto_mkdir=True))
    yield fs, str(tmp_path / "ckpt")
    fs.go.set()


def release_on_second_read(fs: HeldCreates, path: str) -> None:
    """Let the held create finish when its file is read a second time: a reader that took the
    empty file for damage never reads it again, one that waits for it does."""
    fs.on(lambda kind, method, p: method == "cat_file" and p == path,
          lambda *_: fs.go.set(), nth=2)


def test_a_run_log_entry_being_created_does_not_fence_another_job(held):
    """Job A (t0, t1) saves while job B (solo) claims the same prefix: B's run log entry exists,
    empty, when A's fence check reads it. It used to be taken for a damaged entry that "may be
    a newer run": A's save raised CheckpointFencedError although B is another job. Now A waits
    for the entry (it is young) and reads B's family in it."""
    fs, root = held
    a = StepCheckpointManager(root, filesystem=fs, nodes=NODES, handle_preemption=False)
    for step in range(3):
        a.save(step, items(step))
    fs.hold_next(ENTRY)

    def job_b():
        with StepCheckpointManager(root, filesystem=fs, nodes=["solo"],
                                   handle_preemption=False) as b:
            b.save(0, items(0.0, ["solo"]))
            return b.all_steps(read=True)
    thread, b_outcome = in_thread(job_b)
    assert fs.held.wait(30)
    assert os.path.getsize(fs.held_path) == 0  # visible and empty: what A's fence check finds
    release_on_second_read(fs, fs.held_path)
    try:
        a.save(3, items(3.0))
    finally:
        fs.go.set()
        thread.join(60)
        a.close()
    assert b_outcome == {"result": [0]}, b_outcome
    with StepCheckpointManager(root, filesystem=fs, nodes=NODES, handle_preemption=False) as a2:
        assert a2.all_steps(read=True) == [0, 1, 2, 3]
        assert a2.restore(3)["t0"]["w"][0] == 3.0


def test_a_record_being_created_is_not_reported_as_damage(held):
    """``caffe2ckpt ls`` while a save's commit record exists, empty: it used to report the
    record as damaged (exit 1); now it waits for the record and lists the step committed."""
    fs, root = held
    with StepCheckpointManager(root, filesystem=fs, nodes=["n"], handle_preemption=False) as mgr:
        mgr.save(0, items(0.0, ["n"]))
        fs.hold_next(RECORD)
        thread, outcome = in_thread(lambda: mgr.save(1, items(1.0, ["n"])))
        assert fs.held.wait(30)
        assert os.path.getsize(fs.held_path) == 0
        release_on_second_read(fs, fs.held_path)
        try:
            code, doc = cli_json("ls", register(fs, root))
        finally:
            fs.go.set()
            thread.join(60)
    assert outcome == {"result": True}, outcome
    assert code == 0, doc
    assert [(r["epoch"], r["state"]) for r in doc["epochs"]] == [(0, "committed"),
                                                                 (1, "committed")], doc


@pytest.mark.parametrize("age", ["young", "old"])
def test_an_entry_that_stays_empty_still_fences(held, monkeypatch, age):
    """The grace is bounded: an empty entry after the run's own still fences it (it may be a
    newer run of its job), once the grace is over (young: the writer may have died between its
    open and its close) or at once (written before the grace)."""
    fs, root = held
    monkeypatch.setattr(location_module, "CREATE_GRACE", 0.5)
    with StepCheckpointManager(root, filesystem=fs, nodes=["n"], handle_preemption=False) as mgr:
        mgr.save(0, items(0.0, ["n"]))
        entries = sorted(os.listdir(f"{root}/_runs"))
        newest = int(max(e for e in entries if e.count(".") == 1).split(".")[0])
        stray = f"{root}/_runs/{newest + 1:012d}.json"
        open(stray, "wb").close()
        if age == "old":
            os.utime(stray, (time.time() - 3600, time.time() - 3600))
        started = time.monotonic()
        with pytest.raises(CheckpointFencedError, match="unreadable"):
            mgr.save(1, items(1.0, ["n"]))
        waited = time.monotonic() - started
    assert (0.4 <= waited < 10) if age == "young" else waited < 0.4, waited
