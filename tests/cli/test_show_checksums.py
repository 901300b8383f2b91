"""``caffe2ckpt show --json`` gives each blob's recorded checksums (``"checksums"``), so two
epochs or a copy can be compared by hand: the CRC32C of each chunk of a blob's own array, of the
packed array's chunks a packed blob lies in, the xxh3-128 of a blob a differential save reads
through older groups. Each equals what a re-read of the stored bytes computes."""

from __future__ import annotations

import google_crc32c
import numpy as np
import xxhash

from caffe2ckpt import Layout, StepCheckpointManager, StepManagerOptions
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.format.manifest import chunk_key
from caffe2ckpt.store.format.zarrgroup import CRC_BYTES
from tests.cli.test_cli import run, run_json

NODES = ["t0", "t1"]
ROWS = 5 * (1 << 20) // 8  # 5 MiB of float32 rows of 2: chunks of 2 MiB or less (rows blob)


def items(step: int) -> dict[str, dict[str, np.ndarray]]:
    return {node: {"emb": np.full((ROWS, 2), k + step, np.float32),
                   "bias": np.arange(16.0) + k + step,  # packed
                   "count": np.int64(step),  # packed
                   "fixed": np.arange(8192, dtype=np.int64) * (k + 1)}  # 64 KiB, packed
            for k, node in enumerate(NODES)}


def crc_of_file(location: Location, path: str) -> int:
    """The CRC32C a re-read computes of a chunk file: of its bytes before the trailing CRC."""
    return google_crc32c.value(location.fs.cat_file(path)[:-CRC_BYTES])


def test_recorded_checksums_of_arrays_and_packed_blobs_are_the_chunks_crcs(prefix, capsys):
    with StepCheckpointManager(prefix, nodes=NODES, layout=Layout(rows=["emb"]),
                               handle_preemption=False) as mgr:
        mgr.save(0, items(0))
    doc = run_json(capsys, "show", prefix, "--epoch", 0)
    location = Location(prefix)
    got = {(b["node"], b["name"]): b for b in doc["blobs"]}
    for node in NODES:
        emb = got[node, "emb"]
        assert emb["checksum"] == "recorded" and emb["storage"] == "array"
        crcs = emb["checksums"]["crc32c"]
        assert len(crcs) == emb["chunks"] > 1 and all(isinstance(c, int) for c in crcs)
        assert crcs == [crc_of_file(location, location.path(f"{node}.0", emb["path"],
                                                            chunk_key(2, i)))
                        for i in range(len(crcs))]
        for name in ("bias", "count", "fixed"):
            entry = got[node, name]
            assert entry["storage"] == "packed"
            sums = entry["checksums"]
            assert sums["crc32c"] == [crc_of_file(location, location.path(
                f"{node}.0", "_packed", chunk_key(1, i))) for i in sums["packed_chunks"]]
            assert len(sums["packed_chunks"]) == 1  # the packed array is one chunk here
    # the nodes' tables differ, so do their checksums
    assert got["t0", "emb"]["checksums"] != got["t1", "emb"]["checksums"]
    # --verify keeps them, and says what it found in "checksum"
    verified = run_json(capsys, "show", prefix, "--epoch", 0, "--verify")
    assert [b["checksums"] for b in verified["blobs"]] == [b["checksums"] for b in doc["blobs"]]
    assert {b["checksum"] for b in verified["blobs"]} == {"ok"}
    code, out, _ = run(capsys, "show", prefix, "--epoch", 0)  # the text is as before
    assert code == 0 and "crc32c recorded" in out
    assert str(got["t0", "emb"]["checksums"]["crc32c"][0]) not in out


def test_differential_blobs_give_their_recorded_digests(prefix, capsys):
    """A blob unchanged since the last save (``same``) and one with a few rows changed
    (``rows``: an overlay here on older groups): the xxh3-128 of each as saved."""
    options = StepManagerOptions(delta_saves=True)
    step0, step1 = items(0), items(0)
    for node in NODES:
        step1[node]["emb"] = step1[node]["emb"].copy()
        step1[node]["emb"][7] = -1.0
    with StepCheckpointManager(prefix, nodes=NODES, options=options,
                               handle_preemption=False) as mgr:
        mgr.save(0, step0)
        mgr.save(1, step1)
    got = {(b["node"], b["name"]): b for b in run_json(capsys, "show", prefix, "--epoch",
                                                       1)["blobs"]}
    for node in NODES:
        for name, storage in (("fixed", "same"), ("emb", "rows")):
            entry = got[node, name]
            assert entry["storage"] == storage and entry["from_epochs"][0] == 0
            digest = xxhash.xxh3_128_hexdigest(step1[node][name].tobytes())
            assert entry["checksums"] == {"xxh3_128": digest}
    doc = run_json(capsys, "show", prefix, "--epoch", 1, "--verify")  # and the digests hold
    assert {b["checksum"] for b in doc["blobs"]} == {"ok"}
