"""Damaged checkpoints: every corruption of a committed 2-node checkpoint is either detected
(CheckpointCorruptedError naming node, epoch and blob; or the epoch stops counting as committed)
or harmless (the data loads bit-exact) — never silently wrong data (DESIGN.md §4 and §5)."""

from __future__ import annotations

import logging
import re
import zlib
from dataclasses import dataclass

import fsspec
import numpy as np
import pytest

from caffe2ckpt import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    StepCheckpointManager,
)
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.naming import blob_path
from caffe2ckpt.store.format.records import list_records, read_record
from tests.s3server import NOT_ON_S3
from tests.stores import load as load_node

NODES = ["n0", "n1"]
BIG = "big/w"  # 1.02 MiB, over the pack threshold: its own zarr array
PACKED = ["small/b", "count", "names"]  # packed together into "_packed"


def node_blobs(node: str, epoch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([zlib.crc32(node.encode()), epoch])
    return {
        BIG: rng.normal(size=(1040, 256)).astype(np.float32),
        "small/b": rng.normal(size=10),
        "count": np.int64(epoch * 100 + NODES.index(node)),
        "names": np.array([f"{node}-{epoch}", "über"], "<U8"),
    }


@dataclass
class Ckpt:
    prefix: str
    fs: fsspec.AbstractFileSystem
    root: str

    def path(self, node: str, epoch: int, *parts: str) -> str:
        return "/".join([self.root, f"{node}.{epoch}", *parts])

    def chunk(self, node: str, epoch: int, array: str) -> str:
        chunks = sorted(p for p in self.fs.find(self.path(node, epoch, array))
                        if p.rsplit("/", 1)[1].startswith("c."))
        assert chunks, (node, epoch, array)
        return chunks[0]

    def record(self, node: str, epoch: int):
        (ref,) = [r for r in list_records(Location(self.prefix)) if (r.node, r.epoch) == (node, epoch)]
        return ref, f"{self.root}/_commits/{ref.filename}"

    def handler(self) -> ZarrMetadataHandler:
        handler = ZarrMetadataHandler()
        handler.set_params(db_prefix=self.prefix, db_type="zarr", node_names=NODES)
        return handler


def fs_root(prefix: str, memory_fs) -> tuple[fsspec.AbstractFileSystem, str]:
    if prefix.startswith("memory://"):
        return memory_fs, memory_fs._strip_protocol(prefix).rstrip("/")
    if prefix.startswith("s3://"):  # the moto server of tests/conftest.py
        fs, root = fsspec.core.url_to_fs(prefix)
        return fs, root.rstrip("/")
    return fsspec.filesystem("file"), prefix


_PRISTINE: dict[str, dict[str, bytes]] = {}  # "memory"/"local" -> {relative path: bytes}


def write_checkpoint(prefix: str) -> None:
    """Commit epochs 1 and 2 of nodes n0 and n1 under ``prefix`` through the public API."""
    session = LocalSession()
    for node in NODES:
        session.workspace(node).update(node_blobs(node, 1))
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    cm.set_params(NODES)
    session.run(cm.init(NODES))
    for epoch in (1, 2):
        for node in NODES:
            session.workspace(node).update(node_blobs(node, epoch))
        session.run(cm.save(epoch))
        cm.write_checkpoint_metadata(epoch)


@pytest.fixture
def ckpt(prefix, memory_fs) -> Ckpt:
    """Epochs 1 and 2 of nodes n0 and n1, committed under ``prefix``. Written by caffe2ckpt once
    per filesystem kind; later tests get a byte-for-byte copy of those files (it is faster)."""
    fs, root = fs_root(prefix, memory_fs)
    kind = prefix.partition("://")[0] if "://" in prefix else "local"
    if kind not in _PRISTINE:
        write_checkpoint(prefix)
        _PRISTINE[kind] = {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(root)}
    else:
        for relative, data in _PRISTINE[kind].items():
            fs.makedirs(f"{root}/{relative}".rsplit("/", 1)[0], exist_ok=True)
            fs.pipe_file(f"{root}/{relative}", data)
    c = Ckpt(prefix, fs, root)
    assert c.handler().last_epoch() == 2
    return c


def load(c: Ckpt, epoch: int, nodes=NODES) -> dict[str, dict[str, np.ndarray]]:
    """Load ``nodes``' checkpoints of ``epoch`` with a fresh manager into a fresh session."""
    session = LocalSession()
    cm = MultiNodeCheckpointManager(c.prefix, metadata_handler=ZarrMetadataHandler())
    session.run(cm.init(list(nodes), retrieve_from_epoch=epoch))
    session.run(cm.load(epoch))
    return {node: dict(session.workspace(node)) for node in nodes}


def assert_exact(loaded: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(loaded) == sorted(want)
    for name, value in want.items():
        got = loaded[name]
        assert (got.dtype.str, got.shape) == (value.dtype.str, value.shape), f"wrong blob {name!r}"
        assert got.tobytes() == value.tobytes(), f"wrong data in blob {name!r}"


def assert_raises_or_exact(c: Ckpt, node: str, epoch: int) -> CheckpointCorruptedError | None:
    """The contract: a damaged checkpoint loads bit-exact or raises CheckpointCorruptedError
    naming the damaged node and epoch."""
    try:
        loaded = load(c, epoch, [node])
    except CheckpointCorruptedError as exc:
        assert (exc.node, exc.epoch) == (node, epoch), str(exc)
        assert repr(node) in str(exc) and f"epoch {epoch}" in str(exc), str(exc)
        return exc
    assert_exact(loaded[node], node_blobs(node, epoch))
    return None


def assert_others_intact(c: Ckpt, node: str = "n1", epoch: int = 2) -> None:
    """Damage to ``node``'s checkpoint of ``epoch`` leaves the other node and epoch intact."""
    other = NODES[1 - NODES.index(node)]
    assert_exact(load(c, epoch, [other])[other], node_blobs(other, epoch))
    assert_exact(load(c, epoch - 1, [node])[node], node_blobs(node, epoch - 1))


def mutate(fs, path: str, how: str) -> None:
    if how == "delete":
        fs.rm_file(path)
        return
    data = bytearray(fs.cat_file(path))
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = bytearray()
    elif how == "grow":
        data += b"\0" * 8
    elif how == "garbage":
        data = bytearray(b"\x00\xff{not json" * 3)
    else:
        raise AssertionError(how)
    fs.pipe_file(path, bytes(data))


# -- chunks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("array", "how"), [(BIG, "flip"), (BIG, "truncate"), (BIG, "delete"),
                                             (BIG, "empty"), (BIG, "grow"),
                                             ("_packed", "flip"), ("_packed", "truncate"),
                                             ("_packed", "delete")])
def test_damaged_chunk_raises_naming_node_epoch_blob(ckpt, array, how):
    stored = blob_path(array) if array == BIG else array
    mutate(ckpt.fs, ckpt.chunk("n1", 2, stored), how)
    with pytest.raises(CheckpointCorruptedError) as info:
        load(ckpt, 2)
    exc = info.value
    assert (exc.node, exc.epoch) == ("n1", 2)
    if array == BIG:
        assert exc.blob == BIG
    else:
        assert exc.blob in ("_packed", *PACKED)
    message = str(exc)
    assert "'n1'" in message and "epoch 2" in message and repr(exc.blob) in message
    assert_others_intact(ckpt)


@pytest.mark.parametrize("array", [BIG, "_packed"])
@NOT_ON_S3
def test_any_single_bit_flip_in_a_chunk_is_detected(ckpt, array):
    path = ckpt.chunk("n1", 2, blob_path(array) if array == BIG else array)
    original = ckpt.fs.cat_file(path)
    positions = sorted({0, 1, len(original) - 1, len(original) - 4,
                        *range(0, len(original), max(1, len(original) // 10))})
    for pos in positions:
        damaged = bytearray(original)
        damaged[pos] ^= 1 << (pos % 8)
        ckpt.fs.pipe_file(path, bytes(damaged))
        exc = assert_raises_or_exact(ckpt, "n1", 2)
        assert exc is not None, f"flip at byte {pos} of {path} went unnoticed"
    ckpt.fs.pipe_file(path, original)
    assert_exact(load(ckpt, 2)["n1"], node_blobs("n1", 2))


# -- zarr metadata ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("array", "how"), [(BIG, "delete"), (BIG, "garbage"), (BIG, "truncate"),
                                             ("_packed", "delete"), ("_packed", "empty")])
@NOT_ON_S3
def test_damaged_array_metadata_raises_naming_node_and_epoch(ckpt, array, how):
    stored = blob_path(array) if array == BIG else array
    mutate(ckpt.fs, ckpt.path("n1", 2, stored, "zarr.json"), how)
    with pytest.raises(CheckpointCorruptedError) as info:
        load(ckpt, 2)
    assert (info.value.node, info.value.epoch) == ("n1", 2)
    assert "'n1'" in str(info.value) and "epoch 2" in str(info.value)
    assert_others_intact(ckpt)


@pytest.mark.parametrize("how", ["garbage", "truncate", "empty", "not-a-manifest"])
@NOT_ON_S3
def test_damaged_group_metadata_raises_and_epoch_falls_back(ckpt, how, caplog):
    path = ckpt.path("n1", 2, "zarr.json")
    if how == "not-a-manifest":  # a valid zarr group without caffe2ckpt attributes
        ckpt.fs.pipe_file(path, b'{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    else:
        mutate(ckpt.fs, path, how)
    with pytest.raises(CheckpointCorruptedError) as info:
        load(ckpt, 2)
    assert (info.value.node, info.value.epoch) == ("n1", 2)
    assert "'n1'" in str(info.value) and "epoch 2" in str(info.value)
    # the records still commit epoch 2 (every API agrees it is the newest); its damage is found
    # when it is read, and an automatic resume then falls back (test_automatic_resume_...)
    assert ckpt.handler().last_epoch() == 2
    assert_others_intact(ckpt)


def test_deleted_group_metadata_fails_the_load(ckpt):
    ckpt.fs.rm_file(ckpt.path("n1", 2, "zarr.json"))
    with pytest.raises(CheckpointCorruptedError, match="group metadata is missing"):
        load(ckpt, 2)
    assert ckpt.handler().last_epoch() == 2  # records decide what is committed


# Single-bit flips in metadata documents that still parse. Each case: the file (relative to the
# node's group), a regex whose group 1 is the byte to flip, which match of it, and which bit.
METADATA_FLIPS = {
    "array-chunk-key-separator": (f"{blob_path(BIG)}/zarr.json", rb'"separator":\s*"(\.)"', 0, 0),
    "manifest-packed-offset-1st": ("zarr.json", rb'"offsets":\s*\[\s*(\d)', 0, 0),  # 0 -> 1
    "manifest-packed-offset-2nd": ("zarr.json", rb'"offsets":\s*\[\s*\d+\s*,\s*(\d)', 0, 0),
    "manifest-blob-name": ("zarr.json", rb'"(s)mall/b"', 0, 0),  # -> "rmall/b"
    "manifest-dtype": ("zarr.json", rb'"<f(8)"', 0, 0),  # -> "<f9"
    "manifest-shape": ("zarr.json", rb'\[\s*1(0)\s*\]', 0, 0),  # [10] -> [11]
}


@pytest.mark.parametrize("case", sorted(METADATA_FLIPS))
@NOT_ON_S3
def test_single_bit_flip_in_metadata_never_yields_wrong_data(ckpt, case):
    relative, pattern, occurrence, bit = METADATA_FLIPS[case]
    path = ckpt.path("n1", 2, relative)
    data = bytearray(ckpt.fs.cat_file(path))
    matches = list(re.finditer(pattern, bytes(data)))
    assert len(matches) > occurrence, f"{case}: pattern not found in {path}"
    data[matches[occurrence].start(1)] ^= 1 << bit
    ckpt.fs.pipe_file(path, bytes(data))
    assert_raises_or_exact(ckpt, "n1", 2)  # a raw TypeError/ValueError escaping fails too


# -- commit records --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["garbage", "truncate", "empty", "other-record"])
def test_damaged_commit_record_is_not_committed(ckpt, how, caplog):
    ref, path = ckpt.record("n1", 2)
    if how == "other-record":  # a valid record, but for another epoch
        ckpt.fs.pipe_file(path, ckpt.fs.cat_file(ckpt.record("n1", 1)[1]))
    else:
        mutate(ckpt.fs, path, how)
    location = Location(ckpt.prefix)
    with pytest.raises(CheckpointCorruptedError) as info:
        read_record(location, ref)
    assert ref.filename in str(info.value)
    assert (info.value.node, info.value.epoch) == ("n1", 2)
    handler = ckpt.handler()
    with caplog.at_level(logging.WARNING, logger="caffe2ckpt"):
        assert handler.last_epoch() == 1
    assert any(ref.filename in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    with pytest.raises(CheckpointNotFoundError):
        handler.last_epoch(user_epoch=2)
    assert handler.last_epoch(user_epoch=1) == 1
    assert read_record(location, ckpt.record("n0", 2)[0]).epoch == 2  # the other node's is fine
    with pytest.raises(CheckpointError):
        load(ckpt, 2, ["n1"])
    assert_exact(load(ckpt, 1)["n1"], node_blobs("n1", 1))


def test_deleted_commit_record_is_not_committed(ckpt):
    ckpt.fs.rm_file(ckpt.record("n0", 2)[1])
    assert ckpt.handler().last_epoch() == 1
    for nodes in (["n0"], ["n1"]):  # a save with a missing record commits nothing
        with pytest.raises(CheckpointNotFoundError):
            load(ckpt, 2, nodes)
    assert_exact(load(ckpt, 1, ["n1"])["n1"], node_blobs("n1", 1))


# -- a whole job -----------------------------------------------------------------------------------


def train(prefix: str, num_epochs: int, session: LocalSession | None = None, **kw) -> JobRunner:
    runner = JobRunner(build_job(num_epochs=num_epochs),
                       MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler()),
                       **kw)
    runner.final_epoch = runner.train(session if session is not None else LocalSession())
    return runner


def test_job_falls_back_past_corrupt_newest_epoch(prefix, memory_fs, caplog, capsys):
    # the uninterrupted run's workspaces do not depend on the filesystem: computed on memory://
    # (on S3 its seven saves were a third of this test's requests)
    reference_session = LocalSession()
    assert train("memory://corruption-reference", 6, reference_session).final_epoch == 6

    assert train(prefix, 4).final_epoch == 4
    fs, root = fs_root(prefix, memory_fs)
    chunk = sorted(fs.find(f"{root}/trainer_1.4/{blob_path('data/x')}"))[0]
    assert chunk.rsplit("/", 1)[1].startswith("c."), chunk
    mutate(fs, chunk, "flip")

    # explicitly asked for: a clear error, not a fallback
    with pytest.raises(CheckpointCorruptedError) as info:
        train(prefix, 6, resume_from_epoch=4)
    assert (info.value.node, info.value.epoch, info.value.blob) == ("trainer_1", 4, "data/x")
    assert "'trainer_1'" in str(info.value) and "epoch 4" in str(info.value)

    # chosen automatically: fall back to epoch 3 with a warning, then train on to 6
    session = LocalSession()
    caplog.clear()
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="caffe2ckpt"):
        runner = train(prefix, 6, session)
    assert runner.final_epoch == 6 and runner.resumed_from == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("epoch 4" in m and "trainer_1" in m for m in warnings), warnings
    assert "epoch   4" in capsys.readouterr().out  # epoch 4 was trained again

    for node in ("trainer_0", "trainer_1"):
        got, want = session.workspace(node), reference_session.workspace(node)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype.str == want[name].dtype.str, (node, name)
            assert got[name].tobytes() == want[name].tobytes(), (node, name)
    handler = ZarrMetadataHandler()
    handler.set_params(db_prefix=prefix, db_type="zarr", node_names=["trainer_0", "trainer_1"])
    assert handler.last_epoch() == 6


def test_a_chunk_from_another_save_is_detected(prefix, memory_fs):
    """Two runs writing the same epoch must never yield a checkpoint that mixes their data: a
    chunk carries a valid CRC32C either way, but the manifest records which one was written."""
    fs, root = fsspec.core.url_to_fs(prefix)
    stores = {}
    for run, value in (("a", 1.0), ("b", 2.0)):
        session = LocalSession()
        session.workspace("n")["w"] = np.full(1 << 17, value)  # 1 MiB: its own array
        cm = MultiNodeCheckpointManager(f"{prefix}/{run}")
        session.run(cm.init(["n"]))
        session.run(cm.save(3))
        stores[run] = cm.store
    (chunk,) = [p for p in fs.find(f"{root}/b/n.3/w") if p.rsplit("/", 1)[1].startswith("c.")]
    fs.pipe_file(chunk.replace(f"{root}/b/", f"{root}/a/"), fs.cat_file(chunk))
    with pytest.raises(CheckpointCorruptedError, match="another save") as info:
        load_node(stores["a"], "n", 3)
    assert (info.value.node, info.value.epoch, info.value.blob) == ("n", 3, "w")
    assert load_node(stores["b"], "n", 3)["w"][0] == 2.0


def test_damage_in_the_packed_array_names_the_blobs_packed_there(tmp_path):
    """Small blobs share one packed array: its damage names them, the names a user knows."""
    prefix = str(tmp_path / "ckpt")
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        mgr.save(0, {"n0": {"lr": np.float32(0.1), "step": np.int64(7), "big": np.ones(1 << 18)}})
    chunk = tmp_path / "ckpt" / "n0.0" / "_packed" / "c.0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        with pytest.raises(CheckpointCorruptedError) as caught:
            mgr.restore(0)
    assert caught.value.blob == "lr"  # the first blob of the chunk, not the internal array
    assert "blob 'lr' (packed in '_packed' with 'step'), chunk" in str(caught.value)
