"""Durability on local disks: every file a save writes is flushed on the descriptor it was
written through, and every directory that got a new entry is fsync'ed, before the commit record
exists; a flush failure fails the save (see :mod:`caffe2ckpt.fs.localio`'s durability rule).

A real write-back error (EIO) cannot be produced on ext4 without root and a faulty device, so
two tests look at the mechanism instead:

- the kernel's errseq semantics are emulated at the flush calls: a write-back error of file X is
  reported only by ``fsync``/``fdatasync`` of a descriptor of X (``syncfs`` reports nothing, as
  before Linux 5.8 or after another process's ``syncfs`` consumed the error). The save must fail
  and commit nothing, and leave no descriptor open;
- with ``strace`` (skipped when it is not installed), a real save in a subprocess is traced:
  each file created is ``fdatasync``'ed (or ``fsync``'ed) on the descriptor it was created with,
  each directory that got an entry is ``fsync``'ed, all before the commit record is linked, and
  ``syncfs``/``sync`` are never called.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from caffe2ckpt.fs import localio
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.commit.protocol import CheckpointStore, SaveInfo
from caffe2ckpt.store.format.paths import new_save_id
from caffe2ckpt.store.format.records import list_records
from tests.stores import load
from tests.strace import FD_PATH, call_paths, trace_events

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="needs /proc/self/fd (Linux)")

NODE = "trainer_0"


def blobs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out = {"w": rng.random(400_000), "v": rng.random((300, 1000), dtype=np.float32)}
    out.update({f"small_{i}": rng.random(10 + i) for i in range(20)})  # packed together
    return out


def save(prefix: str, epoch: int):
    return CheckpointStore(Location(prefix)).save_node(
        NODE, epoch, blobs(), SaveInfo(save_id=new_save_id(1), nodes=[NODE]))


def open_fds(root) -> set[str]:
    """What this process's descriptors below ``root`` point at (descriptors of other tests'
    sockets and files, which may close meanwhile, do not count)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(str(root)):
            found.add(target)
    return found


def fail_flushes_of(monkeypatch, victim: str) -> list[str]:
    """Make every fsync/fdatasync of a descriptor of a file whose path matches the regular
    expression ``victim`` at its end fail with EIO (a write-back error only that file's
    descriptors are told about); return the paths
    it failed for."""
    failed: list[str] = []

    def wrap(real):
        def flush(fd):
            number = fd if isinstance(fd, int) else fd.fileno()
            path = os.readlink(f"/proc/self/fd/{number}")
            if re.search(f"{victim}$", path):
                failed.append(path)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(fd)
        return flush

    monkeypatch.setattr(os, "fsync", wrap(os.fsync))
    if hasattr(os, "fdatasync"):
        monkeypatch.setattr(os, "fdatasync", wrap(os.fdatasync))
    if hasattr(localio, "fdatasync"):  # bound at import
        monkeypatch.setattr(localio, "fdatasync", wrap(localio.fdatasync))
    return failed


@pytest.mark.parametrize("victim", [r"/w/c\.0", r"/v/c\.0\.0", r"/_packed/c\.0", r"/v/zarr\.json",
                                    rf"/{NODE}\.2/zarr\.json"],
                         ids=["1-d chunk", "2-d chunk", "packed chunk", "array metadata",
                              "group metadata"])
@pytest.mark.parametrize("pending", [None, 1], ids=["batched", "flushed-early"])
def test_writeback_error_of_a_file_fails_the_save(tmp_path, monkeypatch, victim, pending):
    """A write-back error of any one file of the group, reported only to that file's descriptors,
    fails the save: no commit record, the earlier epoch intact, no descriptor left open. With
    ``pending=1`` the files are flushed by the writing threads (the bound on open descriptors)."""
    prefix = str(tmp_path / "ckpt")
    save(prefix, 1)
    if pending is not None:
        monkeypatch.setattr(localio, "MAX_PENDING", pending, raising=False)
    before = open_fds(tmp_path)
    failed = fail_flushes_of(monkeypatch, victim)
    with pytest.raises(OSError) as info:
        save(prefix, 2)
    assert info.value.errno == errno.EIO
    assert failed, "the failing file was never flushed"
    assert open_fds(tmp_path) == before == set()
    monkeypatch.undo()
    location = Location(prefix)
    assert [(r.node, r.epoch) for r in list_records(location)] == [(NODE, 1)]
    loaded = load(CheckpointStore(location), NODE, 1)
    for name, arr in blobs().items():
        np.testing.assert_array_equal(loaded[name], arr)


def test_a_failed_write_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """A save whose writes fail half-way (the disk filled up) closes the descriptors of the files
    already written and waiting for their flush."""
    prefix = str(tmp_path / "ckpt")
    save(prefix, 1)
    before = open_fds(tmp_path)
    real_write = os.write
    calls = {"n": 0}

    def write(fd, data):
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(OSError, match="No space left"):
        save(prefix, 2)
    monkeypatch.undo()
    assert open_fds(tmp_path) == before == set()
    assert [(r.node, r.epoch) for r in list_records(Location(prefix))] == [(NODE, 1)]


# -- what the kernel sees: strace ----------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from caffe2ckpt.store.format.paths import new_save_id
    from caffe2ckpt.store.commit.protocol import CheckpointStore, SaveInfo
    from caffe2ckpt.fs.location import Location
    rng = np.random.default_rng(7)
    blobs = {"w": rng.random(3_000_000), "v": rng.random((300, 1000), dtype=np.float32)}
    blobs.update({f"small_{i}": rng.random(10 + i) for i in range(20)})
    CheckpointStore(Location(sys.argv[1])).save_node(
        "trainer_0", 3, blobs, SaveInfo(save_id=new_save_id(1), nodes=["trainer_0"]))
''')

def _fd_path(args: str) -> str | None:
    """The path strace's ``-y`` shows for a call's first argument (a descriptor)."""
    first = args.split(",")[0].strip()
    m = FD_PATH.match(first)
    return m["path"] if m else None


def _ok(event: dict) -> bool:
    return event["ret"].split()[0] not in ("-1",) and not event["ret"].startswith("?")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None,
                    reason="strace is not installed (apt-get install strace)")
def test_kernel_sees_each_file_and_directory_flushed_before_the_record(tmp_path):
    """Traced save into a new prefix: every file created under it, except under ``_commits/``
    (the record's own protocol), is flushed on its creating descriptor before that descriptor is
    closed; every directory that got a new entry is fsync'ed; all before the record's link; and
    no ``syncfs``/``sync`` anywhere."""
    prefix = str(tmp_path / "runs" / "ckpt")  # "runs" and "ckpt" are created by the save
    script = tmp_path / "save.py"
    script.write_text(SCRIPT)
    log = tmp_path / "strace.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run(
        ["strace", "-f", "-qq", "-y", "-s", "4096", "-o", str(log),
         "-e", "trace=openat,open,creat,mkdir,mkdirat,fsync,fdatasync,syncfs,sync,close,"
               "link,linkat,rename,renameat,renameat2",
         sys.executable, str(script), prefix],
        check=True, env=env, timeout=300)
    events = trace_events(log.read_text())
    under = prefix + "/"
    commits = posixpath.join(prefix, "_commits")
    assert not [e for e in events if e["name"] in ("syncfs", "sync")], "syncfs/sync was used"
    links = [e for e in events if e["name"] in ("link", "linkat") and commits in e["args"]]
    assert links, "the commit record was not linked"
    record_at = links[0]["start"]

    created_files: dict[str, int] = {}  # path -> index of the open that created it
    created_dirs: list[str] = []
    created_dirs_at: dict[str, int] = {}
    for e in events:
        if e["name"] in ("openat", "open", "creat") and "O_CREAT" in e["args"] and _ok(e):
            path = FD_PATH.match(e["ret"])
            if path and path["path"].startswith(under) and not path["path"].startswith(commits):
                created_files.setdefault(path["path"], e["end"])
        if e["name"] in ("mkdir", "mkdirat") and _ok(e):  # _commits/ too: its parent's entry
            path = call_paths(e["args"])[0]
            created_dirs.append(path)
            created_dirs_at[path] = e["end"]
    assert created_files and any(p.endswith("/w/c.0") for p in created_files)
    assert created_dirs[:2] == [str(tmp_path / "runs"), prefix]

    def flushes(path: str, names: tuple[str, ...]) -> list[dict]:
        return [e for e in events if e["name"] in names and _fd_path(e["args"]) == path
                and e["ret"] == "0"]

    problems = []
    for path, opened in created_files.items():
        closed = [e["start"] for e in events
                  if e["name"] == "close" and _fd_path(e["args"]) == path and e["start"] > opened]
        done = [e for e in flushes(path, ("fdatasync", "fsync")) if e["start"] > opened
                and (not closed or e["end"] < closed[0])]
        if not done:
            problems.append(f"{path}: not flushed on the descriptor it was written through")
        elif done[0]["end"] > record_at:
            problems.append(f"{path}: flushed after the commit record was linked")
    last_entry: dict[str, int] = {}  # directory -> when its last new entry was created
    for path, at in [*created_files.items(), *((d, created_dirs_at[d]) for d in created_dirs)]:
        parent = posixpath.dirname(path)
        last_entry[parent] = max(last_entry.get(parent, -1), at)
    for directory, at in sorted(last_entry.items()):
        done = [e for e in flushes(directory, ("fsync", "fdatasync"))
                if at < e["start"] and e["end"] < record_at]
        if not done:
            problems.append(f"directory {directory}: not fsync'ed after its new entries and "
                            "before the commit record")
    assert not problems, "\n".join(problems)
