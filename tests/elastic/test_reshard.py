"""Elastic restores as a property: every save of N nodes restored on M nodes, for every (N, M) in
{1, 2, 3, 4, 8}^2, both partitions, whole and differential epochs, on every backend (on S3 each
combination on one of the two servers), is
bit-exact against the reference (the old shards put back together and split anew), and reads
no more than its budget: with ``range``, a new node's rows plus at most two chunks (the first
and the last it touches); with ``mod`` when M divides N, exactly its rows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from caffe2ckpt import Layout, StepCheckpointManager, StepManagerOptions
from caffe2ckpt.naming import blob_path
from caffe2ckpt.sharding import new_rows
from caffe2ckpt.store.format import manifest

COUNTS = (1, 2, 3, 4, 8)
ROWS, COLS = 1003, 16  # 64 B rows: 64 rows per 4 KiB chunk
ROW_BYTES = COLS * 4


@pytest.fixture
def chunk(prefix, monkeypatch) -> int:
    """Small chunks for blobs split by rows (2 MiB by default): 4 KiB (16 KiB on S3, where each
    is a request), so a 64 KiB table has shares of several chunks and the boundary rule is
    tested, not swamped by one chunk."""
    size = 16384 if prefix.startswith("s3://") else 4096
    monkeypatch.setattr(manifest, "ROWS_CHUNK_BYTES", size)
    return size


def table(epoch: int) -> np.ndarray:
    """The global table after ``epoch`` epochs: 5% of its rows change each epoch."""
    out = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    rng = np.random.default_rng(0)
    for e in range(1, epoch + 1):
        rows = rng.choice(ROWS, ROWS // 20, replace=False)
        out[rows] += e
    return out


WEIGHTS = np.linspace(0, 1, 300).reshape(20, 15)


def share(whole: np.ndarray, partition: str, index: int, count: int) -> np.ndarray:
    rows = new_rows(partition, index, count, whole.shape[0])
    return np.ascontiguousarray(whole[rows.start:rows.stop:rows.step])


class ReadCounter:
    """Bytes of chunk data read from the table's arrays by one manager."""

    def __init__(self, mgr: StepCheckpointManager) -> None:
        location = mgr._store.location
        self.bytes = 0
        read = location.read_exact
        marker = f"/{blob_path('emb')}/"

        def counted(path, out, trailer):
            if marker in path:
                self.bytes += len(out)
            return read(path, out, trailer)
        location.read_exact = counted


def save_job(url: str, n: int, partition: str, delta: bool) -> tuple[int, int]:
    """Save the job on ``n`` nodes (two epochs when ``delta``, so the last is a chain);
    return the epoch to restore and the table bytes its own nodes read to restore it."""
    options = StepManagerOptions(delta_saves=delta, delta_min_bytes=1, max_to_keep=None)
    nodes = [f"old_{k}" for k in range(n)]
    last = 1 if delta else 0
    with StepCheckpointManager(url, nodes=nodes, layout=Layout(rows=["emb"], replicated=["w"],
                                                               partition=partition),
                               options=options, pack_threshold=1024,
                               handle_preemption=False) as mgr:
        for epoch in range(last + 1):
            whole = table(epoch)
            mgr.save(epoch, {node: {"emb": share(whole, partition, k, n), "w": WEIGHTS}
                             for k, node in enumerate(nodes)}, force=True)
        if delta:
            assert mgr._step(last).first.delta is not None  # a differential epoch
        counter = ReadCounter(mgr)
        mgr.restore(last)
    return last, counter.bytes


def restore_on(url: str, m: int, partition: str, epoch: int, n: int) -> int:
    """Restore ``epoch`` on ``m`` new nodes at once, check it against the reference, and
    return the bytes of the table read."""
    nodes = [f"new_{k}" for k in range(m)]
    whole = table(epoch)
    with StepCheckpointManager(url, nodes=nodes, layout=Layout(rows=["emb"], replicated=["w"],
                                                               partition=partition),
                               handle_preemption=False) as mgr:
        assert mgr.all_steps() == list(range(epoch + 1))
        counter = ReadCounter(mgr)
        got = mgr.restore(epoch)
    for k, node in enumerate(nodes):
        expected = share(whole, partition, k, m)
        assert got[node]["emb"].tobytes() == expected.tobytes(), (n, m, partition, k)
        assert got[node]["emb"].shape == expected.shape
        assert got[node]["emb"].dtype == expected.dtype
        assert np.array_equal(got[node]["w"], WEIGHTS)
    return counter.bytes


# every (partition, kind) on memory and local; on S3 (a restore costs tens of requests), each
# once: moto whole range and delta mod, SeaweedFS whole mod and delta range
CASES = [pytest.param(kind, partition, delta, id=f"{kind}-{partition}-{name}")
         for kind in ("memory", "local") for partition in ("range", "mod")
         for delta, name in ((False, "whole"), (True, "delta"))]
CASES += [pytest.param(f"s3-{server}", partition, delta, marks=pytest.mark.slow,
                       id=f"s3-{server}-{partition}-{'delta' if delta else 'whole'}")
          for server, partition, delta in (("moto", "range", False), ("moto", "mod", True),
                                           ("seaweedfs", "mod", False),
                                           ("seaweedfs", "range", True))]


@pytest.mark.parametrize("prefix, partition, delta", CASES, indirect=["prefix"])
def test_every_n_to_m_restores_bit_exact_within_its_read_budget(prefix, chunk, partition,
                                                               delta):
    """Per (N, M): all M new nodes restored at once (as one process holding them does)."""
    cases = 0
    for n in COUNTS:
        url = f"{prefix}/n{n}"
        epoch, own = save_job(url, n, partition, delta)
        for m in COUNTS:
            read = restore_on(url, m, partition, epoch, n)
            cases += 1
            if delta:
                # what the nodes that saved it read, plus per new node and group of the chain
                # (epoch + 1 of them here) the rest of the first and last chunk it touches
                assert read <= own + 2 * chunk * m * (epoch + 1), (n, m, read, own)
            elif partition == "range":  # each new node: its rows and at most 2 chunks more
                assert read <= ROWS * ROW_BYTES + 2 * chunk * m, (n, m, read)
            else:  # each old shard at most once; exactly the rows needed when M divides N
                assert read <= ROWS * ROW_BYTES, (n, m, read)
                if n % m == 0:
                    assert read == ROWS * ROW_BYTES, (n, m, read)
    assert cases == len(COUNTS) ** 2


def expected_for(nodes: list[str], layout: Layout, whole: np.ndarray) -> dict[str, dict]:
    """The plain numpy model: each node's share of every blob the layout declares rows (the
    global array cut by its partition in the nodes' order), the whole of every other."""
    out = {}
    for k, node in enumerate(nodes):
        blobs = {}
        for name, value in (("emb", whole), ("w", WEIGHTS)):
            rows = layout.kind(name) == "rows"
            blobs[name] = share(value, layout.partition, k, len(nodes)) if rows else value
        out[node] = blobs
    return out


def restored_as(url: str, nodes: list[str], layout: Layout, epoch: int) -> dict:
    with StepCheckpointManager(url, nodes=nodes, layout=layout, handle_preemption=False) as mgr:
        got = mgr.restore(epoch)
        described = mgr.item_metadata(epoch)
    for node, blobs in got.items():  # item_metadata says what restore returns
        assert {n: (a.dtype.str, a.shape) for n, a in blobs.items()} == {
            n: (m.dtype, m.shape) for n, m in described[node].items()}
    return got


def assert_model(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for node, blobs in want.items():
        assert sorted(got[node]) == sorted(blobs), (what, node)
        for name, value in blobs.items():
            have = got[node][name]
            assert (have.dtype, have.shape) == (value.dtype, value.shape), (what, node, name)
            assert have.tobytes() == np.ascontiguousarray(value).tobytes(), (what, node, name)


# every (partition, kind) on memory and local; on S3 the whole epochs, one per server (the
# differential ones' reads on S3 are the test above's)
CHANGES = [c for c in CASES if not c.id.startswith("s3-") or c.id.endswith("-whole")]


@pytest.mark.parametrize("prefix, partition, delta", CHANGES, indirect=["prefix"])
def test_every_change_of_order_partition_or_kind_is_cut_anew_or_refused(prefix, chunk,
                                                                        partition, delta):
    """Per N: the same node names in another order under both partitions (the order the save
    recorded is not the job's: a reshard, never each node's old shard back), and on another
    node count M the kinds switched (the table declared replicated reaches every node whole,
    the replicated weights declared rows are cut by rows), saved again by those M nodes (a
    second family), and a third node set resuming the newest family; each bit-exact against
    the plain numpy model, and a blob declared local that was saved spread is refused by
    name."""
    from caffe2ckpt import JobDefinitionError

    rng = random.Random(f"{partition}-{delta}")
    for n in COUNTS:
        url = f"{prefix}/n{n}"
        epoch, _ = save_job(url, n, partition, delta)
        whole = table(epoch)
        old = [f"old_{k}" for k in range(n)]
        order = rng.sample(old, n)
        order = order if order != old else old[1:] + old[:1]  # another order whenever n > 1
        for new_partition in ("range", "mod"):
            layout = Layout(rows=["emb"], replicated=["w"], partition=new_partition)
            assert_model(restored_as(url, order, layout, epoch),
                         expected_for(order, layout, whole), (n, order, new_partition))
        m = rng.choice(COUNTS)
        nodes = [f"new_{k}" for k in range(m)]
        switched = Layout(rows=["w"], replicated=["emb"], partition=rng.choice(["range", "mod"]))
        with StepCheckpointManager(url, nodes=nodes, layout=switched,
                                   handle_preemption=False) as mgr:
            got = mgr.restore(epoch)
            mgr.save(epoch + 1, got)  # a second family with a layout: the newest run's
        assert_model(got, expected_for(nodes, switched, whole), (n, m, switched))
        third = [f"third_{k}" for k in range(rng.choice(COUNTS))]
        layout = Layout(rows=["emb"], replicated=["w"], partition=rng.choice(["range", "mod"]))
        with StepCheckpointManager(url, nodes=third, layout=layout,
                                   handle_preemption=False) as mgr:
            assert mgr.all_steps() == [epoch + 1], (n, m, mgr.all_steps())
        assert_model(restored_as(url, third, layout, epoch + 1), expected_for(third, layout, whole),
                     (n, m, third, "the newest family"))
        for declared, blob in ((Layout(rows=["emb"]), "w"), (Layout(replicated=["w"]), "emb")):
            with pytest.raises(JobDefinitionError, match=f"blob {blob!r} was saved"):
                restored_as(url, rng.choice([old, nodes]), declared, epoch)
