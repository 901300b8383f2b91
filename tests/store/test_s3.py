"""The storage and resume protocol on object storage: each real S3-protocol server (moto's server
mode and SeaweedFS, started once per session by tests/conftest.py) on 127.0.0.1, reached through
s3fs; every test here runs on both (``s3-moto``, ``s3-seaweedfs``).

Besides the S3 variants of the storage, resume, corruption, fencing, concurrency and hostile-input
modules (their ``prefix`` fixture includes ``s3``), this module shows that saves issue no rename,
move, copy, delete or listing on S3 and upload each byte once (every group is written once at a
path of its own), that commit records and run entries are created exclusively (a conditional
``If-None-Match`` PUT; racing creators get exactly one winner), and it runs the save / re-save
fault matrix of tests/safety/test_faults.py against S3 on one fault per class of S3 request.
"""

from __future__ import annotations

import dataclasses
import json
import time

import fsspec
import pytest
from faultfs import FaultyFileSystem

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.store.format.records import CommitRecord, write_record
from tests.safety import test_faults as faults
from tests.safety.test_concurrency import race_exclusive_creates
from tests.stores import newest_epoch

s3fs = pytest.importorskip("s3fs")

pytestmark = pytest.mark.slow
NODES = ["trainer_0", "trainer_1"]


@pytest.fixture
def s3(s3_server, s3_bucket):
    """(storage_options, bucket) for a fresh bucket on the S3 server of this case."""
    return {**s3_server.options(), "skip_instance_cache": True}, s3_bucket


def count_requests(monkeypatch) -> list[tuple[str, str, int]]:
    """Every S3 request from now on (where s3fs calls S3, in aiobotocore): operation, key (or
    prefix) and bytes up, in the list returned."""
    from aiobotocore.client import AioBaseClient

    calls: list[tuple[str, str, int]] = []
    real = AioBaseClient._make_api_call

    async def counted(client, operation, params):
        body = params.get("Body", b"")
        calls.append((operation, params.get("Key", params.get("Prefix", "")),
                      len(body) if isinstance(body, bytes | bytearray | memoryview) else -1))
        return await real(client, operation, params)
    monkeypatch.setattr(AioBaseClient, "_make_api_call", counted)
    return calls


def manager(options, url: str, **kw) -> MultiNodeCheckpointManager:
    return MultiNodeCheckpointManager(url, storage_options=options,
                                      metadata_handler=ZarrMetadataHandler(), **kw)


def test_records_are_created_exclusively_on_s3(s3):
    """A second record of the same name is refused (on SeaweedFS too, whose 412 s3fs does not
    call FileExistsError); the same bytes again are the create's own (a retried PUT)."""
    options, bucket = s3
    location = Location(f"s3://{bucket}/exclusive", options)
    record = CommitRecord(epoch=1, node="n", save_id="abc", nodes=["n"], nbytes=0, blob_count=0,
                          seconds=0.0)
    write_record(location, record)
    with pytest.raises(FileExistsError):
        write_record(location, dataclasses.replace(record, seconds=1.0))
    write_record(location, record)
    assert location.list_names(location.path("_commits")) == [record.ref.filename]


# -- no renames, exclusive creation ----------------------------------------------------------------

_MOVES = ("mv", "_mv", "copy", "_copy", "cp_file", "_cp_file", "rename", "move", "_move")


def test_saves_on_s3_write_each_object_once_and_delete_nothing(s3, monkeypatch):
    """A whole job (saves of epochs 0..3, their commits, runs, a resume and loads) calls no
    rename, move or copy of s3fs (each patched to fail): every group is written once at a path
    of its own, its zarr.json first and exclusively (a PUT with If-None-Match), every record and
    run entry exclusively; no object but the hint is written twice and nothing is deleted."""
    options, bucket = s3
    for name in _MOVES:
        if hasattr(s3fs.S3FileSystem, name):
            monkeypatch.setattr(s3fs.S3FileSystem, name, _forbidden(name))
    url = f"s3://{bucket}/norename"
    counter = FaultyFileSystem(s3fs.S3FileSystem(**options))
    cm = MultiNodeCheckpointManager(f"{bucket}/norename", filesystem=counter,
                                    metadata_handler=ZarrMetadataHandler())
    assert JobRunner(build_job(2), cm).train(LocalSession()) == 2
    runner = JobRunner(build_job(3), manager(options, url))  # resume through the plain URL
    assert runner.train(LocalSession()) == 3 and runner.resumed_from == 2
    writes = counter.ops("write")
    assert {m for m, _p in writes} <= {"pipe_file", "open(xb)", "makedirs"}, writes
    exclusive = [p for m, p in writes if m == "open(xb)"]
    assert sum("/_commits/" in p for p in exclusive) == 6  # epochs 0..2, two nodes
    assert sum("/_runs/" in p for p in exclusive) == 2  # the run's entry and committed mark
    assert sum(p.endswith("/zarr.json") and "/_commits/" not in p
               for p in exclusive) == 6  # every group's first object
    assert counter.ops("delete") == []
    puts = [p for m, p in writes if m != "makedirs" and "/_hints/" not in p]
    assert len(puts) == len(set(puts)), "an object was written twice"
    assert newest_epoch(manager(options, url).store, NODES) == 3


def test_a_save_on_s3_sends_puts_and_one_fence_check_and_nothing_else(s3, monkeypatch):
    """What a node's save costs on the wire (counted where s3fs calls S3, in aiobotocore): its
    group's objects and its record, each one PUT, plus its hint PUT and one request for the
    fence check (a GET of the next run's entry: 404); a second save of an epoch also tries the
    path the first one took (a conditional PUT refused, then that path's ``zarr.json`` read back:
    another save's); no LIST, HEAD, DELETE or COPY, nothing else downloaded, and the bytes
    uploaded for the group's chunks are the payload's."""
    import numpy as np

    from caffe2ckpt.store.commit import runs
    from caffe2ckpt.store.commit.protocol import CheckpointStore, SaveInfo
    from caffe2ckpt.store.format.paths import new_save_id

    options, bucket = s3
    store = CheckpointStore(Location(f"s3://{bucket}/wire", options))
    run = runs.claim(store.location, nodes=["n"], parent=None)
    blobs = {"w": np.arange(1 << 18, dtype=np.float32), "v": np.ones(3000)}
    calls = count_requests(monkeypatch)
    for taken in (False, True):  # a first save of epoch 1, then a second one
        calls.clear()
        epoch = 1
        save_id = new_save_id(run.generation)
        record = store.save_node("n", epoch, blobs, SaveInfo(save_id=save_id, nodes=["n"]))
        ops = [op for op, _key, _n in calls]
        assert set(ops) == {"PutObject", "GetObject"}, calls
        gets = [key for op, key, _n in calls if op == "GetObject"]
        assert gets[-1].endswith(runs.run_name(run.generation + 1)), gets  # the fence check
        assert gets[:-1] == ["wire/n.1/zarr.json"] * taken, gets  # read back after the 412
        group = f"wire/{record.group}/"
        data = [(key, n) for op, key, n in calls if op == "PutObject" and key.startswith(group)
                and not key.endswith("zarr.json")]
        payload = sum(b.nbytes for b in blobs.values())  # "v" is packed, "w" its own array
        assert sum(n for _key, n in data) == payload + 4 * len(data), data  # + a CRC32C each
        in_group = [key for op, key, _n in calls if op == "PutObject" and key.startswith(group)]
        assert len(in_group) == 2 * len(data) + 1, in_group  # arrays' metadata, the group's
        # + the record and the hint; a second save first tries Caffe2's path (412: taken)
        assert ops.count("PutObject") == len(in_group) + 2 + taken, calls


def _forbidden(name):
    def boom(*args, **kwargs):
        raise AssertionError(f"s3fs {name} called: a commit must not rename or copy on S3")
    return boom


def test_the_bucket_is_checked_once_per_location_not_before_every_create(s3, monkeypatch):
    """S3 has no directories: s3fs's makedirs of a key prefix only checks (HEAD) the bucket, and
    creates it when missing. A Location does that once, not before each of the dozens of
    exclusive creates of a save (files copied into place, records, claims)."""
    options, bucket = s3
    calls: list[str] = []
    makedirs = s3fs.S3FileSystem.makedirs

    def counted(self, path, exist_ok=False):
        calls.append(path)
        return makedirs(self, path, exist_ok=exist_ok)
    monkeypatch.setattr(s3fs.S3FileSystem, "makedirs", counted)
    url = f"s3://{bucket}/once"
    assert JobRunner(build_job(1), manager(options, url)).train(LocalSession()) == 1
    first = len(calls)  # two saves of two nodes: before, six per node and save
    assert 1 <= first <= 3, calls  # at most once per Location the manager made
    runner = JobRunner(build_job(4), manager(options, url))  # three more saves
    assert runner.train(LocalSession()) == 4 and runner.resumed_from == 1
    assert len(calls) - first <= 3, calls


def test_exclusive_creation_has_exactly_one_winner_on_s3(s3, s3_server, monkeypatch):
    """Eight threads create the same record (and claim) at once: exactly one creation succeeds
    each time, the others get FileExistsError and change nothing.

    moto: twenty times over, its server answering each key lookup 10 ms late, so a create that
    is not one conditional write (or a server that checks and then writes in two steps, as moto
    itself does) lets several threads win: 20 of 20 trials had several winners before the
    server made such writes atomic. SeaweedFS: five times (it makes concurrent conditional PUTs
    of one key wait for each other, about a second a step here: a trial takes seconds)."""
    trials = 20
    if s3_server.kind == "moto":
        from moto.s3.models import S3Backend

        get_object = S3Backend.get_object

        def slow_get_object(self, *args, **kwargs):
            found = get_object(self, *args, **kwargs)
            time.sleep(0.01)
            return found
        monkeypatch.setattr(S3Backend, "get_object", slow_get_object)
    else:
        trials = 5
    options, bucket = s3
    race_exclusive_creates(Location(f"s3://{bucket}/race", options), trials)


# -- the save / re-save fault matrix on S3 (one fault per class of S3 operation) -----------------

# A case costs ~100-200 requests (~2-4 s): the full matrix on S3 would take minutes, and the memory
# and local matrices (tests/safety/test_faults.py) fault every operation. On S3 each case faults
# the first operation of one class of S3 request the save makes (whichever node's thread makes
# it; FaultyFileSystem.arm's ``match``), plus the very last write of the save:
#
# - the hint (a plain PUT, before anything of the save);
# - the exclusive (If-None-Match) PUT of a group's zarr.json, which takes its path;
# - a PUT of a chunk or an array's metadata inside the group;
# - the exclusive PUT of a commit record (the last write: the second node's record, so one node
#   committed and the other not).
#
# A save deletes nothing and lists nothing (tests/safety/test_faults.py checks it); makedirs,
# stat and ENOSPC faults are raised by the wrapper before any request, exactly as on
# memory/local, where every one is faulted.


def _record(method: str, path: str) -> bool:
    return "/_commits/" in path


def _group_json(method: str, path: str) -> bool:
    return method == "open(xb)" and path.endswith("/zarr.json") and not _record(method, path)


LAST = None  # the last op of the kind in the save (n = the count of a fault-free save)
WRITE_CLASSES = {
    "hint": lambda m, p: m == "pipe_file" and "/_hints/" in p,
    "group-zarr.json": _group_json,
    "group-data": lambda m, p: m == "pipe_file" and "/_hints/" not in p,
    "record": lambda m, p: m == "open(xb)" and _record(m, p),
    "last": LAST,  # the run's committed mark, written once its first save is committed
}
S3_FAULTS = [
    pytest.param(faults.FRESH, "write", WRITE_CLASSES, id="fresh-write-EIO"),
    pytest.param(faults.RESAVE, "write", {k: WRITE_CLASSES[k] for k in
                                          ("group-zarr.json", "group-data", "record")},
                 id="resave-write-EIO"),
]


@pytest.fixture(scope="module")
def fault_templates(s3_server):
    """(inner s3fs, root, template(scenario)): each scenario's committed template (and the ops of
    a fault-free save from it, counted once) in one bucket shared by the module's fault tests."""
    inner = s3fs.S3FileSystem(**s3_server.options(), skip_instance_cache=True)
    root = f"{s3_server.new_bucket()}/faults"
    made: dict[str, tuple[str, FaultyFileSystem]] = {}

    def template(sc: faults.Scenario) -> tuple[str, FaultyFileSystem]:
        if sc.name not in made:
            path = f"{root}/template-{sc.name}"
            faults.train(FaultyFileSystem(inner), path, sc.setup_epochs)
            probe = f"{root}/probe-{sc.name}"
            faults.clone(inner, path, probe)
            counter = FaultyFileSystem(inner)
            faults.train(counter, probe, faults.SAVED, resume=sc.resume, hook=counter.reset)
            made[sc.name] = path, counter
        return made[sc.name]

    return inner, root, template


@pytest.mark.parametrize(("sc", "kind", "classes"), S3_FAULTS)
def test_faults_of_a_save_on_s3(fault_templates, sc, kind, classes):
    inner, root, template_of = fault_templates
    template, counter = template_of(sc)
    total = counter.counts[kind]
    ops = counter.ops(kind)
    for label, match in classes.items():  # every class really occurs in the save
        assert match is LAST or any(match(m, p) for m, p in ops), (label, ops)
    if kind == "write":  # the last writes: a commit record, then the run's committed mark
        last = [op for op in ops if "/_runs" not in op[1]][-1]
        assert WRITE_CLASSES["record"](*last) and "/_runs/" in ops[-1][1], ops[-3:]
    failures, outcomes = [], []
    for label, match in classes.items():
        fault = faults.Fault(kind, label=label, match=match)
        n = total if match is LAST else 1
        try:
            outcomes.append(f"{label}: {faults.run_case(inner, root, template, sc, fault, n)}")
        except Exception as exc:  # noqa: BLE001 - every class is reported, then the test fails
            failures.append(f"{label} (n={n}/{total}): {type(exc).__name__}: {exc}")
    print(f"{kind} ops of the save on S3: {total}; faulted: {list(classes)}")
    print("\n".join(outcomes))
    assert not failures, (f"{len(failures)} of {len(classes)} faults broke the protocol on S3:\n"
                          + "\n".join(failures))


def test_a_delta_save_on_s3_sends_few_requests_and_no_listing(s3, monkeypatch):
    """A differential save of a step (5% of a table's rows changed, a frozen blob, a moved
    packed blob) on the wire: its group's ``zarr.json``, the overlay's two arrays (metadata and
    chunk each), the packed array, the record and the hint (PUTs); the base's record read before
    planning and after the commit, and the fence check (GETs). At most 16 requests, no LIST,
    and the bytes uploaded are the changed rows, their ids and the packed blobs."""
    import numpy as np

    from caffe2ckpt import StepCheckpointManager, StepManagerOptions

    options, bucket = s3
    rng = np.random.default_rng(0)
    table = rng.random((16384, 64), dtype=np.float32)  # 4 MiB: an array of its own
    blobs = {"table": table, "frozen": rng.random((256, 256), dtype=np.float32),
             "dense": rng.random(4096, dtype=np.float32)}
    opts = StepManagerOptions(delta_saves=True, delta_min_bytes=1 << 20)
    with StepCheckpointManager(f"s3://{bucket}/delta", options=opts, storage_options=options,
                               handle_preemption=False) as mgr:
        mgr.save(0, {"n": blobs})
        rows = np.sort(rng.choice(16384, 819, replace=False))
        table[rows] += 1
        blobs["dense"] += 1
        with monkeypatch.context() as patch:  # the server's settings stay patched
            calls = count_requests(patch)
            mgr.save(1, {"n": blobs}, force=True)
    ops = [op for op, _key, _n in calls]
    assert len(calls) <= 16 and "ListObjectsV2" not in ops, calls
    assert set(ops) == {"PutObject", "GetObject"}, calls
    up = sum(n for op, _key, n in calls if op == "PutObject")
    changed = rows.size * (64 * 4 + 4)  # values and int32 ids
    packed = blobs["dense"].nbytes + 8  # the dense blob and the chunk's CRC (and alignment)
    assert changed + packed <= up <= changed + packed + 16 << 10, (up, calls)


def test_an_elastic_restore_on_s3_lists_only_the_history_and_reads_each_chunk_once(
        s3, monkeypatch):
    """A save of 2 nodes restored on 4 (``mod``: each new node takes every other row of one old
    shard) and its replicated weights: the only listings are the prefix's history (the run log
    and the records, once each; a same-topology restore lists records once), none of the old
    groups; each chunk of the table is read once, and so is each old node's record, manifest
    and the metadata of each array read."""
    import numpy as np

    from caffe2ckpt import Layout, StepCheckpointManager

    options, bucket = s3
    url, layout = f"s3://{bucket}/elastic", Layout(rows=["emb"], replicated=["w"],
                                                   partition="mod")
    table = np.random.default_rng(0).random((32768, 64), dtype=np.float32)  # 4 chunks of 2 MiB
    weights = np.arange(1 << 16, dtype=np.float32)
    old, new = ["old_0", "old_1"], [f"new_{k}" for k in range(4)]
    with StepCheckpointManager(url, nodes=old, layout=layout, storage_options=options,
                               handle_preemption=False) as mgr:
        mgr.save(0, {node: {"emb": table[k::2], "w": weights} for k, node in enumerate(old)})
    with StepCheckpointManager(url, nodes=new, layout=layout, storage_options=options,
                               handle_preemption=False) as mgr, monkeypatch.context() as patch:
        calls = count_requests(patch)
        out = mgr.restore(0)
    for k, node in enumerate(new):
        assert out[node]["emb"].tobytes() == table[k::4].tobytes(), node
        assert out[node]["w"].tobytes() == weights.tobytes(), node
    lists = sorted(key for op, key, _n in calls if op.startswith("List"))
    assert lists == ["elastic/_commits/", "elastic/_runs/"], calls
    chunks = [key for op, key, _n in calls if op == "GetObject" and "/emb/c." in key]
    assert len(chunks) == len(set(chunks)) == 4, chunks
    others = sorted(key.rsplit(".g", 1)[0] if "/_commits/" in key else key
                    for op, key, _n in calls if not op.startswith("List") and key not in chunks)
    assert others == sorted([  # once each: every old node's record, manifest and table metadata,
        *(f"elastic/{path}" for node in old for path in (  # and the weights' writer's packed array
            f"_commits/000000000000.{node}", f"{node}.0/zarr.json", f"{node}.0/emb/zarr.json")),
        "elastic/old_0.0/_packed/zarr.json", "elastic/old_0.0/_packed/c.0"]), calls


# -- a prefix behind fsspec's DirFileSystem (review of e4d82ae, D7) --------------------------------


def test_a_removed_resave_behind_a_dir_wrapper_leaves_nothing_for_gc(s3_bucket, capsys):
    """A prefix named by a ``dir::s3://`` URL (fsspec's DirFileSystem around s3fs): a re-saved
    step is stored at its own path (``n.1.<save id>``); deleting it leaves no directory behind,
    and once a newer run has started, ``caffe2ckpt gc`` through the same URL finds nothing left
    and exits 0. On SeaweedFS,
    whose filer keeps a directory once its keys are deleted, the wrapper used to get the generic
    class, whose ``rmdir`` s3fs refuses: the directory stayed, and every gc listed it as
    unidentified data, failed to remove it (FileExistsError) and exited 4."""
    import numpy as np

    from caffe2ckpt import StepCheckpointManager
    from caffe2ckpt.cli import main as cli_main

    url = f"dir::s3://{s3_bucket}/ckpt"  # s3:// reaches this case's server (s3_bucket)
    wrapper, root = fsspec.core.url_to_fs(url)  # plain file operations, through the wrapper

    def groups() -> list[str]:
        return sorted(p.rsplit("/", 1)[1] for p in wrapper.ls(root, detail=False, refresh=True)
                      if p.rsplit("/", 1)[1].startswith("n."))

    with StepCheckpointManager(url, handle_preemption=False) as mgr:
        for step in range(3):
            mgr.save(step, {"n": {"w": np.full(8, float(step))}})
        mgr.save(1, {"n": {"w": np.full(8, 10.0)}}, force=True)  # a new run: its own path
        resaved = [g for g in groups() if g.startswith("n.1.")]
        assert len(resaved) == 1, groups()
        mgr.delete(1)
        assert mgr.all_steps(read=True) == [0]
    with StepCheckpointManager(url, handle_preemption=False) as mgr:  # a newer run: the
        mgr.save(3, {"n": {"w": np.full(8, 3.0)}})  # re-save's run can no longer be writing
    capsys.readouterr()
    for _ in range(2):  # the second gc finds what the first left
        code = cli_main(["gc", url, "--min-age", "0", "--yes", "--json"])
        doc = json.loads(capsys.readouterr().out)
        assert (code, doc["leftovers"], doc["skipped"]) == (0, [], []), doc["leftovers"]
    assert groups() == ["n.0", "n.1", "n.2", "n.3"]  # the re-save's directory went with it
