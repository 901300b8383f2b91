"""Elastic epochs: a save of N nodes restored on M, against restores of saves by the nodes that
restore them, in one run (paired, alternating, cold); what each reads against what it needs;
what a save writes with its replicated weights written once; a consolidation.

    python benchmarks/bench_reshard.py                     # 1 GiB table + 64 MiB weights, local
    python benchmarks/bench_reshard.py --server seaweedfs  # on S3: requests counted
    python benchmarks/bench_reshard.py --smoke             # seconds, for CI

The job: a float32 ``emb`` table of ``--rows`` x 64 split by rows over the nodes
(``caffe2ckpt.Layout(rows=["emb"], replicated=["w"])``, ``--partition range`` and ``mod``) and
dense weights ``w`` (``--weights-mib``) that every node holds. Each node count (2, 4, 8) saves
once per partition. Then, for each (N, M) in 4->2, 2->4, 4->8 and 4->4 (with other node
names, and with the same names in reverse order: both split anew, each node other rows):

- **restore time**: all M new nodes restored in one process (one ``restore()`` call) against
  two same-topology restores: the N-node save by its own N nodes (N -> N), and the M-node save
  by its own M nodes (M -> M: the same arrays returned as the elastic restore, each of the M
  nodes with its copy of the weights, nothing resharded). Page cache dropped before each
  (when permitted), alternating, ``--repeat`` times: medians of the times, and of each
  repeat's ratios (its three restores run back to back, so the disk's drift cancels);
- **bytes read / bytes needed** by one process restoring all M nodes (needed: the table once,
  the weights once), and the most any one new node reads alone (a Dask worker holding one
  node) against its share (its rows of the table and the weights): chunk bytes as read
  (padding excluded), from every array of the save;
- on S3, the requests of each restore and whether any was a LIST.

Also: the bytes a save of 4 nodes writes with ``w`` declared replicated (written once) and
without (every node writes its copy); and ``materialize(consolidate=True)`` of the 4-node save:
seconds and the most ``tracemalloc`` saw held (numpy reports its arrays to it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import drop_caches  # noqa: E402

import caffe2ckpt  # noqa: E402
from caffe2ckpt import Layout, StepCheckpointManager, materialize  # noqa: E402
from caffe2ckpt.sharding import new_rows  # noqa: E402

# (N, M, the new nodes' names): new ones, or the old ones in reverse order (a reshard too)
PAIRS = [(4, 2, "new"), (2, 4, "new"), (4, 8, "new"), (4, 4, "new"), (4, 4, "reordered")]


def _cold() -> None:
    with contextlib.suppress(OSError):
        drop_caches()


class Reads:
    """Chunk bytes a manager reads (``read_exact`` of its location)."""

    def __init__(self, mgr: StepCheckpointManager) -> None:
        self.bytes = 0
        location = mgr._store.location
        read = location.read_exact
        lock = threading.Lock()  # reads run on several threads

        def counted(path, out, trailer):
            with lock:
                self.bytes += len(out)
            return read(path, out, trailer)
        location.read_exact = counted


class Job:
    """The table and weights, and where each node count's saves are."""

    def __init__(self, args, base: str, options: dict) -> None:
        rng = np.random.default_rng(0)
        self.table = rng.random((args.rows, 64), dtype=np.float32)
        self.weights = rng.random(args.weights_mib * 2**20 // 4, dtype=np.float32)
        self.base, self.options = base, options

    def url(self, partition: str, n: int, suffix: str = "") -> str:
        return f"{self.base}/{partition}-{n}{suffix}"

    def items(self, partition: str, n: int) -> dict:
        out = {}
        for k in range(n):
            rows = new_rows(partition, k, n, len(self.table))
            out[f"old_{k}"] = {"emb": np.ascontiguousarray(
                self.table[rows.start:rows.stop:rows.step]), "w": self.weights}
        return out

    def save(self, partition: str, n: int, layout: Layout, suffix: str = "") -> int:
        """Save on ``n`` nodes; the bytes the save wrote."""
        items = self.items(partition, n)
        with StepCheckpointManager(self.url(partition, n, suffix), nodes=list(items),
                                   layout=layout, handle_preemption=False,
                                   **self.options) as mgr:
            mgr.save(0, items)
            return sum(r.nbytes for r in mgr._step(0).records.values())

    def manager(self, partition: str, n: int, nodes: list[str]) -> StepCheckpointManager:
        return StepCheckpointManager(self.url(partition, n), nodes=nodes,
                                     layout=Layout(rows=["emb"], replicated=["w"],
                                                   partition=partition),
                                     handle_preemption=False, **self.options)


def _timed(fn):
    gc.collect()
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def restore(job: Job, partition: str, n: int, nodes: list[str], wire, only=None):
    """One cold restore of the ``partition`` save of ``n`` nodes by a manager of ``nodes``
    (all of them, or ``only``): seconds, chunk bytes read, S3 requests (and LISTs)."""
    mgr = job.manager(partition, n, nodes)
    reads = Reads(mgr)
    _cold()
    with wire() as counter:
        seconds, out = _timed(lambda: mgr.restore(0, nodes=only))
    mgr.close()
    requests = lists = None
    if counter is not None:
        requests = counter.counts.requests
        lists = counter.counts.ops["ListObjectsV2"]
    return {"seconds": seconds, "read": reads.bytes, "requests": requests, "lists": lists,
            "out": out}


def check(job: Job, partition: str, out: dict, nodes: list[str]) -> None:
    for k, node in enumerate(nodes):
        rows = new_rows(partition, k, len(nodes), len(job.table))
        expected = job.table[rows.start:rows.stop:rows.step]
        if out[node]["emb"].tobytes() != expected.tobytes():
            raise SystemExit(f"{partition}: node {node} of {len(nodes)}: not bit-exact")
        if out[node]["w"].tobytes() != job.weights.tobytes():
            raise SystemExit(f"{partition}: node {node}: weights differ")


def measure_pair(job: Job, partition: str, n: int, m: int, names: str, repeat: int,
                 wire) -> dict:
    """Cold restores, alternating: the N-node save by its own nodes ("same"), the M-node save
    by its own nodes ("target": what M nodes restore when nothing is resharded; the same as
    "same" when M == N) and the N-node save by M new nodes, or (``names="reordered"``) by its
    own nodes in reverse order ("elastic")."""
    old = [f"old_{k}" for k in range(n)]
    new = old[::-1] if names == "reordered" else [f"new_{k}" for k in range(m)]
    kinds = {"same": (n, old), "target": (m, [f"old_{k}" for k in range(m)]),
             "elastic": (n, new)}
    if m == n:
        del kinds["target"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    row: dict = {}
    for turn in range(repeat):
        for kind in list(kinds)[::1 - 2 * (turn % 2)]:
            saved_by, nodes = kinds[kind]
            result = restore(job, partition, saved_by, nodes, wire)
            times[kind].append(result["seconds"])
            if kind == "elastic":
                check(job, partition, result["out"], new)
                row.update(read=result["read"], requests=result["requests"],
                           lists=result["lists"])
            elif kind == "same":
                row.update(same_requests=result["requests"])
            del result
    times.setdefault("target", times["same"])
    table_bytes, w_bytes = job.table.nbytes, job.weights.nbytes
    row["needed"] = table_bytes + w_bytes
    worst = 0.0
    for k in range(m):  # each new node alone, as a worker holding one node restores it
        alone = restore(job, partition, n, new, wire, only=[new[k]])
        share = len(new_rows(partition, k, m, len(job.table))) * 64 * 4 + w_bytes
        worst = max(worst, alone["read"] / share)
        del alone
    row.update({kind: statistics.median(t) for kind, t in times.items()}, worst_alone=worst)
    # each repeat's restores ran back to back: the median of their ratios cancels the disk's drift
    row["ratios"] = {kind: statistics.median(e / b for e, b in zip(times["elastic"], times[kind]))
                     for kind in ("same", "target")}
    return row


def report(args, results, writes, consolidation, where: str) -> None:
    table_mib = args.rows * 256 / 2**20
    print(f"\n## Elastic restores: table {args.rows:,} x 64 float32 ({table_mib:.0f} MiB) + "
          f"{args.weights_mib} MiB replicated weights, on {where}, {args.repeat} cold restores "
          "each (medians; a ratio is the median of each repeat's ratio)")
    s3 = results and results[0][4].get("requests") is not None
    print("\n| partition | N -> M | N -> N restore s | M -> M restore s | elastic N -> M "
          "restore s | ratio to N -> N | ratio to M -> M | bytes read / needed (one process) | "
          "worst node alone: read / its share |"
          + (" requests (elastic / same) | LIST |" if s3 else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if s3 else ""))
    for partition, n, m, names, row in results:
        pair = f"{n} -> {m}" + {"reordered": " (same names, reordered)",
                                "new": " (other names)" if n == m else ""}[names]
        line = (f"| {partition} | {pair} | {row['same']:.3f} | {row['target']:.3f} | "
                f"{row['elastic']:.3f} | {row['ratios']['same']:.2f}x | "
                f"{row['ratios']['target']:.2f}x | {row['read'] / row['needed']:.3f} | "
                f"{row['worst_alone']:.3f} |")
        if s3:
            line += f" {row['requests']} / {row['same_requests']} | {row['lists']} |"
        print(line)
    print("\n| save of 4 nodes | bytes written | of table + weights once |")
    print("|---|---|---|")
    once = args.rows * 256 + args.weights_mib * 2**20
    for label, nbytes in writes:
        print(f"| {label} | {nbytes / 2**20:.1f} MiB | {nbytes / once:.3f} |")
    if consolidation:
        seconds, peak = consolidation
        print(f"\nconsolidate (materialize --consolidate) of the 4-node save: "
              f"{seconds:.2f} s, at most {peak / 2**20:.1f} MiB held (tracemalloc)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1 << 22, help="table rows (x 64 float32)")
    parser.add_argument("--weights-mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--partition", choices=["range", "mod", "both"], default="both")
    parser.add_argument("--dir", default=None, help="where to write (local; default: temp dir)")
    parser.add_argument("--server", choices=["moto", "seaweedfs"], default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.weights_mib, args.repeat = 1 << 14, 1, 1
    local = tempfile.mkdtemp(prefix="bench-reshard-", dir=args.dir)
    server, wire = None, contextlib.nullcontext
    options: dict = {}
    base = local
    if args.server is not None:
        import s3wire

        s3wire.require_s3()
        server = s3wire.start_server(kind=args.server)
        server.filesystem().mkdir("reshard-bench")
        base, options, wire = "s3://reshard-bench/job", {
            "storage_options": server.options()}, s3wire.WireCounter
    try:
        job = Job(args, base, options)
        partitions = ["range", "mod"] if args.partition == "both" else [args.partition]
        results = []
        for partition in partitions:
            layout = Layout(rows=["emb"], replicated=["w"], partition=partition)
            for n in sorted({k for n, m, _ in PAIRS for k in (n, m)}):
                job.save(partition, n, layout)
            for n, m, names in PAIRS:
                results.append((partition, n, m, names, measure_pair(
                    job, partition, n, m, names, args.repeat, wire)))
        writes = [("w replicated (written once)",
                   job.save("range", 4, Layout(rows=["emb"], replicated=["w"]), "-once")),
                  ("w local (each node writes its copy)",
                   job.save("range", 4, Layout(rows=["emb"]), "-local"))]
        consolidation = None
        if server is None:
            tracemalloc.start()
            seconds, _ = _timed(lambda: materialize(job.url(partitions[0], 4), 0,
                                                    f"{local}/consolidated", consolidate=True))
            consolidation = (seconds, tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        report(args, results, writes, consolidation,
               "local disk" if server is None else f"S3 ({server.where})")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(local, ignore_errors=True)
    print(f"\ncaffe2ckpt {getattr(caffe2ckpt, '__version__', '')}; load average "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
