"""Hostile input through the public API: node names, prefixes and URLs, epochs, credentials, blob
names and values, and crafted checkpoints. Every bad input gets a clear error (its type, and a
message naming the offending value) before anything is written, nothing is ever written outside
the prefix, and loading never unpickles anything.

"Nothing written" is checked on the whole world the test can see: for a local prefix a
recursive listing (files and directories) of the parent of the test's temp dir, for
``memory://`` fsspec's whole memory store, for ``s3://`` the test's own bucket on the moto server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import threading
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest

from caffe2ckpt import (
    CheckpointCorruptedError,
    CheckpointManager,
    InvalidBlobError,
    InvalidLocationError,
    Job,
    JobDefinitionError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    StepCheckpointManager,
    StorageCredentialsError,
    Task,
    epoch_limiter,
)
from caffe2ckpt.cli import main as cli_main
from caffe2ckpt.example import build_job
from caffe2ckpt.fs import strictjson
from caffe2ckpt.fs.location import Location
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.records import (
    delete_record,
    list_records,
    read_record,
    write_record,
)
from tests.s3server import NOT_ON_S3, prefix_kind, storage_cases
from tests.stores import epochs_with_records, load, newest_epoch

# -- helpers ---------------------------------------------------------------------------------------


@pytest.fixture
def tmp_path(tmp_path):
    """The test's temp dir, one level down in a fresh directory of its own: "the parent of the
    test's temp dir" (the world listed below) then holds this test's files only. pytest's own
    parent holds every earlier test's directory of the session (tens of thousands of entries by
    the end of a run), and listing it cost seconds per call. The prefix fixture uses this too."""
    path = tmp_path / "parent" / "test"
    path.mkdir(parents=True)
    return path


@pytest.fixture
def world(prefix, tmp_path, memory_fs):
    """A function listing everything this test could have written (see the module docstring)."""
    kind = prefix_kind(prefix)

    def listing() -> set[str]:
        if kind == "memory":
            return {f"file:{k}" for k in memory_fs.store} | {
                f"dir:{d}" for d in memory_fs.pseudo_dirs if d}
        if kind == "s3":
            fs, root = fsspec.core.url_to_fs(prefix)
            fs.invalidate_cache()
            return set(fs.find(root.split("/", 1)[0], withdirs=True))
        return {str(p) + ("/" if p.is_dir() else "") for p in tmp_path.parent.rglob("*")}

    return listing


def inside(prefix: str, tmp_path: Path, memory_fs, new: set[str]) -> list[str]:
    """The entries of ``new`` (from ``world``) that are outside ``prefix``."""
    kind = prefix_kind(prefix)
    if kind == "memory":
        root = memory_fs._strip_protocol(prefix).rstrip("/")
        return [e for e in new if not e.split(":", 1)[1].startswith(root + "/")
                and e.split(":", 1)[1] != root]
    if kind == "s3":
        root = fsspec.core.url_to_fs(prefix)[1].rstrip("/")
        return [e for e in new if not (e == root or e.startswith(root + "/"))]
    root = str(Path(prefix))
    outside = [e for e in new if not (e.rstrip("/") == root or e.startswith(root + "/"))]
    # the prefix's own parent directories may be created (tmp_path itself exists already)
    return [e for e in outside if not root.startswith(e.rstrip("/") + "/")]


def seeded_session(nodes, epoch: int = 0) -> LocalSession:
    session = LocalSession()
    for i, node in enumerate(nodes):
        session.workspace(node).update({
            "big": np.full(1 << 17, float(i + 10 * epoch)),  # 1 MiB: its own array
            "small": np.arange(5, dtype=np.int32) + i + epoch,
        })
    return session


def one_node_job(node: str, epochs: int = 2) -> Job:
    with Job(name="hostile") as job:
        with Node(node):
            with job.init_group:
                Task(lambda ws: ws.update({"w": np.zeros(4), "step": np.int64(0)}), name="init")
            Task(lambda ws: ws.update({"w": ws["w"] + 1, "step": ws["step"] + 1}), name="train")
        epoch_limiter(job, epochs)
    return job


def named(exc: BaseException, value: object) -> bool:
    """Does the error message name ``value`` (as its repr, or for numbers as written)?"""
    msg = str(exc)
    return repr(value) in msg or (isinstance(value, (int, float)) and str(value) in msg)


# -- node names ------------------------------------------------------------------------------------

BAD_NODES = {
    "empty": "", "dot": ".", "dotdot": "..", "slash": "a/b", "abs": "/etc", "backslash": "a\\b",
    "reserved": "_x", "commits": "_commits", "nul": "a\x00b", "newline": "t\n",
    "200-chars": "x" * 200, "129-bytes-utf8": "ü" * 64 + "x", "surrogate": "\ud800x",
}


@pytest.mark.parametrize("node", list(BAD_NODES.values()), ids=list(BAD_NODES))
def test_bad_node_names_are_refused_before_anything_is_written(prefix, world, node):
    before = world()
    session = seeded_session([node]) if node else LocalSession()
    cm = MultiNodeCheckpointManager(prefix)
    with pytest.raises(InvalidLocationError) as info:
        cm.init([node])
    assert named(info.value, node), str(info.value)
    with pytest.raises(InvalidLocationError) as info:
        CheckpointManager(prefix, node)
    assert named(info.value, node), str(info.value)
    cm = MultiNodeCheckpointManager(prefix)
    with pytest.raises(InvalidLocationError) as info:
        cm.load_blobs_locally([node], ["big"], 0, session)
    assert named(info.value, node), str(info.value)
    assert world() - before == set()
    with pytest.raises((InvalidLocationError, JobDefinitionError)) as info:
        JobRunner(one_node_job(node), MultiNodeCheckpointManager(prefix)).train(LocalSession())
    assert named(info.value, node), str(info.value)
    assert world() - before == set()  # not even the run's claim


@pytest.mark.parametrize("bad", ["node", "epoch"])
def test_a_refused_runner_writes_no_claim_either(tmp_path, bad):
    prefix = str(tmp_path / "ckpt")
    job = one_node_job("a/b" if bad == "node" else "n")
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    with pytest.raises(InvalidLocationError):
        JobRunner(job, cm, resume_from_epoch=-1 if bad == "epoch" else None).train(LocalSession())
    assert list(tmp_path.rglob("*")) == []


GOOD_NODES = ["über", "权重", "🚀", "e\u0301", "x" * 128, "ü" * 64, "node.with.dots", "1", "-",
              "a b", "%2F", "zarr.json", ".hidden"]


def test_unicode_and_long_node_names_work_and_stay_inside_prefix(prefix, world, tmp_path,
                                                                 memory_fs):
    before = world()
    session = seeded_session(GOOD_NODES)
    cm = MultiNodeCheckpointManager(prefix)
    session.run(cm.init(GOOD_NODES))
    session.run(cm.save(3))
    new = world() - before
    assert new and inside(prefix, tmp_path, memory_fs, new) == []
    assert newest_epoch(cm.store, GOOD_NODES) == 3
    fresh, cm2 = LocalSession(), MultiNodeCheckpointManager(prefix)
    fresh.run(cm2.init(GOOD_NODES, retrieve_from_epoch=3))
    fresh.run(cm2.load(3))
    for node in GOOD_NODES:
        for name, value in session.workspace(node).items():
            assert fresh.workspace(node)[name].tobytes() == value.tobytes(), (node, name)
    # a whole job on such a node resumes through the commit records (names with dots parse)
    for node in ("node.with.dots", "🚀"):
        job_prefix = f"{prefix}/job-{len(node)}"  # a prefix of its own, inside the test's
        assert JobRunner(one_node_job(node, 2), MultiNodeCheckpointManager(
            job_prefix, metadata_handler=ZarrMetadataHandler())).train(LocalSession()) == 2
        runner = JobRunner(one_node_job(node, 3), MultiNodeCheckpointManager(
            job_prefix, metadata_handler=ZarrMetadataHandler()))
        session = LocalSession()
        assert runner.train(session) == 3 and runner.resumed_from == 2
        assert int(session.workspace(node)["step"]) == 3
    assert inside(prefix, tmp_path, memory_fs, world() - before) == []


# -- epochs ----------------------------------------------------------------------------------------

BAD_EPOCHS = [-1, 1.5, "3", True, 10**13, None, np.float64(2.0), 2**63]


@pytest.mark.parametrize("epoch", BAD_EPOCHS, ids=repr)
def test_bad_epochs_are_refused_before_anything_is_written(prefix, world, epoch):
    before = world()
    session = seeded_session(["n"])
    cm = MultiNodeCheckpointManager(prefix)
    session.run(cm.init(["n"]))
    calls = {
        "save": lambda: cm.save(epoch),
        "load": lambda: cm.load(epoch),
        "check_db_exists": lambda: cm.check_db_exists(epoch),
        "partial load": lambda: cm.load_blobs_from_checkpoint(["big"], epoch),
        "load_blobs_locally": lambda: cm.load_blobs_locally(["n"], ["big"], epoch, session),
        "init(retrieve_from_epoch)": lambda: MultiNodeCheckpointManager(prefix).init(
            ["n"], retrieve_from_epoch=epoch),
    }
    if epoch is None:  # None means "no epoch" where an epoch is optional
        calls = {k: v for k, v in calls.items() if k != "init(retrieve_from_epoch)"}
    for what, call in calls.items():
        with pytest.raises(InvalidLocationError) as info:
            session.run(call())
        assert named(info.value, epoch), f"{what}: {info.value}"
    if epoch is not None:
        handler = ZarrMetadataHandler()
        handler.set_params(db_prefix=prefix, db_type="zarr", node_names=["n"])
        with pytest.raises(InvalidLocationError) as info:
            handler.last_epoch(user_epoch=epoch)
        assert named(info.value, epoch), str(info.value)
    assert world() - before == set()


@pytest.mark.parametrize("epoch", [e for e in BAD_EPOCHS if e is not None], ids=repr)
def test_bad_resume_epochs_are_refused_with_no_checkpoint_written(prefix, world, epoch):
    before = world()
    for handler in (None, ZarrMetadataHandler()):
        cm = MultiNodeCheckpointManager(prefix, metadata_handler=handler)
        runner = JobRunner(one_node_job("n"), cm, resume_from_epoch=epoch)
        with pytest.raises(InvalidLocationError) as info:
            runner.train(LocalSession())
        assert named(info.value, epoch), str(info.value)
    assert world() - before == set()  # not even the run's claim


# -- prefixes and URLs -----------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["", "   ", "memory://", "s3://", "memory://a/../b", "memory://a/./b",
                                 "memory://../escape", "memory://a//b", "s3://bucket/a/../../b",
                                 "s3://bucket/x/..", "nosuch://x", "nosuch::memory://x",
                                 "memory://a\x00b", "/tmp/a\x00b"])
def test_bad_prefixes_are_refused_before_anything_is_written(memory_fs, tmp_path, url):
    before = set(memory_fs.store), set(memory_fs.pseudo_dirs), set(tmp_path.parent.rglob("*"))
    for make in (lambda: MultiNodeCheckpointManager(url), lambda: CheckpointManager(url, "n"),
                 lambda: Location(url)):
        with pytest.raises(InvalidLocationError) as info:
            make()
        assert repr(url) in str(info.value), str(info.value)
    handler = ZarrMetadataHandler()
    with pytest.raises(InvalidLocationError, match="prefix"):
        handler.set_params(db_prefix=url, db_type="zarr", node_names=["n"])
    after = set(memory_fs.store), set(memory_fs.pseudo_dirs), set(tmp_path.parent.rglob("*"))
    assert after == before


@pytest.mark.parametrize("url", [None, 3, b"memory://x"], ids=["none", "int", "bytes"])
def test_prefixes_that_are_not_strings_are_refused(url):
    with pytest.raises(InvalidLocationError) as info:
        MultiNodeCheckpointManager(url)
    assert repr(url) in str(info.value)


def test_local_dotdot_segments_resolve_like_the_os_and_create_nothing_else(tmp_path, monkeypatch):
    """A local prefix's '.' and '..' are resolved (as the OS does) before anything is written:
    'x/nonexistent/../ckpt' is 'x/ckpt', and 'nonexistent' is never created."""
    (tmp_path / "x").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    cases = {str(tmp_path / "x" / "nonexistent" / ".." / "ckpt"): tmp_path / "x" / "ckpt",
             "../rel/./ckpt": tmp_path / "rel" / "ckpt"}
    for url, resolved in cases.items():
        before = set(tmp_path.rglob("*"))
        session = seeded_session(["n"])
        cm = MultiNodeCheckpointManager(url)
        assert cm.store.location.root == os.path.realpath(resolved)
        session.run(cm.init(["n"]))
        session.run(cm.save(1))
        new = set(tmp_path.rglob("*")) - before
        assert new and all(p == resolved or resolved in p.parents or p in resolved.parents
                           for p in new), sorted(map(str, new))
        assert not (tmp_path / "x" / "nonexistent").exists()
        assert newest_epoch(CheckpointStore(Location(str(resolved))), ["n"]) == 1


def test_a_prefix_that_is_a_file_fails_clearly_and_leaves_the_file_alone(tmp_path, memory_fs):
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"precious")
    for url in (str(blocker), str(blocker / "sub")):
        before = set(tmp_path.parent.rglob("*"))
        runner = JobRunner(one_node_job("n"), MultiNodeCheckpointManager(
            url, metadata_handler=ZarrMetadataHandler()), on_save_error="raise")
        with pytest.raises(OSError) as info:
            runner.train(LocalSession())
        assert str(blocker) in str(info.value) and "epoch 0" in str(info.value), str(info.value)
        assert set(tmp_path.parent.rglob("*")) == before
        assert blocker.read_bytes() == b"precious"
    memory_fs.pipe_file("/a_file", b"precious")  # the same on memory://
    session = seeded_session(["n"])
    cm = MultiNodeCheckpointManager("memory://a_file")
    session.run(cm.init(["n"]))
    with pytest.raises(OSError, match="memory://a_file"):
        session.run(cm.save(0))
    assert memory_fs.cat_file("/a_file") == b"precious"


@pytest.mark.slow
def test_s3_without_credentials_fails_fast_naming_the_url(s3_server, monkeypatch, tmp_path):
    """No credentials anywhere (no env, no config files, no instance metadata): the first access
    raises StorageCredentialsError (an InvalidLocationError) naming the URL, at once (botocore's
    NoCredentialsError is not retried by s3fs), and nothing is written."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # else botocore asks 169.254.169.254
    monkeypatch.delitem(fsspec.config.conf, "s3", raising=False)
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/run"
    options = {"endpoint_url": s3_server.endpoint, "skip_instance_cache": True}
    for handler in (ZarrMetadataHandler(), None):
        start = time.monotonic()
        cm = MultiNodeCheckpointManager(url, storage_options=options, metadata_handler=handler)
        with pytest.raises(StorageCredentialsError) as info:
            JobRunner(one_node_job("n"), cm).train(LocalSession())
        assert time.monotonic() - start < 10
        assert repr(url) in str(info.value) and "NoCredentialsError" in str(info.value)
    assert s3_server.filesystem().find(bucket) == []


@pytest.mark.slow
def test_s3_bad_storage_options_and_unreachable_endpoint_fail_clearly(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    cm = MultiNodeCheckpointManager(url, storage_options={**s3_server.options(), "retries": 1,
                                                          "skip_instance_cache": True})
    with pytest.raises(InvalidLocationError) as info:  # s3fs takes no 'retries' option
        JobRunner(one_node_job("n"), cm).train(LocalSession())
    assert repr(url) in str(info.value) and "retries" in str(info.value)
    # a closed port: bounded by botocore's retry config (s3fs adds ~1 s of its own back-off)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {**s3_server.options(), "endpoint_url": f"http://127.0.0.1:{port}",
               "skip_instance_cache": True,
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    start = time.monotonic()
    cm = MultiNodeCheckpointManager(url, storage_options=options,
                                    metadata_handler=ZarrMetadataHandler())
    with pytest.raises(OSError) as info:
        JobRunner(one_node_job("n"), cm).train(LocalSession())
    assert time.monotonic() - start < 30
    assert not isinstance(info.value, CheckpointCorruptedError)
    assert repr(url) in str(info.value) and "EndpointConnectionError" in str(info.value)
    assert s3_server.filesystem().find(s3_bucket) == []


# -- blob names and values -------------------------------------------------------------------------

HUGE_NAMES = ["x" * 10_000, "/" * 10_000, "ü" * 10_000, "../" * 3_000, "a\x00" * 5_000,
              "..", "/abs/path", "\x00", "x" * 9_999 + "y"]


@pytest.mark.parametrize("pack_threshold", [None, 1], ids=["packed", "own-array"])
def test_huge_and_hostile_blob_names_round_trip_inside_the_prefix(prefix, world, tmp_path,
                                                                  memory_fs, pack_threshold):
    before = world()
    blobs = {name: np.arange(i, i + 3, dtype=np.int16) for i, name in enumerate(HUGE_NAMES)}
    session = LocalSession()
    session.workspace("n").update(blobs)
    kw = {} if pack_threshold is None else {"pack_threshold": pack_threshold}
    cm = MultiNodeCheckpointManager(prefix, **kw)
    session.run(cm.init(["n"]))
    session.run(cm.save(1))
    new = world() - before
    assert new and inside(prefix, tmp_path, memory_fs, new) == []
    for entry in new:  # every file name stays well under the usual 255-byte limit
        assert all(len(seg.encode()) <= 200 for seg in entry.split("/")), entry[:300]
    loaded = load(CheckpointStore(Location(prefix)), "n", 1)
    assert sorted(loaded) == sorted(blobs)
    for name, value in blobs.items():
        assert loaded[name].tobytes() == value.tobytes()


@pytest.mark.parametrize("value", [
    np.array([1, "a", None], dtype=object), np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
    np.zeros(3, dtype="V4"), np.array(["2024-01-01"], dtype="datetime64[D]"), [1, 2], "text",
], ids=["object", "structured", "void", "datetime", "list", "str"])
@NOT_ON_S3
def test_unstorable_values_are_refused_in_tasks_and_restore(prefix, world, value):
    """Through a task of a running job (after epoch 0 was committed) and through
    ``Workspace.restore``: InvalidBlobError naming the blob; nothing of the epoch is written."""
    def poison(ws):
        if int(ws["step"]) == 1:
            ws["layer/evil"] = value
    job = one_node_job("n", 3)
    Task(poison, name="poison", group=job.epoch_group, node="n")
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    runner = JobRunner(job, cm)
    with pytest.raises(InvalidBlobError, match="'layer/evil'"):
        runner.train(LocalSession())
    assert newest_epoch(cm.store, ["n"]) == 0 and epochs_with_records(cm.store, ["n"]) == [0]
    before = world()
    session = LocalSession()
    session.workspace("n")["ok"] = np.arange(3)
    with pytest.raises(InvalidBlobError, match="'layer/evil'"):
        session.workspace("n").restore({"fine": np.arange(2), "layer/evil": value})
    assert list(session.workspace("n")) == ["ok"]  # nothing assigned
    cm = MultiNodeCheckpointManager(prefix)
    session.run(cm.init(["n"]))
    session.run(cm.save(5))
    assert world() - before != set() and load(CheckpointStore(Location(prefix)), "n", 5)


# -- crafted checkpoints: loading never unpickles ----------------------------------------------------

PWNED: list[str] = []


def _pwned(what: str) -> None:  # what a malicious pickle would run
    PWNED.append(what)


class Evil:
    def __reduce__(self):
        return (_pwned, ("unpickled",))


def recommit(prefix: str, node: str, epoch: int, edit, **record_changes) -> None:
    """Rewrite ``node``'s group metadata at ``epoch`` with ``edit(dict)`` and commit it again with
    a valid record (as an attacker with write access to the prefix could), so that only the
    loader's own checks stand between the crafted bytes and the caller. ``record_changes``:
    fields of the new record to change as well."""
    location = Location(prefix)
    fs, root = location.fs, location.root
    path = f"{root}/{node}.{epoch}/zarr.json"
    group = json.loads(fs.cat_file(path))
    edit(group)
    raw = json.dumps(group).encode()
    fs.pipe_file(path, raw)
    (ref,) = [r for r in list_records(location) if (r.node, r.epoch) == (node, epoch)]
    record = read_record(location, ref)
    delete_record(location, ref)
    write_record(location, dataclasses.replace(
        record, metadata={**record.metadata, "zarr.json": hashlib.sha256(raw).hexdigest()},
        **record_changes))


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fail the test if anything unpickles (and record it); checked at teardown too."""
    calls: list[str] = []

    def forbidden(what):
        def boom(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"{what} called while loading a checkpoint")
        return boom

    for mod, attr in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                      (np, "load"), (np.lib.format, "read_array")]:
        monkeypatch.setattr(mod, attr, forbidden(f"{mod.__name__}.{attr}"))
    PWNED.clear()
    yield calls
    assert calls == [] and PWNED == []


@pytest.mark.parametrize("dtype", ["|O", "|V8", "<M8[D]", "[('a', '<i4')]", "object"])
@pytest.mark.parametrize("where", ["array", "packed"])
@NOT_ON_S3
def test_a_crafted_manifest_claiming_object_dtype_is_refused_not_unpickled(
        prefix, no_unpickling, where, dtype):
    session = seeded_session(["n"])
    cm = MultiNodeCheckpointManager(prefix)
    session.run(cm.init(["n"]))
    session.run(cm.save(1))
    payload = pickle.dumps(np.array([Evil()], dtype=object), protocol=2)  # a real .npy-like attack
    location = Location(prefix)
    chunk = f"{location.root}/n.1/big/c.0"
    if where == "array":  # the large blob's chunk becomes a pickle, and its dtype "object"
        location.fs.pipe_file(chunk, payload)

        def edit(group):
            group["attributes"]["caffe2ckpt"]["arrays"]["big"]["dtype"] = dtype
    else:
        def edit(group):
            group["attributes"]["caffe2ckpt"]["packed"]["dtypes"][0] = dtype
    recommit(prefix, "n", 1, edit)
    with pytest.raises(CheckpointCorruptedError) as info:
        load(CheckpointStore(Location(prefix)), "n", 1)
    assert (info.value.node, info.value.epoch) == ("n", 1)
    fresh = LocalSession()
    with pytest.raises(CheckpointCorruptedError):
        fresh.run(MultiNodeCheckpointManager(prefix).init(["n"], retrieve_from_epoch=1))
    assert len(fresh.workspace("n")) == 0


def test_pickles_anywhere_in_a_checkpoint_are_never_unpickled(prefix, no_unpickling):
    """Array metadata rewritten to a pickle codec, a pickle as a commit record, and .npy/.pkl
    files dropped into the group: the load verifies or refuses, and never unpickles."""
    session = seeded_session(["n", "m"])
    cm = MultiNodeCheckpointManager(prefix)
    session.run(cm.init(["n", "m"]))
    session.run(cm.save(1))
    location = Location(prefix)
    fs, root = location.fs, location.root
    evil = pickle.dumps(Evil())
    fs.pipe_file(f"{root}/n.1/big/evil.npy", evil)
    fs.pipe_file(f"{root}/n.1/evil.pkl", evil)
    meta_path = f"{root}/n.1/big/zarr.json"
    meta = json.loads(fs.cat_file(meta_path))
    meta["data_type"] = "object"
    meta["codecs"] = [{"name": "pickle", "configuration": {}}]
    fs.pipe_file(meta_path, json.dumps(meta).encode())
    with pytest.raises(CheckpointCorruptedError) as info:  # the record's digest disagrees
        load(CheckpointStore(location), "n", 1)
    assert info.value.blob == "big"
    (ref,) = [r for r in list_records(location) if r.node == "m"]
    fs.pipe_file(f"{root}/_commits/{ref.filename}", evil)  # a pickle where JSON belongs
    with pytest.raises(CheckpointCorruptedError, match=ref.filename):
        load(CheckpointStore(location), "m", 1)
    assert newest_epoch(CheckpointStore(location), ["n", "m"]) is None


# -- hostile stored files: each uncommits only itself --------------------------------------------

NODES = ["trainer_0", "trainer_1"]


def trained(prefix: str, epochs: int = 2, **kw) -> JobRunner:
    """The example's 2-node job run for ``epochs`` epochs (committed: 0 .. epochs)."""
    runner = JobRunner(build_job(epochs), MultiNodeCheckpointManager(
        prefix, metadata_handler=ZarrMetadataHandler(), **kw))
    runner.train(LocalSession())
    return runner


def record_path(prefix: str, node: str, epoch: int) -> str:
    location = Location(prefix)
    (ref,) = [r for r in list_records(location) if (r.node, r.epoch) == (node, epoch)]
    return location.path("_commits", ref.filename)


def cli(capsys, *argv: str) -> tuple[int, dict]:
    """Run the CLI with --json; its exit code and its stdout, which must be one JSON document."""
    capsys.readouterr()
    code = cli_main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def hostile_record(good: bytes, kind: str) -> bytes:
    """A copy of record ``good`` damaged in the way ``kind`` names."""
    record = json.loads(good)
    field, value = {"deep": ("writer", "[" * 100_000 + "]" * 100_000),
                    "infinity": ("nbytes", "Infinity"), "nan": ("created", "NaN"),
                    "400-digit": ("seconds", "9" * 400), "1e999": ("created", "1e999"),
                    "huge": ("writer", "{}")}[kind]
    record[field] = "@@"
    text = json.dumps(record).replace('"@@"', value).encode()
    return text + b" " * (strictjson.MAX_BYTES + 1) if kind == "huge" else text


@storage_cases("kind", ["deep", "infinity", "nan", "400-digit", "1e999", "huge"],
               s3=["deep", "huge"])
def test_a_hostile_commit_record_uncommits_only_its_own_epoch(prefix, capsys, kind):
    """Deeply nested, NaN, Infinity, a 400-digit number, a float overflow, a huge file: the record
    is corrupt for its own node and epoch; listings, the CLI, StepCheckpointManager and an
    automatic resume all go on with the epochs before it."""
    trained(prefix)
    location = Location(prefix)
    path = record_path(prefix, "trainer_0", 2)
    location.fs.pipe_file(path, hostile_record(location.fs.cat_file(path), kind))
    (ref,) = [r for r in list_records(location) if (r.node, r.epoch) == ("trainer_0", 2)]
    with pytest.raises(CheckpointCorruptedError) as info:
        read_record(location, ref)
    assert (info.value.node, info.value.epoch) == ("trainer_0", 2)
    assert ref.filename in str(info.value), str(info.value)
    assert newest_epoch(CheckpointStore(location), NODES) == 1
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [0, 1] and mgr.latest_step() == 1
    code, doc = cli(capsys, "ls", prefix)
    assert doc["committed_epochs"] == [0, 1], doc
    assert [(e["epoch"], e["state"]) for e in doc["epochs"] if e["epoch"] == 2] == [
        (2, "damaged record")], doc
    code, doc = cli(capsys, "verify", prefix)
    assert code == 1 and [r["record"] for r in doc["unreadable_records"]] == [ref.filename], doc
    for argv in (["show", prefix, "--epoch", "2"], ["diff", prefix, "1", "2"]):
        code, doc = cli(capsys, *argv)
        assert code == 3 and ref.filename in doc["error"], doc
    code, doc = cli(capsys, "gc", prefix, "--keep-last", "1")
    assert code == 0, doc
    runner = JobRunner(build_job(3), MultiNodeCheckpointManager(
        prefix, metadata_handler=ZarrMetadataHandler()))
    assert runner.train(LocalSession()) == 3 and runner.resumed_from == 1


HUGE_CLAIMS = {  # edits of a group manifest that claim far more memory than is stored
    "array": lambda m: m["arrays"]["w"].update(shape=[10**15], chunk_rows=10**15),
    "packed": lambda m: m["packed"].update(nbytes=10**15, chunk=10**15),
    "axes-overflow": lambda m: m["arrays"]["w"].update(shape=[2**40, 2**40],
                                                        chunk_rows=2**40),
}


@pytest.mark.parametrize("record_too", [False, True], ids=["manifest", "manifest+record"])
@storage_cases("claim", list(HUGE_CLAIMS), s3=["array"])
def test_a_manifest_claiming_huge_blobs_is_corrupt_not_a_memory_error(prefix, claim,
                                                                      record_too):
    """A manifest (recommitted with a valid record, whose nbytes may be forged to match) that
    claims petabytes, axes whose product overflows, or a bool for a size: corrupt for that node
    and epoch, found before anything is allocated; a resume falls back to the epoch before."""
    with Job(name="huge") as job:
        with Node("n"):
            with job.init_group:
                Task(lambda ws: ws.update({"w": np.zeros(1 << 17), "step": np.int64(0)}),
                     name="init")
            Task(lambda ws: ws.update({"w": ws["w"] + 1, "step": ws["step"] + 1}), name="train")
        epoch_limiter(job, 2)
    JobRunner(job, MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
              ).train(LocalSession())
    claimed: dict = {}

    def edit(group):
        HUGE_CLAIMS[claim](group["attributes"]["caffe2ckpt"])
        manifest = group["attributes"]["caffe2ckpt"]
        claimed["nbytes"] = sum(8 * int(np.prod(a["shape"], dtype=object))
                                for a in manifest["arrays"].values()) + 8  # w, and step
    recommit(prefix, "n", 2, edit)
    if record_too:
        (ref,) = [r for r in list_records(Location(prefix)) if (r.node, r.epoch) == ("n", 2)]
        record = read_record(Location(prefix), ref)
        delete_record(Location(prefix), ref)
        nbytes = min(claimed["nbytes"], 2**63 - 1)
        write_record(Location(prefix), dataclasses.replace(record, nbytes=nbytes))
    with pytest.raises(CheckpointCorruptedError) as info:
        load(CheckpointStore(Location(prefix)), "n", 2)
    assert (info.value.node, info.value.epoch) == ("n", 2), str(info.value)
    assert info.value.blob in ("w", "zarr.json", "_packed"), str(info.value)
    runner = JobRunner(one_node_job("n", 3), MultiNodeCheckpointManager(
        prefix, metadata_handler=ZarrMetadataHandler()))
    assert runner.train(LocalSession()) == 3 and runner.resumed_from == 1


def without_hanging(call, *fifos: Path, seconds: float = 10.0):
    """``call()`` in a thread: what it returned or raised. If it is still blocked after
    ``seconds`` (on a FIFO), the FIFOs are opened for writing to release it and the test fails."""
    result: dict = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in filter(os.path.exists, fifos):
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))  # a blocked open() returns
        thread.join(seconds)
        pytest.fail(f"blocked for more than {seconds} s (on a FIFO?)")
    return result.get("error", result.get("value"))


SECRET_SIZE = 123_457  # the size of a file outside the prefix: must never be reported


@pytest.mark.parametrize("where, kind", [
    *((where, kind) for where in ("chunk", "zarr.json", "record")
      for kind in ("fifo", "symlink-to-fifo", "symlink-to-copy")),
    ("chunk", "symlink-to-secret"),  # its size was reported: "123457 bytes where ... expected"
    ("array-dir", "symlink-to-copy"),
])
def test_fifos_and_symlinks_in_a_checkpoint_are_corrupt_never_a_hang(tmp_path, capsys, where,
                                                                     kind):
    """Files of a checkpoint are read only if they are regular files reached without a
    symlink below the prefix: a FIFO (or a symlink to one) would block the read forever, and a
    symlink may lead out of the prefix (even to a bit-exact copy). Each is corruption of its own
    node and epoch: no hang, nothing about the target in the message, resume falls back."""
    prefix = str(tmp_path / "ckpt")
    trained(prefix)
    group = Path(prefix) / "trainer_0.2"
    target = {"chunk": group / "data%2Fx" / "c.0.0", "zarr.json": group / "zarr.json",
              "array-dir": group / "data%2Fx",
              "record": Path(record_path(prefix, "trainer_0", 2))}[where]
    outside = tmp_path / "outside"
    fifos = [target, outside] if "fifo" in kind else []
    if kind == "symlink-to-copy":
        (shutil.copytree if target.is_dir() else shutil.copyfile)(target, outside)
    elif kind == "symlink-to-secret":
        outside.write_bytes(b"s" * SECRET_SIZE)
    (shutil.rmtree if target.is_dir() else os.unlink)(target)
    if kind == "fifo":
        os.mkfifo(target)
    else:
        if kind == "symlink-to-fifo":
            os.mkfifo(outside)
        os.symlink(outside, target)
    store = CheckpointStore(Location(prefix))
    error = without_hanging(lambda: load(store, "trainer_0", 2), *fifos)
    assert isinstance(error, CheckpointCorruptedError), repr(error)
    assert (error.node, error.epoch) == ("trainer_0", 2), str(error)
    assert str(SECRET_SIZE) not in str(error) and str(outside) not in str(error), str(error)
    assert without_hanging(lambda: newest_epoch(store, NODES), *fifos) == (
        1 if where == "record" else 2)  # records decide; groups are read by a load
    for command in ("ls", "verify"):
        code, doc = without_hanging(lambda: cli(capsys, command, prefix), *fifos)
        assert code == (1 if command == "verify" else 0), doc
        assert str(SECRET_SIZE) not in json.dumps(doc), doc
    runner = JobRunner(build_job(3), MultiNodeCheckpointManager(
        prefix, metadata_handler=ZarrMetadataHandler()))
    assert without_hanging(lambda: runner.train(LocalSession()), *fifos) == 3
    assert runner.resumed_from == 1
