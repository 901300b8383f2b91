"""Benchmark caffe2ckpt save/restore side by side with raw file I/O, safetensors, np.savez and,
when they are installed, torch.save / torch.load and Orbax's PyTreeCheckpointer.

    /tmp/venv/bin/python benchmarks/bench_checkpoint.py --workloads W1 --repeats 5 --dir /tmp/bench
    /tmp/venv/bin/python benchmarks/bench_checkpoint.py --workloads W1,W2,W3 --dir /tmp/bench
    /tmp/venv/bin/python benchmarks/bench_checkpoint.py --smoke      # a few seconds, for CI

Workloads (seeded random data): W1 = 1 GiB in 8 float32 arrays of 128 MiB; W2 = 256 MiB in 200
arrays (8 float32 of 24 MiB + 192 float32/int64/float16 of 256 B..4 MiB, log-uniform, 64 MiB in
all); W3 = 10,000 float32 arrays of 1 KiB; W1s = 256 MiB in 8 float32 arrays of 32 MiB; W2s = 69
MiB in 200 arrays (8 float32 of 6 MiB + 192 as in W2 of 21 MiB in all). ``--smoke``: W1/W2 of 8 MiB, W3 of 500, 2 repetitions.

One run measures every method on the same disk, repetitions interleaved (order rotated). Per
repetition and method: time a durable save (files fsynced, then their directory; caffe2ckpt:
``session.run(cm.save(epoch))``, new epoch each time, which writes, fsyncs and commits); evict the
files from the page cache; time the restore (caffe2ckpt: new session and manager, untimed
``cm.init([node], retrieve_from_epoch=epoch)``, timed ``cm.load(epoch)``); verify every array
(untimed); delete the files, so at most one checkpoint is on disk. Before each timed restore the
page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``); if that is not permitted (or
with ``--warm``) all restores are warm, and the header and table titles say so.

Columns: medians; GB/s = 1e9 payload bytes/s; "x raw" = raw_time / method_time (>1: faster than
raw); "CPU s" = process CPU time (all threads, user + system) of the step, which disk noise barely
moves; "peak RSS" = this process's peak resident set during the method's steps, workspace included;
"+MiB" = that peak minus the RSS at the step's start (max over repetitions; freed heap is returned
to the OS between steps with malloc_trim). For W1 each method also saves and restores once in a
fresh subprocess: peak minus RSS at the start, for the save and for the restore (workspace freed,
so 1.00 x workspace is the restored data itself).
Peaks are VmHWM (what getrusage's ru_maxrss reports for a live process), reset before each step
via /proc/self/clear_refs: ru_maxrss cannot be reset and survives fork+exec (getrusage(2)).
One untimed warm-up repetition runs first (``--warmup``). Disk speed varies: compare ratios from
one run and read the per-repetition lines on stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    import safetensors.numpy
except ImportError:  # the table then has no safetensors row
    safetensors = None
try:
    import torch
except ImportError:  # the table then has no torch row (pip install torch==2.13.0 adds it)
    torch = None

MiB = 1 << 20
SEED = 20240601
NODE = "trainer_0"


def make_workload(name: str, smoke: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    if name in ("W1", "W1s"):
        n = (1 if smoke else 128 if name == "W1" else 32) * MiB // 4
        return {f"gpu_0/fc{i}_w": rng.random(n, dtype=np.float32) for i in range(8)}
    if name == "W2":
        scale = 32 if smoke else 1
        return _mixed(rng, 6144 // scale, 64 * MiB // scale)
    if name == "W2s":  # 69 MiB: 8 x 6 MiB and 192 arrays of 21 MiB in all
        return _mixed(rng, 192 if smoke else 1536, (2 if smoke else 21) * MiB)
    if name == "W3":
        return {f"gpu_0/b{i:05d}": rng.random(256, dtype=np.float32)
                for i in range(500 if smoke else 10_000)}
    raise SystemExit(f"unknown workload {name!r} (use W1, W1s, W2, W2s, W3)")


def _mixed(rng, conv_rows: int, small_total: int) -> dict[str, np.ndarray]:
    """8 float32 arrays of ``conv_rows`` x 1024 and 192 float32/int64/float16 arrays of 256 B
    to 4 MiB (log-uniform) holding ``small_total`` bytes: parameters and optimizer state."""
    ws = {f"gpu_0/conv{i}_w": rng.random((conv_rows, 1024), dtype=np.float32) for i in range(8)}
    weights = 2.0 ** rng.uniform(8, 22, 192)
    sizes = np.maximum(weights / weights.sum() * small_total // 8, 1).astype(np.int64) * 8
    sizes[-1] += small_total - sizes.sum()
    for i, nbytes in enumerate(sizes):
        dtype = np.dtype(np.int64 if i % 5 == 0 else np.float16 if i % 7 == 0 else np.float32)
        n = int(nbytes) // dtype.itemsize
        ws[f"gpu_0/p{i}_{dtype.name}"] = (rng.integers(0, 1 << 40, n) if dtype.kind == "i"
                                         else rng.random(n, dtype=np.float32).astype(dtype))
    return ws


# -- methods: save(ws, epoch), prepare(epoch) untimed, restore(epoch) -> mapping, cleanup(epoch) --

def _durable(path):  # fsync the file, then its directory
    for p in (path, os.path.dirname(path)):
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def raw_save(ws, path):
    with open(path, "wb") as f:
        for arr in ws.values():
            arr.tofile(f)


def raw_load(path, spec):
    out = {}
    with open(path, "rb", buffering=0) as f:
        for name, (shape, dtype) in spec.items():
            arr = out[name] = np.empty(shape, dtype)
            if f.readinto(arr) != arr.nbytes:  # one read(2) per array (< 2 GiB each here)
                raise EOFError(path)
    return out


def torch_save(ws, path):
    torch.save({k: torch.from_numpy(v) for k, v in ws.items()}, path)


def torch_load(path, spec):
    return {k: t.numpy() for k, t in torch.load(path, weights_only=True).items()}


def npz_load(path, spec):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


class FileMethod:
    def __init__(self, name, ext, save_fn, load_fn, root, ws):
        self.name, self.ext, self.root = name, ext, root
        self.save_fn, self.load_fn = save_fn, load_fn
        self.spec = {k: (v.shape, v.dtype) for k, v in ws.items()}

    def path(self, epoch):
        return os.path.join(self.root, f"{self.name}.{epoch}{self.ext}")

    def save(self, ws, epoch):
        self.save_fn(ws, self.path(epoch))
        _durable(self.path(epoch))

    def prepare(self, epoch):  # nothing untimed to do
        pass

    def restore(self, epoch):
        return self.load_fn(self.path(epoch), self.spec)

    def cleanup(self, epoch):
        os.remove(self.path(epoch))


class Caffe2Ckpt:
    name = "caffe2ckpt"

    def __init__(self, root, ws):
        import caffe2ckpt
        self.c2, self.prefix = caffe2ckpt, os.path.join(root, "caffe2ckpt")
        self.session = caffe2ckpt.LocalSession()
        self.session.workspace(NODE).update(ws)  # the same arrays, not copies
        self.cm = caffe2ckpt.CheckpointManager(self.prefix, NODE)
        self.session.run(self.cm.init([NODE]))
        self.rsession = self.rcm = None

    def save(self, ws, epoch):
        self.session.run(self.cm.save(epoch))

    def prepare(self, epoch):
        self.rsession = self.c2.LocalSession()
        self.rcm = self.c2.CheckpointManager(self.prefix, NODE)
        self.rsession.run(self.rcm.init([NODE], retrieve_from_epoch=epoch))

    def restore(self, epoch):
        self.rsession.run(self.rcm.load(epoch))
        return self.rsession.workspace(NODE)

    def cleanup(self, epoch):  # the whole prefix: each save starts from an empty one
        shutil.rmtree(self.prefix)
        self.rsession = self.rcm = None


class Orbax:
    """Orbax's PyTreeCheckpointer (TensorStore, OCDBT) on the workspace as a flat dict (blob
    names with "/" spelled "|": Orbax reads "/" as nesting); durable like the others: every
    file it wrote, then every directory, fsynced after its save returns."""

    name = "orbax"

    def __init__(self, root, ws):
        import orbax.checkpoint as ocp  # here: importing jax costs seconds and starts threads

        self.root = root
        self.checkpointer = ocp.PyTreeCheckpointer()

    def path(self, epoch):
        return os.path.join(self.root, f"orbax.{epoch}")

    def save(self, ws, epoch):
        self.checkpointer.save(self.path(epoch), {k.replace("/", "|"): v for k, v in ws.items()})
        for directory, _, names in os.walk(self.path(epoch), topdown=False):
            for name in names:
                _durable(os.path.join(directory, name))
            _durable(directory)

    def prepare(self, epoch):
        pass

    def restore(self, epoch):
        tree = self.checkpointer.restore(self.path(epoch))
        return {k.replace("|", "/"): np.asarray(v) for k, v in tree.items()}

    def cleanup(self, epoch):
        shutil.rmtree(self.path(epoch))


def build_methods(root, ws, only=None):
    methods = [FileMethod("raw", ".bin", raw_save, raw_load, root, ws), Caffe2Ckpt(root, ws)]
    if safetensors is not None:
        methods.append(FileMethod("safetensors", ".safetensors", safetensors.numpy.save_file,
                                  lambda path, spec: safetensors.numpy.load_file(path), root, ws))
    if torch is not None:
        methods.append(FileMethod("torch", ".pt", torch_save, torch_load, root, ws))
    methods.append(FileMethod("np.savez", ".npz",  # uncompressed
                              lambda ws, path: np.savez(path, **ws), npz_load, root, ws))
    if importlib.util.find_spec("orbax") is not None:  # no row without it
        methods.append(Orbax(root, ws))
    return [m for m in methods if only is None or m.name == only]


# -- page cache and memory --------------------------------------------------------------------

def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def cache_mode(warm):
    try:
        return "warm" if warm else drop_caches() or "cold"
    except OSError:
        return "warm (drop_caches not permitted)"


def _status_bytes(key):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))


def measure(fn):
    """(result, (wall s, CPU s of all threads), peak RSS during fn, peak minus RSS at start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    except OSError:
        pass  # then peaks are lifetime peaks
    rss0, start, cpu = _status_bytes("VmRSS"), time.perf_counter(), time.process_time()
    out = fn()
    seconds = (time.perf_counter() - start, time.process_time() - cpu)
    peak = _status_bytes("VmHWM")
    return out, seconds, peak, peak - rss0


def release_memory():
    """Free what the last step left: caffe2ckpt's restored workspace sits in a reference cycle,
    and glibc keeps freed heap pages resident (which would hide the next step's peak)."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def verify(ws, out, name):
    for k, a in ws.items():
        if out[k].dtype != a.dtype or not np.array_equal(a, out[k]):  # shapes too
            raise SystemExit(f"{name}: blob {k!r} differs after restore")


# -- running ----------------------------------------------------------------------------------

def run_workload(wl, args, mode):
    ws = make_workload(wl, args.smoke)
    nbytes = sum(a.nbytes for a in ws.values())
    free = shutil.disk_usage(args.dir).free
    if free < 2 * nbytes + 2**30:
        raise SystemExit(f"only {free / 2**30:.1f} GiB free in {args.dir}: need twice the "
                         f"workspace ({nbytes / 2**30:.2f} GiB) + 1 GiB")
    root = tempfile.mkdtemp(prefix=f"bench-{wl}-", dir=args.dir)
    try:
        methods = build_methods(root, ws)
        keys = ("save", "load", "save_cpu", "load_cpu", "peak", "save_mem", "load_mem")
        res = {m.name: {k: [] for k in keys} for m in methods}
        reps, rep, slowest = args.repeats, -args.warmup, 0.0  # repetitions < 0: untimed warm-ups
        while rep < reps:
            epoch, k = rep + args.warmup + 1, rep % len(methods)
            for m in methods[k:] + methods[:k]:  # rotate the order: no method always goes first
                os.sync()  # start each save with no dirty pages of earlier steps pending
                _, (ts, cs), ps, ms = measure(lambda: m.save(ws, epoch))
                slowest = max(slowest, ts)
                m.prepare(epoch)
                if mode == "cold":
                    drop_caches()
                out, (tl, cl), pl, ml = measure(lambda: m.restore(epoch))
                verify(ws, out, m.name)
                del out
                m.cleanup(epoch)
                release_memory()
                for key, value in zip(res[m.name], (ts, tl, cs, cl, max(ps, pl), ms, ml)):
                    if rep >= 0:
                        res[m.name][key].append(value)
                print(f"  {wl} rep {rep + 1}/{reps} {m.name:12s} save {ts:8.3f} s  restore "
                      f"{tl:8.3f} s" + " (warm-up)" * (rep < 0), file=sys.stderr, flush=True)
            if rep == -args.warmup and reps > 3 and slowest > args.slow_save:
                reps = 3
                print(f"# {wl}: a save took > {args.slow_save} s: repetitions capped at 3")
            rep += 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(wl, len(ws), nbytes, reps, mode, res)
    del ws
    if wl == "W1" and not args.no_probe:
        probe_memory(args, nbytes, [m.name for m in methods])


def print_table(wl, count, nbytes, reps, mode, res):
    label = {"cold": "cold restores (page cache dropped before each)",
             "warm": "WARM restores (--warm: page cache not dropped)"}.get(mode, f"WARM: {mode}")
    print(f"\n{wl}: {count} arrays, {nbytes / MiB:.1f} MiB; medians (min) of {reps}; durable "
          f"saves; {label}")
    head = ("method", "save s", "restore s", "save GB/s", "rest GB/s", "save x raw", "rest x raw",
            "save CPU s", "rest CPU s", "peak RSS MiB", "save +MiB", "rest +MiB")
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    med = {n: (statistics.median(r["save"]), statistics.median(r["load"])) for n, r in res.items()}
    raw_s, raw_l = med.get("raw", (float("nan"),) * 2)
    for name, r in res.items():
        s, l = med[name]
        cells = (name, f"{s:.3f} ({min(r['save']):.3f})", f"{l:.3f} ({min(r['load']):.3f})",
                 f"{nbytes / s / 1e9:.2f}", f"{nbytes / l / 1e9:.2f}", f"{raw_s / s:.2f}",
                 f"{raw_l / l:.2f}", f"{statistics.median(r['save_cpu']):.3f}",
                 f"{statistics.median(r['load_cpu']):.3f}", f"{max(r['peak']) / MiB:.0f}",
                 f"{max(r['save_mem']) / MiB:.0f}", f"{max(r['load_mem']) / MiB:.0f}")
        print("| " + " | ".join(cells) + " |")
    if "raw" in res:  # medians hide how bimodal this VM's timings are: the fastest runs, too
        best = {n: (min(r["save"]), min(r["load"])) for n, r in res.items()}
        print("x raw of the fastest repetitions (save / restore): " + ", ".join(
            f"{n} {best['raw'][0] / s:.2f} / {best['raw'][1] / l:.2f}"
            for n, (s, l) in best.items() if n != "raw"))
    sys.stdout.flush()


def probe_memory(args, nbytes, names):
    print(f"\nW1 in a fresh subprocess per method: peak RSS above the RSS at the start of a save "
          f"(workspace of {nbytes / MiB:.0f} MiB resident) and of a restore (workspace freed)")
    print("| method | RSS before save MiB | save +MiB | save + / workspace | RSS before restore "
          "MiB | restore +MiB | restore + / workspace |\n" + "|---" * 7 + "|")
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--probe", name, "--dir", args.dir]
        out = subprocess.run(cmd + ["--smoke"] * args.smoke, capture_output=True, text=True)
        if out.returncode:
            print(f"| {name} | probe failed: {out.stderr.strip().splitlines()[-1:]} |")
            continue
        (s0, s1), (l0, l1) = json.loads(out.stdout)
        print(f"| {name} | {s0 / MiB:.0f} | {(s1 - s0) / MiB:.0f} | {(s1 - s0) / nbytes:.2f} | "
              f"{l0 / MiB:.0f} | {(l1 - l0) / MiB:.0f} | {(l1 - l0) / nbytes:.2f} |", flush=True)


def probe_child(args):  # in the subprocess: one W1 save, then one restore with the workspace freed
    ws, root = make_workload("W1", args.smoke), tempfile.mkdtemp(prefix="probe-", dir=args.dir)
    try:
        (m,) = build_methods(root, ws, only=args.probe)
        _, _, save_peak, save_extra = measure(lambda: m.save(ws, 1))
        del ws
        m.session = None  # caffe2ckpt's source workspace holds the arrays too
        release_memory()
        m.prepare(1)
        out, _, load_peak, load_extra = measure(lambda: m.restore(1))
        print(json.dumps([[save_peak - save_extra, save_peak],
                          [load_peak - load_extra, load_peak]]))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=None, help="comma-separated W1,W2,W3 (default W1)")
    ap.add_argument("--repeats", type=int, default=None, help="repetitions per method (default 5)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where files are written")
    ap.add_argument("--smoke", action="store_true", help="tiny workloads, 2 repetitions")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first runs (default 1)")
    ap.add_argument("--warm", action="store_true", help="keep the page cache for restores")
    ap.add_argument("--slow-save", type=float, default=10.0, help="cap repetitions at 3 above this")
    ap.add_argument("--no-probe", action="store_true", help="skip the W1 subprocess memory probe")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.probe:
        return probe_child(args)
    args.repeats = args.repeats or (2 if args.smoke else 5)
    args.warmup = (0 if args.smoke else 1) if args.warmup is None else args.warmup
    workloads = (args.workloads or "W1").split(",")
    mode = cache_mode(args.warm)
    du, mem = shutil.disk_usage(args.dir), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    have = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    versions = [f"{m} {have[m]}" for m in ("numpy", "zarr", "fsspec", "safetensors", "torch",
                                           "orbax-checkpoint", "jax",
                                           "caffe2ckpt")
                if m in have]
    rev = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "describe",
                          "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    print(f"# {' '.join([os.path.basename(sys.executable)] + sys.argv)}  (git {rev or '?'})")
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, {mem / 2**30:.1f} GiB RAM, Python "
          f"{platform.python_version()}, {', '.join(versions)}")
    print(f"# dir {os.path.abspath(args.dir)}: {du.free / 2**30:.0f} of {du.total / 2**30:.0f} GiB "
          f"free; page cache: {mode}" + ", smoke" * args.smoke)
    for wl in workloads:
        run_workload(wl.strip(), args, mode)


if __name__ == "__main__":
    main()
