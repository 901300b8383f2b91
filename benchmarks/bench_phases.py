"""Where a save's and a restore's time goes, phase by phase, and what each must do at least.

    python benchmarks/bench_phases.py                              # W1s, W2s, W3 on a local disk
    python benchmarks/bench_phases.py --workloads W2s --repeats 9 --dir /tmp/bp
    python benchmarks/bench_phases.py --server moto                # the same on S3 (or seaweedfs)
    python benchmarks/bench_phases.py --scaling                    # against array count and size
    python benchmarks/bench_phases.py --smoke                      # seconds, for CI

Workloads as in bench_checkpoint.py (W1s = 256 MiB in 8 arrays, W2s = 69 MiB in 200 mixed
arrays, W3 = 10,000 arrays of 1 KiB; W1 and W2 too). Each repetition times a durable save
(``session.run(cm.save(epoch))``) and, after the page cache is dropped (local disks, when
permitted), a restore (``cm.load(epoch)`` of a new manager whose ``init`` ran untimed), beside
raw: one file written and fsynced (file and directory), read back with ``readinto`` (on S3 one
``pipe`` / ``cat``).

Phases are the package's own functions, timed by wrapping them for the run (so the figures
include the wrapping, a few microseconds per call). A save runs its phases one after another on
the calling thread: **plan** (the manifest, the group's ``zarr.json``), **take path** (the
group's ``zarr.json`` created exclusively), **write** (every chunk and array ``zarr.json``, on the I/O threads), **flush**
(fdatasync of every file, fsync of every directory, on the I/O threads), **fence** (the run-log
check), **record** (the commit record, durable); **other** is the rest (the manager, the session,
the hint). A restore: **manifest** (the group's ``zarr.json`` read, its digest checked, parsed),
**allocate** (the destination arrays), **read** (every chunk read and its CRC32C checked, the
metadata files' digests checked, on the I/O threads; on object stores also the one listing that
checks chunk sizes before large destinations are populated), **unpack** (the arrays handed
back), **other**. Under each step, thread time summed over the I/O threads: chunk writes and
reads, the packed array's chunks assembled from its small blobs ("packing": joined when they
are tiny, else handed over as they are), CRC32C, flushes (which overlap: their sum can exceed
the step). Medians are taken per phase, so they need not add up to the step's ("other" may be
slightly negative).

``--scaling`` times caffe2ckpt and raw (total step times only) on float32 arrays of equal
size: 10, 100, 1,000 and 10,000 arrays holding 64 MiB in all, then 100 arrays holding 1, 16, 256
and 1,024 MiB.

"Must do at least" compares what the step did with raw's one file: files created and fsync
calls (local disks), requests and bytes (S3). Medians over ``--repeats`` (one untimed warm-up
first).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import drop_caches, make_workload, raw_load, raw_save

import caffe2ckpt
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.commit import protocol
from caffe2ckpt.store.format import packing, zarrgroup
from caffe2ckpt.store.read import group as groupread

NODE = "trainer_0"
SEED = 20240601
SAVE_PHASES = ("plan", "take path", "write", "flush", "fence", "record")
LOAD_PHASES = ("manifest", "allocate", "read", "unpack")
OPTIONS: dict = {}  # the saving manager's (--pack-threshold)
THREAD = ("chunk writes", "packing", "chunk reads", "CRC32C", "file flushes", "directory fsyncs")


class Clock:
    """Seconds per phase of the current step: wall time of calls on the stepping thread, thread
    time summed over the I/O threads; and counts of fsync calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.step: collections.Counter[str] = collections.Counter()
        self.fsyncs = 0

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.step[name] += seconds

    def timed(self, name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)
        return wrapper

    def counted(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.lock:
                self.fsyncs += 1
            return fn(*args, **kwargs)
        return wrapper

    def take(self) -> tuple[dict[str, float], int]:
        with self.lock:
            step, fsyncs = dict(self.step), self.fsyncs
            self.step.clear()
            self.fsyncs = 0
        return step, fsyncs


class _Crc:
    """google_crc32c as a module seen by one of ours, its calls timed."""

    def __init__(self, module, clock: Clock) -> None:
        self.value = clock.timed("CRC32C", module.value)
        self.extend = clock.timed("CRC32C", module.extend)


@contextlib.contextmanager
def instrumented(clock: Clock):
    """Wrap the phases' functions (module attributes, so callers see the wrappers) and
    os.fsync/os.fdatasync for the duration."""
    from caffe2ckpt.fs import localio

    patches = [
        (protocol, "plan_group", "plan"), (packing.Packed, "__getitem__", "packing"),
        (protocol.CheckpointStore, "_take_path", "take path"),
        (protocol, "write_arrays", "write"), (Location, "make_durable", "flush"),
        (protocol.runs, "check_fence", "fence"), (protocol, "write_record", "record"),
        (protocol.CheckpointStore, "manifest", "manifest"),
        (groupread, "_destinations", "allocate"), (groupread, "run_reads", "read"),
        (groupread, "_restored", "unpack"),
        (zarrgroup, "_write_chunk", "chunk writes"), (groupread, "_read_chunk", "chunk reads"),
        (localio, "_flush_file", "file flushes"), (localio, "_flush_dir", "directory fsyncs"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    saved += [(m, "google_crc32c", m.google_crc32c) for m in (zarrgroup, groupread)]
    saved += [(os, name, getattr(os, name)) for name in ("fsync", "fdatasync")]
    try:
        for owner, attr, name in patches:
            setattr(owner, attr, clock.timed(name, getattr(owner, attr)))
        for module in (zarrgroup, groupread):
            module.google_crc32c = _Crc(module.google_crc32c, clock)
        for name in ("fsync", "fdatasync"):
            setattr(os, name, clock.counted(getattr(os, name)))
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


# -- methods --------------------------------------------------------------------------------------

class LocalMethods:
    """caffe2ckpt on a local folder, and raw's one file there."""

    def __init__(self, root: str, ws: dict[str, np.ndarray]) -> None:
        self.root, self.ws = root, ws
        self.prefix = os.path.join(root, "caffe2ckpt")
        self.spec = {k: (v.shape, v.dtype) for k, v in ws.items()}
        self.session = caffe2ckpt.LocalSession()
        self.session.workspace(NODE).update(ws)
        self.cm = caffe2ckpt.CheckpointManager(self.prefix, NODE, **OPTIONS)
        self.session.run(self.cm.init([NODE]))
        self.rcm = self.rsession = None

    def save(self, epoch: int) -> None:
        self.session.run(self.cm.save(epoch))

    def prepare(self, epoch: int) -> None:
        self.rsession = caffe2ckpt.LocalSession()
        self.rcm = caffe2ckpt.CheckpointManager(self.prefix, NODE)
        self.rsession.run(self.rcm.init([NODE], retrieve_from_epoch=epoch))
        _cold()

    def restore(self, epoch: int) -> None:
        self.rsession.run(self.rcm.load(epoch))

    def saved(self, epoch: int) -> tuple[int, int]:
        """(files, bytes) of the epoch's group and its commit record."""
        files = [p for p in Path(self.prefix).rglob("*") if p.is_file()
                 and (f"{NODE}.{epoch}" in p.parts or p.name.startswith(f"{epoch:012d}."))]
        return len(files), sum(p.stat().st_size for p in files)

    def raw_path(self, epoch: int) -> str:
        return os.path.join(self.root, f"raw.{epoch}.bin")

    def raw_save(self, epoch: int) -> None:
        path = self.raw_path(epoch)
        raw_save(self.ws, path)
        for p in (path, self.root):
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def raw_prepare(self, epoch: int) -> None:
        _cold()

    def raw_restore(self, epoch: int) -> None:
        raw_load(self.raw_path(epoch), self.spec)

    def cleanup(self, epoch: int) -> None:  # caffe2ckpt's epochs stay: the history it saves on
        os.remove(self.raw_path(epoch))
        self.rcm = self.rsession = None


def _cold() -> None:
    with contextlib.suppress(OSError):
        drop_caches()


class S3Methods(LocalMethods):
    """caffe2ckpt on an S3 server on loopback, and raw's one ``pipe`` / ``cat`` there."""

    def __init__(self, server, ws: dict[str, np.ndarray]) -> None:
        import uuid

        self.server, self.ws = server, ws
        self.bucket = f"phases-{uuid.uuid4().hex[:12]}"
        self.fs = server.filesystem()
        self.fs.mkdir(self.bucket)
        self.prefix = f"s3://{self.bucket}/caffe2ckpt"
        self.spec = {k: (v.shape, v.dtype) for k, v in ws.items()}
        self.session = caffe2ckpt.LocalSession()
        self.session.workspace(NODE).update(ws)
        self.cm = caffe2ckpt.CheckpointManager(self.prefix, NODE, **OPTIONS,
                                               storage_options=server.options())
        self.session.run(self.cm.init([NODE]))
        self.rcm = self.rsession = None

    def prepare(self, epoch: int) -> None:
        self.rsession = caffe2ckpt.LocalSession()
        self.rcm = caffe2ckpt.CheckpointManager(
            self.prefix, NODE, storage_options=self.server.options(skip_instance_cache=True))
        self.rsession.run(self.rcm.init([NODE], retrieve_from_epoch=epoch))

    def saved(self, epoch: int) -> tuple[int, int]:
        sizes = self.fs.du(f"{self.bucket}/caffe2ckpt/{NODE}.{epoch}", total=False)
        return len(sizes) + 1, sum(sizes.values())  # + the record

    def raw_path(self, epoch: int) -> str:
        return f"{self.bucket}/raw.{epoch}.bin"

    def raw_save(self, epoch: int) -> None:
        self.fs.pipe({self.raw_path(epoch): b"".join(a.tobytes() for a in self.ws.values())})

    def raw_prepare(self, epoch: int) -> None:
        pass

    def raw_restore(self, epoch: int) -> None:
        data = self.fs.cat(self.raw_path(epoch))
        offset = 0
        for shape, dtype in self.spec.values():
            count = int(np.prod(shape, dtype=np.int64))
            np.frombuffer(data, dtype, count, offset).reshape(shape)
            offset += count * dtype.itemsize

    def cleanup(self, epoch: int) -> None:
        self.fs.rm_file(self.raw_path(epoch))
        self.rcm = self.rsession = None


# -- running --------------------------------------------------------------------------------------

def measure(step, clock: Clock, wire) -> dict[str, float]:
    """One timed step: its wall seconds ("total"), phases, fsyncs and (S3) requests."""
    gc.collect()
    clock.take()
    with wire() as counter:
        start = time.perf_counter()
        step()
        total = time.perf_counter() - start
    phases, fsyncs = clock.take()
    out = {"total": total, "fsyncs": float(fsyncs), **phases}
    if counter is not None:
        out["requests"] = float(counter.counts.requests)
        out["bytes up"], out["bytes down"] = float(counter.counts.up), float(counter.counts.down)
    return out


def run_workload(name: str, args, server) -> None:
    ws = make_workload(name, args.smoke)
    rows, saved = measure_workload(ws, args, server)
    report(name, len(ws), sum(a.nbytes for a in ws.values()), saved, rows, server)


def measure_workload(ws: dict[str, np.ndarray], args, server):
    """Every step of every repetition (order alternating), and the last save's (files, bytes)."""
    root = tempfile.mkdtemp(prefix="phases-", dir=args.dir)
    methods = LocalMethods(root, ws) if server is None else S3Methods(server, ws)
    clock = Clock()
    if server is None:
        wire = lambda: contextlib.nullcontext()  # noqa: E731
    else:
        import s3wire

        wire = s3wire.WireCounter
    rows: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    saved = (0, 0)
    with instrumented(clock):
        for rep in range(-args.warmup, args.repeats):
            epoch = rep + args.warmup + 1
            saves = [("caffe2ckpt save", None, methods.save), ("raw save", None, methods.raw_save)]
            restores = [("caffe2ckpt restore", methods.prepare, methods.restore),
                        ("raw restore", methods.raw_prepare, methods.raw_restore)]
            for steps in (saves, restores):
                for what, prepare, step in (steps if rep % 2 else steps[::-1]):
                    if prepare is not None:
                        prepare(epoch)
                    result = measure(lambda s=step, e=epoch: s(e), clock, wire)
                    if rep >= 0:
                        rows[what].append(result)
                if steps is saves:
                    saved = methods.saved(epoch)
            methods.cleanup(epoch)
    if server is None:
        shutil.rmtree(root, ignore_errors=True)
    return rows, saved


def uniform(count: int, nbytes: int) -> dict[str, np.ndarray]:
    """``count`` float32 arrays of ``nbytes`` in all (seeded)."""
    rng = np.random.default_rng(SEED)
    return {f"gpu_0/a{i:05d}": rng.random(max(1, nbytes // count // 4), dtype=np.float32)
            for i in range(count)}


def run_scaling(args, server) -> None:
    """Save and restore time against the number of arrays at a fixed total, and against the
    total at a fixed number of arrays, for caffe2ckpt and raw."""
    mib = 1 << 20
    total, count = (4 * mib, 10) if args.smoke else (64 * mib, 100)
    counts = (10, 100) if args.smoke else (10, 100, 1_000, 10_000)
    sizes = (1, 4) if args.smoke else (1, 16, 256, 1024)
    where = "a local disk" if server is None else server.where
    for title, cases in ((f"arrays, {total // mib} MiB in all", [(c, total) for c in counts]),
                         (f"MiB in all, {count} arrays", [(count, m * mib) for m in sizes])):
        print(f"\n## Scaling on {where}: save and restore ms against {title}; medians of "
              f"{args.repeats}\n")
        print("| arrays | MiB | caffe2ckpt save | raw save | x raw | caffe2ckpt restore | "
              "raw restore | x raw |\n|---|---|---|---|---|---|---|---|")
        for arrays, nbytes in cases:
            rows, _ = measure_workload(uniform(arrays, nbytes), args, server)
            cells = []
            for step in ("save", "restore"):
                mine, raw = (_median(rows[f"{m} {step}"], "total") for m in ("caffe2ckpt", "raw"))
                cells.append(f"{mine * 1e3:.1f} | {raw * 1e3:.1f} | {raw / mine:.2f}")
            print(f"| {arrays:,} | {nbytes / mib:g} | {' | '.join(cells)} |", flush=True)


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


def report(name, count, nbytes, saved, rows, server) -> None:
    where = "a local disk" if server is None else server.where
    print(f"\n## {name}: {count} arrays, {nbytes / (1 << 20):.1f} MiB, on {where}; medians of "
          f"{len(rows['raw save'])} (ms)\n")
    for step, phases in (("save", SAVE_PHASES), ("restore", LOAD_PHASES)):
        mine, raw = rows[f"caffe2ckpt {step}"], rows[f"raw {step}"]
        total = _median(mine, "total")
        print(f"| {step} phase | ms | share |\n|---|---|---|")
        for phase in phases:
            value = _median(mine, phase)
            if value:
                print(f"| {phase} | {value * 1e3:.1f} | {value / total:.0%} |")
        main = sum(_median(mine, p) for p in phases)
        print(f"| other | {(total - main) * 1e3:.1f} | {(total - main) / total:.0%} |")
        print(f"| **total** | **{total * 1e3:.1f}** | raw {_median(raw, 'total') * 1e3:.1f} "
              f"({_median(raw, 'total') / total:.2f} x raw) |")
        summed = [f"{p} {_median(mine, p) * 1e3:.1f}" for p in THREAD if _median(mine, p)]
        print(f"\nI/O threads, summed (ms): {', '.join(summed) or 'none'}")
        print(f"What it does against raw: {_work(step, mine, raw, saved, server)}\n")


def _work(step, mine, raw, saved, server) -> str:
    if server is not None:
        return (f"{_median(mine, 'requests'):.0f} requests against raw's "
                f"{_median(raw, 'requests'):.0f}; bytes up {_median(mine, 'bytes up'):.0f} "
                f"against {_median(raw, 'bytes up'):.0f}, down {_median(mine, 'bytes down'):.0f} "
                f"against {_median(raw, 'bytes down'):.0f}")
    if step == "restore":
        return f"{saved[0]} files read against raw's 1"
    return (f"{saved[0]} files ({saved[1]} bytes, record included) and "
            f"{_median(mine, 'fsyncs'):.0f} fsync calls against raw's 1 file and "
            f"{_median(raw, 'fsyncs'):.0f} fsyncs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="W1s,W2s,W3")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dir", default=None, help="local folder (default: a temporary one)")
    parser.add_argument("--server", choices=("moto", "seaweedfs"), default=None,
                        help="measure on this S3 server on 127.0.0.1 instead of a local disk")
    parser.add_argument("--smoke", action="store_true", help="tiny workloads, 2 repetitions")
    parser.add_argument("--scaling", action="store_true",
                        help="instead of the workloads: time against array count and total size")
    parser.add_argument("--pack-threshold", type=int, default=None,
                        help="the saving manager's pack_threshold (default: the package's)")
    args = parser.parse_args(argv)
    if args.pack_threshold is not None:
        OPTIONS["pack_threshold"] = args.pack_threshold
    if args.smoke:
        args.repeats, args.warmup = 2, 0
    server = None
    if args.server is not None:
        import s3wire

        server = s3wire.start_server(kind=args.server)
    print(f"# {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    try:
        if args.scaling:
            run_scaling(args, server)
        for name in [] if args.scaling else args.workloads.split(","):
            run_workload(name, args, server)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
