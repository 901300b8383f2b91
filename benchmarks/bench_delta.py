"""Differential saves on the study's workload E1, against a whole save and against rewriting
the touched chunks of a plain Zarr array in place, in one run (paired, epoch by epoch).

    python benchmarks/bench_delta.py                       # 256 MiB table, 10 epochs, local
    python benchmarks/bench_delta.py --rows 4194304        # 1 GiB table
    python benchmarks/bench_delta.py --dist zipf           # Zipf (a = 1.1, clustered ids)
    python benchmarks/bench_delta.py --server moto         # on S3: requests per save counted
    python benchmarks/bench_delta.py --smoke               # seconds, for CI

E1 (shared/DIFFERENTIAL.md section 1): a float32 table of ``--rows`` x 64, dense weights
``dense_w1`` 512x256 and ``dense_w2`` 256x64 with biases (every value moves each epoch), a step
counter, and ``frozen_proj`` 256x256 (never changes). Each epoch 5% of the table's rows get new
values: chosen uniformly, or by Zipf ranks (a = 1.1, drawn until 5% are distinct; rank r is row
r).

Per epoch (1..``--epochs``; epoch 0 is written untimed by each method), in a rotating order:

- **whole**: ``StepCheckpointManager.save`` without deltas;
- **hints**: ``delta_saves=True, delta_detection="hints"`` with the changed rows given;
- **compare**: ``delta_saves=True`` (rows compared with the last saved copy);
- **zarr in place**: the touched chunks of a plain Zarr array (the table, ``--zarr-rows`` rows
  per chunk, zarr-python's own write path) rewritten, plus the small blobs rewritten whole.

On S3 every request of a ``save()`` call is counted (``StepCheckpointManager.save``: the first
save after a run's start also reads the step listing once, two LIST requests; the median
shows the steady state). Saves are durable (fsync'ed) for caffe2ckpt; plain Zarr is timed with the files flushed by an
``os.sync()`` after its writes. Bytes are the data each save wrote (caffe2ckpt: the record's
``bytes_written``, every chunk's padding included; Zarr: the files it rewrote). Then every
epoch of the ``compare`` prefix is restored (a fresh manager, page cache dropped when permitted)
and timed against a restore of the same epoch from the whole prefix: bit-exact equal, and the
ratio by chain depth (how many overlays the table's chain applies). Medians; ratios are of
paired timings (same epoch, back to back).
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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import drop_caches  # noqa: E402

import caffe2ckpt  # noqa: E402
from caffe2ckpt import StepCheckpointManager, StepManagerOptions  # noqa: E402

NODE = "trainer_0"
CHANGED = 0.05


class E1:
    """The workload's state and its epoch-to-epoch changes (seeded)."""

    def __init__(self, rows: int, dist: str, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.dist = dist
        self.blobs = {
            "table": self.rng.random((rows, 64), dtype=np.float32),
            "dense_w1": self.rng.random((512, 256), dtype=np.float32),
            "dense_w2": self.rng.random((256, 64), dtype=np.float32),
            "dense_b1": self.rng.random(256, dtype=np.float32),
            "dense_b2": self.rng.random(64, dtype=np.float32),
            "frozen_proj": self.rng.random((256, 256), dtype=np.float32),
            "step": np.array(0, np.int64),
        }

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
        rows = self.rows()
        table = self.blobs["table"]
        table[rows] = self.rng.random((rows.size, table.shape[1]), dtype=np.float32)
        for name in ("dense_w1", "dense_w2", "dense_b1", "dense_b2"):
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


class Run:
    """The three managers (and plain Zarr, locally) on their own prefixes."""

    def __init__(self, args, base: str, server) -> None:
        self.server, self.base = server, base
        self.options = {} if server is None else {"storage_options": server.options()}
        delta = {"delta_saves": True, "max_delta_chain": args.chain}
        self.mgrs = {
            "whole": self._mgr("whole", StepManagerOptions()),
            "hints": self._mgr("hints", StepManagerOptions(**delta, delta_detection="hints")),
            "compare": self._mgr("compare", StepManagerOptions(**delta)),
        }
        self.zarr = None
        self.zarr_rows = args.zarr_rows

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def _mgr(self, name: str, options: StepManagerOptions) -> StepCheckpointManager:
        return StepCheckpointManager(self.url(name), options=options, handle_preemption=False,
                                     **self.options)

    def close(self) -> None:
        for mgr in self.mgrs.values():
            mgr.close()


def _wire(server):
    if server is None:
        return contextlib.nullcontext
    import s3wire

    return s3wire.WireCounter


def measure_saves(run: Run, work: E1, epochs: int) -> dict[str, list[dict[str, float]]]:
    """Each method's save of every epoch (epoch 0 untimed), in a rotating order."""
    blobs = work.blobs
    for mgr in run.mgrs.values():
        mgr.save(0, {NODE: blobs})
    if run.server is None:
        run.zarr = ZarrInPlace(run.url("zarr"), blobs, run.zarr_rows)
    methods = [*run.mgrs, *(["zarr in place"] if run.zarr is not None else [])]
    out: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    wire = _wire(run.server)
    for epoch in range(1, epochs + 1):
        rows = work.step()
        shift = epoch % len(methods)
        for method in methods[shift:] + methods[:shift]:
            with wire() as counter:
                seconds, written = _timed(lambda m=method: _save(run, m, epoch, blobs, rows))
            row = {"seconds": seconds, "bytes": float(written)}
            if counter is not None:
                row["requests"] = float(counter.counts.requests)
                row["lists"] = float(counter.counts.ops["ListObjectsV2"])
            out[method].append(row)
    return out


def _save(run: Run, method: str, epoch: int, blobs: dict[str, np.ndarray],
          rows: np.ndarray) -> int:
    if method == "zarr in place":
        return run.zarr.save(blobs, rows)
    hints = {NODE: {"table": rows}} if method == "hints" else None
    run.mgrs[method].save(epoch, {NODE: blobs}, changed_rows=hints)
    return 0


def measure_restores(run: Run, epochs: int) -> list[dict[str, float]]:
    """Every epoch of the ``compare`` prefix restored (cold) against the same epoch from the
    whole prefix: seconds each, and the table's chain depth."""
    out = []
    for epoch in range(1, epochs + 1):
        record = _record(run.mgrs["compare"], epoch)  # overlays applied to the table:
        depth = 0 if record.delta is None else len(record.delta.chains.get("table", ()))
        timings = {}
        data = {}
        for name in ("whole", "compare"):
            reader = StepCheckpointManager(run.url(name), handle_preemption=False, **run.options)
            _cold()
            timings[name], data[name] = _timed(lambda r=reader: r.restore(epoch)[NODE])
            reader.close()
        same = all(data["whole"][k].tobytes() == data["compare"][k].tobytes()
                   for k in data["whole"])
        if not same:
            raise SystemExit(f"epoch {epoch}: the delta restore differs from the whole one")
        out.append({"epoch": epoch, "depth": depth, "whole": timings["whole"],
                    "delta": timings["compare"]})
    return out


def report(args, saves, restores, run: Run, full_bytes: int) -> None:
    where = "local disk" if run.server is None else f"S3 ({run.server.where})"
    print(f"\n## E1: table {args.rows:,} x 64 float32 ({full_bytes / (1 << 20):.1f} MiB in all), "
          f"{args.dist}, {args.epochs} epochs, max_delta_chain={args.chain}, on {where}")
    whole = saves["whole"]
    print("\n| method | save s (median) | ratio to whole (median of paired) | bytes per epoch "
          "(median) | of a whole save |"
          + (" requests (median) | LIST (median) |" if run.server else ""))
    print("|---|---|---|---|---|" + ("---|---|" if run.server else ""))
    for method, rows in saves.items():
        ratio = statistics.median(r["seconds"] / w["seconds"] for r, w in zip(rows, whole))
        nbytes = statistics.median(r["bytes"] for r in rows)
        extra = (f" {statistics.median(r['requests'] for r in rows):.0f} | "
                 f"{statistics.median(r['lists'] for r in rows):.0f} |" if run.server else "")
        print(f"| {method} | {statistics.median(r['seconds'] for r in rows):.3f} | "
              f"{ratio:.2f} | {nbytes / (1 << 20):.2f} MiB | {nbytes / full_bytes:.4f} |{extra}")
    print("\n| table chain depth | epochs | whole restore s (median) | delta restore s | ratio "
          "(median of paired) |")
    print("|---|---|---|---|---|")
    for depth in sorted({r["depth"] for r in restores}):
        rows = [r for r in restores if r["depth"] == depth]
        print(f"| {depth} | {len(rows)} | {statistics.median(r['whole'] for r in rows):.3f} | "
              f"{statistics.median(r['delta'] for r in rows):.3f} | "
              f"{statistics.median(r['delta'] / r['whole'] for r in rows):.2f} |")


def fill_bytes(run: Run, saves, epochs: int) -> None:
    """The bytes each caffe2ckpt save wrote, from its record; ``frozen_proj`` must be 0."""
    for method in run.mgrs:
        for epoch in range(1, epochs + 1):
            record = _record(run.mgrs[method], epoch)
            saves[method][epoch - 1]["bytes"] = float(record.bytes_written)
            if record.delta is not None:
                manifest = run.mgrs[method]._store.manifest(record)
                assert manifest.inherited["frozen_proj"].kind == "same", epoch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1 << 20, help="table rows (x 64 float32)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--chain", type=int, default=4, help="max_delta_chain")
    parser.add_argument("--dist", choices=["uniform", "zipf"], default="uniform")
    parser.add_argument("--zarr-rows", type=int, default=1024,
                        help="rows per chunk of the plain Zarr table (default 1024: 256 KiB)")
    parser.add_argument("--dir", default=None, help="where to write (local; default: a temp dir)")
    parser.add_argument("--server", choices=["moto", "seaweedfs"], default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.epochs = 1 << 14, 3
    server = None
    if args.server is not None:
        import s3wire

        s3wire.require_s3()
        server = s3wire.start_server(kind=args.server)
        server.filesystem().mkdir("delta-bench")
        base = "s3://delta-bench/e1"
    else:
        base = tempfile.mkdtemp(prefix="bench-delta-", dir=args.dir)
    try:
        work = E1(args.rows, args.dist)
        full_bytes = sum(a.nbytes for a in work.blobs.values())
        run = Run(args, base, server)
        try:
            saves = measure_saves(run, work, args.epochs)
            fill_bytes(run, saves, args.epochs)
            restores = measure_restores(run, args.epochs)
        finally:
            run.close()
        report(args, saves, restores, run, full_bytes)
    finally:
        if server is not None:
            server.stop()
        else:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\ncaffe2ckpt {getattr(caffe2ckpt, '__version__', '')}; load average "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
