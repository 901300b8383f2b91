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

With ``--flow``, each trial kills the flow process instead: a process running the job against
the cluster (saves every 1-3 epochs, sync or async, copies kept 120 s) is SIGKILLed at a random
moment of its run, and a new session in this process resumes the job. Once the dead process's
actors are gone, the trial computes, from what the workers keep, the newest epoch of which every
node has a complete copy of the dead run at or after its newest commit; the resume must take
exactly that epoch from memory (or the newest commit from storage when there is none), commit it
before training on, end where the uninterrupted run ends and commit the same contents.

Prints one line per trial and a summary; exits 1 on the first wrong result (its seed reproduces
it: ``--trials 1 --seed N``).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
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


def flow_trial(seed: int, client, root: Path, reference: tuple) -> str:
    """A flow process killed at a random moment; a new session resumes (see the docstring)."""
    from caffe2ckpt import JobRunner, MultiNodeCheckpointManager, events
    from caffe2ckpt.dask import DaskSession
    from caffe2ckpt.fs.location import Location
    from caffe2ckpt.policy import StepManagerOptions
    from caffe2ckpt.store.commit.protocol import CheckpointStore
    from tests.stores import load
    from tests.tierjobs import EPOCHS, NODES, Recoveries, dict_of, job, same

    rng = random.Random(seed)
    interval, async_save, delay = rng.choice((1, 2, 3)), rng.random() < 0.5, rng.uniform(0, 1.8)
    work = root / f"trial-{seed}"
    work.mkdir()
    url = str(work / "ckpt")
    flow = subprocess.Popen([sys.executable, __file__, "--run-flow", client.scheduler.address,
                             url, str(interval), str(int(async_save))],
                            stdout=subprocess.PIPE, text=True)
    assert flow.stdout is not None and flow.stdout.readline().strip() == "ready"
    time.sleep(delay)
    flow.send_signal(signal.SIGKILL)
    finished = flow.wait() == 0
    expected_epoch, stored = _newest_recoverable(client, url)
    heard = Recoveries(events.RUN_RESUMED)
    unsubscribe = events.subscribe(heard)
    options = StepManagerOptions(save_interval_steps=interval)
    try:
        with DaskSession(client, memory_tier=True) as session:
            runner = JobRunner(job(), MultiNodeCheckpointManager(url, async_save=async_save),
                               options=options)
            assert runner.train(session) == EPOCHS
            final = {node: dict_of(session, node) for node in NODES}
    finally:
        unsubscribe()
    expected, ref = reference
    resumed = [(r["source"], r["epoch"], r["stored"]) for r in heard.seen]
    if stored is None:
        assert resumed == [], resumed
    elif expected_epoch is None:
        assert resumed == [("storage", stored, stored)], (resumed, stored)
    else:
        assert resumed == [("memory", expected_epoch, stored)], (resumed, expected_epoch)
        assert expected_epoch == stored or expected_epoch in runner.saved_epochs, \
            runner.saved_epochs  # persisted before training on
    store = CheckpointStore(Location(url))
    for epoch in [*runner.saved_epochs, *([] if stored is None else [stored])]:
        for node in NODES:
            assert same(load(store, node, epoch), load(ref, node, epoch)), (node, epoch)
    storage = bool(resumed) and resumed[0][0] == "storage"
    for node in NODES:
        keep = set(load(ref, node, EPOCHS)) if storage else final[node]
        assert same({k: v for k, v in final[node].items() if k in keep},
                    {k: v for k, v in expected[node].items() if k in keep}), node
    return (f"interval {interval}, async {async_save}, kill at {delay:.2f} s"
            f"{' (it had finished)' if finished else ''} -> "
            + (", ".join(f"{src} {e} (storage holds {st})" for src, e, st in resumed)
               or "fresh start"))


def _newest_recoverable(client, url: str) -> tuple[int | None, int | None]:
    """Once the dead process's actors are gone: the newest epoch at or after the newest commit
    of which every node has a complete copy of the dead run in worker memory (None: none),
    and the newest commit (None: none)."""
    from caffe2ckpt.dask import tier
    from caffe2ckpt.fs.location import Location
    from caffe2ckpt.history.scan import newest_save
    from caffe2ckpt.session import tier_key
    from caffe2ckpt.store.commit.protocol import CheckpointStore
    from tests.tierjobs import NODES

    location = Location(url)
    key = tier_key(location.canonical_url)
    for _ in range(300):  # the scheduler releases the dead client's actors, a little later
        if all(client.run(_released, key).values()):
            break
        time.sleep(0.05)
    time.sleep(0.5)  # a digest or send of the last snapshot still under way ends
    save = newest_save(CheckpointStore(location), NODES)
    stored = None if save is None else save.epoch
    complete: dict[str, set[int]] = {}
    for entries in client.run(tier.kept, key).values():
        for e in entries:
            if e["complete"]:
                complete.setdefault(e["node"], set()).add(e["epoch"])
    common = set.intersection(*(complete.get(n, set()) for n in NODES))
    common = {e for e in common if stored is not None and e >= stored}
    return (max(common) if common else None), stored


def _released(key: str) -> bool:
    """On a worker: no actor holds copies for ``key`` any more."""
    import gc

    from caffe2ckpt.dask import tier
    gc.collect()
    with tier._kept_lock:
        return all(e.owner is None for (k, _), e in tier._kept.items() if k == key)


def run_flow(scheduler: str, url: str, interval: int, async_save: bool) -> None:
    """The flow process of a ``--flow`` trial."""
    from caffe2ckpt import JobRunner, MultiNodeCheckpointManager
    from caffe2ckpt.dask import DaskSession
    from caffe2ckpt.policy import StepManagerOptions
    from tests.tierjobs import job

    with DaskSession(scheduler, memory_tier=True, memory_tier_keep=120.0) as session:
        print("ready", flush=True)
        JobRunner(job(pace=0.2), MultiNodeCheckpointManager(url, async_save=async_save),
                  options=StepManagerOptions(save_interval_steps=interval)).train(session)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--flow", action="store_true", help="kill the flow process instead")
    parser.add_argument("--run-flow", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_flow:
        scheduler, url, interval, async_save = args.run_flow
        run_flow(scheduler, url, int(interval), async_save == "1")
        return 0
    from tests.daskcluster import client_of, local_cluster
    from tests.tierjobs import reference

    root = Path(tempfile.mkdtemp(prefix="chaos-tier-", dir=args.dir))
    uninterrupted = reference(root)  # saves every epoch: any trial's saves are compared
    kinds: dict[str, int] = {}
    start = time.monotonic()
    with local_cluster(3) as cluster, client_of(cluster) as client:
        for seed in range(args.seed, args.seed + args.trials):
            try:
                line = (flow_trial if args.flow else trial)(seed, client, root, uninterrupted)
            except Exception as exc:  # noqa: BLE001 - every failure is a wrong result
                traceback.print_exc()
                print(f"seed {seed}: WRONG: {type(exc).__name__}: {exc}", flush=True)
                return 1
            for source in ("memory", "storage", "fresh"):
                kinds[source] = kinds.get(source, 0) + line.count(f"> {source} ") + line.count(
                    f", {source} ")
            print(f"seed {seed}: {line}", flush=True)
    print(f"{args.trials} trials, {sum(kinds.values())} recoveries or resumes ({kinds}), 0 wrong, "
          f"{time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
