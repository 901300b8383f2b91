"""One global checkpoint out of a save of N nodes (``materialize(consolidate=True)`` and
``caffe2ckpt materialize --consolidate``): each rows blob one global array, replicated blobs
once, local blobs under ``<node>/``; bit-exact for both partitions, whole and differential
epochs; streamed (what it holds stays under 64 MiB + a chunk for a table larger than that)."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import zarr

from caffe2ckpt import Layout, StepCheckpointManager, StepManagerOptions, materialize
from caffe2ckpt.sharding import new_rows


def save(url: str, table: np.ndarray, partition: str, delta: bool, nodes: str = "abc",
         epochs: int = 3) -> np.ndarray:
    """Save ``epochs`` epochs of ``table`` (every 7th row changing) split over ``nodes``; the
    table as the last epoch holds it."""
    layout = Layout(rows=["emb"], replicated=["w"], partition=partition)
    options = StepManagerOptions(delta_saves=delta, delta_min_bytes=1, max_to_keep=None)
    with StepCheckpointManager(url, nodes=list(nodes), layout=layout, pack_threshold=1024,
                               options=options, handle_preemption=False) as mgr:
        for epoch in range(epochs):
            table[epoch::7] += 1
            items = {}
            for k, node in enumerate(nodes):
                rows = new_rows(partition, k, len(nodes), len(table))
                items[node] = {"emb": table[rows.start:rows.stop:rows.step].copy(),
                               "w": np.eye(3), "opt": np.full(2, k)}
            mgr.save(epoch, items)
    return table


@pytest.mark.parametrize("delta", [False, True], ids=["whole", "delta"])
@pytest.mark.parametrize("partition", ["range", "mod"])
def test_a_consolidated_epoch_is_the_global_table(prefix, tmp_path, partition, delta):
    table = save(prefix, np.arange(5003 * 8, dtype=np.float32).reshape(5003, 8), partition,
                 delta)
    written = materialize(prefix, 2, str(tmp_path / "out"), consolidate=True)
    group = zarr.open_group(written[0], mode="r")
    assert written[0].endswith("consolidated.2")
    assert group["emb"][...].tobytes() == table.tobytes()
    assert np.array_equal(group["w"][...], np.eye(3))
    for k, node in enumerate("abc"):
        assert np.array_equal(zarr.open_group(f"{written[0]}/{node}", mode="r")["opt"][...],
                              np.full(2, k))
    described = group.attrs["caffe2ckpt_materialized"]
    assert described["nodes"] == list("abc") and described["partition"] == partition
    assert {n: b["kind"] for n, b in described["blobs"].items()} == {
        "emb": "rows", "w": "replicated", "opt": "local"}
    with pytest.raises(FileExistsError, match="never overwrites"):
        materialize(prefix, 2, str(tmp_path / "out"), consolidate=True)


def test_the_command_line_consolidates(tmp_path):
    url = str(tmp_path / "ckpt")
    table = save(url, np.ones((300, 4), np.float32), "range", False, nodes="ab", epochs=1)
    result = subprocess.run([sys.executable, "-m", "caffe2ckpt.cli", "materialize", url,
                             "--epoch", "0", "--consolidate", str(tmp_path / "g"), "--json"],
                            capture_output=True, text=True, check=True)
    doc = json.loads(result.stdout)
    assert doc["consolidated"] is True and len(doc["groups"]) == 3
    assert np.array_equal(zarr.open_group(doc["groups"][0], mode="r")["emb"][...], table)


def test_ls_and_show_print_the_layout(tmp_path):
    """A new user found no command that said how a save's blobs are spread over its nodes."""
    url = str(tmp_path / "ckpt")
    save(url, np.ones((300, 4), np.float32), "mod", False, nodes="ab", epochs=1)

    def cli(*argv: str) -> str:
        return subprocess.run([sys.executable, "-m", "caffe2ckpt.cli", *argv, url],
                              capture_output=True, text=True, check=True).stdout
    assert "a,b (mod)" in cli("ls")
    shown = cli("show")
    assert ("layout: mod over 2 nodes (a, b); rows: emb; replicated: w; other blobs local"
            in shown), shown
    doc = json.loads(cli("show", "--json"))
    assert doc["layout"] == {"partition": "mod", "order": ["a", "b"], "rows": ["emb"],
                             "replicated": ["w"]}
    assert {(b["node"], b["name"]): b["kind"] for b in doc["blobs"]} == {
        ("a", "emb"): "rows", ("a", "w"): "replicated", ("a", "opt"): "local",
        ("b", "emb"): "rows", ("b", "opt"): "local"}  # w is written once, by a
    assert json.loads(cli("ls", "--json"))["epochs"][0]["layout"] == doc["layout"]


def test_consolidation_streams(tmp_path):
    """A 96 MiB table saved by 4 nodes, consolidated holding at most 64 MiB + one 16 MiB
    chunk (numpy reports its arrays to tracemalloc)."""
    url = str(tmp_path / "ckpt")
    rows = 96 * 2**20 // 256
    layout = Layout(rows=["emb"])
    with StepCheckpointManager(url, nodes=["a", "b", "c", "d"], layout=layout,
                               handle_preemption=False) as mgr:
        table = np.random.default_rng(0).random((rows, 64), dtype=np.float32)
        mgr.save(0, {n: {"emb": table[k * rows // 4:(k + 1) * rows // 4]}
                     for k, n in enumerate("abcd")})
        del table
    tracemalloc.start()
    try:
        written = materialize(url, 0, str(tmp_path / "out"), consolidate=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= (64 + 16) * 2**20, peak / 2**20
    assert zarr.open_group(written[0], mode="r")["emb"].shape == (rows, 64)
