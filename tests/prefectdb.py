"""One migrated Prefect database per pytest session, copied into the homes of the servers the
tests start, so that each of them does not build its schema again: on the 2-core machine a
server on a fresh database took 33 s to answer, on a copy of a migrated one 18 s (building the
template once: about 24 s, in whichever process asks first while the others wait).

The servers are real: a copy is what a user's second ``prefect server start`` finds.
``test_orphans.py``'s killed flow still starts on a fresh home, as a user's first run does.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FOLDER_ENV = "CAFFE2CKPT_TEST_PREFECT_DB"  #: the session's folder, set by the first process


def claim_folder() -> None:
    """Name the session's template folder in the environment, unless a parent process did (xdist
    workers inherit the controller's); the process that names it removes it at exit."""
    if FOLDER_ENV not in os.environ:
        os.environ[FOLDER_ENV] = tempfile.mkdtemp(prefix="caffe2ckpt-prefect-db-")
        atexit.register(shutil.rmtree, os.environ[FOLDER_ENV], ignore_errors=True)


def template(timeout: float = 300) -> Path | None:
    """The migrated database: built by the first process to ask (``prefect server database
    upgrade``), waited for by the others; ``None`` if it could not be built in ``timeout``
    (servers then build their own, as without it)."""
    folder = Path(os.environ[FOLDER_ENV])
    ready, failed = folder / "prefect.db", folder / "failed"
    try:
        (folder / "making").mkdir()
    except FileExistsError:
        deadline = time.monotonic() + timeout
        while not (ready.exists() or failed.exists()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return ready if ready.exists() else None
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(folder / "making"), DO_NOT_TRACK="1")
    try:
        done = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade",
                               "-y"], env=env, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess([], 1, b"", f"timed out after {timeout} s".encode())
    if done.returncode != 0:  # the waiters stop waiting
        failed.write_bytes(done.stdout + done.stderr)
        return None
    os.rename(folder / "making" / "prefect.db", ready)  # whole, or not there: waiters poll it
    return ready


def seed(database: Path) -> None:
    """Start ``database`` (a server's SQLite file, not created yet) as a copy of the template."""
    source = template()
    if source is not None and not database.exists():
        database.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, database)


def seed_home(home: Path) -> Path:
    """``home`` as a ``PREFECT_HOME`` whose server starts from the template; returns it."""
    seed(home / "prefect.db")
    return home
