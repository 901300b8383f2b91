"""The command line (and the plain readers) on differential epochs, on prefixes two jobs share,
and ``gc``'s figures and retire notes: the review of e4d82ae (D2, D4, D5, D6) and the CLI
frictions of issue 34 (chains shown compactly, missing epochs named with the committed ones,
stored bytes where sizes are expected)."""

from __future__ import annotations

import json
import re

import fsspec
import numpy as np
import pytest
import zarr

import caffe2ckpt
from caffe2ckpt import StepCheckpointManager, StepManagerOptions
from caffe2ckpt.cli import main
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.scan import scan
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.paths import RETIRED_DIR, parse_group_name
from caffe2ckpt.units import human_bytes
from tests.faultfs import FaultyFileSystem

SMALL = 16 << 10  # delta_min_bytes here: the 64 KiB tables below get row overlays
TINY = 200  # unchanged small blobs of a differential epoch (all inherited, packed in the source)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv, code: int = 0) -> dict:
    got, out, err = run(capsys, *argv, "--json")
    assert got == code, (got, out, err)
    return json.loads(out)


def delta_options(**kw) -> StepManagerOptions:
    return StepManagerOptions(delta_saves=True, delta_min_bytes=SMALL, **kw)


# -- D2: a differential epoch's inherited blobs are read once, not one chain at a time ----------


class CountingMemory(FaultyFileSystem):
    """memory:// behind tests/faultfs.py's counter, under a protocol of its own so that the
    command line opens it by URL (one cached instance: the test reads its counts)."""

    protocol = "countmem"
    cachable = True

    def __init__(self, **kwargs) -> None:
        super().__init__(fsspec.filesystem("memory"), **kwargs)


@pytest.fixture
def counting(memory_fs):
    fsspec.register_implementation("countmem", CountingMemory, clobber=True)
    fs = fsspec.filesystem("countmem")
    fs.reset()
    return fs


def tiny_blobs_then_one_row(url: str, hint: int | None = None) -> None:
    """Epoch 0 whole; epoch 1 changes row 5 of a table: TINY unchanged small blobs (of 1 KiB,
    the smallest a differential save names as inherited), the table (a row overlay on epoch 0)
    and an unchanged 1.5 MiB blob (its own array in epoch 0's group) are read through epoch 0.
    With ``hint``, the rows are hinted: that row."""
    blobs = {f"tiny/{i}": np.full(256, i, np.float32) for i in range(TINY)}
    blobs["table"] = np.zeros((256, 64), np.float32)
    blobs["frozen"] = np.arange(3 << 17, dtype=np.float32)
    opts = delta_options(delta_detection="compare" if hint is None else "hints")
    with StepCheckpointManager(url, options=opts, handle_preemption=False) as mgr:
        mgr.save(0, {"n0": blobs})
        blobs["table"][5] = 1.0
        hints = None if hint is None else {"n0": {"table": [hint]}}
        mgr.save(1, {"n0": blobs}, changed_rows=hints)


def packed_reads(fs: CountingMemory, group: str) -> int:
    """How many times the chunk of ``group``'s packed array was read."""
    return sum(1 for _, path in fs.ops("read") if f"/{group}/_packed/c" in path)


def test_verify_show_and_diff_read_each_source_of_a_delta_epoch_once(counting, capsys):
    """Review D2: 200 unchanged tiny blobs of a differential epoch cost 200 reads of the source's
    packed array (and 200 parses of each manifest) when each blob's chain was resolved alone."""
    url = "countmem://d2/ckpt"
    tiny_blobs_then_one_row(url)
    counting.reset()
    doc = run_json(capsys, "verify", url, "--epoch", 1)
    assert doc["summary"]["ok"] == 1 and doc["summary"]["checked"] == 1
    assert packed_reads(counting, "n0.0") == 1, packed_reads(counting, "n0.0")

    counting.reset()
    doc = run_json(capsys, "show", url, "--epoch", 1, "--verify")
    assert {b["checksum"] for b in doc["blobs"]} == {"ok"} and len(doc["blobs"]) == TINY + 2
    assert packed_reads(counting, "n0.0") == 1

    counting.reset()
    doc = run_json(capsys, "diff", url, 0, 1)
    assert doc["summary"] == {"changed": 1, "added": 0, "removed": 0, "same": TINY + 1}
    assert packed_reads(counting, "n0.0") == 2  # epoch 0's own packed blobs, epoch 1's chains


def flip(fs, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(path, bytes(data))


@pytest.mark.parametrize("damaged", ["_packed", "frozen"])
def test_damage_under_a_delta_epoch_is_named_per_blob(counting, capsys, damaged):
    """Reading the inherited blobs together keeps each blob's verdict: damage in the source's
    packed array hits exactly the blobs packed there, damage in one blob's array that blob."""
    url = "countmem://d2/damage"
    tiny_blobs_then_one_row(url, hint=6 if damaged.startswith("a hint") else None)
    fs = fsspec.filesystem("memory")
    if not damaged.startswith("a hint"):
        flip(fs, min(p for p in fs.find("/d2/damage/n0.0") if f"/{damaged}/c" in p))
    doc = run_json(capsys, "show", url, "--epoch", 1, "--verify", code=1)
    states = {b["name"]: b["checksum"] for b in doc["blobs"]}
    hit = {n for n, s in states.items() if s == "bad"}
    packed = {n for n in states if n != "frozen"}  # epoch 0 packs every blob below 1 MiB
    assert hit == {"_packed": packed, "frozen": {"frozen"}}.get(damaged, {"table"})
    assert set(states.values()) == {"ok", "bad"}
    named = {p["blob"] for p in doc["problems"]}  # the blob, or the first of blobs read together
    if damaged == "_packed":  # one problem: the packed chunk's, named by its first blob
        (together,) = doc["problems"]
        assert together["blob"] == "tiny/0" and sorted(together["blobs"]) == sorted(packed)
    else:
        assert named == hit, doc["problems"]
    assert all("epoch 1" in p["error"] and "n0." in p["error"] for p in doc["problems"])
    code, out, _ = run(capsys, "verify", url, "--epoch", 1)
    assert code == 1 and "DAMAGED" in out


# -- D4: gc counts every group a deletion frees ---------------------------------------------


def group_file_bytes(prefix: str) -> int:
    """The bytes of every file in the prefix's node groups."""
    loc = Location(prefix)
    root = loc.root.rstrip("/")
    return sum(loc.fs.size(p) for p in loc.fs.find(root)
               if parse_group_name(p[len(root) + 1:].split("/", 1)[0]) is not None)


def test_gc_bytes_freed_counts_the_pinned_groups_a_deletion_frees(prefix, capsys):
    """Review D4: epoch 2 (a delta) alone pins epoch 0's whole group (its record went with
    retention); deleting it frees that group (1 MiB), not only its own bytes: its own group
    and epoch 1's stay, pinned by epoch 3."""
    table = np.zeros((4096, 64), np.float32)  # 1 MiB
    opts = delta_options(max_delta_chain=2, max_to_keep=2)
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        for step in range(4):
            table[step::1024] = step  # a row of each of its 3 parts: every part changes
            mgr.save(step, {"n0": {"table": table}})
    before = run_json(capsys, "gc", prefix, "--min-age", 0)
    assert [(p["path"], p["pinned_by"]) for p in before["pinned"]] == [("n0.0", [2]),
                                                                        ("n0.1", [2, 3])]
    assert run_json(capsys, "ls", prefix)["pinned_bytes_stored"] == before["bytes_pinned"]
    whole = next(p["bytes"] for p in before["pinned"] if p["path"] == "n0.0")
    dry = run_json(capsys, "gc", prefix, "--keep-last", 1, "--min-age", 0)
    (gone,) = dry["delete"]
    assert gone["epoch"] == 2 and [p["path"] for p in dry["pinned"]] == ["n0.1", "n0.2"]
    assert gone["frees"] == dry["bytes_freed"] == whole >= 1 << 20
    assert sorted(gone["groups_freed"]) == ["n0.0"]
    files_before = group_file_bytes(prefix)
    real = run_json(capsys, "gc", prefix, "--keep-last", 1, "--min-age", 0, "--yes")
    shrunk = files_before - group_file_bytes(prefix)
    assert real["delete"][0]["done"] is True
    assert real["bytes_freed"] == dry["bytes_freed"]
    assert 0 <= shrunk - real["bytes_freed"] < 8 << 10, (shrunk, real["bytes_freed"])  # metadata


def test_gc_rows_add_up_to_its_totals_in_stored_bytes(prefix, capsys):
    """Issue 34: each deletion's row shows what removing it frees (stored bytes, pinned
    groups included), the same figures the last line adds up; kept rows show stored bytes
    beside the blobs' size."""
    table = np.zeros((4096, 64), np.float32)
    with StepCheckpointManager(prefix, options=delta_options(max_delta_chain=2),
                               handle_preemption=False) as mgr:
        for step in range(6):
            table[step] = step
            mgr.save(step, {"n0": {"table": table}})
    doc = run_json(capsys, "gc", prefix, "--keep-last", 2, "--min-age", 0)
    assert [d["epoch"] for d in doc["delete"]] == [0, 1, 2, 3]
    assert sum(d["frees"] for d in doc["delete"]) == doc["bytes_freed"]
    assert all("bytes_written" in k for k in doc["keep"])
    code, out, _ = run(capsys, "gc", prefix, "--keep-last", 2, "--min-age", 0)
    assert code == 0
    lines = out.splitlines()
    header = next(x for x in lines if x.startswith("EPOCH") and "RESULT" in x)
    assert header.split()[:4] == ["EPOCH", "NODES", "FREES", "STORED"]
    rows = lines[lines.index(header) + 1:lines.index(header) + 5]
    frees = [d["frees"] for d in doc["delete"]]
    assert [r.split()[0] for r in rows] == ["0", "1", "2", "3"]
    assert all(human_bytes(f) in r for f, r in zip(frees, rows))
    assert f"({human_bytes(doc['bytes_freed'])}) would be removed" in lines[-1]


# -- D5: two jobs on one prefix: the node picks the save -------------------------------------


def two_jobs(prefix: str) -> dict[int, np.ndarray]:
    """Job B (solo_0, differential) saves epochs 0-3, then 2 again (forced: a run from 1; its
    first 2 and 3 are superseded); then job A (trainer_0, trainer_1) saves epochs 0-3: the
    newer run, so the prefix's current epochs 0-3 are A's. Returns B's tables by epoch (its
    current 0, 1, 2 and its superseded 3)."""
    table, tables = np.zeros((4096, 64), np.float32), {}  # 1 MiB: a plain Zarr array
    with StepCheckpointManager(prefix, options=delta_options(), nodes=["solo_0"],
                               handle_preemption=False) as mgr:
        for step in range(4):
            table[step] = step + 1
            mgr.save(step, {"solo_0": {"table": table}})
            tables[step] = table.copy()
        table[2] = 99
        assert mgr.save(2, {"solo_0": {"table": table}}, force=True)  # goes back: a new run
        tables[2] = table.copy()
    with StepCheckpointManager(prefix, nodes=["trainer_0", "trainer_1"],
                               handle_preemption=False) as mgr:
        for step in range(4):
            mgr.save(step, {n: {"w": np.full(4, float(step))} for n in ("trainer_0", "trainer_1")})
    return tables


def test_plain_readers_find_the_epoch_of_the_job_holding_the_node(prefix, tmp_path):
    """Review D5: materialize and zarr_store took the newest job's save of an epoch and refused
    the other job's node ("has no node(s) ['solo_0']"), and called a superseded epoch "not
    committed"."""
    tables = two_jobs(prefix)
    for epoch in (2, 3):  # B's current 2 (A's 2 is newer), B's superseded 3
        dest = str(tmp_path / f"plain{epoch}")
        (written,) = caffe2ckpt.materialize(prefix, epoch, dest, nodes=["solo_0"])
        assert written.endswith(f"solo_0.{epoch}")
        group = zarr.open_group(f"{dest}/solo_0.{epoch}", mode="r")
        assert np.array_equal(group["table"][:], tables[epoch]), epoch
        store = caffe2ckpt.zarr_store(prefix, epoch, "solo_0")
        assert np.array_equal(zarr.open_group(store=store, mode="r")["table"][:], tables[epoch])
    written = caffe2ckpt.materialize(prefix, 3, str(tmp_path / "a3"))  # no node: A's (current)
    assert [w.rpartition("/")[2] for w in written] == ["trainer_0.3", "trainer_1.3"]
    with pytest.raises(caffe2ckpt.CheckpointNotFoundError,
                       match=r"epoch 3 under .* has no node\(s\) \['nobody'\]; its saves: "):
        caffe2ckpt.materialize(prefix, 3, str(tmp_path / "x"), nodes=["nobody"])


def test_superseded_epochs_are_materialized_as_ls_lists_them(prefix, tmp_path, capsys):
    """Review D5: an epoch only a superseded save holds was "not committed" for materialize
    while ls lists it; the CLI says which save it wrote."""
    tables = two_jobs(prefix)
    assert 3 in run_json(capsys, "ls", prefix)["superseded_epochs"]
    doc = run_json(capsys, "materialize", prefix, "--epoch", 3, "--node", "solo_0",
                   str(tmp_path / "m"))
    assert doc["superseded"] is True and doc["nodes"] == ["solo_0"] and doc["save_id"]
    group = zarr.open_group(str(tmp_path / "m" / "solo_0.3"), mode="r")
    assert np.array_equal(group["table"][:], tables[3])
    code, out, _ = run(capsys, "materialize", prefix, "--epoch", 2, "--node", "solo_0",
                       tmp_path / "n")
    assert code == 0 and out.splitlines() == [f"wrote {tmp_path / 'n' / 'solo_0.2'}"]
    code, out, _ = run(capsys, "materialize", prefix, "--epoch", 3, "--node", "solo_0",
                       tmp_path / "o")
    assert code == 0 and "superseded save" in out


def test_show_diff_and_verify_select_the_save_by_node(prefix, capsys):
    """Review D5: show --node and diff --node refused a committed epoch of the job that ran
    first; show without --epoch takes the newest epoch of the job holding the node."""
    two_jobs(prefix)
    doc = run_json(capsys, "show", prefix, "--epoch", 2, "--node", "solo_0")
    assert doc["nodes"] == ["solo_0"] and doc["superseded"] is False
    assert doc["kind"] == "full"  # B's second run starts whole
    doc = run_json(capsys, "show", prefix, "--epoch", 3, "--node", "solo_0", "--verify")
    assert doc["nodes"] == ["solo_0"] and doc["superseded"] is True and doc["kind"] == "delta"
    assert run_json(capsys, "show", prefix, "--node", "solo_0")["epoch"] == 2
    assert run_json(capsys, "show", prefix, "--epoch", 2)["nodes"] == ["trainer_0", "trainer_1"]
    doc = run_json(capsys, "diff", prefix, 1, 2, "--node", "solo_0")
    assert doc["nodes"] == ["solo_0"] and doc["summary"]["changed"] == 1
    doc = run_json(capsys, "diff", prefix, 1, 3, "--node", "solo_0")  # to a superseded save
    assert doc["summary"]["changed"] == 1
    doc = run_json(capsys, "verify", prefix, "--epoch", 3, "--node", "solo_0")
    assert [(r["epoch"], r["node"]) for r in doc["results"]] == [(3, "solo_0")]
    code, _, err = run(capsys, "show", prefix, "--epoch", 2, "--node", "solo_0", "--node",
                       "trainer_0")
    assert code == 3 and "epoch 2 under" in err
    assert ("has no node(s) ['solo_0', 'trainer_0'] in one save; its saves: trainer_0, "
            "trainer_1; solo_0") in err


@pytest.mark.parametrize("smaller_first", [True, False])
def test_the_exact_node_set_reaches_a_smaller_job_with_overlapping_node_names(
        prefix, tmp_path, capsys, smaller_first):
    """Two jobs saved epoch 4: four nodes t0-t3 and two nodes t0, t1, in either order.
    --node t0 --node t1 means the two-node job's save, whichever job ran last; the four-node
    job's is reached through a node only it has, or all four."""
    four, two = ["t0", "t1", "t2", "t3"], ["t0", "t1"]
    jobs = [(two, 2.0), (four, 4.0)]
    for nodes, value in jobs if smaller_first else jobs[::-1]:
        with StepCheckpointManager(prefix, nodes=nodes, handle_preemption=False) as mgr:
            mgr.save(4, {n: {"w": np.full(3, value)} for n in nodes})
    for wanted, value in ((two, 2.0), (["t0", "t2"], 4.0), (four, 4.0)):
        argv = [a for n in wanted for a in ("--node", n)]
        doc = run_json(capsys, "show", prefix, "--epoch", 4, *argv)
        assert doc["nodes"] == wanted, (wanted, doc["nodes"])
        dest = tmp_path / "-".join(wanted)
        written = caffe2ckpt.materialize(prefix, 4, str(dest), nodes=wanted)
        assert len(written) == len(wanted)
        group = zarr.open_group(f"{dest}/t0.4", mode="r")
        assert group["w"][:].tolist() == [value] * 3, wanted


def test_a_lineage_save_goes_before_a_superseded_save_of_exactly_the_nodes(prefix, capsys):
    """t0, t1 save epochs 0-4, then go back to 3 (their epoch 4 is superseded); then t0-t3
    save epoch 4. --node t0 --node t1 --epoch 4 means the four-node job's current save, not
    the two-node job's abandoned one (which it no longer lists)."""
    two, four = ["t0", "t1"], ["t0", "t1", "t2", "t3"]
    with StepCheckpointManager(prefix, nodes=two, handle_preemption=False) as mgr:
        for step in range(5):
            mgr.save(step, {n: {"w": np.full(3, 2.0)} for n in two})
        mgr.save(3, {n: {"w": np.full(3, 2.0)} for n in two}, force=True)
        assert mgr.all_steps() == [0, 1, 2, 3]
    with StepCheckpointManager(prefix, nodes=four, handle_preemption=False) as mgr:
        mgr.save(4, {n: {"w": np.full(3, 4.0)} for n in four})
    doc = run_json(capsys, "show", prefix, "--epoch", 4, "--node", "t0", "--node", "t1")
    assert doc["nodes"] == two and doc["superseded"] is False
    assert scan(CheckpointStore(Location(prefix))).save_at(4, two).nodes == frozenset(four)


# -- D6: a failed record delete leaves no retire note; gc reports and removes stale ones ----------


def faulty_manager(prefix: str) -> tuple[FaultyFileSystem, StepCheckpointManager]:
    fs, root = fsspec.core.url_to_fs(prefix, auto_mkdir=True)
    faulty = FaultyFileSystem(fs)
    mgr = StepCheckpointManager(root, filesystem=faulty, handle_preemption=False)
    for step in range(3):
        mgr.save(step, {"n0": {"w": np.full(4, float(step))}})
    return faulty, mgr


def notes(prefix: str) -> list[str]:
    loc = Location(prefix)
    return loc.list_names(loc.path(RETIRED_DIR))


def is_record_delete(method: str, path: str) -> bool:
    return "/_commits/" in path


def test_a_failed_record_delete_takes_its_retire_note_back(prefix):
    """Review D6: the note was written, the record's DELETE failed, and the note stayed for
    good (gc skips every note whose record exists)."""
    faulty, mgr = faulty_manager(prefix)
    faulty.arm("delete", 1, match=is_record_delete)
    with mgr, pytest.raises(OSError, match="injected"):
        mgr.delete(1)
    assert faulty.failed and mgr.all_steps(read=True) == [0, 1, 2]
    assert notes(prefix) == []
    with StepCheckpointManager(prefix, handle_preemption=False) as again:
        assert float(again.restore(1)["n0"]["w"][0]) == 1.0
        again.delete(1)  # and the removal can be done later
        assert again.all_steps(read=True) == [0, 2]
    assert notes(prefix) == []


def test_gc_reports_and_removes_a_retire_note_whose_record_stands(prefix, capsys):
    """A note that could not be taken back either (every delete failing) is reported by gc as
    a stale retire note, removed with --yes, and the save it names stays committed."""
    faulty, mgr = faulty_manager(prefix)
    faulty.arm("delete", 1, sticky=True)
    with mgr, pytest.raises(OSError, match="injected"):
        mgr.delete(1)
    faulty.reset()
    (note,) = notes(prefix)
    assert run_json(capsys, "gc", prefix)["leftovers"] == []  # younger than --min-age
    doc = run_json(capsys, "gc", prefix, "--min-age", 0)
    (item,) = doc["leftovers"]
    assert item["kind"] == "stale retire note" and item["path"] == f"{RETIRED_DIR}/{note}"
    code, out, _ = run(capsys, "gc", prefix, "--min-age", 0)
    assert code == 0 and "stale retire note" in out
    doc = run_json(capsys, "gc", prefix, "--min-age", 0, "--yes")
    assert doc["leftovers"][0]["done"] is True
    assert notes(prefix) == []
    store = CheckpointStore(Location(prefix))
    assert sorted(s.epoch for s in scan(store).saves()) == [0, 1, 2]
    assert run_json(capsys, "verify", prefix)["summary"]["ok"] == 3


# -- issue 34: chains shown compactly, missing epochs named, sizes as stored --------------------


def chained(prefix: str, steps: int = 4) -> None:
    table = np.zeros((1024, 64), np.float32)
    with StepCheckpointManager(prefix, options=delta_options(), handle_preemption=False) as mgr:
        for step in range(steps):
            table[step] = step + 1
            mgr.save(step, {"n0": {"table": table, "frozen": np.ones((32, 64), np.float32)}})


def test_show_tells_chains_by_epoch_and_keeps_paths_for_json(prefix, capsys):
    chained(prefix)
    code, out, _ = run(capsys, "show", prefix, "--epoch", 3)
    assert code == 0
    table = next(x for x in out.splitlines() if x.split()[:2] == ["n0", "table"])
    frozen = next(x for x in out.splitlines() if x.split()[:2] == ["n0", "frozen"])
    assert "rows on epochs 0-2 (3 groups)" in table
    assert "same, from epoch 0" in frozen
    assert "n0.0" not in out and len(table) < 120 and len(frozen) < 120
    blobs = {b["name"]: b for b in run_json(capsys, "show", prefix, "--epoch", 3)["blobs"]}
    assert [g.rpartition("/")[2] for g in blobs["table"]["from"]] == ["n0.0", "n0.1", "n0.2"]
    assert blobs["table"]["from_epochs"] == [0, 1, 2]


@pytest.mark.parametrize("argv", [["show", "--epoch", 99], ["verify", "--epoch", 99],
                                  ["diff", 0, 99], ["materialize", "--epoch", 99, "DEST"]])
def test_a_missing_epoch_lists_the_committed_ones(prefix, tmp_path, capsys, argv):
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        for step in (*range(0, 60, 2), 61):  # 31 epochs
            mgr.save(step, {"n0": {"w": np.zeros(2)}})
    argv = [str(tmp_path / "d") if a == "DEST" else a for a in argv]
    code, out, err = run(capsys, argv[0], prefix, *argv[1:])
    assert code == 3 and out == ""
    assert f"epoch 99 is not committed under {prefix!r}" in err
    assert "31 committed epochs" in err and "52, 54, 56, 58, 61" in err and "0, 2" not in err
    assert err.count("\n") == 1 and len(err) < 300


def test_ls_totals_are_stored_bytes_with_superseded_saves_apart(prefix, capsys):
    """Issue 34: "1.1 GiB committed" while 391 MB were on disk (logical sizes of differential
    epochs) and the total counted superseded saves."""
    two_jobs(prefix)
    doc = run_json(capsys, "ls", prefix)
    rows = doc["epochs"]
    current = [r for r in rows if r["state"] == "committed"]
    superseded = [r for r in rows if r["state"] == "superseded"]
    assert doc["bytes_stored"] == sum(r["bytes_written"] for r in current)
    assert doc["superseded_bytes_stored"] == sum(r["bytes_written"] for r in superseded) > 0
    assert doc["bytes"] == sum(r["bytes"] for r in current) > doc["bytes_stored"]
    _, out, _ = run(capsys, "ls", prefix)
    first = out.splitlines()[0]
    assert re.search(rf"{re.escape(human_bytes(doc['bytes_stored']))} stored \(blobs "
                     rf"{re.escape(human_bytes(doc['bytes']))}\)", first), first
    assert f"2 superseded saves, {human_bytes(doc['superseded_bytes_stored'])}" in first
    header = next(line for line in out.splitlines() if line.startswith("EPOCH"))
    assert header.split()[:4] == ["EPOCH", "NODES", "STORED", "SIZE"]
