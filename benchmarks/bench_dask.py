"""DaskSession against the in-process sessions, on a local process-based Dask cluster.

    python benchmarks/bench_dask.py [--dir DIR] [--mib 256] [--nodes 1 2 4] [--repeats 3]
                                    [--pairs 9] [--epochs 200] [--smoke]

1. **Save throughput.** N nodes (N = 1, 2, 4) each hold ``--mib`` MiB (float64, made on the
   node: it never travels) and save it as one epoch, durably, all nodes at once: with a
   ``DaskSession`` on a ``LocalCluster`` of N worker processes (one node each), against the same
   N nodes and bytes saved by one process (``LocalSession``, a thread per node). The two
   alternate save by save; prints the median aggregate MiB/s of each and the median of the
   pairs' ratios (target: >= 0.95 with 2 workers on one disk).
2. **Per-epoch overhead.** A trivial 2-node epoch (one task per node that adds 1 to a scalar):
   median milliseconds per epoch on ``LocalSession`` (threads) and ``DaskSession`` (actors), and
   inside a Prefect flow on ``PrefectSession()`` and ``PrefectSession(nodes=DaskSession(...))``
   (Prefect's temporary local server). Target: actors add <= 15 ms per epoch over threads.

Sessions are measured interleaved, so load changes hit all alike.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time

if "PREFECT_HOME" not in os.environ:  # a Prefect home of its own, removed when it exits
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="bench-dask-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED", "false")

import numpy as np  # noqa: E402

MiB = 1 << 20


def fill(node_index: int, mib: int):
    def init(ws) -> None:
        ws["w"] = np.random.default_rng(node_index).standard_normal(mib * MiB // 8)
    return init


def bump(ws) -> None:
    ws["x"] = ws["x"] + 1


def filled(session, nodes: list[str], mib: int) -> None:
    """Give every node ``mib`` MiB of float64, made on the node (it never travels)."""
    from caffe2ckpt import Task, TaskGroup, WorkspaceType

    init = TaskGroup(WorkspaceType.GLOBAL, name="init")
    for i, node in enumerate(nodes):
        Task(fill(i, mib), name="fill", group=init, node=node)
    session.run(init)


def save_seconds(session, nodes: list[str], root: str) -> float:
    """Seconds to save every node at once as one epoch, durably, into a fresh prefix."""
    from caffe2ckpt import MultiNodeCheckpointManager

    url = tempfile.mkdtemp(prefix="ckpt-", dir=root)
    cm = MultiNodeCheckpointManager(url, auto_resume=False)
    session.run(cm.init(nodes))
    os.sync()  # the previous save's write-back is not this one's cost
    start = time.perf_counter()
    session.run(cm.save(0))
    seconds = time.perf_counter() - start
    shutil.rmtree(url, ignore_errors=True)
    return seconds


def throughput(args) -> None:
    """Saves of the two sessions strictly alternate (ABBA), and each Dask save is compared with
    the one-process save next to it: on a virtual disk whose write speed drifts by 2-5x within
    minutes (measured), only such pairs compare like with like."""
    from distributed import Client, LocalCluster

    from caffe2ckpt import LocalSession
    from caffe2ckpt.dask import DaskSession

    print(f"\n1. save throughput: each node {args.mib} MiB float64, all nodes saving at once, "
          f"durable, into {args.dir}; {args.pairs} alternating pairs (aggregate MiB/s: median; "
          f"ratio: median of the pairs' ratios)")
    print("| nodes | one process MiB/s | Dask workers MiB/s | workers x one process |\n"
          "|---|---|---|---|")
    for n in args.nodes:
        nodes = [f"trainer_{i}" for i in range(n)]
        with LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                          dashboard_address=":0", silence_logs=40) as cluster, \
                Client(cluster) as client, DaskSession(client) as remote:
            local = LocalSession()
            filled(local, nodes, args.mib)
            filled(remote, nodes, args.mib)
            save_seconds(local, nodes, args.dir), save_seconds(remote, nodes, args.dir)  # warm-up
            pairs = []
            for i in range(args.pairs):  # ABBA: neither goes first every time
                first, second = (local, remote) if i % 2 == 0 else (remote, local)
                t = {first: save_seconds(first, nodes, args.dir)}
                t[second] = save_seconds(second, nodes, args.dir)
                pairs.append((t[local], t[remote]))
        mib = n * args.mib
        a = statistics.median(mib / s for s, _ in pairs)
        b = statistics.median(mib / s for _, s in pairs)
        ratio = statistics.median(s / r for s, r in pairs)
        print(f"| {n} | {a:.0f} | {b:.0f} | {ratio:.2f} |", flush=True)


def epoch_ms(session, epochs: int) -> float:
    """Median milliseconds of running a trivial 2-node epoch group on ``session``."""
    from caffe2ckpt import Task, TaskGroup, WorkspaceType

    init = TaskGroup(WorkspaceType.GLOBAL, name="init")
    epoch = TaskGroup(WorkspaceType.GLOBAL, name="epoch_group")
    for node in ("trainer_0", "trainer_1"):
        Task(lambda ws: ws.__setitem__("x", np.int64(0)), name="init", group=init, node=node)
        Task(bump, name="bump", group=epoch, node=node)
    session.run(init)
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        session.run(epoch)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def overhead(args) -> None:
    from distributed import Client, LocalCluster
    from prefect import flow

    from caffe2ckpt import LocalSession
    from caffe2ckpt.dask import DaskSession
    from caffe2ckpt.prefect import PrefectSession, temporary_server

    @flow(name="bench-dask-epochs")
    def in_flow(client, dask: bool, epochs: int) -> float:
        if not dask:
            return epoch_ms(PrefectSession(artifacts=False), epochs)
        with DaskSession(client) as nodes:
            return epoch_ms(PrefectSession(nodes=nodes, artifacts=False), epochs)

    results: dict[str, list[float]] = {k: [] for k in ("threads", "actors", "prefect threads",
                                                        "prefect actors")}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0", silence_logs=40) as cluster, \
            Client(cluster) as client, \
            (contextlib.nullcontext() if args.smoke else temporary_server()):
        for _ in range(args.repeats):
            results["threads"].append(epoch_ms(LocalSession(), args.epochs))
            with DaskSession(client) as session:
                results["actors"].append(epoch_ms(session, args.epochs))
            if not args.smoke:  # (a temporary Prefect server takes ~10 s to start)
                prefect_epochs = max(args.epochs // 4, 5)
                results["prefect threads"].append(in_flow(client, False, prefect_epochs))
                results["prefect actors"].append(in_flow(client, True, prefect_epochs))
    med = {k: statistics.median(v) if v else float("nan") for k, v in results.items()}
    print(f"\n2. trivial 2-node epoch: median ms per epoch, median of {args.repeats} runs "
          f"({args.epochs} epochs each; {max(args.epochs // 4, 5)} inside a flow)")
    print("| session | ms/epoch | actors - threads ms |\n|---|---|---|")
    print(f"| LocalSession (threads) | {med['threads']:.2f} | |")
    print(f"| DaskSession (actors) | {med['actors']:.2f} | {med['actors'] - med['threads']:+.2f} |")
    print(f"| PrefectSession (threads) | {med['prefect threads']:.2f} | |")
    print(f"| PrefectSession + DaskSession | {med['prefect actors']:.2f} | "
          f"{med['prefect actors'] - med['prefect threads']:+.2f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where checkpoints are written")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=9, help="alternating save pairs per size")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no Prefect (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.nodes, args.repeats, args.pairs, args.epochs = 4, [2], 1, 1, 10
    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench-dask-")
    os.makedirs(args.dir, exist_ok=True)
    if made:
        atexit.register(shutil.rmtree, args.dir, ignore_errors=True)
    from importlib.metadata import version

    print(f"# python {' '.join(sys.argv)}\n# {os.cpu_count()} CPUs, Python "
          f"{sys.version.split()[0]}, distributed {version('distributed')}, prefect "
          f"{version('prefect')}; dir {args.dir}" + ", smoke" * args.smoke)
    throughput(args)
    overhead(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
