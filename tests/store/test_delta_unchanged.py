"""Issue 56: what did not change costs nothing. A large blob, or a part of one, with no change
since the save that holds it is written by no later save (its record names where it is); a
small unchanged blob is named, however old its copy; an unchanged workspace writes its metadata
only; a save never needs more than ``MAX_GROUPS`` older groups; and a large blob written whole
although deltas are on says why (record, log, ``ls``, ``show``)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from caffe2ckpt import StepCheckpointManager, StepManagerOptions
from caffe2ckpt.cli import main as cli_main
from caffe2ckpt.history.scan import scan
from caffe2ckpt.store.delta.links import part_edges
from caffe2ckpt.store.format.chains import MAX_GROUPS
from tests.stores import open_store

ROWS = 4096
PARTS = 4  # max_delta_chain=3


def records(prefix: str) -> dict:
    return {r.epoch: r for r in scan(open_store(prefix)).records()}


def chain_epochs(record, blob: str) -> list[int]:
    groups = record.delta.groups
    return [groups[i].epoch for i in record.delta.chains[blob]]


def metadata_bytes(prefix: str, record) -> int:
    """The bytes of the group's files besides data chunks, and of the record."""
    location = open_store(prefix).location
    fs, root = location.fs, location.path(record.group)
    files = [f for f in fs.find(root) if f.endswith("zarr.json")]
    return sum(fs.size(f) for f in files) + len(json.dumps(record.to_dict()))


def test_frozen_blobs_and_parts_are_written_by_no_later_save(prefix):
    """A table whose first half changes each save (5% of its rows), a large blob that never
    changes and a small one: the frozen blob and the table's frozen parts stay in the run's
    first group; every save writes the changing parts only; once nothing changes, every dirty
    part is rewritten once (its turn) and then a save writes no data at all, its metadata under
    64 KiB. Every step restores bit-exact."""
    rng = np.random.default_rng(3)
    table = rng.random((ROWS, 64), dtype=np.float32)  # 1 MiB
    frozen = rng.random((ROWS, 32), dtype=np.float32)
    small = rng.random(512)  # 4 KiB
    opts = StepManagerOptions(delta_saves=True, delta_min_bytes=64 << 10, max_delta_chain=3)
    edges = part_edges(ROWS, 256, PARTS)
    states = {}
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        for step in range(20):
            if 0 < step < 12:
                rows = rng.choice(edges[2], ROWS // 20, replace=False)  # parts 0 and 1
                table[rows] = step
            mgr.save(step, {"n0": {"table": table, "frozen": frozen, "small": small}})
            states[step] = table.copy()
        saved = records(prefix)
        for step, record in saved.items():
            if step == 0:
                assert record.delta is None
                continue
            assert chain_epochs(record, "frozen") == chain_epochs(record, "small") == [0]
            table_chain = chain_epochs(record, "table")
            assert table_chain[0] == 0 and len(table_chain) <= PARTS, (step, table_chain)
            changed_parts = (edges[2] if step < 12 else edges[-1]) * 256  # at most
            assert record.bytes_written <= changed_parts // 2 + ROWS * 256 // 20 * 2, step
        assert [saved[s].bytes_written for s in range(16, 20)] == [0] * 4
        assert max(metadata_bytes(prefix, saved[s]) for s in range(16, 20)) < 64 << 10
        for step in range(20):
            got = mgr.restore(step)["n0"]
            assert np.array_equal(got["table"], states[step]), step
            assert np.array_equal(got["frozen"], frozen) and np.array_equal(got["small"], small)


def test_a_save_never_needs_more_than_max_groups_older_groups(prefix):
    """70 small blobs, each changing once at its own step, and a large blob that never changes:
    what did not change stays where it was written until a save would need more than
    MAX_GROUPS older groups; then the blobs in the oldest are written again (the large one says
    why). Every record stays within the bound and every step restores bit-exact."""
    count = 70
    blobs = {f"s{i}": np.full(256, i, np.float64) for i in range(count)}
    blobs["frozen"] = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)
    opts = StepManagerOptions(delta_saves=True, delta_min_bytes=32 << 10, max_delta_chain=2,
                              max_to_keep=None)
    states = {}
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        for step in range(count + 1):
            if step:
                blobs[f"s{step - 1}"] = blobs[f"s{step - 1}"] + 1000
            mgr.save(step, {"n0": blobs})
            states[step] = dict(blobs)
        saved = records(prefix)
        assert all(len(r.delta.groups) <= MAX_GROUPS for r in saved.values() if r.delta)
        assert max(len(r.delta.groups) for r in saved.values() if r.delta) == MAX_GROUPS
        rewritten = sorted(s for s, r in saved.items() if "frozen" in r.whole)
        assert rewritten[0] == 0 and len(rewritten) == 2, rewritten
        assert saved[rewritten[1]].whole["frozen"] == (
            f"its save would need more than {MAX_GROUPS} older groups")
        for step in (MAX_GROUPS, MAX_GROUPS + 1, count):
            got = mgr.restore(step)["n0"]
            assert all(np.array_equal(got[n], a) for n, a in states[step].items()), step


def test_a_large_blob_written_whole_says_why(prefix, caplog, capsys):
    """First save of a run, a changed shape, overlays past max_delta_fraction: each in the
    record, once in an INFO line, in ``ls`` (STORED) and ``show`` (text and JSON)."""
    table = np.zeros((ROWS, 64), np.float32)
    opts = StepManagerOptions(delta_saves=True, delta_min_bytes=64 << 10,
                              max_delta_fraction=0.1)
    with (caplog.at_level(logging.INFO, logger="caffe2ckpt.store.delta.plan"),
          StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr):
        mgr.save(0, {"n0": {"t": table}})
        table[::50] = 1  # 2% of rows
        mgr.save(1, {"n0": {"t": table}})
        table[::5] = 2  # 20% of rows: past the overlay cap
        mgr.save(2, {"n0": {"t": table}})
        mgr.save(3, {"n0": {"t": np.zeros((ROWS + 1, 64), np.float32)}})
    saved = records(prefix)
    assert saved[0].whole == {"t": "first save of its run"}
    assert saved[1].whole == {} and saved[1].delta is not None
    assert saved[2].whole == {"t": "its row overlays would pass max_delta_fraction=0.1 of its "
                                   "bytes"}
    assert saved[3].whole == {"t": "dtype, shape or order changed"}
    lines = [r.getMessage() for r in caplog.records if "written whole" in r.getMessage()]
    assert len(lines) == 3 and "node 'n0', epoch 2" in lines[1] and "max_delta_fraction" in lines[1]
    assert cli_main(["ls", prefix]) == 0
    listing = capsys.readouterr().out
    assert "whole" in listing.splitlines()[3] and "delta" in listing.splitlines()[4]
    assert cli_main(["show", prefix, "--epoch", "2"]) == 0
    assert ("written whole although delta_saves is on: node n0, blob 't': its row overlays "
            "would pass max_delta_fraction=0.1") in capsys.readouterr().out
    assert cli_main(["show", prefix, "--epoch", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["written_whole"] == {
        "n0": {"t": "dtype, shape or order changed"}}


@pytest.mark.parametrize("detection", ["compare", "hints"])
def test_a_part_that_changes_again_after_being_frozen_is_found(prefix, detection):
    """A part left clean for many saves (its copy in the first group), then changed at the very
    row where its turn starts and at its last row: found and written, in both modes."""
    table = np.zeros((ROWS, 16), np.float32)
    edges = part_edges(ROWS, 64, PARTS)
    opts = StepManagerOptions(delta_saves=True, delta_min_bytes=64 << 10, max_delta_chain=3,
                              delta_detection=detection)
    states = {}
    with StepCheckpointManager(prefix, options=opts, handle_preemption=False) as mgr:
        for step in range(14):
            rows = np.array([edges[step % PARTS], edges[step % PARTS + 1] - 1]) if step > 8 \
                else np.array([], np.int64)
            table[rows] = step
            hints = {"n0": {"t": rows}} if detection == "hints" else None
            mgr.save(step, {"n0": {"t": table}}, changed_rows=hints)
            states[step] = table.copy()
        for step in range(14):
            assert np.array_equal(mgr.restore(step)["n0"]["t"], states[step]), step


class _Tracked:
    """A tracker saving node n0 to a store directly, as a manager does."""

    def __init__(self, tmp_path, **options) -> None:
        from caffe2ckpt.store.commit import runs
        from caffe2ckpt.store.delta.plan import DeltaTracker

        self.store = open_store(str(tmp_path))
        self.generation = runs.claim(self.store.location, nodes=["n0"],
                                     parent=None).generation
        self.tracker = DeltaTracker("n0", StepManagerOptions(delta_saves=True,
                                                             delta_min_bytes=1024, **options))

    def plan(self, base, blobs, defer=False):
        from caffe2ckpt.store.commit.protocol import SaveInfo
        from caffe2ckpt.store.format.paths import new_save_id

        return SaveInfo(save_id=new_save_id(self.generation), nodes=["n0"]), self.tracker.plan(
            base, blobs, self.store.has_record, defer=defer)

    def commit(self, epoch, info, planned):
        record = self.store.save_node("n0", epoch, planned.whole, info, planned)
        self.tracker.committed(planned)
        return record


def test_a_plan_that_overwrote_the_base_digests_leaves_no_base_until_it_commits(tmp_path):
    """Row digests are compared with the base's and written over them (one copy): a second plan
    on the same base while the first is in flight must not build on digests that now describe
    the first's save. It is whole; once it fails and the first commits, the next save finds the
    row the second plan had changed (review of issue 56, M1)."""
    node = _Tracked(tmp_path, max_delta_chain=3)
    table = np.random.default_rng(0).random((ROWS, 16), dtype=np.float32)
    info0, first = node.plan(None, {"t": table})
    node.commit(0, info0, first)
    table[10] += 1
    info1, in_flight = node.plan(info0.save_id, {"t": table})
    table[2000] += 1
    _, second = node.plan(info0.save_id, {"t": table})  # the same base, epoch 1 in flight
    assert second.layout is None and second.why["t"].startswith("no earlier save")
    node.tracker.failed(second)
    node.commit(1, info1, in_flight)
    info3, third = node.plan(info1.save_id, {"t": table})
    assert third.layout.overlays["t"][0].tolist() == [2000]
    record = node.commit(3, info3, third)
    assert np.array_equal(node.store.load_node(record)["t"], table)


def test_a_span_inside_one_block_leaves_no_digest_for_later():
    """A span narrower than a block of rows has no block wholly inside it: every block is
    digested (and compared) at once, each once, never twice (review of issue 56, M2)."""
    from caffe2ckpt.store.delta.plan import _span_blocks

    table = np.zeros((100, 1), np.uint8)  # 1-byte rows: blocks of 64 rows, parts of 10
    assert _span_blocks(table, 10, 1, 64, 2) == (0, 0)
    assert _span_blocks(np.zeros((1000, 1), np.uint8), 2, 1, 64, 16) == (8, 16)
