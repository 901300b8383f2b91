"""``caffe2ckpt diff`` between epochs saved with a layout: the global arrays are compared (each
``rows`` blob as the whole table, each replicated blob once, local blobs per node), so a resize
(4 nodes -> 3) that restored bit-exactly reads as identical, and a changed value is reported at
its global row. Without a layout on both sides the comparison stays per node, and says why."""

from __future__ import annotations


import numpy as np
import pytest

import caffe2ckpt.cli.diff as diff_module
from caffe2ckpt import Layout, StepCheckpointManager, StepManagerOptions
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import blob_path
from caffe2ckpt.sharding import new_rows
from tests.cli.test_deltas_families_gc import run, run_json

OLD = ["t0", "t1", "t2", "t3"]
NEW = ["u0", "u1", "u2"]
ROWS, COLS = 1000, 8
GLOBAL = "global arrays (layouts)"




def table() -> np.ndarray:
    return np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) / 7


def weights() -> np.ndarray:
    return np.linspace(-1, 1, 16).reshape(4, 4)


def shards(data: np.ndarray, nodes: list[str], partition: str) -> list[np.ndarray]:
    """Each node's rows of ``data`` as a job of ``nodes`` holds them under ``partition``."""
    out = []
    for k in range(len(nodes)):
        rows = new_rows(partition, k, len(nodes), len(data))
        out.append(data[rows.start:rows.stop:rows.step].copy())
    return out


def manager(url: str, nodes: list[str], layout: Layout | None, **kw) -> StepCheckpointManager:
    return StepCheckpointManager(url, nodes=nodes, layout=layout, handle_preemption=False,
                                 pack_threshold=1024, **kw)


def save_old(url: str, partition: str, step: int = 1) -> None:
    """Step ``step`` of the table (rows) and the weights (replicated) on the 4 old nodes."""
    layout = Layout(rows=["emb"], replicated=["w"], partition=partition)
    with manager(url, OLD, layout) as mgr:
        mgr.save(step, {node: {"emb": rows, "w": weights()}
                        for node, rows in zip(OLD, shards(table(), OLD, partition))})


def resize(url: str, partition: str, change=None) -> dict[str, dict[str, np.ndarray]]:
    """Restore step 1 on the 3 new nodes, ``change(restored)``, save it as step 2."""
    layout = Layout(rows=["emb"], replicated=["w"], partition=partition)
    with manager(url, NEW, layout) as mgr:
        restored = mgr.restore()
        assert [len(restored[n]["emb"]) for n in NEW] == [
            len(new_rows(partition, k, 3, ROWS)) for k in range(3)]
        if change is not None:
            change(restored)
        mgr.save(2, restored)
    return restored


def by_key(doc: dict) -> dict:
    return {(x["node"], x["name"]): x for x in doc["blobs"]}


@pytest.mark.parametrize("partition", ["range", "mod"])
def test_a_bit_exact_resize_diffs_identical_as_global_arrays(prefix, capsys, partition):
    save_old(prefix, partition)
    resize(prefix, partition)

    doc = run_json(capsys, "diff", prefix, 1, 2)
    assert doc["compared"] == GLOBAL
    assert "both saves have a layout" in doc["compared_why"]
    assert [lay["order"] for lay in doc["layouts"]] == [OLD, NEW]
    assert {lay["partition"] for lay in doc["layouts"]} == {partition}
    assert doc["summary"] == {"changed": 0, "added": 0, "removed": 0, "same": 2}
    assert (doc["nodes_added"], doc["nodes_removed"]) == (NEW, OLD)
    got = by_key(doc)
    assert set(got) == {(None, "emb"), (None, "w")}
    emb, w = got[None, "emb"], got[None, "w"]
    assert (emb["kind"], w["kind"]) == ("rows", "replicated")
    assert emb["a"] == emb["b"] == {"dtype": "<f4", "shape": [ROWS, COLS], "bytes": ROWS * COLS * 4,
                                    "kind": "rows"}
    assert (emb["elements"], emb["differing"], emb["rows_differing"]) == (ROWS * COLS, 0, 0)
    assert (w["a"]["shape"], w["differing"], w["rows_differing"]) == ([4, 4], 0, None)

    code, out, err = run(capsys, "diff", prefix, 1, 2, "--all")
    assert code == 0, err
    assert "0 changed, 0 added, 0 removed, 2 same" in out
    assert "compared as global arrays: both saves have a layout" in out
    assert f"epoch 1: {partition} over 4 nodes" in out and f"epoch 2: {partition} over 3 nodes" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["(global)", "emb", "rows", "same", "<f4", f"({ROWS},", f"{COLS}),", "identical"] in lines
    assert ["(global)", "w", "replicated", "same", "<f8", "(4,", "4),", "identical"] in lines
    assert not [line for line in lines if line and line[0] in OLD + NEW]  # no node's shard


@pytest.mark.parametrize("partition", ["range", "mod"])
def test_a_changed_value_is_reported_at_its_global_row(prefix, capsys, partition):
    save_old(prefix, partition)

    def change(restored):
        restored["u1"]["emb"][5, 3] += 1.5
        restored["u2"]["emb"][-1, 0] -= 0.25
        for node in NEW:  # replicated: every node holds the same value
            restored[node]["w"][1, 2] += 0.125

    resize(prefix, partition, change)
    first, second = new_rows(partition, 1, 3, ROWS)[5], new_rows(partition, 2, 3, ROWS)[-1]
    changed = sorted([first, second])
    before = table()
    after = before.copy()
    after[first, 3] += 1.5
    after[second, 0] -= 0.25
    want_max = float(np.abs(after.astype(np.float64) - before).max())

    doc = run_json(capsys, "diff", prefix, 1, 2)
    assert doc["compared"] == GLOBAL
    assert doc["summary"] == {"changed": 2, "added": 0, "removed": 0, "same": 0}
    emb, w = by_key(doc)[None, "emb"], by_key(doc)[None, "w"]
    assert (emb["status"], emb["differing"], emb["elements"]) == ("changed", 2, ROWS * COLS)
    assert emb["max_abs_diff"] == want_max
    assert (emb["rows_differing"], emb["rows_differing_first"]) == (2, changed)
    assert (w["status"], w["differing"], w["elements"]) == ("changed", 1, 16)
    assert w["max_abs_diff"] == 0.125

    code, out, _ = run(capsys, "diff", prefix, 1, 2)
    assert code == 0
    assert "2 changed, 0 added, 0 removed, 0 same" in out
    assert (f"2/{ROWS * COLS} elements differ in 2/{ROWS} rows "
            f"(rows {changed[0]}, {changed[1]}), max |b-a| {want_max:.6g}") in out
    assert "1/16 elements differ, max |b-a| 0.125" in out


def test_kind_changes_local_blobs_and_the_same_nodes(prefix, capsys):
    """A blob rows in one save and replicated in the other is compared by its global values;
    local blobs stay per node (removed with the old nodes, added with the new, compared on a
    node both saves hold); a save of the same nodes compares globally too."""
    rows_b = Layout(rows=["emb", "b"], replicated=["w"])
    with manager(prefix, OLD, rows_b) as mgr:
        mgr.save(1, {node: {"emb": rows, "w": weights(), "b": bias, "opt": np.full(3, k)}
                     for k, (node, rows, bias) in enumerate(zip(
                         OLD, shards(table(), OLD, "range"), np.split(np.arange(8.0), 4)))})
        mgr.save(2, {node: {"emb": rows, "w": weights(), "b": bias,
                            "opt": np.full(3, k + (node == "t2"))}
                     for k, (node, rows, bias) in enumerate(zip(
                         OLD, shards(table(), OLD, "range"), np.split(np.arange(8.0), 4)))})
    replicated_b = Layout(rows=["emb"], replicated=["w", "b"])
    with manager(prefix, NEW, replicated_b) as mgr:
        mgr.save(3, {node: {"emb": rows, "w": weights(), "b": np.arange(8.0), "opt": np.zeros(3)}
                     for node, rows in zip(NEW, shards(table(), NEW, "range"))})

    doc = run_json(capsys, "diff", prefix, 1, 3)
    assert doc["compared"] == GLOBAL
    got = by_key(doc)
    assert {k: (v["kind"], v["status"]) for k, v in got.items()} == {
        (None, "emb"): ("rows", "same"), (None, "w"): ("replicated", "same"),
        (None, "b"): ("rows -> replicated", "same"),
        **{(n, "opt"): ("local", "removed") for n in OLD},
        **{(n, "opt"): ("local", "added") for n in NEW}}
    assert (got[None, "b"]["a"]["kind"], got[None, "b"]["b"]["kind"]) == ("rows", "replicated")
    text = run(capsys, "diff", prefix, 1, 3, "--all")[1]
    assert [line.split()[:4] for line in text.splitlines()
            if " b " in line] == [["(global)", "b", "rows", "->"]]

    same = run_json(capsys, "diff", prefix, 1, 2)  # the same 4 nodes and layout
    assert same["compared"] == GLOBAL
    assert {k: v["status"] for k, v in by_key(same).items()} == {
        (None, "emb"): "same", (None, "w"): "same", (None, "b"): "same",
        ("t0", "opt"): "same", ("t1", "opt"): "same", ("t2", "opt"): "changed",
        ("t3", "opt"): "same"}
    assert by_key(same)["t2", "opt"]["max_abs_diff"] == 1


def test_the_same_nodes_in_another_order_compare_row_for_row(prefix, capsys):
    """Each node's shard changes when the node order does: per node, every shard would differ;
    the global table is the same, and one changed row is found at its global index."""
    save_old(prefix, "range")
    data = table()
    data[600, 1] = -1
    with manager(prefix, OLD[::-1], Layout(rows=["emb"], replicated=["w"])) as mgr:
        mgr.save(2, {node: {"emb": rows, "w": weights()}
                     for node, rows in zip(OLD[::-1], shards(data, OLD, "range"))})
    doc = run_json(capsys, "diff", prefix, 1, 2)
    assert doc["compared"] == GLOBAL
    assert [lay["order"] for lay in doc["layouts"]] == [OLD, OLD[::-1]]
    emb = by_key(doc)[None, "emb"]
    assert (emb["differing"], emb["rows_differing_first"]) == (1, [600])
    assert by_key(doc)[None, "w"]["status"] == "same"


def test_a_differential_epoch_is_compared_globally(prefix, capsys):
    options = StepManagerOptions(delta_saves=True, delta_min_bytes=1)
    layout = Layout(rows=["emb"], replicated=["w"], partition="mod")
    data = table()
    with manager(prefix, OLD, layout, options=options) as mgr:
        for step in (1, 2):
            data[17, 2] += step - 1
            mgr.save(step, {node: {"emb": rows, "w": weights()}
                            for node, rows in zip(OLD, shards(data, OLD, "mod"))})
    doc = run_json(capsys, "diff", prefix, 1, 2)
    emb = by_key(doc)[None, "emb"]
    assert (doc["compared"], emb["differing"], emb["rows_differing_first"]) == (GLOBAL, 1, [17])


def test_a_large_table_is_read_alone_and_small_blobs_together(prefix, capsys, monkeypatch):
    """Memory stays at one large global array per side: each is read by a read_shares call of
    its own; the small blobs (30 biases here) share one call per side."""
    layout = Layout(rows=["emb"], replicated=["w", "bias*"])
    big = np.arange(40000 * 8, dtype=np.float32).reshape(40000, 8)  # 1.25 MiB
    with manager(prefix, OLD[:2], layout) as mgr:
        for step in (1, 2):
            big[123, 4] += step
            mgr.save(step, {node: {"emb": rows, "w": weights(),
                                   **{f"bias{i}": np.full(3, float(i)) for i in range(30)}}
                            for node, rows in zip(OLD[:2], shards(big, OLD[:2], "range"))})
    calls = []
    real = diff_module.read_shares

    def counting(store, records, order, partition, **kw):
        calls.append(sorted(kw["names"]))
        return real(store, records, order, partition, **kw)

    monkeypatch.setattr(diff_module, "read_shares", counting)
    doc = run_json(capsys, "diff", prefix, 1, 2)
    small = sorted(["w", *(f"bias{i}" for i in range(30))])
    assert sorted(calls) == sorted([["emb"], ["emb"], small, small])
    assert doc["summary"] == {"changed": 1, "added": 0, "removed": 0, "same": 31}
    assert by_key(doc)[None, "emb"]["rows_differing_first"] == [123]


def test_per_node_when_a_save_has_no_layout_or_with_node(prefix, capsys):
    save_old(prefix, "range")
    with manager(prefix, OLD, None) as mgr:
        mgr.save(2, {node: {"emb": rows, "w": weights()}
                     for node, rows in zip(OLD, shards(table(), OLD, "range"))})

    doc = run_json(capsys, "diff", prefix, 1, 2)
    assert doc["compared"] == "per node"
    assert "epoch 2" in doc["compared_why"] and "no layout" in doc["compared_why"]
    assert doc["layouts"][0]["order"] == OLD and doc["layouts"][1] is None
    got = by_key(doc)
    assert got["t1", "emb"]["status"] == "same" and got["t1", "emb"]["a"]["shape"] == [250, 8]
    assert got["t0", "w"]["status"] == "same"
    # epoch 1 wrote w once (t0); epoch 2, without a layout, on every node
    assert got["t1", "w"]["status"] == "added" and got["t1", "w"]["kind"] is None
    code, out, _ = run(capsys, "diff", prefix, 1, 2)
    assert code == 0 and "compared per node: epoch 2's save has no layout" in out

    resize_url = prefix + "-resized"
    save_old(resize_url, "range")
    resize(resize_url, "range")
    doc = run_json(capsys, "diff", resize_url, 1, 2, "--node", "t0", "--node", "u0")
    assert doc["compared"] == "per node" and "--node" in doc["compared_why"]
    assert (doc["nodes_added"], doc["nodes_removed"]) == (["u0"], ["t0"])  # of those nodes
    assert {(x["node"], x["name"], x["status"]) for x in doc["blobs"]} == {
        ("t0", "emb", "removed"), ("t0", "w", "removed"), ("u0", "emb", "added"),
        ("u0", "w", "added")}


def test_damage_in_a_global_read_exits_1_naming_node_epoch_and_blob(prefix, capsys):
    save_old(prefix, "range")
    resize(prefix, "range")
    loc = Location(prefix)
    group = f"{loc.root}/t2.1/{blob_path('emb')}"
    chunk = min(p for p in loc.fs.find(group) if p.rsplit("/", 1)[1].startswith("c."))
    data = bytearray(loc.fs.cat_file(chunk))
    data[len(data) // 2] ^= 0x10
    loc.fs.pipe_file(chunk, bytes(data))

    code, out, err = run(capsys, "diff", prefix, 1, 2)
    assert code == 1 and out == ""
    assert "'t2'" in err and "epoch 1" in err and "'emb'" in err
