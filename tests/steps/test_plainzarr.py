"""``materialize``: any committed epoch written for readers that know nothing of caffe2ckpt,
every blob an ordinary Zarr v3 array of its own at its blob path (issue 34 item 5.1), read here
with plain ``zarr`` alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tracemalloc
import uuid

import fsspec
import numpy as np
import pytest
import zarr

import caffe2ckpt
from caffe2ckpt import CheckpointCorruptedError, StepCheckpointManager, StepManagerOptions
from caffe2ckpt.cli import main as cli_main
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import blob_path

NAN_PAYLOAD = np.array([0x7FF8_0000_0000_0123], np.uint64).view(np.float64)[0]


def blobs() -> dict[str, np.ndarray]:
    """Every kind of blob a checkpoint keeps, small (packed in the checkpoint) and large (an
    array of its own there, several chunks of which the last is short)."""
    rng = np.random.default_rng(7)
    return {
        "model/w": rng.random((300, 7), dtype=np.float32),
        "fortran": np.asfortranarray(rng.random((5, 4))),
        "fortran/3d": np.asfortranarray(rng.integers(0, 99, (3, 4, 5), dtype=np.int16)),
        "big_endian": np.arange(12, dtype=">f4").reshape(3, 4),
        "big_endian/i8": np.arange(5, dtype=">i8") - 2,
        "unicode": np.array([["abcdef", "é"], ["x", ""]], dtype="<U6"),
        "unicode/be": np.array(["ab", "ü€"], dtype=">U6"),
        "bytes": np.array([b"ab\x00cd", b"zzzzzz", b""], dtype="S6"),
        "bool": np.array([True, False, True]),
        "scalar": np.array(3.25),
        "scalar/int": np.array(-7, np.int64),
        "empty": np.zeros((0, 3), np.int16),
        "empty/cols": np.zeros((3, 0), np.float32),
        "nan": np.array([NAN_PAYLOAD, -0.0, np.inf]),
        "complex": np.array([1 + 2j, -3j], np.complex64),
        "large": rng.random(((24 << 20) // 32 + 5, 4)),  # 24 MiB: two chunks, the last short
        "large/fortran": np.asfortranarray(rng.random((8, (20 << 20) // 64 + 3))),  # 20 MiB
    }


def read_plain(group_url: str, name: str) -> np.ndarray:
    """What plain zarr gives for blob ``name`` (only its path is caffe2ckpt's; zarr gives a 0-d
    array as a numpy scalar)."""
    return np.asarray(zarr.open_group(group_url, mode="r")[blob_path(name)][...])


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    return (got.dtype == want.dtype and got.shape == want.shape
            and got.tobytes(order="A") == want.tobytes(order="A"))


def save(prefix: str, items: dict[str, np.ndarray], step: int = 0) -> None:
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        mgr.save(step, {"n0": items})


@pytest.fixture(params=["local", "memory"])
def dest(request, tmp_path):
    """Where materialize writes: a local folder (durable writes) or memory:// (fsspec's)."""
    if request.param == "local":
        yield str(tmp_path / "plain")
        return
    url = f"memory://plain-{uuid.uuid4().hex[:8]}"
    yield url
    fsspec.filesystem("memory").rm(url, recursive=True)


def test_every_blob_is_a_plain_array_with_its_dtype_shape_and_order(prefix, dest):
    want = blobs()
    save(prefix, want)
    [url] = caffe2ckpt.materialize(prefix, 0, dest)
    group = zarr.open_group(url, mode="r")
    assert "_packed" not in group and "caffe2ckpt" not in group.attrs  # not a checkpoint group
    assert sorted(group.array_keys()) == sorted(blob_path(n) for n in want)
    assert group.attrs["caffe2ckpt_materialized"]["blobs"] == {n: blob_path(n) for n in want}
    for name, arr in want.items():
        got = read_plain(url, name)
        # zarr v3 keeps neither byte order nor memory order in a data type: plain zarr gives
        # the values, exactly, as native-endian, C-ordered arrays of the same kind and shape
        assert same_bits(got, np.asarray(arr, arr.dtype.newbyteorder("="), order="C")), name
        # the array's attributes give the rest: exactly the blob that was saved
        blob = group[blob_path(name)].attrs["caffe2ckpt_blob"]
        assert blob["name"] == name
        assert same_bits(np.asarray(got, dtype=blob["dtype"], order=blob["order"]), arr), name
        assert (blob["order"] == "F") == (arr.flags.f_contiguous and not arr.flags.c_contiguous)


def test_fortran_and_big_endian_blobs_are_stored_in_their_own_layout(prefix, tmp_path):
    """On disk a Fortran-ordered blob is its own memory (Zarr's transpose codec) and a
    big-endian one its own bytes (the bytes codec's "big"): zarr set to Fortran order reads the
    Fortran blob back Fortran-ordered, and every chunk is the blob's bytes in its own order."""
    want = {"f": np.asfortranarray(np.arange(24, dtype=">i4").reshape(2, 3, 4))}
    save(prefix, want)
    [url] = caffe2ckpt.materialize(prefix, 0, str(tmp_path / "plain"))
    array = zarr.open_group(url, mode="r")["f"]
    codecs = array.metadata.to_dict()["codecs"]
    assert [c["name"] for c in codecs] == ["transpose", "bytes", "crc32c"]
    assert codecs[1]["configuration"]["endian"] == "big"
    chunk = Location(url).read_bytes(f"{Location(url).root}/f/c.0.0.0")
    assert chunk[:-4] == want["f"].tobytes(order="F")
    with zarr.config.set({"array.order": "F"}):
        got = zarr.open_group(url, mode="r")["f"][...]
    assert got.flags.f_contiguous and np.array_equal(got, want["f"])


def test_a_differential_epoch_materializes_whole(prefix, tmp_path):
    options = StepManagerOptions(delta_saves=True, delta_min_bytes=1024)
    table = np.zeros((4096, 4), np.float32)
    with StepCheckpointManager(prefix, options=options, handle_preemption=False) as mgr:
        for step in range(3):
            table[step * 10:step * 10 + 5] = step + 1
            mgr.save(step, {"n0": {"table": table, "frozen": np.ones(2048, ">f8")}})
    [url] = caffe2ckpt.materialize(prefix, 2, str(tmp_path / "plain"))
    assert same_bits(read_plain(url, "table"), table)
    assert np.array_equal(read_plain(url, "frozen"), np.ones(2048))


def test_materialize_holds_one_blob_at_a_time_not_the_workspace(tmp_path):
    """Streaming: sixteen 4 MiB blobs (64 MiB) are read and written one at a time; the peak of
    what numpy and zarr allocate meanwhile stays under half the workspace."""
    prefix = str(tmp_path / "ckpt")
    save(prefix, {f"b{i}": np.full((1 << 19,), i, np.float64) for i in range(16)})
    tracemalloc.start()
    try:
        caffe2ckpt.materialize(prefix, 0, str(tmp_path / "plain"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"peak {peak / 2**20:.1f} MiB"


def test_a_damaged_epoch_leaves_nothing_at_the_destination(tmp_path):
    prefix, dest = str(tmp_path / "ckpt"), tmp_path / "plain"
    save(prefix, {"a": np.ones(1 << 18), "z": np.ones(1 << 18)})  # two arrays of their own
    chunk = tmp_path / "ckpt" / "n0.0" / "z" / "c.0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError) as caught:
        caffe2ckpt.materialize(prefix, 0, str(dest))
    assert caught.value.blob == "z"
    assert not (dest / "n0.0").exists()  # blob "a" was written first: it went again


@pytest.mark.parametrize("consolidate", [False, True])
def test_a_damaged_node_leaves_nothing_of_any_node_and_a_repaired_epoch_materializes(
        tmp_path, consolidate):
    """Node b's damage is found after node a's group (or the consolidated arrays) were written:
    all of it goes again, empty directories included, so the same DEST takes the epoch once it
    is repaired."""
    prefix, dest = str(tmp_path / "ckpt"), tmp_path / "plain"
    with StepCheckpointManager(prefix, nodes=["a", "b"], layout=caffe2ckpt.Layout(
            rows=["emb"], replicated=["w"]), handle_preemption=False) as mgr:
        mgr.save(0, {n: {"emb": np.full((3000, 4), k, np.float32), "w": np.ones(2)}
                     for k, n in enumerate("ab")})
    chunk = max(p for p in (tmp_path / "ckpt" / "b.0").rglob("*")
                if p.is_file() and p.name != "zarr.json")
    good = chunk.read_bytes()
    chunk.write_bytes(good[:10] + bytes([good[10] ^ 1]) + good[11:])
    with pytest.raises(CheckpointCorruptedError):
        caffe2ckpt.materialize(prefix, 0, str(dest), consolidate=consolidate)
    assert not dest.exists() or list(dest.iterdir()) == []
    chunk.write_bytes(good)
    written = caffe2ckpt.materialize(prefix, 0, str(dest), consolidate=consolidate)
    assert len(written) == (1 if consolidate else 2)


def test_an_existing_destination_is_a_usage_error_before_anything_is_read(tmp_path, capsys):
    """Issue 34 item 5.2: it exited 4 ("storage failed"). Now exit 2 naming the destination,
    and nothing is read: a damaged epoch is not even noticed."""
    prefix, dest = str(tmp_path / "ckpt"), str(tmp_path / "plain")
    save(prefix, {"a": np.ones(1 << 18)})
    assert cli_main(["materialize", prefix, "--epoch", "0", dest]) == 0
    chunk = tmp_path / "ckpt" / "n0.0" / "a" / "c.0"
    chunk.write_bytes(b"damaged")
    capsys.readouterr()
    assert cli_main(["materialize", prefix, "--epoch", "0", dest]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"caffe2ckpt materialize: error: {dest}/n0.0 exists already: "
                            "materialize never overwrites; choose another DEST (or delete "
                            "that group)\n")


def test_a_destination_that_cannot_be_written_is_named_alone(tmp_path, capsys):
    """A DEST below a file: exit 4 (storage failed) naming that path, not the source prefix."""
    prefix, blocker = str(tmp_path / "ckpt"), tmp_path / "afile"
    save(prefix, {"a": np.ones(4)})
    blocker.write_text("")
    capsys.readouterr()
    assert cli_main(["materialize", prefix, "--epoch", "0", str(blocker / "plain")]) == 4
    err = capsys.readouterr().err
    assert err.startswith("caffe2ckpt materialize: error: [Errno 20] Not a directory"), err
    assert str(blocker) in err and prefix not in err


KILLED_AT_THE_LAST_STEP = """
import os, sys
import caffe2ckpt
from caffe2ckpt.steps import consolidate
from caffe2ckpt.store.format import zarrgroup
def killed(*args, **kwargs):
    os._exit(9)  # as a SIGKILL would: no clean-up runs
zarrgroup.mark_complete = consolidate.mark_complete = killed
caffe2ckpt.materialize(sys.argv[1], 0, sys.argv[2], consolidate=sys.argv[3] == "1")
"""


@pytest.mark.parametrize("consolidate", [False, True])
def test_a_group_a_kill_stopped_says_it_is_unfinished(tmp_path, consolidate):
    """Killed before its last step, a materialized group keeps ``complete: false``; the next
    materialize to that DEST refuses it as unfinished, and runs once it is deleted."""
    prefix, dest = str(tmp_path / "ckpt"), tmp_path / "plain"
    with StepCheckpointManager(prefix, nodes=["a", "b"], layout=caffe2ckpt.Layout(
            rows=["emb"]), handle_preemption=False) as mgr:
        mgr.save(0, {n: {"emb": np.full((30, 4), k, np.float32), "own": np.ones(2)}
                     for k, n in enumerate("ab")})
    child = subprocess.run([sys.executable, "-c", KILLED_AT_THE_LAST_STEP, prefix, str(dest),
                            "1" if consolidate else "0"], capture_output=True, text=True)
    assert child.returncode == 9, child.stderr
    group = dest / ("consolidated.0" if consolidate else "a.0")
    assert zarr.open_group(str(group), mode="r").attrs["caffe2ckpt_materialized"][
        "complete"] is False
    with pytest.raises(FileExistsError, match="exists already but is unfinished"):
        caffe2ckpt.materialize(prefix, 0, str(dest), consolidate=consolidate)
    shutil.rmtree(group)
    caffe2ckpt.materialize(prefix, 0, str(dest), consolidate=consolidate)
    assert zarr.open_group(str(group), mode="r").attrs["caffe2ckpt_materialized"]["complete"]
