"""Differential saves through the public step API: what each save writes (a span of each large
blob in turn and its changed rows), what the writer keeps in memory (8-byte row digests and the
union of hints, never a copy), and that every kept step restores bit for bit whatever retention,
gc, deletes and damage did to the chains.

Each test runs on memory, local and S3. On S3, the tests of what deletes, gc, empty blobs and
hints do run on both servers (moto and SeaweedFS); the long checks of the delta logic above
the storage layer (restores across chains, bytes written, plain zarr reads, async saves, the
CLI, damage) each run on one of them: what they ask of S3 (writes, whole and ranged reads,
listings) the other tests here and tests/store/test_s3.py check on both."""

from __future__ import annotations

import json
import logging
import time
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
import zarr

import caffe2ckpt
from caffe2ckpt import StepCheckpointManager, StepManagerOptions
from caffe2ckpt.cli import main as cli_main
from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    InvalidBlobError,
    InvalidLocationError,
    JobDefinitionError,
)
from caffe2ckpt.history.scan import scan
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.commit.protocol import SaveInfo
from caffe2ckpt.store.delta import plan as delta
from caffe2ckpt.store.delta.plan import DeltaTracker, span_rows
from caffe2ckpt.store.format.paths import new_save_id
from caffe2ckpt.store.format.records import delete_record, record_path
from caffe2ckpt.workspace import merge_rows
from tests.faultfs import FaultyFileSystem
from tests.s3server import NOT_ON_S3, on_one_s3_server
from tests.stores import gone, open_store, unreferenced_groups

ROWS = 4096
SMALL = 16 << 10  # delta_min_bytes in these tests: every table below is large enough


class Model:
    """A node's workspace: tables of several layouts whose rows change a few at a time, a
    frozen blob and a step counter (packed)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.blobs = {
            "emb/table": self.rng.random((ROWS, 64), dtype=np.float32),
            "fortran": np.asfortranarray(self.rng.random((ROWS, 8))),
            "big_endian": self.rng.integers(0, 1 << 30, (ROWS, 16)).astype(">i4"),
            "names": np.array([[f"r{i}", f"c{i}"] for i in range(ROWS)], dtype="<U8"),
            "frozen": self.rng.random((32, 64), dtype=np.float32),  # small: never overlaid
            "step": np.array(0, np.int64),
        }

    def step(self, fraction: float = 0.05) -> dict[str, np.ndarray]:
        """Change ``fraction`` of each table's rows; return the rows changed per table."""
        changed = {}
        for name in ("emb/table", "fortran", "big_endian", "names"):
            arr = self.blobs[name]
            rows = np.sort(self.rng.choice(ROWS, int(ROWS * fraction), replace=False))
            if arr.dtype.kind == "U":
                arr[rows] = np.array([f"x{self.rng.integers(1 << 20)}"] * arr.shape[1])
            else:
                arr[rows] = self.rng.integers(0, 1 << 20, (rows.size, arr.shape[1]))
            changed[name] = rows
        self.blobs["step"] = np.array(self.blobs["step"] + 1)
        return changed

    def copy(self) -> dict[str, np.ndarray]:
        return {k: np.array(v, copy=True, order="K") for k, v in self.blobs.items()}


def save_steps(mgr: StepCheckpointManager, model: Model, steps: int,
               states: dict[int, dict[str, np.ndarray]] | None = None) -> dict:
    """Save steps 0..``steps``-1 of ``model`` (changed before each but the first); return
    (and fill) what each step holds."""
    states = {} if states is None else states
    for step in range(steps):
        if step:
            model.step()
        mgr.save(step, {"n0": model.blobs})
        states[step] = model.copy()
    return states


def options(**kw) -> StepManagerOptions:
    return StepManagerOptions(delta_saves=True, delta_min_bytes=SMALL, **kw)


def reader(prefix: str) -> StepCheckpointManager:
    return StepCheckpointManager(prefix, handle_preemption=False)


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        assert got[name].tobytes(order="A") == arr.tobytes(order="A"), name
        assert got[name].flags.f_contiguous == arr.flags.f_contiguous or arr.ndim < 2, name


def check_windows(prefix: str, chain: int) -> None:
    """Every differential record builds on at most ``chain`` older groups for the blobs that
    change, all among the ``chain`` epochs before it (every step is saved where this is used),
    and for the blob that never changes on the group of the run's first save only."""
    for record in scan(open_store(prefix)).records():
        if record.delta is not None:
            epochs = [g.epoch for g in record.delta.groups]
            for blob, chain_of in record.delta.chains.items():
                groups = {epochs[i] for i in chain_of}
                window = set(range(record.epoch - chain, record.epoch))
                assert groups == {min(epochs)} if blob == "frozen" else groups <= window, (
                    record.epoch, blob, groups)


def check_all(prefix: str, states: dict[int, dict[str, np.ndarray]]) -> list[int]:
    """Every step a fresh reader lists restores to what was saved; returns the steps."""
    with reader(prefix) as r:
        steps = r.all_steps()
        for step in steps:
            assert_same(r.restore(step)["n0"], states[step])
    return steps


@pytest.mark.parametrize("prefix, detection", [
    *[(kind, detection) for kind in ("memory", "local") for detection in ("compare", "hints")],
    pytest.param("s3-moto", "compare", marks=pytest.mark.slow),
    pytest.param("s3-seaweedfs", "hints", marks=pytest.mark.slow),
], indirect=["prefix"])
def test_every_kept_step_restores_bit_exact_across_chains_and_retention(prefix, detection):
    model, states = Model(), {}
    opts = options(delta_detection=detection, max_to_keep=2, keep_period=5)
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        for step in range(14):
            changed = model.step() if step else {}
            hints = {"n0": changed} if detection == "hints" and step else None
            mgr.save(step, {"n0": model.blobs}, changed_rows=hints)
            states[step] = model.copy()
            if not prefix.startswith("s3://") or step % 5 == 4:  # S3: every 5th (time)
                assert check_all(prefix, states) == mgr.all_steps()
    assert check_all(prefix, states) == mgr.all_steps() == [0, 5, 10, 12, 13]
    assert unreferenced_groups(open_store(prefix)) == []
    depths = [(r.epoch, r.delta.depth if r.delta else 0)
              for r in sorted(scan(open_store(prefix)).records(), key=lambda r: r.epoch)]
    assert depths == [(0, 0), (5, 5), (10, 10), (12, 12), (13, 13)]  # no save is whole again
    check_windows(prefix, opts.max_delta_chain)


def test_a_delta_writes_a_span_the_changed_rows_and_nothing_for_unchanged_blobs(prefix):
    model = Model()
    with StepCheckpointManager(prefix, options=options(), handle_preemption=False) as mgr:
        mgr.save(0, {"n0": model.blobs})
        model.step(0.05)
        mgr.save(1, {"n0": model.blobs})
    with reader(prefix) as r:
        meta = [r.metadata(step) for step in (0, 1)]
    assert [(m.kind, m.bytes_written == m.nbytes) for m in meta] == [("full", True),
                                                                     ("delta", False)]
    store = open_store(prefix)
    first, second = sorted(scan(store).records(), key=lambda r: r.epoch)
    assert first.delta is None and second.delta is not None
    assert second.nbytes == first.nbytes
    manifest = store.manifest(second)
    tables = {"emb/table", "fortran", "big_endian", "names"}
    assert set(manifest.overlays) == set(manifest.spans) == tables
    parts = options().max_delta_chain + 1
    for name in tables:  # part 1 of 10 whole, and the changed rows outside it
        start, span = manifest.spans[name]
        row_bytes = model.blobs[name].nbytes // ROWS
        assert (start, start + span.shape[0]) == span_rows(ROWS, row_bytes, parts, 1)
        assert 0.09 * ROWS <= span.shape[0] <= 0.11 * ROWS
    emb = manifest.overlays["emb/table"][0].shape[0]  # 256-byte rows: compared one by one
    assert int(ROWS * 0.05 * 0.85) <= emb <= int(ROWS * 0.05)
    # a tenth of each table, its changed rows (narrow tables: blocks of 160 bytes) and the step
    assert second.bytes_written <= 0.30 * second.nbytes, (second.bytes_written, second.nbytes)
    assert manifest.inherited["frozen"][0] == "same" and "frozen" not in manifest.stored_blobs
    files = store.location.list_names(store.group_path(second))
    assert not [name for name in files if name.startswith("emb")]  # the table is not whole


@on_one_s3_server("seaweedfs")
def test_every_save_writes_about_the_same_and_needs_at_most_the_chain(prefix):
    """Rolling spans: no save after the first is whole, each writes about a part of every
    table and its changed rows, and needs at most ``max_delta_chain`` older groups."""
    model, states = Model(), {}
    opts = options(max_delta_chain=3)
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        save_steps(mgr, model, 12, states)
    records = sorted(scan(open_store(prefix)).records(), key=lambda r: r.epoch)
    written = [r.bytes_written for r in records[1:]]
    assert all(r.delta is not None for r in records[1:])
    assert max(written) <= 1.3 * min(written), written
    assert max(written) <= 0.5 * records[0].nbytes, written
    check_windows(prefix, 3)
    assert check_all(prefix, states) == list(range(12))


def test_nan_payloads_and_negative_zero_are_changes(prefix):
    table = np.zeros((ROWS, 64), np.float32)
    with StepCheckpointManager(prefix, options=options(), handle_preemption=False) as mgr:
        mgr.save(0, {"n0": {"t": table}})
        table[3, 0] = -0.0
        table.view(np.uint32)[7, 1] = 0x7FC00001  # a NaN with a payload
        table.view(np.uint32)[9, 2] = 0x7FC00002
        mgr.save(1, {"n0": {"t": table}})
        table.view(np.uint32)[9, 2] = 0x7FC00003  # NaN to another NaN
        mgr.save(2, {"n0": {"t": table}})
    with reader(prefix) as r:
        assert r.restore(2)["n0"]["t"].tobytes() == table.tobytes()
    manifest = open_store(prefix).manifest(r._step(2).records["n0"])
    assert manifest.overlays["t"][0].shape == (1,)


@pytest.mark.parametrize(("block_bytes", "written"), [(None, 4), (160, 10), (16, 1)])
def test_narrow_rows_are_compared_in_blocks_of_delta_block_bytes(prefix, block_bytes, written):
    """16-byte rows: one 8-byte digest per 4 rows at the default (64 bytes), per 10 with
    ``delta_block_bytes=160``, per row with 16: a changed row writes the rows of its block."""
    table = np.zeros((ROWS, 4), np.float32)
    opts = options(**({} if block_bytes is None else {"delta_block_bytes": block_bytes}))
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        mgr.save(0, {"n0": {"t": table}})
        table[25, 1] = 1.0
        mgr.save(1, {"n0": {"t": table}})
    with reader(prefix) as r:
        assert np.array_equal(r.restore(1)["n0"]["t"], table)
    manifest = open_store(prefix).manifest(r._step(1).records["n0"])
    assert manifest.overlays["t"][0].shape == (written,)


def test_a_hint_that_misses_rows_is_written_and_reported_never_damage(prefix, caplog):
    """Issue 34 item 2: changed rows a hint left out are found by their digests before the
    record is written, saved, and reported; the step restores."""
    table = np.zeros((ROWS, 64), np.float32)
    opts = options(delta_detection="hints")
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        mgr.save(0, {"n0": {"t": table}})
        table[[1, 2, 3]] = 5.0
        with caplog.at_level(logging.WARNING, logger="caffe2ckpt"):
            mgr.save(1, {"n0": {"t": table}}, changed_rows={"n0": {"t": [1, 2]}})  # not 3
    with reader(prefix) as r:
        assert np.array_equal(r.restore(1)["n0"]["t"], table)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "node 'n0', blob 't': 1 changed row(s) were not in the changed-rows hints" in warning


@on_one_s3_server("moto")
def test_chains_are_bounded_by_length_and_by_overlay_bytes(prefix):
    model = Model()
    with StepCheckpointManager(prefix, options=options(max_delta_chain=2),
                               handle_preemption=False) as mgr:
        save_steps(mgr, model, 7)
    check_windows(prefix, 2)
    # overlays of about 4.5% each may reach 12% of a blob: the third delta writes it whole
    second = "memory://fraction" if prefix.startswith("memory") else f"{prefix}-fraction"
    with StepCheckpointManager(second, options=options(max_delta_fraction=0.12),
                               handle_preemption=False) as mgr:
        save_steps(mgr, model, 4)
        kinds = [open_store(second).manifest(mgr._step(step).records["n0"]).inherited
                 for step in (1, 2, 3)]
    assert [k["emb/table"].kind for k in kinds[:2]] == ["rows", "rows"]
    assert "emb/table" not in kinds[2] and kinds[2]["frozen"].kind == "same"


def test_bad_hints_are_refused_before_anything_is_written(prefix):
    table = np.zeros((ROWS, 16), np.float32)
    with StepCheckpointManager(prefix, options=options(), handle_preemption=False) as mgr:
        with pytest.raises(JobDefinitionError, match="delta_detection='hints'"):
            mgr.save(0, {"n0": {"t": table}}, changed_rows={"n0": {"t": [1]}})
    opts = options(delta_detection="hints")
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        with pytest.raises(InvalidLocationError, match="'n1'"):
            mgr.save(0, {"n0": {"t": table}}, changed_rows={"n1": {"t": [1]}})
        with pytest.raises(InvalidLocationError, match="'u'"):
            mgr.save(0, {"n0": {"t": table}}, changed_rows={"n0": {"u": [1]}})
        mgr.save(0, {"n0": {"t": table}})
        with pytest.raises(InvalidBlobError, match=r"blob 't'.*4095"):
            mgr.save(1, {"n0": {"t": table}}, changed_rows={"n0": {"t": [ROWS]}})
        with pytest.raises(InvalidBlobError, match="integers"):
            mgr.save(1, {"n0": {"t": table}}, changed_rows={"n0": {"t": [0.5]}})
        with pytest.raises(InvalidLocationError, match="must map node names.*got list"):
            mgr.save(1, {"n0": {"t": table}}, changed_rows=["n0"])
        with pytest.raises(InvalidBlobError, match=r"blob 's': it is a single value \(0-d\)"):
            mgr.save(1, {"n0": {"t": table, "s": np.float32(1)}}, changed_rows={"n0": {"s": [0]}})
        assert mgr.all_steps() == [0]


@pytest.mark.parametrize("option, value", [
    ("max_delta_chain", 0), ("max_delta_chain", 65), ("max_delta_chain", 2.0),
    ("max_delta_fraction", 0), ("max_delta_fraction", 1.5), ("delta_min_bytes", 0),
    ("delta_detection", "rows"), ("delta_saves", 1), ("delta_block_bytes", 7),
    ("delta_block_bytes", 16385), ("delta_block_bytes", 64.0)])
def test_delta_options_are_validated(option, value):
    with pytest.raises(JobDefinitionError, match=option):
        StepManagerOptions(**{option: value})


def test_a_deleted_base_makes_the_next_save_whole(prefix):
    model, states = Model(), {}
    with StepCheckpointManager(prefix, options=options(), handle_preemption=False) as mgr:
        save_steps(mgr, model, 2, states)
        with reader(prefix) as other:
            other.delete(1)  # the newest: the base of the next save
        model.step()
        mgr.save(2, {"n0": model.blobs})
        states[2] = model.copy()
    assert check_all(prefix, states) == [0, 2]
    assert all(r.delta is None for r in scan(open_store(prefix)).records())
    assert unreferenced_groups(open_store(prefix)) == []


def test_a_base_deleted_while_a_delta_is_written_takes_its_record_back(prefix):
    """The remover deletes the base's records, then reads the records to see what is still
    needed; the saver writes its record, then reads the base's: one of them sees the other."""
    store, model = open_store(prefix), Model()
    info = SaveInfo(save_id=new_save_id(runs.claim(store.location, nodes=["n0"],
                                                   parent=None).generation), nodes=["n0"])
    tracker = DeltaTracker("n0", options())
    plan = tracker.plan(None, model.blobs, store.has_record)
    base = store.save_node("n0", 0, plan.whole, info, plan)
    tracker.committed(plan)
    model.step()
    plan = tracker.plan(info.save_id, model.blobs, store.has_record)
    assert plan.layout is not None
    delete_record(store.location, base.ref)  # between the plan and the commit
    later = replace(info, save_id=new_save_id(info.generation))
    with pytest.raises(CheckpointWriteError, match="builds on.*epoch 0"):
        store.save_node("n0", 1, plan.whole, later, plan)
    tracker.failed(plan)
    assert scan(store).records() == []
    assert tracker.plan(later.save_id, model.blobs, store.has_record).layout is None


@pytest.mark.parametrize("defer", [True, False], ids=["synchronous", "asynchronous"])
def test_a_synchronous_save_writes_its_spans_from_the_workspace_an_async_one_copies_them(
        tmp_path, defer):
    """A save that writes before it returns needs no copy of its spans; one that writes while
    the workspace moves on does (and then restores what it was given, tested elsewhere)."""
    store, model = open_store(str(tmp_path)), Model()
    info = SaveInfo(save_id=new_save_id(runs.claim(store.location, nodes=["n0"],
                                                   parent=None).generation), nodes=["n0"])
    tracker = DeltaTracker("n0", options())
    plan = tracker.plan(None, model.blobs, store.has_record, defer=defer)
    store.save_node("n0", 0, plan.whole, info, plan)
    tracker.committed(plan)
    model.step()
    plan = tracker.plan(info.save_id, model.blobs, store.has_record, defer=defer)
    spans = plan.layout.spans
    assert sorted(spans) == ["big_endian", "emb/table", "fortran", "names"]
    assert {name: np.shares_memory(span, model.blobs[name]) for name, (_, span) in
            spans.items()} == dict.fromkeys(spans, defer)
    plan.abandon()


def test_gc_keeps_every_chain_a_kept_step_needs_and_sweeps_the_rest(prefix, capsys):
    model, states = Model(), {}
    with StepCheckpointManager(prefix, options=options(max_delta_chain=2),
                               handle_preemption=False) as mgr:
        save_steps(mgr, model, 8, states)
    assert cli_main(["gc", prefix, "--keep-last", "2", "--yes", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["epoch"] for d in doc["delete"]] == [0, 1, 2, 3, 4, 5]
    assert check_all(prefix, states) == [6, 7]  # they build on the groups of 4, 5 (and 6),
    assert unreferenced_groups(open_store(prefix)) == []  # and of 0: "frozen" never changed
    location = open_store(prefix).location
    assert [gone(location, f"n0.{e}") for e in range(6)] == [False] + [True] * 3 + [False] * 2
    assert cli_main(["gc", prefix, "--keep-last", "1", "--yes"]) == 0
    capsys.readouterr()
    assert check_all(prefix, states) == [7]
    assert unreferenced_groups(open_store(prefix)) == []


@NOT_ON_S3
def test_gc_leaves_a_damaged_record_with_the_chain_its_save_reads(prefix):
    """A differential step whose record is damaged is not committed any more, and gc leaves its
    group for a person to inspect: with it, the older groups its chain reads, whose own records
    retention deleted (nothing else names them). Put the record back and the step restores
    bit-exact (review of e4d82ae, residual suspicion 2: gc removed those groups)."""
    model, states = Model(), {}
    with StepCheckpointManager(prefix, options=options(max_to_keep=1),
                               handle_preemption=False) as mgr:
        save_steps(mgr, model, 3, states)  # retention keeps step 2, which builds on 0 and 1
    store = open_store(prefix)
    location = store.location
    [record] = scan(store).records()
    path = record_path(location, record.ref)
    good = location.read_bytes(path)
    location.fs.pipe_file(path, b"{damaged")
    runs.claim(location, nodes=["n0"], parent=None)  # its run is over: gc may sweep its saves
    assert cli_main(["gc", prefix, "--min-age", "0", "--yes"]) == 0
    assert [gone(location, f"n0.{e}") for e in range(3)] == [False] * 3
    location.fs.pipe_file(path, good)
    assert check_all(prefix, states) == [2]


@on_one_s3_server("seaweedfs")
def test_a_damaged_base_is_found_in_every_step_built_on_it(prefix):
    model, states = Model(), {}
    with StepCheckpointManager(prefix, options=options(), handle_preemption=False) as mgr:
        save_steps(mgr, model, 4, states)
    store = open_store(prefix)
    chunk = store.location.path("n0.0", "emb%2Ftable", "c.0.0")
    data = bytearray(store.location.read_bytes(chunk, limit=1 << 30))
    data[100] ^= 1
    store.location.replace_file(chunk, bytes(data))
    with reader(prefix) as r:
        for step in range(4):
            with pytest.raises(CheckpointCorruptedError) as caught:
                r.restore(step)
            assert (caught.value.epoch, caught.value.blob) == (step, "emb/table")
        assert_same(r.restore(3, blobs=["fortran"])["n0"], {"fortran": states[3]["fortran"]})


@on_one_s3_server("seaweedfs")
def test_async_differential_saves_restore_bit_exact(prefix):
    model, states = Model(), {}
    opts = options(enable_async_checkpointing=True, max_to_keep=3)
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        save_steps(mgr, model, 7, states)
    assert check_all(prefix, states) == [4, 5, 6]
    assert [r.delta is not None for r in sorted(scan(open_store(prefix)).records(),
                                                 key=lambda r: r.epoch)] == [True, True, True]


@on_one_s3_server("seaweedfs")
def test_every_kept_step_reads_bit_exact_through_plain_zarr(prefix, tmp_path):
    model, states = Model(), {}
    with StepCheckpointManager(prefix, options=options(max_to_keep=3),
                               handle_preemption=False) as mgr:
        save_steps(mgr, model, 6, states)
    for step in (3, 4, 5):  # whole (3) and deltas on it
        store = caffe2ckpt.zarr_store(prefix, step, "n0")
        assert_same(read_group(zarr.open_group(store=store, mode="r")), states[step])
        [url] = caffe2ckpt.materialize(prefix, step, str(tmp_path / "plain"))
        assert url.endswith(f"n0.{step}")
        assert_same(read_plain_group(zarr.open_group(url, mode="r")), states[step])
    with pytest.raises(FileExistsError, match="exists already"):
        caffe2ckpt.materialize(prefix, 5, str(tmp_path / "plain"))
    with pytest.raises(CheckpointNotFoundError, match="epoch 1 is not committed"):
        caffe2ckpt.zarr_store(prefix, 1, "n0")
    with pytest.raises(CheckpointNotFoundError, match=r"no node\(s\) \['n9'\]"):
        caffe2ckpt.materialize(prefix, 5, str(tmp_path / "other"), nodes=["n9"])


def read_group(group) -> dict[str, np.ndarray]:
    """A whole group's blobs through plain zarr, from its manifest (own arrays and packed)."""
    manifest = group.attrs["caffe2ckpt"]
    out = {name: np.asarray(group[info["path"]][...], order=info["order"])
           for name, info in manifest["arrays"].items()}
    packed = manifest["packed"]
    data = np.asarray(group["_packed"][...]) if packed["names"] else None
    for i, name in enumerate(packed["names"]):
        dtype, shape = np.dtype(packed["dtypes"][i]), tuple(packed["shapes"][i])
        raw = data[packed["offsets"][i]:packed["offsets"][i] + dtype.itemsize * int(np.prod(shape))]
        out[name] = raw.view(dtype).reshape(shape)
        if i in packed["fortran"]:
            out[name] = np.asfortranarray(out[name])
    for name, info in manifest["arrays"].items():  # stored little-endian, strings as units
        dtype = np.dtype(info["dtype"])
        arr = out[name]
        if dtype.kind in "US":
            arr = np.ascontiguousarray(arr).view(dtype.newbyteorder("<") if dtype.kind == "U"
                                                 else dtype).reshape(info["shape"])
        out[name] = np.asarray(arr.astype(dtype), order=info["order"])
    return out


def read_plain_group(group) -> dict[str, np.ndarray]:
    """A materialized group's blobs through plain zarr: each its own array, its exact dtype and
    memory order in its attributes (Zarr v3 data types keep neither byte nor memory order)."""
    out = {}
    for _, array in group.arrays():
        blob = array.attrs["caffe2ckpt_blob"]
        out[blob["name"]] = np.asarray(array[...], dtype=blob["dtype"], order=blob["order"])
    return out


@on_one_s3_server("seaweedfs")
def test_the_cli_tells_deltas_pinned_groups_and_materializes(prefix, tmp_path, capsys):
    model = Model()
    with StepCheckpointManager(prefix, options=options(), handle_preemption=False) as mgr:
        save_steps(mgr, model, 3)
    assert cli_main(["ls", prefix, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["epochs"]
    assert [(r["kind"], r.get("depth")) for r in rows] == [("full", None), ("delta", 1),
                                                            ("delta", 2)]
    assert rows[2]["bytes_written"] < 0.3 * rows[2]["bytes"]
    assert [g.rpartition("/")[2] for g in rows[2]["builds_on"]["n0"]] == ["n0.0", "n0.1"]
    assert cli_main(["show", prefix, "--json", "--verify"]) == 0
    blobs = {b["name"]: b for b in json.loads(capsys.readouterr().out)["blobs"]}
    assert blobs["emb/table"]["storage"] == "rows" and blobs["frozen"]["storage"] == "same"
    assert blobs["emb/table"]["checksum"] == "ok"
    assert cli_main(["gc", prefix, "--keep-last", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(p["path"], p["pinned_by"]) for p in doc["pinned"]] == [("n0.0", [2]), ("n0.1", [2])]
    assert doc["bytes_freed"] == 0 and doc["bytes_pinned"] > 0  # both epochs stay as data
    assert cli_main(["verify", prefix, "--json", "--no-progress"]) == 0
    capsys.readouterr()
    dest = str(tmp_path / "m")
    assert cli_main(["materialize", prefix, "--epoch", "2", dest, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"][0].endswith("n0.2")
    assert cli_main(["materialize", prefix, "--epoch", "7", dest]) == 3
    assert "epoch 7 is not committed" in capsys.readouterr().err


def test_hints_of_a_save_that_failed_on_another_node_count_for_the_next(prefix, monkeypatch):
    """Node a's save fails; node b's was never attempted: both nodes' hints stay for the next
    save, which restores bit-exact (found by review)."""
    tables = {n: np.zeros((ROWS, 16), np.float32) for n in ("a", "b")}
    opts = options(delta_detection="hints")
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        mgr.save(0, {n: {"t": t} for n, t in tables.items()})
        real = mgr._store.save_node

        def failing(node, *args, **kw):
            if node == "a":
                raise OSError("a transient I/O error")
            return real(node, *args, **kw)
        for t in tables.values():
            t[[5, 6]] = 1.0
        with monkeypatch.context() as patch, pytest.raises(CheckpointWriteError,
                                                           match="transient"):
            patch.setattr(mgr._store, "save_node", failing)
            mgr.save(1, {n: {"t": t} for n, t in tables.items()},
                     changed_rows={n: {"t": [5, 6]} for n in tables})
        for t in tables.values():
            t[9] = 2.0
        mgr.save(2, {n: {"t": t} for n, t in tables.items()},
                 changed_rows={n: {"t": [9]} for n in tables})
    with reader(prefix) as r:
        got = r.restore(2)
    assert all(np.array_equal(got[n]["t"], t) for n, t in tables.items())


def test_hints_given_with_steps_the_policy_skips_count_for_the_next_save(prefix):
    table = np.zeros((ROWS, 16), np.float32)
    opts = options(delta_detection="hints", save_interval_steps=2)
    states = {}
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        for step in range(5):
            table[step] = step + 1
            if mgr.save(step, {"n0": {"t": table}}, changed_rows={"n0": {"t": [step]}}):
                states[step] = table.copy()
    assert sorted(states) == [0, 2, 4]
    with reader(prefix) as r:
        for step, want in states.items():
            assert np.array_equal(r.restore(step)["n0"]["t"], want), step


def test_a_hint_for_rows_a_blob_no_longer_has_is_no_hint(prefix):
    """A hint noted before the blob shrank is not a promise about the new blob: it is
    compared by digest (written whole if it changed), and later saves are not blocked."""
    ws = caffe2ckpt.Workspace({"t": np.zeros((ROWS, 4), np.float32)})
    with pytest.raises(InvalidBlobError, match=r"mark_changed, blob 't'.*0 to 4095"):
        ws.mark_changed("t", [ROWS])
    tracker = DeltaTracker("n0", options(delta_detection="hints"))
    store = open_store(prefix)
    info = SaveInfo(save_id=new_save_id(runs.claim(store.location, nodes=["n0"],
                                                   parent=None).generation), nodes=["n0"])
    plan = tracker.plan(None, {"t": ws["t"]}, store.has_record)
    store.save_node("n0", 0, plan.whole, info, plan)
    tracker.committed(plan)
    tracker.mark_changed("t", np.array([ROWS - 1]))
    smaller = np.ones((ROWS // 2, 4), np.float32)
    assert tracker.plan(info.save_id, {"t": smaller}, store.has_record).whole == {"t": smaller}


def test_diff_reads_differential_epochs(prefix, capsys):
    model = Model()
    with StepCheckpointManager(prefix, options=options(), handle_preemption=False) as mgr:
        save_steps(mgr, model, 3)
    assert cli_main(["diff", prefix, "1", "2", "--json"]) == 0
    blobs = {b["name"]: b for b in json.loads(capsys.readouterr().out)["blobs"]}
    assert blobs["emb/table"]["status"] == "changed" and blobs["frozen"]["status"] == "same"
    assert blobs["emb/table"]["differing"] == int(ROWS * 0.05) * 64


def test_empty_blobs_in_a_differential_save_commit_cleanly(prefix, capsys):
    """Review D1: a differential save whose small blobs are all empty has no packed array; the
    state update after its record raised a bare KeyError, so save() failed although the step
    was committed (retention never ran; a two-node step stayed partial)."""
    table = np.zeros((ROWS, 64), np.float32)
    empty = {"ids": np.zeros((0, 4), np.int64), "none": np.zeros(0), "wide": np.zeros((5, 0))}
    states = {}
    opts = options(max_to_keep=2)
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        for step in range(4):
            table[step] = step
            assert mgr.save(step, {n: {"t": table, **empty} for n in ("n0", "n1")})
            states[step] = {"t": table.copy(), **empty}
        assert mgr.all_steps() == [2, 3]
    assert [mgr.metadata(s).kind for s in (2, 3)] == ["delta", "delta"]
    with reader(prefix) as r:
        for step in (2, 3):
            for node in ("n0", "n1"):
                assert_same(r.restore(step)[node], states[step])
    assert cli_main(["ls", prefix, "--json"]) == 0
    assert [e["epoch"] for e in json.loads(capsys.readouterr().out)["epochs"]] == [2, 3]


def test_hints_hold_their_union_not_one_array_per_call(tmp_path):
    """Review D3: the same 20,000 rows hinted at steps the policy skips (and marked as many
    times in a workspace) held one array per call: 0.15 MiB each, 15 MiB over the 100 steps
    here (76 MiB over 500 in the review). Their union is 0.15 MiB."""
    table = np.zeros((40_000, 64), np.float32)
    rows = np.arange(0, 40_000, 2)
    opts = options(delta_detection="hints", save_interval_steps=4000)
    with StepCheckpointManager(str(tmp_path), options=opts, handle_preemption=False) as mgr:
        mgr.save(0, {"n0": {"t": table}})
        ws = caffe2ckpt.Workspace({"t": table})
        tracemalloc.start()
        try:
            for step in range(1, 101):
                mgr.save(step, {"n0": {"t": table}}, changed_rows={"n0": {"t": rows}})
                ws.mark_changed("t", rows)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert held < 2 << 20, held


@pytest.mark.parametrize("seed", range(6))
def test_hint_unions_are_what_numpy_unique_gives(seed):
    """The hints' union (``merge_rows``, ``sorted_unique``) equals ``np.unique`` of everything
    noted: unsorted ids, repeats, empty and single-id calls."""
    rng = np.random.default_rng(seed)
    held: dict[str, np.ndarray] = {}
    noted = []
    for size in rng.choice([0, 1, 2, 50, 3000], 5):
        ids = rng.integers(0, 4000, size).astype(np.int64)
        noted.append(ids)
        merge_rows(held, "t", ids)
        expected = np.unique(np.concatenate(noted))
        assert held["t"].dtype == np.int64 and held["t"].tolist() == expected.tolist()


@pytest.mark.parametrize("depth", [None, 0, 1, 4])
def test_digests_left_for_later_are_the_ones_computed_at_once(depth):
    """A synchronous save leaves what only its record and the next save need (the large blobs'
    xxh3, the row digests of its span, of every row when it is whole) for while its data is
    made durable: settled, they equal the ones computed at once (rows of 64, 12 and 4 bytes:
    blocks of 1, 6 and 16 rows, a shorter last block, spans not on block edges). The span's
    are left only when its part changed since its last whole copy (it is written whatever its
    digests say); else they tell whether to write it."""
    from caffe2ckpt.store.delta.links import Link
    from caffe2ckpt.store.delta.write import Saved, info_of

    tracker = DeltaTracker("n0", StepManagerOptions(delta_saves=True, delta_min_bytes=1024,
                                                   max_delta_chain=4))
    rng = np.random.default_rng(7)
    blobs = {"t": rng.random((1001, 16), np.float32), "narrow": rng.random((2999, 3), np.float32),
             "thin": rng.integers(0, 9, 5001).astype(np.int32), "small": np.arange(5)}
    changed = [Link("g0", "s", {}, {}, whole=True), Link("g1", "s", {}, {},
                                                         touched=frozenset(range(5)))]
    saved = None if depth is None else Saved(
        "s", "g", depth, {n: info_of(b) for n, b in blobs.items()}, {},
        {n: changed for n in blobs}, {})
    if saved is not None:  # clean parts: every digest is needed now
        clean = Saved("s", "g", depth, saved.infos, {}, {n: changed[:1] for n in blobs}, {})
        assert tracker._later(blobs, clean) == {}
    later = tracker._later(blobs, saved)
    assert sorted(later) == ["narrow", "t", "thin"] and all(b > a for a, b in later.values())
    deferred = tracker._measure(blobs, {}, later, defer=True, saved=None)
    now = tracker._measure(blobs, {}, {}, defer=False, saved=None)
    assert sorted(deferred.digests) == ["small"] and deferred.deferred
    deferred.settle()
    assert deferred.digests == now.digests and not deferred.deferred
    for name in ("t", "narrow", "thin"):
        assert deferred.rows[name].tobytes() == now.rows[name].tobytes(), name


@pytest.mark.parametrize("row_floats", [3, 16])
def test_changes_beside_each_span_edge_are_found(tmp_path, row_floats):
    """The span's row digests are left for later, so the rows just outside it (in a block that
    straddles its edge, for narrow rows) must still be compared: at every depth, rows on both
    sides of both edges change, and every step restores bit-exact."""
    rows = 3001
    table = np.zeros((rows, row_floats), np.float32)
    opts = options(max_delta_chain=3)
    with StepCheckpointManager(str(tmp_path), options=opts, handle_preemption=False) as mgr:
        mgr.save(0, {"n0": {"t": table}})
        expected = {0: table.copy()}
        for step in range(1, 9):
            start, stop = span_rows(rows, table.nbytes // rows, 4, step)
            for row in (start - 1, start, stop - 1, stop):
                if 0 <= row < rows:
                    table[row] += step
            mgr.save(step, {"n0": {"t": table}})
            expected[step] = table.copy()
    with reader(str(tmp_path)) as r:
        for step, value in expected.items():
            assert r.restore(step)["n0"]["t"].tobytes() == value.tobytes(), step


def test_a_failure_of_what_a_save_left_for_later_fails_it_before_its_record(tmp_path,
                                                                            monkeypatch):
    """What a save computes while its data is made durable (the large blobs' xxh3 here) is
    waited for before the record: if it fails, the save fails uncommitted, and the next save
    (whole: its base may be gone) restores."""
    from caffe2ckpt.store.delta import plan as delta

    table = np.arange(ROWS * 64, dtype=np.float32).reshape(ROWS, 64)
    original = delta.stored_digest

    def failing(stored):
        if stored.nbytes >= SMALL:
            raise MemoryError("digest failed")
        return original(stored)

    with StepCheckpointManager(str(tmp_path), options=options(),
                               handle_preemption=False) as mgr:
        mgr.save(0, {"n0": {"t": table}})
        table[7] += 1
        monkeypatch.setattr(delta, "stored_digest", failing)
        with pytest.raises(Exception, match="digest failed"):
            mgr.save(1, {"n0": {"t": table}})
        monkeypatch.setattr(delta, "stored_digest", original)
        assert mgr.all_steps() == [0]
        table[9] += 1
        mgr.save(2, {"n0": {"t": table}})
        assert mgr.all_steps() == [0, 2]
    with reader(str(tmp_path)) as r:
        assert np.array_equal(r.restore(2)["n0"]["t"], table)
        assert r._step(2).records["n0"].delta is None  # whole


def test_compare_keeps_row_digests_not_a_copy(tmp_path):
    """Issue 34 item 3: finding changed rows costs at most 5% of the large blobs' memory (8
    bytes per 160 bytes of rows), not a copy of them (on a local disk: memory:// would hold
    the saved bytes in this process)."""
    table = np.zeros((1 << 16, 64), np.float32)  # 16 MiB
    tracemalloc.start()
    try:
        with StepCheckpointManager(str(tmp_path), options=options(),
                                   handle_preemption=False) as mgr:
            before, _ = tracemalloc.get_traced_memory()
            for step in range(3):
                table[step::97] += 1
                mgr.save(step, {"n0": {"t": table}})
            held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held - before <= 0.05 * table.nbytes + (1 << 20), (held - before, table.nbytes)


def test_a_retention_that_fails_after_the_commit_does_not_fail_the_save(memory_fs, caplog):
    """Nothing that runs after a step's records are written may fail its save: a retention
    whose deletes the store refuses is reported, and the step counts as saved."""
    fs = FaultyFileSystem(memory_fs)
    table = np.zeros((ROWS, 64), np.float32)
    with StepCheckpointManager("/retain", filesystem=fs, options=options(max_to_keep=1),
                               handle_preemption=False) as mgr:
        assert mgr.save(0, {"n0": {"t": table}})
        fs.arm("delete", 1, sticky=True)
        table[1] = 1.0
        with caplog.at_level(logging.WARNING, logger="caffe2ckpt"):
            assert mgr.save(1, {"n0": {"t": table}})
        assert mgr.latest_step() == 1
        fs.reset()
    assert "step 1 is committed" in caplog.text
    with StepCheckpointManager("/retain", filesystem=fs, handle_preemption=False) as r:
        assert np.array_equal(r.restore(1)["n0"]["t"], table)


def small_blobs_saved(url: str) -> tuple[list[list[str]], list[int]]:
    """Three steps of 3,000 blobs of 8 bytes, 40 of 1,024 to 1,648 bytes ("mid00".."mid39") and
    a table (steps 1 and 2 differential, step 2 restored bit-exact): per differential step the
    small blobs named as inherited, and each step's manifest size."""
    blobs = {f"tiny{i:04d}": np.full(2, i, np.float32) for i in range(3000)}
    blobs |= {f"mid{i:02d}": np.full(256 + 16 * i, i, np.float32) for i in range(40)}
    blobs["t"] = np.zeros((ROWS, 64), np.float32)
    with StepCheckpointManager(url, options=options(), handle_preemption=False) as mgr:
        for step in range(3):
            blobs["t"][step] = step
            assert mgr.save(step, {"n0": blobs})
        assert [mgr.metadata(s).kind for s in range(3)] == ["full", "delta", "delta"]
        restored = mgr.restore(2)["n0"]
        assert all(restored[n].tobytes() == b.tobytes() for n, b in blobs.items())
    store = open_store(url)
    records = sorted(scan(store).records(), key=lambda r: r.epoch)
    named = [sorted(n for n, entry in store.manifest(r).inherited.items() if entry[0] == "same")
             for r in records[1:]]
    sizes = [len(store.location.read_bytes(store.location.path(r.group, "zarr.json")))
             for r in records]
    return named, sizes


def test_a_delta_names_at_most_a_bounded_set_of_small_blobs(tmp_path, monkeypatch):
    """Review residual 3: a differential save named every unchanged small blob as inherited (its
    chain in the manifest, its digest in the record: about 150 bytes each, where a whole save
    lists it in compact columns), so with 850,000 blobs of 8 bytes a whole save passed and every
    differential save failed (a 71.4 MB manifest, over the 64 MiB readers accept). Now a blob
    under 1 KiB is written whole, and at most ``INHERITED_BYTES`` of metadata names inherited
    small blobs (the smallest past it are written whole): a differential save's manifest is
    never more than that larger than a whole save's."""
    mids = [f"mid{i:02d}" for i in range(40)]
    named, _ = small_blobs_saved(str(tmp_path / "default"))  # 16 MiB: every blob of 1 KiB+
    assert named == [mids, mids]
    monkeypatch.setattr(delta, "INHERITED_BYTES", 4000)  # about 20 of the 40
    named, sizes = small_blobs_saved(str(tmp_path / "budget"))
    for names in named:  # the largest, as many as the budget allows
        assert 0 < len(names) < 40 and names == mids[-len(names):]
    assert max(sizes[1:]) <= sizes[0] + 4000, sizes


@pytest.mark.parametrize("text", ["layer0/bias", 'a"b', "a\\b", "tab\tx", "\x7f", "é", "日本",
                                  "😀", ""])
def test_the_naming_cost_counts_a_name_as_json_writes_it(text):
    """The budget of inherited small blobs is an upper bound only if each name is counted as
    long as the manifest and record write it (escapes and non-ASCII included)."""
    assert delta._json_len(text) == len(json.dumps(text))


@pytest.mark.parametrize("prefix", ["memory", "local"], indirect=True)
def test_overlay_rows_land_after_the_span_rows_under_them_whatever_the_reads_timing(
        prefix, monkeypatch):
    """A restore starts an overlay chunk once the span reads under its rows are done
    (caffe2ckpt/store/read/rounds.py). With small chunks (many per span and overlay) and the span
    reads delayed at random, whole restores and windows (which skip the blob's digest check)
    still return what was saved, overlay chunks do start before the last span read is done,
    and each writes only rows within the rows it was declared to wait for."""
    from caffe2ckpt.store.format import manifest, zarrgroup
    from caffe2ckpt.store.read import chain as chainread
    from caffe2ckpt.store.read import rounds
    from caffe2ckpt.store.read.save import SaveReader

    # chunks of 32 KiB (spans, whole arrays) and 4 KiB (overlays), for writer and reader alike
    monkeypatch.setattr(zarrgroup, "CHUNK_BYTES", 32 << 10)
    monkeypatch.setattr(manifest.chunk_rows, "__defaults__", (32 << 10,))
    for module in (zarrgroup, manifest):
        monkeypatch.setattr(module, "FINE_CHUNK_BYTES", 4 << 10)
    model = Model()
    with StepCheckpointManager(prefix, options=options(max_delta_chain=4),
                               handle_preemption=False) as mgr:
        states = save_steps(mgr, model, 8)
    rng, starts, ends = np.random.default_rng(0), [], []
    first, then, scatter = rounds.Rounds.first, rounds.Rounds.then, chainread._Scatter.__call__

    def delayed(call):
        pause = float(rng.random()) * 0.004

        def run():
            time.sleep(pause)
            call()
            ends.append(time.monotonic())
        return run

    def noted(call):
        def run():
            starts.append(time.monotonic())
            call()
        return run

    def checked(self, at, chunk):  # the rows written lie within the declared ones
        lo, hi = self.rows_of(at, at + chunk.shape[0]) or (0, 0)
        taken = self.rows[np.searchsorted(self.taken, at):np.searchsorted(
            self.taken, at + chunk.shape[0])]
        assert taken.size == 0 or lo <= taken.min() and taken.max() < hi
        scatter(self, at, chunk)
    monkeypatch.setattr(rounds.Rounds, "first", lambda self, reads: first(
        self, ((delayed(call), key, pieces) for call, key, pieces in reads)))
    monkeypatch.setattr(rounds.Rounds, "then", lambda self, reads: then(
        self, ((noted(call), key, rows) for call, key, rows in reads)))
    monkeypatch.setattr(chainread._Scatter, "__call__", checked)
    store, early = open_store(prefix), 0
    for record in scan(store).records():
        for name in ("emb/table", "fortran", "big_endian", "names"):
            want = states[record.epoch][name]
            for start, stop in [(0, ROWS), (1, 1000), (1500, 3333), (ROWS - 7, ROWS)]:
                starts.clear(), ends.clear()
                got = SaveReader(store, {record.node: record}).rows(record.node, name,
                                                                    start, stop)
                assert got.tobytes() == np.ascontiguousarray(want[start:stop]).tobytes(), (
                    record.epoch, name, start, stop)
                early += sum(s < max(ends) for s in starts) if starts and ends else 0
        assert_same(store.load_node(record), states[record.epoch])
    assert early > 0, "no overlay chunk started before the span reads were all done"
