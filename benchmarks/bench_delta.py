"""Differential saves on the study's workload E1, against a whole save and against rewriting
the touched chunks of a plain Zarr array in place, in one run (paired, epoch by epoch): what each
save writes and costs, what every epoch costs to restore, and what the writer holds in memory.

    python benchmarks/bench_delta.py                       # 256 MiB table, 100 epochs, local
    python benchmarks/bench_delta.py --rows 4194304        # 1 GiB table
    python benchmarks/bench_delta.py --dist zipf           # Zipf (a = 1.1, clustered ids)
    python benchmarks/bench_delta.py --rows 1048576 --width 16 --dense-mib 4
                                                           # 64 MiB of 64-byte rows, 4 MiB dense
    python benchmarks/bench_delta.py --frozen-mib 64       # + a 64 MiB blob that never changes
    python benchmarks/bench_delta.py --unchanged           # nothing changes after epoch 0
    python benchmarks/bench_delta.py --server moto         # on S3: requests per save counted
    python benchmarks/bench_delta.py --smoke               # seconds, for CI

E1 (shared/DIFFERENTIAL.md section 1): a float32 table of ``--rows`` x ``--width`` (64), dense
weights ``dense_w1`` 512x256 and ``dense_w2`` 256x64 with biases (every value moves each epoch),
a step counter, and ``frozen_proj`` 256x256 (never changes); with ``--dense-mib``, a large dense
blob ``dense_big`` that moves like the others; with ``--frozen-mib``, a large
``frozen_backbone`` that never changes (fine-tuning a frozen backbone). Each epoch 5% of the
table's rows get new values: chosen uniformly, or by Zipf ranks (a = 1.1, drawn until 5% are
distinct; rank r is row r); with ``--unchanged`` nothing changes after epoch 0.

Per epoch (1..``--epochs``; epoch 0 is each method's first, whole save, also timed), in a
rotating order:

- **whole**: ``StepCheckpointManager.save`` without deltas;
- **hints**: ``delta_saves=True, delta_detection="hints"`` with the changed rows given;
- **compare**: ``delta_saves=True`` (changed rows found by row digests);
- **compare, numpy digests** (when the ``fast`` extra's compiled kernel is in use): the same, its
  row digests computed by the numpy kernel instead, for the two kernels side by side;
- **zarr in place** (the first ``--zarr-epochs`` epochs, local only): the touched chunks of a
  plain Zarr array (the table, ``--zarr-rows`` rows per chunk, zarr-python's own write path)
  rewritten, plus the small blobs rewritten whole.

Then the epoch is restored from the ``whole`` and the ``compare`` prefixes (a fresh manager each,
page cache dropped when permitted, in a rotating order) and the two compared bit for bit: every
epoch is a kept epoch once (``max_to_keep=3`` bounds the disk). Bytes are the data each save
wrote (caffe2ckpt: the record's ``bytes_written``, every chunk's padding included; Zarr: the files
it rewrote); "average per epoch" is the total of a run's saves over its epochs (with and without
epoch 0's whole save). Saves are durable (fsync'ed) for caffe2ckpt; plain Zarr is timed with the
files flushed by an ``os.sync()`` after its writes. On S3 every request of a ``save()`` call is
counted. Medians of paired timings (same epoch, back to back), and the worst case beside them.

Memory (``--memory-epochs`` saves on fresh local prefixes, traced with ``tracemalloc``, which
numpy reports its arrays to): what a manager holds between differential saves beyond the
workspace (``compare`` and ``hints``: the row digests), and what an ``async`` differential save
holds while it writes in the background (the most, from ``save()`` until
``wait_until_finished()``), against the bytes that save writes; and what a restore of the
newest ``compare`` epoch holds beyond the blobs it returns.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import drop_caches  # noqa: E402
from bench_reshard import Reads  # noqa: E402

import caffe2ckpt  # noqa: E402
from caffe2ckpt import StepCheckpointManager, StepManagerOptions  # noqa: E402
from caffe2ckpt.store.delta import rowhash  # noqa: E402

NODE = "trainer_0"
CHANGED = 0.05


class E1:
    """The workload's state and its epoch-to-epoch changes (seeded): a table of ``rows`` x
    ``width`` float32, and optionally ``dense_mib`` more of dense weights (one blob, every value
    moving each epoch) and a frozen blob of ``frozen_mib`` (never changes). ``unchanged``:
    nothing changes after epoch 0."""

    def __init__(self, rows: int, dist: str, seed: int = 0, *, width: int = 64,
                 dense_mib: float = 0, frozen_mib: float = 0, unchanged: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.dist, self.unchanged = dist, unchanged
        self.blobs = {
            "table": self.rng.random((rows, width), dtype=np.float32),
            "dense_w1": self.rng.random((512, 256), dtype=np.float32),
            "dense_w2": self.rng.random((256, 64), dtype=np.float32),
            "dense_b1": self.rng.random(256, dtype=np.float32),
            "dense_b2": self.rng.random(64, dtype=np.float32),
            "frozen_proj": self.rng.random((256, 256), dtype=np.float32),
            "step": np.array(0, np.int64),
        }
        if dense_mib:
            self.blobs["dense_big"] = self.rng.random((int(dense_mib * 1024), 256),
                                                      dtype=np.float32)
        if frozen_mib:
            self.blobs["frozen_backbone"] = self.rng.random((int(frozen_mib * 1024), 256),
                                                            dtype=np.float32)

    def rows(self) -> np.ndarray:
        n = self.blobs["table"].shape[0]
        want = int(n * CHANGED)
        if self.dist == "uniform":
            return np.sort(self.rng.choice(n, want, replace=False))
        found: set[int] = set()
        while len(found) < want:
            draws = self.rng.zipf(1.1, want) - 1
            found.update(int(r) for r in draws[draws < n])
        return np.sort(np.fromiter(found, np.int64))[:want]

    def step(self) -> np.ndarray:
        if self.unchanged:
            return np.array([], np.int64)
        rows = self.rows()
        table = self.blobs["table"]
        table[rows] = self.rng.random((rows.size, table.shape[1]), dtype=np.float32)
        for name in ("dense_w1", "dense_w2", "dense_b1", "dense_b2", "dense_big"):
            if name in self.blobs:
                self.blobs[name] -= 0.01 * self.rng.standard_normal(self.blobs[name].shape,
                                                                    dtype=np.float32)
        self.blobs["step"] = np.array(self.blobs["step"] + 1)
        return rows


class ZarrInPlace:
    """The table as a plain Zarr array whose touched chunks are rewritten each epoch (and the
    small blobs rewritten whole): what a chunk-position scheme writes."""

    def __init__(self, root: str, blobs: dict[str, np.ndarray], rows: int) -> None:
        import zarr

        self.root, self.rows = root, rows
        self.group = zarr.open_group(root, mode="w")
        self.arrays = {name: self.group.create_array(
            name, shape=arr.shape, dtype=arr.dtype,
            chunks=(rows, *arr.shape[1:]) if name == "table" else (arr.shape or "auto"),
            compressors=None) for name, arr in blobs.items()}
        for name, arr in blobs.items():
            self.arrays[name][...] = arr
        os.sync()

    def save(self, blobs: dict[str, np.ndarray], rows: np.ndarray) -> int:
        """Rewrite the touched chunks; the bytes written."""
        table = blobs["table"]
        touched = np.unique(rows // self.rows)
        for chunk in touched:
            start = int(chunk) * self.rows
            self.arrays["table"][start:start + self.rows] = table[start:start + self.rows]
        for name, arr in blobs.items():
            if name != "table":
                self.arrays[name][...] = arr
        os.sync()
        small = sum(a.nbytes for n, a in blobs.items() if n != "table")
        return int(touched.size) * self.rows * table.shape[1] * table.itemsize + small


def _cold() -> None:
    with contextlib.suppress(OSError):
        drop_caches()


def _timed(fn) -> tuple[float, object]:
    gc.collect()
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _record(mgr: StepCheckpointManager, step: int):
    return mgr._step(step).records[NODE]  # what the save wrote, as its record says


KEEP = 3  # max_to_keep of every prefix: 100 whole epochs of 256 MiB would not fit a disk


def delta_options(args, **extra) -> StepManagerOptions:
    chain = {} if args.chain is None else {"max_delta_chain": args.chain}
    return StepManagerOptions(delta_saves=True, max_to_keep=KEEP, **chain, **extra)


class Run:
    """The three managers (and plain Zarr, locally) on their own prefixes."""

    def __init__(self, args, base: str, server) -> None:
        self.server, self.base = server, base
        self.options = {} if server is None else {"storage_options": server.options()}
        self.mgrs = {
            "whole": self._mgr("whole", StepManagerOptions(max_to_keep=KEEP)),
            "hints": self._mgr("hints", delta_options(args, delta_detection="hints")),
            "compare": self._mgr("compare", delta_options(args)),
        }
        if rowhash.kernel()[0] != "numpy":
            self.mgrs[NUMPY] = self._mgr("compare-numpy", delta_options(args))
        self.chain = self.mgrs["compare"].options.max_delta_chain
        self.zarr = None
        self.zarr_rows, self.zarr_epochs = args.zarr_rows, args.zarr_epochs
        self.restores = 1 if args.smoke else RESTORES

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def _mgr(self, name: str, options: StepManagerOptions) -> StepCheckpointManager:
        return StepCheckpointManager(self.url(name), options=options, handle_preemption=False,
                                     **self.options)

    def methods(self, epoch: int) -> list[str]:
        zarr = self.zarr is not None and epoch <= self.zarr_epochs
        return [*self.mgrs, *(["zarr in place"] if zarr else [])]

    def close(self) -> None:
        for mgr in self.mgrs.values():
            mgr.close()


def _wire(server):
    if server is None:
        return contextlib.nullcontext
    import s3wire

    return s3wire.WireCounter


def measure(run: Run, work: E1, epochs: int) -> tuple[dict[str, list[dict]], list[dict]]:
    """Each method's save of every epoch (epoch 0 first, whole), in a rotating order, each
    epoch then restored from the whole and the compare prefixes."""
    blobs = work.blobs
    saves: dict[str, list[dict[str, float]]] = {m: [] for m in run.mgrs}
    restores = []
    wire = _wire(run.server)
    for method, mgr in run.mgrs.items():
        with digests_for(method):
            seconds, _ = _timed(lambda m=mgr: m.save(0, {NODE: blobs}))
        saves[method].append({"epoch": 0, "seconds": seconds,
                              "bytes": float(_record(mgr, 0).bytes_written)})
    if run.server is None and run.zarr_epochs:
        run.zarr = ZarrInPlace(run.url("zarr"), blobs, run.zarr_rows)
        saves["zarr in place"] = []
    for epoch in range(1, epochs + 1):
        rows = work.step()
        methods = run.methods(epoch)
        shift = epoch % len(methods)
        for method in methods[shift:] + methods[:shift]:
            with wire() as counter:
                seconds, written = _timed(lambda m=method: _save(run, m, epoch, blobs, rows))
            row = {"epoch": epoch, "seconds": seconds, "bytes": float(written)}
            if counter is not None:
                row["requests"] = float(counter.counts.requests)
                row["lists"] = float(counter.counts.ops["ListObjectsV2"])
            saves[method].append(row)
        restores.append(restore(run, epoch, order=epoch % 2))
    return saves, restores


def _save(run: Run, method: str, epoch: int, blobs: dict[str, np.ndarray],
          rows: np.ndarray) -> int:
    if method == "zarr in place":
        return run.zarr.save(blobs, rows)
    hints = {NODE: {"table": rows}} if method == "hints" else None
    mgr = run.mgrs[method]
    with digests_for(method):
        mgr.save(epoch, {NODE: blobs}, changed_rows=hints)
    return _record(mgr, epoch).bytes_written


NUMPY = "compare, numpy digests"


@contextlib.contextmanager
def digests_for(method: str):
    """For :data:`NUMPY`, row digests computed by the numpy kernel meanwhile (the same
    digests, slower); else the kernel in use."""
    if method != NUMPY:
        yield
        return
    chosen = rowhash.kernel
    rowhash.kernel = lambda: ("numpy", rowhash.numpy_multilinear)
    try:
        yield
    finally:
        rowhash.kernel = chosen


RESTORES = 3  # restores of each epoch from each prefix (alternating, cold): their medians


def restore(run: Run, epoch: int, order: int) -> dict[str, float]:
    """``epoch`` restored from the whole and the compare prefixes (cold, alternating,
    :data:`RESTORES` times each; once with ``--smoke``), compared bit for bit; how many groups
    the compare prefix's table is read from."""
    record = _record(run.mgrs["compare"], epoch)
    groups = 1 + (len(record.delta.chains.get("table", ())) if record.delta else 0)
    timings: dict[str, list[float]] = {"whole": [], "compare": []}
    data, read = {}, {}
    for turn in range(run.restores):
        for name in ("whole", "compare")[::1 - 2 * ((order + turn) % 2)]:
            reader = StepCheckpointManager(run.url(name), handle_preemption=False,
                                           **run.options)
            counted = Reads(reader)
            _cold()
            seconds, data[name] = _timed(lambda r=reader: r.restore(epoch)[NODE])
            timings[name].append(seconds)
            read[name] = counted.bytes
            reader.close()
    if any(data["whole"][k].tobytes() != data["compare"][k].tobytes() for k in data["whole"]):
        raise SystemExit(f"epoch {epoch}: the delta restore differs from the whole one")
    return {"epoch": epoch, "groups": groups, "whole": statistics.median(timings["whole"]),
            "delta": statistics.median(timings["compare"]),
            "read": read["compare"] / read["whole"]}


def workload(args, seed: int = 0) -> E1:
    return E1(args.rows, args.dist, seed, width=args.width, dense_mib=args.dense_mib,
              frozen_mib=args.frozen_mib, unchanged=args.unchanged)


def measure_memory(args, base: str, epochs: int) -> list[dict[str, float]]:
    """Per mode, on a fresh local prefix: what the manager holds between differential saves
    beyond the workspace, and (async) the most a differential save holds while it writes."""
    out = []
    for mode in ("compare", "hints", "compare, async"):
        work = workload(args, seed=1)
        large = work.blobs["table"].nbytes
        options = delta_options(args, delta_detection="hints" if mode == "hints" else "compare",
                                enable_async_checkpointing="async" in mode)
        url = f"{base}/memory-{mode.replace(', ', '-')}"
        gc.collect()
        tracemalloc.start()
        try:
            baseline, _ = tracemalloc.get_traced_memory()
            mgr = StepCheckpointManager(url, options=options, handle_preemption=False)
            held, peaks = [], []
            for epoch in range(epochs):
                rows = work.step() if epoch else None
                hints = {NODE: {"table": rows}} if mode == "hints" and epoch else None
                tracemalloc.reset_peak()
                before, _ = tracemalloc.get_traced_memory()
                mgr.save(epoch, {NODE: work.blobs}, changed_rows=hints)
                mgr.wait_until_finished()
                _, peak = tracemalloc.get_traced_memory()
                gc.collect()
                now, _ = tracemalloc.get_traced_memory()
                if epoch:
                    written = _record(mgr, epoch).bytes_written
                    held.append(now - baseline)
                    peaks.append({"extra": peak - before, "written": written})
            mgr.close()
        finally:
            tracemalloc.stop()
        out.append({"mode": mode, "large": large, "held": max(held),
                    "peak": max(p["extra"] for p in peaks),
                    "peak_over_written": max(p["extra"] / p["written"] for p in peaks),
                    "written": statistics.median(p["written"] for p in peaks),
                    **(restore_memory(url) if mode == "compare" else {})})
    return out


def restore_memory(url: str) -> dict[str, float]:
    """The most a restore of the prefix's newest (differential) epoch holds beyond the blobs it
    returns, traced."""
    gc.collect()
    tracemalloc.start()
    try:
        mgr = StepCheckpointManager(url, handle_preemption=False)
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        restored = mgr.restore(mgr.latest_step())[NODE]
        _, peak = tracemalloc.get_traced_memory()
        mgr.close()
    finally:
        tracemalloc.stop()
    returned = sum(a.nbytes for a in restored.values())
    return {"restore_extra": peak - before - returned, "restore_returned": returned}


def report(args, saves, restores, run: Run, full_bytes: int, memory) -> None:
    where = "local disk" if run.server is None else f"S3 ({run.server.where})"
    extra = "".join([f", dense {args.dense_mib:g} MiB" if args.dense_mib else "",
                     f", frozen {args.frozen_mib:g} MiB" if args.frozen_mib else "",
                     ", nothing changes after epoch 0" if args.unchanged else ""])
    print(f"\n## E1: table {args.rows:,} x {args.width} float32{extra} "
          f"({full_bytes / (1 << 20):.1f} MiB in all), {args.dist}, {args.epochs} epochs, "
          f"max_delta_chain={run.chain}, on {where}; row digests by {rowhash.kernel()[0]}")
    report_saves(saves, run, full_bytes)
    report_restores(restores)
    if memory:
        report_memory(memory)


def report_saves(saves, run: Run, full_bytes: int) -> None:
    whole = {r["epoch"]: r for r in saves["whole"]}
    s3 = run.server is not None
    print("\n| method | save s (median) | ratio to whole (median of paired) | bytes per save "
          "(median) | of a whole save | average per epoch, epochs 1..N | with epoch 0 | "
          "largest save |" + (" requests (median) | most | LIST |" if s3 else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|---|" if s3 else ""))
    for method, rows in saves.items():
        print(_save_row(method, rows, whole, full_bytes, s3))


def _save_row(method: str, rows: list[dict], whole: dict, full_bytes: int, s3: bool) -> str:
    later = [r for r in rows if r["epoch"] > 0]
    ratio = statistics.median(r["seconds"] / whole[r["epoch"]]["seconds"] for r in later)
    nbytes = statistics.median(r["bytes"] for r in later)
    full = method != "zarr in place"
    average = sum(r["bytes"] for r in later) / len(later) / full_bytes
    with0 = sum(r["bytes"] for r in rows) / len(rows) / full_bytes if full else None
    largest = max(r["bytes"] for r in later) / full_bytes
    return (f"| {method} | {statistics.median(r['seconds'] for r in later):.3f} | "
            f"{ratio:.2f} | {nbytes / (1 << 20):.2f} MiB | {nbytes / full_bytes:.4f} | "
            f"{average:.4f} ({len(later)} epochs) | "
            f"{'' if with0 is None else f'{with0:.4f}'} | {largest:.4f} |"
            f"{_requests(later) if s3 else ''}")


def _requests(later: list[dict]) -> str:
    if "requests" not in later[0]:
        return " | | |"
    return (f" {statistics.median(r['requests'] for r in later):.0f} | "
            f"{max(r['requests'] for r in later):.0f} | {max(r['lists'] for r in later):.0f} |")


def report_restores(restores) -> None:
    print("\n| groups the table is read from | epochs | whole restore s (median) | delta restore "
          "s (median) | ratio (median of paired) | worst ratio | bytes read / whole's (most) |")
    print("|---|---|---|---|---|---|---|")
    for groups in sorted({r["groups"] for r in restores}):
        rows = [r for r in restores if r["groups"] == groups]
        ratios = [r["delta"] / r["whole"] for r in rows]
        print(f"| {groups} | {len(rows)} | {statistics.median(r['whole'] for r in rows):.3f} | "
              f"{statistics.median(r['delta'] for r in rows):.3f} | "
              f"{statistics.median(ratios):.2f} | {max(ratios):.2f} | "
              f"{max(r['read'] for r in rows):.3f} |")
    ratios = [r["delta"] / r["whole"] for r in restores]
    print(f"\nevery epoch 1..{len(restores)} restored bit-exact; ratio to a whole restore: median "
          f"{statistics.median(ratios):.2f}, worst {max(ratios):.2f}; bytes read: at most "
          f"{max(r['read'] for r in restores):.3f}x a whole restore's")


def report_memory(memory) -> None:
    print("\n| mode | held between saves | of the table | most held while an async save writes "
          "| over its bytes written | limit 1.2x + 16 MiB |")
    print("|---|---|---|---|---|---|")
    for m in memory:
        mib = 1 << 20
        asynchronous = "async" in m["mode"]
        limit = 1.2 * m["written"] + 16 * mib
        tail = (f"{m['peak'] / mib:.1f} MiB | {m['peak_over_written']:.2f}x | "
                f"{'within' if m['peak'] <= limit else 'OVER'} ({limit / mib:.1f} MiB) |"
                if asynchronous else "| | |")
        print(f"| {m['mode']} | {m['held'] / mib:.2f} MiB | {m['held'] / m['large']:.4f} | {tail}")
    for m in memory:
        if "restore_extra" in m:
            print(f"\nrestoring the newest epoch ({m['mode']}, a delta) holds at most "
                  f"{m['restore_extra'] / (1 << 20):.1f} MiB beyond the "
                  f"{m['restore_returned'] / (1 << 20):.1f} MiB it returns")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1 << 20, help="table rows")
    parser.add_argument("--width", type=int, default=64,
                        help="float32s per table row (default 64: 256-byte rows)")
    parser.add_argument("--dense-mib", type=float, default=0,
                        help="a dense blob of this many MiB, every value moving each epoch")
    parser.add_argument("--frozen-mib", type=float, default=0,
                        help="a frozen blob of this many MiB (never changes)")
    parser.add_argument("--unchanged", action="store_true",
                        help="nothing changes after epoch 0")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--chain", type=int, default=None,
                        help="max_delta_chain (default: StepManagerOptions' default)")
    parser.add_argument("--dist", choices=["uniform", "zipf"], default="uniform")
    parser.add_argument("--zarr-rows", type=int, default=1024,
                        help="rows per chunk of the plain Zarr table (default 1024: 256 KiB)")
    parser.add_argument("--zarr-epochs", type=int, default=10,
                        help="epochs plain Zarr is timed for (it rewrites most chunks: slow)")
    parser.add_argument("--memory-epochs", type=int, default=6,
                        help="saves per memory measurement (0: none)")
    parser.add_argument("--dir", default=None, help="where to write (local; default: a temp dir)")
    parser.add_argument("--server", choices=["moto", "seaweedfs"], default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.epochs, args.zarr_epochs, args.memory_epochs = 1 << 14, 3, 1, 2
    server = None
    local = tempfile.mkdtemp(prefix="bench-delta-", dir=args.dir)
    if args.server is not None:
        import s3wire

        s3wire.require_s3()
        server = s3wire.start_server(kind=args.server)
        server.filesystem().mkdir("delta-bench")
        base = "s3://delta-bench/e1"
    else:
        base = local
    try:
        work = workload(args)
        full_bytes = sum(a.nbytes for a in work.blobs.values())
        run = Run(args, base, server)
        try:
            saves, restores = measure(run, work, args.epochs)
        finally:
            run.close()
        memory = measure_memory(args, local, args.memory_epochs) \
            if args.memory_epochs > 1 else []
        report(args, saves, restores, run, full_bytes, memory)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(local, ignore_errors=True)
    print(f"\ncaffe2ckpt {getattr(caffe2ckpt, '__version__', '')}; load average "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
