"""Async-save blocking time against a memcpy, and the latest-epoch lookup among 1,000 epochs.

    python benchmarks/bench_extras.py [--dir DIR] [--repeats 5] [--epochs 1000] [--smoke]

Blocking time: how long ``session.run(cm.save(e))`` holds the training loop with
``async_save=True`` (the snapshot), against ``np.copyto`` of the same workspace into
preallocated buffers, for W1 (1 GiB in 8 arrays) and W2 (256 MiB in 200 arrays). Lookup: a fresh
``ZarrMetadataHandler.last_epoch()`` on a prefix holding ``--epochs`` committed epochs of 2 nodes.
Medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import make_workload  # noqa: E402

from caffe2ckpt import CheckpointManager, LocalSession, MultiNodeCheckpointManager  # noqa: E402
from caffe2ckpt.metadata import ZarrMetadataHandler  # noqa: E402


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def async_blocking(workload: str, root: Path, repeats: int, smoke: bool) -> tuple[float, float]:
    ws = make_workload(workload, smoke)
    buffers = {k: np.empty_like(v) for k, v in ws.items()}

    def memcpy() -> None:
        for k, v in ws.items():
            np.copyto(buffers[k], v)

    memcpy()  # touch the buffers once, as the snapshot buffers are after the first save
    copy = median_time(memcpy, repeats)
    session = LocalSession()
    session.workspace("trainer_0").update(ws)
    cm = CheckpointManager(str(root / f"async-{workload}"), "trainer_0", async_save=True)
    session.run(cm.init(["trainer_0"]))
    session.run(cm.save(0))  # allocates the snapshot buffers
    cm.wait_until_finished()
    times = []
    for epoch in range(1, repeats + 1):
        start = time.perf_counter()
        session.run(cm.save(epoch))
        times.append(time.perf_counter() - start)
        cm.wait_until_finished()  # not timed: runs while the next epoch trains
    return statistics.median(times), copy


def lookup(root: Path, epochs: int, repeats: int) -> float:
    prefix = str(root / "lookup")
    session = LocalSession()
    nodes = ["trainer_0", "trainer_1"]
    for node in nodes:
        session.workspace(node).update({"w": np.zeros(1024, np.float32), "step": np.int64(0)})
    cm = MultiNodeCheckpointManager(prefix)
    session.run(cm.init(nodes))
    for epoch in range(epochs):
        session.run(cm.save(epoch))

    def latest() -> None:
        handler = ZarrMetadataHandler()
        handler.set_params(db_prefix=prefix, db_type="zarr", node_names=nodes)
        assert handler.last_epoch() == epochs - 1

    latest()
    return median_time(latest, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-extras-")) / "extras"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    repeats = 2 if args.smoke else args.repeats
    epochs = 20 if args.smoke else args.epochs
    try:
        print(f"async save blocking time vs memcpy of the workspace (medians of {repeats})")
        print("| workload | blocking s | memcpy s | ratio |\n|---|---|---|---|")
        for workload in ("W1", "W2"):
            blocking, copy = async_blocking(workload, root, repeats, args.smoke)
            print(f"| {workload} | {blocking:.4f} | {copy:.4f} | {blocking / copy:.2f} |")
        seconds = lookup(root, epochs, repeats)
        print(f"\nlatest-epoch lookup, {epochs} committed epochs x 2 nodes, local disk: "
              f"{seconds * 1e3:.1f} ms (median of {repeats})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
