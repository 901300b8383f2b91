"""Shared fixtures: checkpoint prefixes on real filesystems (memory://, a local temp dir and, for
the storage and resume modules, s3:// on each of two S3 servers on 127.0.0.1: moto and SeaweedFS,
see tests/s3server.py)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
import zlib

# Never touch a developer's ~/.prefect or their server, and keep Prefect quiet and offline (one
# home per pytest process, removed when it exits).
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="caffe2ckpt-prefect-home-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Dask's schedulers and workers (also in the processes they start) log at INFO to stderr, which
# lands among pytest's dots: warnings and errors only
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")

import fsspec
import pytest

from tests import prefectdb
from tests.s3server import KINDS, s3_params

prefectdb.claim_folder()  # in the controller: its workers share one migrated Prefect database

# Test modules whose `prefix` tests also run on S3 (moto and SeaweedFS, see tests/s3server.py):
# the storage, resume, corruption and fencing sets. Other modules get memory and local prefixes.
S3_PREFIX_MODULES = frozenset({
    "test_storage", "test_contract", "test_runner", "test_corruption", "test_fencing",
    "test_hostile", "test_concurrency", "test_lineage", "test_delta", "test_reshard",
    "test_review_defects",  # tests/safety/: the review of 75dd0ff (object-store defects)
    "test_review_1aeae9c",  # tests/safety/: the review of 1aeae9c
})
# Of those, the modules whose tests check logic above the storage layer (hostile and damaged
# files, resume, history and gc rules, the Caffe2 contract, the reviews' defects): each test
# runs on one S3 server, moto or SeaweedFS by its name, so every such module still runs on both
# (about half its tests each) at half the cost; so does the delta module, whose requests on the
# wire are tests/store/test_s3.py's (on both). The storage, fencing and concurrency modules (and
# tests/store/test_s3.py, the location contract, lost answers) run every test on both: where the
# two servers answer differently.
ONE_S3_SERVER_MODULES = frozenset({"test_hostile", "test_corruption", "test_runner",
                                   "test_delta_unchanged",
                                   "test_lineage", "test_contract", "test_review_defects",
                                   "test_review_1aeae9c", "test_delta"})


def one_s3_server(test_name: str) -> str:
    """The S3 server a test of :data:`ONE_S3_SERVER_MODULES` runs on (stable across runs)."""
    return KINDS[zlib.crc32(test_name.encode()) % len(KINDS)]


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core and one more (at most 4, pyproject's ``--maxprocesses``):
    a third of the suite's time waits on servers, subprocesses and disks (measured on 2 cores:
    77% of the CPU busy with 2 workers)."""
    return (os.cpu_count() or 1) + 1


def pytest_generate_tests(metafunc):
    """Parametrize ``prefix`` (also when requested through another fixture) by filesystem kind:
    memory and local everywhere, plus s3-moto and s3-seaweedfs (marked slow) in
    :data:`S3_PREFIX_MODULES` (one of them in :data:`ONE_S3_SERVER_MODULES`)."""
    if "prefix" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if "prefix" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return  # the test chooses its own prefixes
    kinds = ["memory", "local"]
    module = metafunc.module.__name__.rpartition(".")[2]
    if module in ONE_S3_SERVER_MODULES:
        kinds += [pytest.param(f"s3-{one_s3_server(metafunc.function.__name__)}",
                               marks=pytest.mark.slow)]
    elif module in S3_PREFIX_MODULES:
        kinds += s3_params()
    metafunc.parametrize("prefix", kinds, indirect=True)


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_session():
    """Every server, worker and subprocess a test starts is stopped by the end of the session
    (after every other fixture's teardown): leftovers are killed and reported as an error."""
    yield
    import psutil

    leftovers = {}
    for p in psutil.Process().children(recursive=True):
        try:
            leftovers[p] = " ".join(p.cmdline())[:200]
        except psutil.Error:
            continue
    leftovers = {p: cmd for p, cmd in leftovers.items()  # these two live until exit, by design
                 if "multiprocessing.resource_tracker" not in cmd
                 and "multiprocessing.forkserver" not in cmd}  # Dask's workers fork from it
    for p in leftovers:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(leftovers), timeout=10)
    assert not leftovers, "processes left running by the tests (now killed): " + "; ".join(
        f"{p.pid}: {cmd}" for p, cmd in leftovers.items())


@pytest.fixture
def memory_fs():
    """fsspec's process-global memory filesystem, emptied before and after the test."""
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    yield fs
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")


def _server(kind: str):
    from tests import s3server

    server = s3server.start(kind)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_server():
    """One moto S3 server on 127.0.0.1 (a free port) for the whole session."""
    yield from _server("moto")


@pytest.fixture(scope="session")
def seaweedfs_server():
    """One SeaweedFS (``weed mini``, a subprocess) on 127.0.0.1 for the whole session; it
    fails, never skips, if it cannot start."""
    yield from _server("seaweedfs")


@pytest.fixture(scope="session", params=[pytest.param(k, id=f"s3-{k}") for k in KINDS])
def s3_server(request):
    """Each S3 server in turn (a test using it runs once per kind: ``s3-moto``,
    ``s3-seaweedfs``)."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture
def s3_bucket(s3_server, monkeypatch) -> str:
    """A fresh empty bucket on the S3 server; during the test, ``s3://`` URLs without storage
    options reach that server (fsspec's defaults for ``s3``), never AWS."""
    s3_server.configure(monkeypatch)
    return s3_server.new_bucket()


@pytest.fixture
def prefix(request, tmp_path, memory_fs) -> str:
    """A fresh checkpoint prefix: ``memory://...``, a local directory, or ``s3://<new bucket>/ckpt``
    on the server ``s3-<kind>`` names (see :func:`pytest_generate_tests` for which modules get
    which); ``s3://`` URLs reach that server during the test."""
    kind = getattr(request, "param", "memory")
    if kind == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    if kind.startswith("s3-"):
        server = request.getfixturevalue(f"{kind.removeprefix('s3-')}_server")
        server.configure(request.getfixturevalue("monkeypatch"))
        return f"s3://{server.new_bucket()}/ckpt"
    return str(tmp_path / "ckpt")



@pytest.fixture(scope="module")
def dask_cluster():
    """A Dask LocalCluster (2 worker processes, see tests/daskcluster.py) for one test module's
    tests in this process: idle Dask processes cost CPU, so none outlives its module."""
    from tests.daskcluster import local_cluster

    with local_cluster() as cluster:
        yield cluster


@pytest.fixture
def dask_client(dask_cluster):
    """A client of the session's Dask cluster, with all its workers up."""
    from tests.daskcluster import client_of

    with client_of(dask_cluster) as client:
        yield client
