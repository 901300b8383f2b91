"""Chaos for DaskSession's memory tier: random worker kills at random points of a real job on a
3-worker LocalCluster, each run compared with an uninterrupted one.

    python benchmarks/chaos_memory_tier.py [--trials 100] [--seed 0] [--dir DIR]

Each trial draws, from its seed: one or two victim nodes (two: a node and, in a ring of three,
its buddy or the node it is buddy of), the epoch they die in, where (``epoch``: at the start of
the epoch's task, possibly before the copy of the epoch before reached its buddy; ``copied``:
once it did; ``save``: in the epoch's save, before its commit record; ``committed``: right after
it), the save interval (1-3 epochs) and sync or async saves. The run must end where the
uninterrupted run ends (every node's workspace equal, dtype and memory order included; once
storage gave the nodes back, each holds only what its save holds, as after any resume), commit
the same epochs with the same contents, report no failed save, and every recovery it reports
must go back to an epoch no older than its newest commit and older than the one that lost
nodes, unless that one was committed (then from storage, to it); a ``copied`` loss of one node must come back from memory, to the epoch before.

Prints one line per trial and a summary; exits 1 on the first wrong result (its seed reproduces
it: ``--trials 1 --seed N``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WHERE = ("epoch", "copied", "save", "committed")


def draw(seed: int, epochs: int) -> dict:
    rng = random.Random(seed)
    where = rng.choice(WHERE)
    interval = rng.choice((1, 2, 3))
    saved = [e for e in range(1, epochs + 1) if e % interval == 0 or e == epochs]
    victims = rng.sample(["trainer_0", "trainer_1", "trainer_2"], rng.choice((1, 1, 1, 2)))
    if where in ("save", "committed"):
        victims = victims[:1]
    die_at = rng.choice(saved) if where in ("save", "committed") else rng.randint(1, epochs)
    return {"where": where, "interval": interval, "victims": victims, "die_at": die_at,
            "async_save": rng.random() < 0.5}


def trial(seed: int, client, root: Path, reference: tuple) -> str:
    from caffe2ckpt import JobRunner, MultiNodeCheckpointManager, events
    from caffe2ckpt.dask import DaskSession
    from caffe2ckpt.fs.location import Location
    from caffe2ckpt.policy import StepManagerOptions
    from caffe2ckpt.store.commit.protocol import CheckpointStore
    from tests.daskcluster import die_after_commit, die_before_commit, undo_die_before_commit
    from tests.stores import load
    from tests.tierjobs import EPOCHS, NODES, Recoveries, dict_of, job, markers, same

    plan = draw(seed, EPOCHS)
    where, victims, die_at = plan["where"], plan["victims"], plan["die_at"]
    work = root / f"trial-{seed}"
    work.mkdir()
    expected, ref = reference
    die: dict[str, str] = {}
    if where in ("epoch", "copied"):
        die = markers(work, *victims)
    else:
        marker = work / "die-in-save"
        marker.touch()
        hook = die_before_commit if where == "save" else die_after_commit
        client.run(hook, str(marker), victims[0], die_at)
    heard = Recoveries()
    unsubscribe = events.subscribe(heard)
    url = str(work / "ckpt")
    try:
        with DaskSession(client, memory_tier=True) as session:
            runner = JobRunner(job(die, die_at, buddied=where == "copied"),
                               MultiNodeCheckpointManager(url, async_save=plan["async_save"]),
                               options=StepManagerOptions(save_interval_steps=plan["interval"]))
            assert runner.train(session) == EPOCHS
            final = {node: dict_of(session, node) for node in NODES}
    finally:
        unsubscribe()
        if where in ("save", "committed"):
            undo_die_before_commit(client)
    saved = sorted({0, *(e for e in range(1, EPOCHS + 1)
                         if e % plan["interval"] == 0 or e == EPOCHS)})
    assert sorted(set(runner.saved_epochs)) == saved, (runner.saved_epochs, saved)
    assert runner.failed_saves == [], runner.failed_saves
    store = CheckpointStore(Location(url))
    for epoch in saved:
        for node in NODES:
            assert same(load(store, node, epoch), load(ref, node, epoch)), (node, epoch)
    for node in NODES:  # once storage gave the nodes back, they hold only what the save holds
        keep = set(load(ref, node, EPOCHS)) if any(
            r["source"] == "storage" for r in heard.seen) else final[node]
        assert same({k: v for k, v in final[node].items() if k in keep},
                    {k: v for k, v in expected[node].items() if k in keep}), node
    for r in heard.seen:  # never older than storage; the failed epoch only once committed
        assert (r["stored"] or 0) <= r["epoch"] <= r["failed_epoch"], r
        assert r["epoch"] < r["failed_epoch"] or (r["source"], r["stored"]) == (
            "storage", r["failed_epoch"]), r
    if where == "copied" and len(victims) == 1:
        assert [(r["source"], r["epoch"]) for r in heard.seen] == [("memory", die_at - 1)], \
            heard.seen
    client.wait_for_workers(3, timeout=120)
    return (f"{plan} -> " + ", ".join(f"{r['source']} {r['epoch']} (lost {r['lost']} in "
                                      f"{r['failed_epoch']})" for r in heard.seen))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    from tests.daskcluster import client_of, local_cluster
    from tests.tierjobs import reference

    root = Path(tempfile.mkdtemp(prefix="chaos-tier-", dir=args.dir))
    uninterrupted = reference(root)  # saves every epoch: any trial's saves are compared
    kinds: dict[str, int] = {}
    start = time.monotonic()
    with local_cluster(3) as cluster, client_of(cluster) as client:
        for seed in range(args.seed, args.seed + args.trials):
            try:
                line = trial(seed, client, root, uninterrupted)
            except Exception as exc:  # noqa: BLE001 - every failure is a wrong result
                traceback.print_exc()
                print(f"seed {seed}: WRONG: {type(exc).__name__}: {exc}", flush=True)
                return 1
            for source in ("memory", "storage"):
                kinds[source] = kinds.get(source, 0) + line.count(f"{source} ")
            print(f"seed {seed}: {line}", flush=True)
    print(f"{args.trials} trials, {sum(kinds.values())} recoveries ({kinds}), 0 wrong, "
          f"{time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
