"""What a flow run killed with ``kill -9`` looks like afterwards, on the temporary server.

``python benchmarks/kill9.py [--repo DIR] [--after-seconds S] [--next-run]`` runs
``flows/regression.py`` of ``--repo`` (default: this checkout) in a fresh ``PREFECT_HOME``, kills
it with SIGKILL once epoch 1 is committed, and reads the server's SQLite database: the killed flow
run's state, its end time against the moment of the kill, and the states and names of its task
runs; ``--after-seconds`` after the kill, and with ``--next-run`` again after a second run of the
flow (the sweep of :mod:`caffe2ckpt.prefect.orphans`). Prints one line per reading.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
# the names caffe2ckpt gives task runs: "epoch_group[trainer_1] e7", "epoch 7"
OURS = r".+\[.+\]( e\d+)?|epoch \d+"


def start(repo: Path, home: Path, ckpt: Path, epochs: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PYTHONPATH=str(repo))
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, str(repo / "flows/regression.py"),
                                 "--checkpoint-url", str(ckpt), "--epochs", str(epochs)],
                                env=env, cwd=home.parent, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def committed(ckpt: Path) -> int:
    """Number of node saves committed under ``ckpt``."""
    from caffe2ckpt.fs.location import Location
    from caffe2ckpt.store.format.records import list_records

    return len(list_records(Location(str(ckpt)))) if ckpt.exists() else 0


def parse(text: str | None) -> datetime | None:
    if not text:
        return None
    value = datetime.fromisoformat(text.replace(" ", "T"))
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def reading(db: Path, pid: int, killed_at: datetime) -> str:
    with sqlite3.connect(db) as con:
        row = con.execute("SELECT id, state_type, start_time, end_time, total_run_time FROM "
                          "flow_run WHERE infrastructure_pid LIKE ?", (f"%:{pid}",)).fetchone()
        if row is None:
            return f"no flow run with infrastructure_pid *:{pid} in {db}"
        tasks = con.execute("SELECT state_type, count(*) FROM task_run WHERE flow_run_id = ? "
                            "GROUP BY state_type", (row[0],)).fetchall()
        names = con.execute("SELECT name FROM task_run WHERE flow_run_id = ?",
                            (row[0],)).fetchall()
    generic = [name for (name,) in names if not re.fullmatch(OURS, name)]
    start, end = parse(row[2]), parse(row[3])
    shown = (end - start).total_seconds() if start and end else None
    after_kill = (end - killed_at).total_seconds() if end else None
    return (f"flow run {row[1]}; end - start {fmt(shown)}; end - kill {fmt(after_kill)}; "
            f"total_run_time {row[4]!r}; task runs {dict(tasks)}; "
            f"generic task run names {generic}")


def fmt(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repo", type=Path, default=HERE)
    parser.add_argument("--after-seconds", type=float, default=10.0)
    parser.add_argument("--next-run", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home, ckpt = Path(tmp) / "home", Path(tmp) / "ckpt"
        first = start(args.repo.resolve(), home, ckpt, 1000, Path(tmp) / "first.log")
        deadline = time.monotonic() + 180
        while committed(ckpt) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # a few more epochs: some task runs are mid-flight
        killed_at = datetime.now(timezone.utc)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        time.sleep(args.after_seconds)
        print(f"{args.after_seconds:.0f} s after kill -9:",
              reading(home / "prefect.db", first.pid, killed_at))
        if args.next_run:
            second = start(args.repo.resolve(), home, Path(tmp) / "other", 3,
                           Path(tmp) / "second.log")
            second.wait(timeout=300)
            print("after the next run:", reading(home / "prefect.db", first.pid, killed_at))


if __name__ == "__main__":
    main()
