"""Prefect's overhead per epoch: a trivial 2-node job with 3 task groups per epoch, run by
PrefectSession inside a flow against the same job on LocalSession (measured in the same run), on
Prefect's temporary local server (lean settings unless --default-services).

    python benchmarks/bench_prefect.py [--epochs 50 200 500] [--repeats 3] [--default-services]

For each epoch count, the sessions are measured in turn, ``--repeats`` times (interleaved, so a
change in the machine's load hits all of them alike), and the medians are printed:

- ``ms/group``: (time per epoch - LocalSession's) / 3 groups, over the whole flow;
- ``early``/``late``: the same over the first and the last quarter of the epochs (flat means
  late ~ early);
- ``+events``: ``ms/group`` including the time the flow then needs to send the events its
  epochs emitted but had not sent yet (Prefect's client sends events from a background queue that
  falls behind while tasks run back to back: ``backlog`` events at the end of the last epoch);
  before each flow the queue is drained, so a flow never pays for the previous one's events;
- ``cpu/grp``: like ``+events`` but CPU time instead of wall time, of the flow process and the
  server together (less sensitive to other processes on the machine; Linux only for the server);
- ``x local``: time per epoch against LocalSession's.

Sessions (each epoch's groups side by side in the flow run, ``group_epochs=False``, unless
said): heartbeats on (30 s) and off without artifacts, heartbeats off with the checkpoint
artifacts (a "saved" event per epoch, as JobRunner sends, updating the table and progress bar),
and heartbeats off with each epoch inside its parent task run ``epoch N`` (the default).
"""

from __future__ import annotations

import argparse
import atexit
import os
import resource
import shutil
import statistics
import tempfile
import time

if "PREFECT_HOME" not in os.environ:  # a Prefect home of its own, removed when it exits
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="bench-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

NODES = ("trainer_0", "trainer_1")
GROUPS = 3


def build_groups():
    from caffe2ckpt import Task, TaskGroup

    groups = []
    for g in range(GROUPS):
        group = TaskGroup(name=f"group{g}")
        for node in NODES:
            Task(lambda ws: None, name=f"noop{g}", group=group, node=node)
        groups.append(group)
    return groups


def run_epochs(session, epochs: int, *, saves: bool = False) -> list[float]:
    """Seconds of each epoch of running the 3 groups on ``session`` (with ``saves``, followed by
    a "saved" event carrying two nodes' commit records, as JobRunner sends after a save)."""
    from caffe2ckpt.session import RunEvent, run_epoch
    from caffe2ckpt.store.format.records import CommitRecord

    def event(kind: str, epoch: int, **info) -> RunEvent:
        return RunEvent(kind=kind, job="bench", epoch=epoch, max_epochs=epochs, **info)

    def one_epoch(epoch: int) -> None:
        session.notify(event("epoch", epoch))
        for group in groups:
            session.run(group)
        if saves:
            records = {n: CommitRecord(epoch=epoch, node=n, save_id="bench", nodes=list(NODES),
                                       nbytes=1 << 20, blob_count=4, seconds=0.01,
                                       metrics={"loss": 1 / epoch}) for n in NODES}
            session.notify(event("saved", epoch, records=records))

    groups = build_groups()
    if saves:
        session.notify(event("started", 0))
    times = []
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        run_epoch(session, epoch, lambda e=epoch: one_epoch(e))  # as JobRunner runs an epoch
        times.append(time.perf_counter() - start)
    if saves:
        session.notify(event("finished", epochs))
    return times


def cpu_seconds(pids: list[int]) -> float:
    """CPU time used so far by this process and ``pids`` (Linux /proc; others: this process)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def server_pids() -> list[int]:
    """This process's children (the temporary Prefect server), from /proc (Linux)."""
    me, pids = str(os.getpid()), []
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as stat:
                        if stat.read().rsplit(")", 1)[1].split()[1] == me:
                            pids.append(int(entry))
                except OSError:
                    continue
    except OSError:
        pass
    return pids


def events_backlog() -> int:
    """Events the client has queued but not sent yet (0 if Prefect's internals have moved)."""
    try:
        from prefect.events.worker import EventsWorker

        return sum(w._queue.qsize() for w in list(EventsWorker._instances.values())
                   if isinstance(w, EventsWorker))
    except Exception:  # noqa: BLE001 - private API: the bench then reports no backlog
        return 0


def drain_events(timeout: float = 300.0) -> float:
    """Wait until the client has sent its queued events; return the seconds waited."""
    start = time.perf_counter()
    while events_backlog() and time.perf_counter() - start < timeout:
        time.sleep(0.02)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, nargs="+", default=[50])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--default-services", action="store_true",
                        help="keep the server's task-run recorder and event persister on")
    args = parser.parse_args()
    if not args.default_services:
        os.environ["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED"] = "false"
        os.environ["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED"] = "false"

    import caffe2ckpt.prefect  # noqa: F401
    from prefect import flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from caffe2ckpt import LocalSession
    from caffe2ckpt.prefect import PrefectSession

    @flow(name="bench-overhead")
    def bench(epochs: int, artifacts: bool = False,
              grouped: bool = False) -> tuple[list[float], int, float, float]:
        cpu = cpu_seconds(server)
        times = run_epochs(PrefectSession(artifacts=artifacts, group_epochs=grouped), epochs,
                           saves=artifacts)
        backlog = events_backlog()
        drained = drain_events()
        return times, backlog, drained, cpu_seconds(server) - cpu

    sessions = {  # label: (heartbeat frequency, artifacts, an epoch task run around each epoch)
        "heartbeat on (30 s)": (30, False, False),
        "heartbeat off": (None, False, False),
        "heartbeat off, artifacts": (None, True, False),
        "heartbeat off, epoch tasks": (None, False, True),
    }
    server: list[int] = []
    bench(2)  # start the temporary server and warm up
    server += server_pids()
    bench(2, True)
    drain_events()
    services = "default services" if args.default_services else "lean server settings"
    load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(f"{len(NODES)} nodes x {GROUPS} groups, trivial tasks, median of {args.repeats}, "
          f"{services}; {load} at start")
    for epochs in args.epochs:
        local: list[float] = []
        local_cpu: list[float] = []
        runs: dict[str, list[tuple[float, ...]]] = {s: [] for s in sessions}
        for _ in range(args.repeats):
            cpu = cpu_seconds([])
            local.append(statistics.mean(run_epochs(LocalSession(), epochs)))
            local_cpu.append((cpu_seconds([]) - cpu) / epochs)
            for label, (freq, artifacts, grouped) in sessions.items():
                drain_events()
                with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: freq}):
                    start = time.perf_counter()
                    times, backlog, drained, cpu = bench(epochs, artifacts, grouped)
                    wall = time.perf_counter() - start
                quarter = max(len(times) // 4, 1)
                runs[label].append((statistics.mean(times), statistics.mean(times[:quarter]),
                                    statistics.mean(times[-quarter:]), drained, wall, backlog,
                                    cpu / epochs))
        base, base_cpu = statistics.median(local), statistics.median(local_cpu)
        print(f"\n{epochs} epochs: LocalSession {base * 1e3:.2f} ms/epoch "
              f"({base_cpu * 1e3:.2f} ms CPU)")
        print(f"{'PrefectSession':<27}{'ms/epoch':>9}{'ms/group':>9}{'early':>7}{'late':>7}"
              f"{'+events':>8}{'cpu/grp':>8}{'x local':>9}{'backlog':>8}{'flow s':>7}")
        for label, results in runs.items():
            def med(i: int, results: list = results) -> float:
                return statistics.median(r[i] for r in results)

            def per_group(seconds: float, base: float = base) -> float:
                return (seconds - base) * 1e3 / GROUPS

            with_events = statistics.median(r[0] + r[3] / epochs for r in results)
            print(f"{label:<27}{med(0) * 1e3:>9.2f}{per_group(med(0)):>9.2f}"
                  f"{per_group(med(1)):>7.2f}{per_group(med(2)):>7.2f}"
                  f"{per_group(with_events):>8.2f}{(med(6) - base_cpu) * 1e3 / GROUPS:>8.2f}"
                  f"{med(0) / base:>8.0f}x{med(5):>8.0f}"
                  f"{med(4):>7.2f}")
    print("\nload average {:.2f} {:.2f} {:.2f} at the end".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
