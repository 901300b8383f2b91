"""What a differential save costs in memory: the peak resident memory of a process saving a
table ``--epochs`` times (5% of its rows changed uniformly before each save after the first)
beyond what it held before its first save, for a plain save, ``compare`` and ``hints``, each in
a fresh process (so the row-digest kernel's compiler, when the ``fast`` extra is installed, is
counted); and ``compare``'s and ``hints``' extra beyond the plain save's against issue 56's
bound, 5% of the large blobs + 96 MiB.

    python benchmarks/bench_delta_memory.py                   # 64, 256 MiB; 64-, 256-byte rows
    python benchmarks/bench_delta_memory.py --mib 64 --width 16  # one table
    python benchmarks/bench_delta_memory.py --smoke                # seconds, for CI

The peak is the kernel's ``VmHWM``, reset (``/proc/self/clear_refs``) once the table and 4 MiB
of dense weights are built; "before" is ``VmRSS`` then. Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

MODES = ("plain", "compare", "hints")
MIB = 1 << 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(mode: str, mib: int, width: int, epochs: int, kernel: str) -> dict[str, float]:
    """One process: ``epochs`` saves of a ``mib`` MiB table of ``width`` float32 per row and
    4 MiB of dense weights; its peak resident memory beyond what it held before."""
    import numpy as np

    from caffe2ckpt import StepCheckpointManager, StepManagerOptions
    from caffe2ckpt.store.delta import rowhash

    if kernel == "numpy":  # as without the fast extra
        rowhash.kernel = lambda: ("numpy", rowhash.numpy_multilinear)

    rng = np.random.default_rng(0)
    rows = mib * MIB // (4 * width)
    blobs = {"table": rng.random((rows, width), dtype=np.float32),
             "dense": rng.random((4 * MIB // 1024, 256), dtype=np.float32)}
    options = StepManagerOptions(max_to_keep=2) if mode == "plain" else StepManagerOptions(
        delta_saves=True, delta_detection=mode, max_to_keep=2)
    with tempfile.TemporaryDirectory(prefix="bench-delta-memory-") as root:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        before = _status("VmRSS")
        with StepCheckpointManager(root, options=options, handle_preemption=False) as mgr:
            for epoch in range(epochs):
                changed = None
                if epoch:
                    ids = np.sort(rng.choice(rows, rows // 20, replace=False))
                    blobs["table"][ids] = rng.random((ids.size, width), dtype=np.float32)
                    blobs["dense"] += np.float32(0.01)
                    changed = {"n0": {"table": ids}} if mode == "hints" else None
                mgr.save(epoch, {"n0": blobs}, changed_rows=changed)
        peak = _status("VmHWM")
    return {"extra": peak - before, "large": blobs["table"].nbytes + blobs["dense"].nbytes}


def measure(mib: int, width: int, epochs: int, kernel: str) -> dict[str, dict[str, float]]:
    out = {}
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--child", mode, "--mib", str(mib),
                               "--width", str(width), "--epochs", str(epochs),
                               "--kernel", kernel],
                              check=True, capture_output=True, text=True)
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def report(results: list[tuple[int, int, dict[str, dict[str, float]]]]) -> None:
    print("| table | row bytes | plain: extra peak | compare | hints | compare - plain | "
          "hints - plain | bound: 5% of large + 96 MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for mib, width, got in results:
        plain = got["plain"]["extra"]
        bound = 0.05 * got["plain"]["large"] + 96 * MIB
        over = {m: got[m]["extra"] - plain for m in ("compare", "hints")}
        verdict = "within" if max(over.values()) <= bound else "OVER"
        print(f"| {mib} MiB | {4 * width} | {plain / MIB:.0f} MiB | "
              f"{got['compare']['extra'] / MIB:.0f} MiB | {got['hints']['extra'] / MIB:.0f} MiB | "
              f"{over['compare'] / MIB:.0f} MiB | {over['hints'] / MIB:.0f} MiB | "
              f"{bound / MIB:.0f} MiB: {verdict} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=None, help="table MiB (default: 64 and 256)")
    parser.add_argument("--width", type=int, default=None,
                        help="float32s per row (default: 16 and 64)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--kernel", choices=["in use", "numpy"], default="in use",
                        help="row digests by the kernel in use (compiled, with the fast extra) or "
                             "by numpy")
    parser.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.mib, args.width, args.epochs, args.kernel)))
        return 0
    if args.smoke:
        args.mib, args.width, args.epochs = args.mib or 8, args.width or 16, 3
    sizes = [args.mib] if args.mib else [64, 256]
    widths = [args.width] if args.width else [16, 64]
    report([(mib, width, measure(mib, width, args.epochs, args.kernel))
            for mib in sizes for width in widths])
    return 0


if __name__ == "__main__":
    sys.exit(main())
