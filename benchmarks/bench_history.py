"""Cost independent of history: a tiny 2-node job's per-epoch time as its history grows, the
resume of a finished job with a long history, and the S3 requests of a latest-epoch lookup at two
history sizes.

    python benchmarks/bench_history.py --dir /tmp/bh                  # 3,000 epochs; S3: 30, 300
    python benchmarks/bench_history.py --epochs 1000 --s3-epochs 30,100
    python benchmarks/bench_history.py --no-s3                        # local parts only
    python benchmarks/bench_history.py --smoke                        # seconds, for CI

Targets (storage model 3): per-epoch cost at epochs 2,700-3,000 within 1.2x of epochs 1-300;
resume of a finished job with 3,000 committed epochs in <= 0.5 s locally; latest-epoch lookup in
O(1) object-store requests in the common case (the same small number at both history sizes).

The job: nodes ``trainer_0`` and ``trainer_1``, each with three small blobs (64 float32, a float32,
an int64) updated every epoch, ``epoch_limiter(job, epochs)`` on trainer_0; ``JobRunner(job,
MultiNodeCheckpointManager(prefix)).train(LocalSession())``, every epoch saved, no retention.

1. Per-epoch time, local disk (``--dir``): a task at the start of trainer_0's epoch group records
   ``time.perf_counter()``; epoch e's cost is the time from its task to the next epoch's, i.e. the
   save of epoch e plus the next epoch's group run. Printed: medians over epochs 1..W and over the
   last W epochs (W = 300, or a tenth of ``--epochs`` if smaller), their ratio, medians per tenth of
   the run, and the same job without a checkpoint manager as the baseline.
2. Resume: a new job (same definition), session, manager and ``JobRunner`` on the finished
   prefix; ``train()`` timed end to end (it loads the newest epoch, sees the stop condition met
   and runs no epoch; each resume adds a run to the prefix's log). Median of ``--repeats``.
3. S3 (moto's server in a child process on 127.0.0.1, see bench_s3.py; needs the ``test``
   extra): the same job trained to each size of ``--s3-epochs`` on its own prefix (its per-epoch
   requests and time, early and late, are printed too); then, counted with s3wire.py, a fresh
   ``ZarrMetadataHandler(storage_options=...)``: ``set_params(...)`` + ``last_epoch()``, and a fresh
   manager's ``set_params(nodes)`` + ``get_resume_from_epoch_id()``, each on a new s3fs client
   (``skip_instance_cache``: nothing cached from the saves, like a new process); then the
   requests of a resume of the finished job there; last, the handler's lookup once more, after
   that resume (a run that claimed the prefix and saved nothing: the hint's save is no longer
   the newest run's).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from caffe2ckpt import (
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    epoch_limiter,
)
from caffe2ckpt.metadata import ZarrMetadataHandler

NODES = ["trainer_0", "trainer_1"]


def build_job(epochs: int, clock: list | None = None, probe=None) -> Job:
    """The tiny 2-node job; with ``clock``, trainer_0's epoch group first appends
    ``(time.perf_counter(), probe())`` to it."""
    def init(ws):
        ws["model/w"] = np.zeros(64, np.float32)
        ws["model/b"] = np.float32(0.0)
        ws["step"] = np.int64(0)

    def train(ws):
        ws["model/w"] = ws["model/w"] + np.float32(0.5)
        ws["model/b"] = np.float32(ws["model/b"] + 1)
        ws["step"] = np.int64(ws["step"] + 1)

    with Job(name="tiny") as job:
        for node in NODES:
            with Node(node):
                with job.init_group:
                    Task(init, name="init")
                if clock is not None and node == NODES[0]:
                    Task(lambda ws: clock.append((time.perf_counter(),
                                                  probe() if probe else None)), name="clock")
                Task(train, name="train")
        with Node(NODES[0]):
            epoch_limiter(job, epochs)
    return job


def per_epoch(clock) -> list[float]:
    """Seconds of epochs 1..n-1 (epoch e: from its clock tick to the next epoch's)."""
    return [b[0] - a[0] for a, b in itertools.pairwise(clock)]


def train(prefix: str, epochs: int, probe=None, **options) -> tuple[list, float]:
    clock: list = []
    cm = MultiNodeCheckpointManager(prefix, **options)
    start = time.perf_counter()
    final = JobRunner(build_job(epochs, clock, probe), cm).train(LocalSession())
    seconds = time.perf_counter() - start
    if final != epochs:
        raise SystemExit(f"the job ended at epoch {final}, not {epochs}")
    return clock, seconds


def resume(prefix: str, epochs: int, **options) -> float:
    cm = MultiNodeCheckpointManager(prefix, **options)
    runner = JobRunner(build_job(epochs), cm)
    start = time.perf_counter()
    final = runner.train(LocalSession())
    seconds = time.perf_counter() - start
    if final != epochs or runner.resumed_from != epochs:
        raise SystemExit(f"the resume ended at {final} (resumed from {runner.resumed_from}), "
                         f"not at the finished epoch {epochs}")
    return seconds


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


# -- 1 and 2: local disk -----------------------------------------------------------------------

def local_part(args, root: Path) -> None:
    epochs, window = args.epochs, args.window
    baseline = []
    job = build_job(epochs, baseline)
    JobRunner(job, None).train(LocalSession())
    base = statistics.median(per_epoch(baseline))

    prefix = str(root / "history")
    clock, seconds = train(prefix, epochs)
    times = per_epoch(clock)  # epochs 1 .. epochs-1
    early = statistics.median(times[:window])
    late = statistics.median(times[-window:])
    n = len(times)
    print(f"\nper-epoch time of a 2-node tiny job, {epochs} epochs saved on local disk "
          f"({os.path.abspath(args.dir)}), no retention; trained in {seconds:.1f} s")
    print(f"| epochs | median ms per epoch |\n|---|---|\n| 1-{window} | {ms(early)} |\n"
          f"| {n - window + 1}-{n} | {ms(late)} |")
    print(f"per-epoch cost, last {window} epochs / first {window}: {late / early:.2f} "
          f"(target <= 1.2); without a checkpoint manager: {ms(base)} ms per epoch")
    tenth = max(1, n // 10)
    print(f"median ms per epoch by tenth of the run ({tenth} epochs each): " + ", ".join(
        ms(statistics.median(times[i:i + tenth])) for i in range(0, tenth * 10, tenth)
        if times[i:i + tenth]))

    handler = ZarrMetadataHandler()
    handler.set_params(db_prefix=prefix, db_type="zarr", node_names=NODES)
    lookups = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        latest = handler.last_epoch()
        lookups.append(time.perf_counter() - start)
    assert latest == epochs, latest
    resumes = [resume(prefix, epochs) for _ in range(args.repeats)]
    print(f"resume of the finished job ({epochs} committed epochs x 2 nodes, local disk): "
          f"{statistics.median(resumes):.3f} s (median of {args.repeats}, fastest "
          f"{min(resumes):.3f} s; target <= 0.5 s); its latest-epoch lookup alone "
          f"(ZarrMetadataHandler.last_epoch): {ms(statistics.median(lookups))} ms")
    print(f"  each resume in order (s): {' '.join(f'{t:.3f}' for t in resumes)} (the first "
          "finds the hint its last save wrote; each later one follows a resume that claimed a "
          "run and saved nothing)")
    sys.stdout.flush()


# -- 3: S3 -------------------------------------------------------------------------------------

def s3_part(args) -> None:
    import s3wire

    try:
        s3wire.require_s3()
    except SystemExit as exc:
        print(f"\nS3 part skipped: {exc}")
        return
    server = s3wire.start_server("process")
    try:
        rows = []
        for epochs in args.s3_epochs:
            rows.append((epochs, s3_history(server, epochs, args)))
        errors = server.errors()
    finally:
        server.stop()
    print(f"\nlatest-epoch lookup on S3 (moto in a child process, 2 nodes, a new s3fs client "
          f"each time, whose creation the ms include): requests by operation, keys returned by "
          f"LISTs (medians of {args.repeats})")
    print("| committed epochs | handler set_params + last_epoch | requests | keys listed | ms | "
          "manager set_params + get_resume_from_epoch_id | requests | keys listed | ms | resume "
          "train() requests | keys listed | resume s |\n" + "|---" * 12 + "|")
    for epochs, r in rows:
        h, m, res = r["handler"], r["manager"], r["resume"]
        print(f"| {epochs} | {h[0]} | {h[1]:g} | {h[3]:g} | {ms(h[2])} | {m[0]} | {m[1]:g} | "
              f"{m[3]:g} | {ms(m[2])} | {res[1]:g} ({res[0]}) | {res[3]:g} | {res[2]:.2f} |")
    (small, a), (large, b) = rows[0], rows[-1]
    print(f"latest-epoch lookup requests on S3 at {small} and {large} committed epochs: "
          f"{a['handler'][1]:g} and {b['handler'][1]:g} (target: the same small number); keys "
          f"listed {a['handler'][3]:g} and {b['handler'][3]:g} (a LIST page holds 1,000)")
    for epochs, r in rows:
        print(f"  requests by phase at {epochs} epochs (s3wire.phase): lookup: "
              f"{r['lookup_phases']}; resume: {r['resume_phases']}")
    a, b = rows[0][1]["after_resume"], rows[-1][1]["after_resume"]
    print(f"latest-epoch lookup on S3 after a resume that saved nothing (the finished job's: "
          f"a newer run than the hint's save, which committed nothing) at {small} and {large} "
          f"committed epochs: {a[0]:g} and {b[0]:g} requests, keys listed {a[1]:g} and {b[1]:g}, "
          f"{ms(a[2])} and {ms(b[2])} ms (by phase at {large}: {b[3]})")
    if errors:
        print(f"note: the server failed {errors} requests with an exception (moto's LIST/DELETE "
              "race between the two nodes' saves: a 500 that the client retried)")
    print("S3 saves of the same job as history grows (each epoch: 2 node-saves):")
    for epochs, r in rows:
        print(f"  {epochs} epochs: requests per epoch, first {r['w']} / last {r['w']}: "
              f"{r['req_early']:g} / {r['req_late']:g}; LIST per epoch {r['list_early']:g} / "
              f"{r['list_late']:g} returning {r['keys_early']:g} / {r['keys_late']:g} keys; "
              f"ms per epoch {ms(r['t_early'])} / {ms(r['t_late'])}; "
              f"built in {r['build']:.1f} s")
    sys.stdout.flush()


def s3_history(server, epochs: int, args) -> dict:
    import s3wire

    bucket = f"hist-{uuid.uuid4().hex[:12]}"
    admin = server.filesystem()
    admin.mkdir(bucket)
    url = f"s3://{bucket}/job"
    options = server.options()
    fresh = server.options(skip_instance_cache=True)  # a new client: no listings cached
    with s3wire.WireCounter() as wire:
        def probe():
            c = wire.counts
            return c.requests, c.ops["ListObjectsV2"] + c.ops["ListObjects"], c.listed
        clock, seconds = train(url, epochs, probe, storage_options=options)
    counts = [tuple(y - x for x, y in zip(a[1], b[1])) for a, b in itertools.pairwise(clock)]
    times = per_epoch(clock)
    w = max(1, min(10, len(times) // 3))
    out = {"build": seconds, "w": w,
           "req_early": statistics.median(c[0] for c in counts[:w]),
           "req_late": statistics.median(c[0] for c in counts[-w:]),
           "list_early": statistics.median(c[1] for c in counts[:w]),
           "list_late": statistics.median(c[1] for c in counts[-w:]),
           "keys_early": statistics.median(c[2] for c in counts[:w]),
           "keys_late": statistics.median(c[2] for c in counts[-w:]),
           "t_early": statistics.median(times[:w]), "t_late": statistics.median(times[-w:])}

    def handler_lookup():
        handler = ZarrMetadataHandler(storage_options=fresh)
        handler.set_params(db_prefix=url, db_type="zarr", node_names=NODES)
        return handler.last_epoch()

    def manager_lookup():
        cm = MultiNodeCheckpointManager(url, storage_options=fresh)
        cm.set_params(NODES)
        return cm.get_resume_from_epoch_id()

    for key, fn in (("handler", handler_lookup), ("manager", manager_lookup)):
        results = []
        for _ in range(args.repeats):
            with s3wire.WireCounter() as wire:
                start = time.perf_counter()
                latest = fn()
                seconds = time.perf_counter() - start
            if latest != epochs:
                raise SystemExit(f"{key} lookup on S3 found epoch {latest}, not {epochs}")
            results.append((wire.counts, seconds))
        out[key] = _summary(results)
        if key == "handler":
            last_lookup = results[-1][0]
    with s3wire.WireCounter() as wire:  # once: it adds a run to the prefix
        seconds = resume(url, epochs, storage_options=fresh)
    out["resume"] = (wire.counts.by_op(), wire.counts.requests, seconds, wire.counts.listed)
    out["resume_phases"] = wire.counts.by_phase()
    out["lookup_phases"] = last_lookup.by_phase()
    with s3wire.WireCounter() as wire:  # the resume claimed a run and saved nothing
        start = time.perf_counter()
        latest = handler_lookup()
        seconds = time.perf_counter() - start
    if latest != epochs:
        raise SystemExit(f"lookup after the resume found epoch {latest}, not {epochs}")
    out["after_resume"] = (wire.counts.requests, wire.counts.listed, seconds,
                           wire.counts.by_phase())
    admin.rm(bucket, recursive=True)
    return out


def _summary(results):
    """(requests by op, total requests, seconds): medians over repetitions."""
    ops = sorted({op for c, _ in results for op in c.ops},
                 key=lambda op: -statistics.median(c.ops[op] for c, _ in results))
    by_op = ", ".join(f"{op} {statistics.median(c.ops[op] for c, _ in results):g}" for op in ops)
    return (by_op or "none", statistics.median(c.requests for c, _ in results),
            statistics.median(s for _, s in results),
            statistics.median(c.listed for c, _ in results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the local prefix is written")
    ap.add_argument("--epochs", type=int, default=None, help="local history (default 3000)")
    ap.add_argument("--window", type=int, default=None,
                    help="epochs compared at the start and end (default min(300, epochs/10))")
    ap.add_argument("--repeats", type=int, default=None, help="resumes and lookups (default 5)")
    ap.add_argument("--s3-epochs", default=None,
                    help="comma-separated S3 history sizes (default 30,300)")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 part")
    ap.add_argument("--smoke", action="store_true", help="20 epochs, S3 histories of 3 and 6")
    args = ap.parse_args()
    args.epochs = args.epochs or (20 if args.smoke else 3000)
    args.window = args.window or max(1, min(300, args.epochs // 10))
    args.repeats = args.repeats or (1 if args.smoke else 5)
    args.s3_epochs = sorted(int(x) for x in (args.s3_epochs or ("3,6" if args.smoke
                                                                else "30,300")).split(","))
    if args.epochs < 3 or args.window > args.epochs // 2:
        raise SystemExit("--epochs must be at least 3 and at least twice --window")
    have = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    versions = [f"{m} {have[m]}" for m in ("numpy", "zarr", "fsspec", "s3fs", "moto",
                                           "caffe2ckpt") if m in have]
    rev = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "describe",
                          "--always", "--dirty"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"# {' '.join([os.path.basename(sys.executable)] + sys.argv)}  (git {rev or '?'})")
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{', '.join(versions)}; loadavg {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          + ", smoke" * args.smoke)
    args.dir = args.dir or tempfile.gettempdir()
    os.makedirs(args.dir, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-history-", dir=args.dir))
    try:
        local_part(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.no_s3:
        print("\nS3 part skipped (--no-s3)")
    else:
        s3_part(args)


if __name__ == "__main__":
    main()
