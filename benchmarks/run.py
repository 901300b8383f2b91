"""Every benchmark in one run: checkpoint save/restore (W1, W2, W3) against raw files and peers,
differential epochs (E1) against whole saves and plain Zarr rewritten in place,
where a save's and a restore's time goes phase by phase (W1s, W2s, W3), async-save blocking time, latest-epoch lookup, per-epoch cost and resume time as history grows,
save/restore on an S3 server against raw s3fs with every request counted (when moto and s3fs
are installed: the "test" extra), Prefect's per-epoch overhead, and DaskSession's save
throughput and per-epoch overhead (when distributed is installed).

    python benchmarks/run.py [--dir DIR] [--smoke]

``--dir`` should be on the disk whose speed matters (default: a temporary folder). ``--smoke``
runs tiny versions of the storage benchmarks in seconds (CI uses it) and skips Prefect's.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where checkpoint files are written")
    parser.add_argument("--smoke", action="store_true", help="seconds-long versions, no Prefect")
    args = parser.parse_args()
    where = ["--dir", args.dir] if args.dir else []
    smoke = ["--smoke"] if args.smoke else []
    runs = [
        ["bench_checkpoint.py", "--workloads", "W1,W2,W3", *where, *smoke],
        ["bench_phases.py", *where, *smoke],
        ["bench_extras.py", *where, *smoke],
        ["bench_history.py", *where, *smoke],
        ["bench_delta.py", *where, *smoke],
        ["bench_reshard.py", *where, *smoke],
    ]
    if all(importlib.util.find_spec(m) is not None for m in ("moto", "flask", "s3fs")):
        runs.append(["bench_s3.py", *smoke])
    else:
        print('# bench_s3.py skipped: it needs moto\'s S3 server and s3fs (the "test" extra): '
              'pip install "moto[s3]>=5.1" flask flask-cors s3fs', flush=True)
    if not args.smoke:
        runs.append(["bench_prefect.py"])
    if importlib.util.find_spec("distributed") is not None:
        runs.append(["bench_dask.py", *where, *smoke])
        if importlib.util.find_spec("s3fs") is not None:  # and SeaweedFS's weed: tests/seaweedfs.py
            runs.append(["bench_memory_tier.py", *smoke])
    for run in runs:
        print(f"\n$ python benchmarks/{' '.join(run)}", flush=True)
        result = subprocess.run([sys.executable, str(HERE / run[0]), *run[1:]])
        if result.returncode != 0:
            return result.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
