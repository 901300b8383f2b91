"""Prefect's overhead per epoch: a trivial 2-node job with 3 task groups per epoch, run by
PrefectSession inside a flow against the same job on LocalSession, with flow heartbeats on and
off, on Prefect's temporary local server (lean settings unless --default-services).

    python benchmarks/bench_prefect.py [--epochs 50] [--repeats 3] [--default-services]

Prints medians of the per-epoch time and the overhead per epoch and per group run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="bench-prefect-"))
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


def run_epochs(session, epochs: int) -> float:
    """Seconds per epoch of running the 3 groups on ``session``."""
    from caffe2ckpt.session import RunEvent

    groups = build_groups()
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        session.notify(RunEvent(kind="epoch", job="bench", epoch=epoch))
        for group in groups:
            session.run(group)
    return (time.perf_counter() - start) / epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=50)
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
    def bench(epochs: int) -> float:
        return run_epochs(PrefectSession(artifacts=False), epochs)

    bench(2)  # start the temporary server and warm up
    local = statistics.median(run_epochs(LocalSession(), args.epochs)
                              for _ in range(args.repeats))
    results = {}
    for label, freq in (("heartbeat on (30 s)", 30), ("heartbeat off", None)):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: freq}):
            per_epoch, wall = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                per_epoch.append(bench(args.epochs))
                wall.append(time.perf_counter() - start)
        results[label] = (statistics.median(per_epoch), statistics.median(wall))

    services = "default services" if args.default_services else "lean server settings"
    print(f"{len(NODES)} nodes x {GROUPS} groups, trivial tasks, {args.epochs} epochs, "
          f"median of {args.repeats}, {services}")
    print(f"{'session':<28}{'ms/epoch':>10}{'overhead ms/epoch':>20}{'ms/group':>10}"
          f"{'flow run wall s':>17}")
    print(f"{'LocalSession':<28}{local * 1e3:>10.2f}{'-':>20}{'-':>10}{'-':>17}")
    for label, (per_epoch, wall) in results.items():
        overhead = (per_epoch - local) * 1e3
        print(f"{'PrefectSession, ' + label:<28}{per_epoch * 1e3:>10.2f}{overhead:>20.2f}"
              f"{overhead / GROUPS:>10.2f}{wall:>17.2f}")


if __name__ == "__main__":
    main()
