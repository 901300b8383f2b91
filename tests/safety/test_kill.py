"""SIGKILL at pseudo-random instants: a 2-node job checkpointing to a local prefix (with fsync)
is killed again and again and restarted until it exits 0; the result must be bit-identical to an
uninterrupted run, and every committed epoch must hold exactly the reference run's data. The job
runs with synchronous saves, with async saves, and with retention after every commit (kills then
land in its deletions too); and ``caffe2ckpt gc --yes`` is killed at random instants of its run:
nothing it keeps may be lost, and what is left must load bit-exact.

The job runs in a subprocess (the script below, written to a temporary folder): per node one
16 MB float64 blob and 200 small int32 blobs, 12 epochs, deterministic (every epoch's randomness
is seeded by node and step), resumed automatically through ``ZarrMetadataHandler``. It prints
``ready`` once imported and logs ``save-start`` / ``save-end`` around every checkpoint save to an
event file, so the test knows where each kill landed.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from caffe2ckpt.cli import main as cli_main
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.scan import scan
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.stores import (
    committed_epochs,
    epochs_with_records,
    find_leftovers,
    load,
    newest_epoch,
    records_at,
    unreferenced_groups,
)

pytestmark = pytest.mark.slow

NODES = ["trainer_0", "trainer_1"]
EPOCHS = 12
KILLS = 16
SMALL = 200  # packed blobs per node, besides one 16 MB array and the step counter
SEED = 20240611

SCRIPT = textwrap.dedent('''
    import faulthandler
    import os
    import sys

    import numpy as np

    faulthandler.enable()  # a crash of the interpreter itself leaves its stacks in the log

    from caffe2ckpt import Job, JobRunner, LocalSession, MultiNodeCheckpointManager, Node, Task
    from caffe2ckpt import StepManagerOptions, epoch_limiter
    from caffe2ckpt.metadata import ZarrMetadataHandler

    NODES = ["trainer_0", "trainer_1"]
    BIG = (31_250, 64)  # float64: 16 MB per node, its own Zarr array; 5% of its rows move
    SMALL = 200  # packed


    def log(event):
        fd = os.open(EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"{os.getpid()} {event}\\n".encode())
        os.close(fd)


    def init(i):
        def fn(ws):
            rng = np.random.default_rng([11, i])
            ws["big"] = rng.standard_normal(BIG)
            for k in range(SMALL):
                ws[f"small/{k:03d}"] = rng.integers(0, 1 << 30, size=k + 1).astype(np.int32)
            ws["step"] = np.int64(0)
        return fn


    def train(i):
        def fn(ws):
            step = int(ws["step"]) + 1
            rng = np.random.default_rng([11, i, step])
            rows = rng.choice(BIG[0], BIG[0] // 20, replace=False)
            ws["big"][rows] = ws["big"][rows] * 0.5 + rng.standard_normal((rows.size, BIG[1]))
            for k in range(SMALL):
                noise = rng.integers(0, 1 << 30, size=k + 1, dtype=np.int32)
                ws[f"small/{k:03d}"] = ws[f"small/{k:03d}"] ^ noise
            ws["step"] = np.int64(step)
        return fn


    class LoggingSession(LocalSession):
        def run(self, runnable):
            saving = getattr(runnable, "name", "") == "checkpoint_save"
            if saving:
                log("save-start")
            super().run(runnable)
            if saving:
                log("save-end")


    prefix, out, epochs, EVENTS = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ASYNC = sys.argv[5] == "async"
    # "retention": every commit is followed by a retention pass (kills land in deletions too);
    # "delta": the same with differential saves (chains of 3); "delta-all": deltas, all kept
    OPTIONS = {"retention": StepManagerOptions(max_to_keep=3, keep_period=4),
               "delta": StepManagerOptions(max_to_keep=3, keep_period=4, delta_saves=True,
                                           max_delta_chain=3),
               "delta-all": StepManagerOptions(delta_saves=True, max_delta_chain=3)}.get(
                   sys.argv[5])
    with Job(name="kill-test") as job:
        for i, node in enumerate(NODES):
            with Node(node):
                with job.init_group:
                    Task(init(i), name="init")
                Task(train(i), name="train")
        epoch_limiter(job, epochs)
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler(),
                                    async_save=ASYNC)
    runner = JobRunner(job, cm, on_save_error="raise", options=OPTIONS)
    session = LoggingSession()
    log("ready")
    print("ready", flush=True)
    final = runner.train(session)
    blobs = {f"{n}|{b}": session.workspace(n)[b] for n, names in cm.blob_list().items()
             for b in names}
    np.savez(out + ".tmp.npz", **blobs)
    os.replace(out + ".tmp.npz", out)
    log(f"done final={final} resumed_from={runner.resumed_from}")
''')


def start(script: Path, prefix: Path, out: Path, events: Path, stderr,
          mode: str = "sync") -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(script), str(prefix), str(out), str(EPOCHS), str(events), mode],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
    )
    line = proc.stdout.readline()  # blocks until the script is imported and about to train
    assert line == "ready\n" or proc.wait() == 0, f"the job did not start: {line!r}"
    return proc


def run_to_completion(script: Path, prefix: Path, out: Path, events: Path, log: Path,
                      mode: str = "sync") -> None:
    with open(log, "a") as stderr:
        proc = start(script, prefix, out, events, stderr, mode)
        rc = proc.wait(timeout=120)
        proc.stdout.close()
    assert rc == 0, f"job exited with {rc}: {log.read_text()[-3000:]}"


def last_event(events: Path, pid: int) -> str:
    mine = [line.split(" ", 1)[1].strip() for line in events.read_text().splitlines()
            if line.split(" ", 1)[0] == str(pid)]
    return mine[-1] if mine else "(nothing)"


def wait_for_event(events: Path, proc: subprocess.Popen, event: str,
                   timeout: float = 60.0) -> None:
    """Poll the event file until ``proc`` logged ``event`` (or exited, or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if events.exists() and f"{proc.pid} {event}\n" in events.read_text():
            return
        time.sleep(0.002)


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def differences(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> list[str]:
    out = [f"blob names differ: {sorted(set(actual) ^ set(expected))}"] if set(actual) != set(
        expected) else []
    for name in sorted(set(actual) & set(expected)):
        a, e = actual[name], expected[name]
        if a.dtype != e.dtype or a.shape != e.shape or a.tobytes() != e.tobytes():
            out.append(f"{name}: {a.dtype}{a.shape} vs {e.dtype}{e.shape} (bytes differ)")
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the job script, the uninterrupted run's prefix with every epoch, its final state)."""
    tmp = tmp_path_factory.mktemp("kill-reference")
    script = tmp / "job.py"
    script.write_text(SCRIPT)
    ref_prefix, ref_out = tmp / "reference", tmp / "reference.npz"
    run_to_completion(script, ref_prefix, ref_out, tmp / "reference.events", tmp / "stderr.log")
    return script, ref_prefix, ref_out


_REFERENCE_DATA: dict[tuple[str, str, int], dict[str, np.ndarray]] = {}


def reference_data(ref_store: CheckpointStore, node: str, epoch: int) -> dict[str, np.ndarray]:
    """``node``'s checkpoint of ``epoch`` in a reference run, read (and verified) once: a
    reference prefix is written once per module and never changed (the gc test works on
    hard-linked copies, and a copy changed in place would then differ from this). The gc test
    compares up to 36 epochs of 16 MB with the reference per trial."""
    key = (ref_store.location.url, node, epoch)
    if key not in _REFERENCE_DATA:
        _REFERENCE_DATA[key] = load(ref_store, node, epoch)
    return _REFERENCE_DATA[key]


@pytest.fixture(scope="module", autouse=True)
def _forget_reference_data():
    """The module's reference data (hundreds of MB) is dropped with the module."""
    yield
    _REFERENCE_DATA.clear()


def check_epochs(store: CheckpointStore, ref_store: CheckpointStore, epochs: list[int]) -> None:
    """Each of ``epochs`` is committed in ``store`` and holds exactly the reference's data."""
    for epoch in epochs:
        for node in NODES:
            problems = differences(load(store, node, epoch), reference_data(ref_store, node, epoch))
            assert not problems, f"{node} epoch {epoch} differs from the reference: {problems}"


@pytest.mark.parametrize(("mode", "kills"), [("sync", KILLS), ("async", KILLS // 2),
                                             ("retention", KILLS // 2), ("delta", KILLS // 2)])
def test_sigkill_at_random_instants_loses_nothing(tmp_path, reference, mode, kills):
    """With ``async``, the saves write in a background thread while the next epoch runs: the
    kills then land mostly in the middle of those background writes. With ``retention``, every
    commit is followed by a retention pass (``max_to_keep=3, keep_period=4``): kills land in
    its deletions too. ``delta`` is ``retention`` with differential saves (chains of 3): kills
    land in saves of overlays and in deletions of saves other kept saves build on; a quiet
    ``gc`` then leaves no group that no record needs."""
    script, ref_prefix, ref_out = reference
    log = tmp_path / "stderr.log"

    # the killed run: SIGKILL after a random delay, restart, until a run exits 0
    prefix, out, events = tmp_path / "killed", tmp_path / "killed.npz", tmp_path / "killed.events"
    rng = random.Random(SEED)
    landed: Counter[str] = Counter()
    runs = 0
    while landed.total() < kills:
        runs += 1
        with open(log, "a") as stderr:
            proc = start(script, prefix, out, events, stderr, mode)
            if rng.random() < 0.5:  # any instant of the run's first ~quarter second
                time.sleep(rng.uniform(0.01, 0.25))
            else:  # an instant inside a save, however slow resuming is on a loaded machine
                wait_for_event(events, proc, "save-start")
                time.sleep(rng.uniform(0.0, 0.03))
            killed = proc.poll() is None
            if killed:
                os.kill(proc.pid, signal.SIGKILL)
            rc = proc.wait(timeout=120)
            proc.stdout.close()
        if not killed or rc == 0:  # finished before the kill
            assert rc == 0, f"run {runs} exited with {rc}: {log.read_text()[-3000:]}"
            break
        assert rc == -signal.SIGKILL, f"run {runs} exited with {rc}, not by SIGKILL"
        where = last_event(events, proc.pid)
        landed[{"save-start": "during a save", "save-end": "between saves (training, "
                "metadata)", "ready": "while resuming/before the first save"}.get(
                    where, f"after {where}")] += 1
    else:
        run_to_completion(script, prefix, out, events, log, mode)
        runs += 1
    print(f"\n{runs} runs, {landed.total()} kills: {dict(landed)}")
    assert "done" in events.read_text()

    # the final state is the uninterrupted run's, bit for bit
    problems = differences(load_npz(out), load_npz(ref_out))
    assert not problems, f"final workspaces differ after {landed.total()} kills: {problems}"

    # every epoch kept is committed and holds exactly the reference data
    ref_store = CheckpointStore(Location(str(ref_prefix)))
    store = CheckpointStore(Location(str(prefix)))
    assert epochs_with_records(ref_store, NODES) == list(range(EPOCHS + 1))
    assert newest_epoch(store, NODES) == EPOCHS
    candidates = epochs_with_records(store, NODES)
    uncommitted = [e for e in candidates if records_at(store, NODES, e) is None]
    assert not uncommitted, f"epochs with records that do not commit: {uncommitted}"
    if mode in ("retention", "delta"):  # the newest 3, every 4th, the last run's start
        resumed = events.read_text().rsplit("resumed_from=", 1)[1].split()[0]
        kept = {EPOCHS, EPOCHS - 1, EPOCHS - 2, *range(0, EPOCHS + 1, 4)}
        kept |= set() if resumed == "None" else {int(resumed)}
        assert sorted(candidates) == sorted(kept), f"committed epochs: {candidates}"
        check_epochs(store, ref_store, candidates)
        if mode == "delta":
            assert any(r.delta for r in scan(store).records()), "no differential save"
            assert cli_main(["gc", str(prefix), "--min-age", "0", "--yes"]) == 0
            check_epochs(store, ref_store, candidates)
            assert unreferenced_groups(store) == []
        return
    assert sorted(candidates) == list(range(EPOCHS + 1)), f"committed epochs: {candidates}"
    previous: dict[str, dict[str, np.ndarray]] = {}
    for epoch in sorted(candidates):
        for node in NODES:
            got = load(store, node, epoch)
            want = reference_data(ref_store, node, epoch)
            assert len(want) == SMALL + 2 + (node == NODES[0]), sorted(want)  # + the epoch counter
            problems = differences(got, want)
            assert not problems, f"{node} epoch {epoch} differs from the reference: {problems}"
            assert node not in previous or differences(want, previous[node])  # epochs differ
            previous[node] = want
    if mode == "sync":  # async saves return after the snapshot: the events cannot tell
        assert landed["during a save"] >= 1, f"no kill landed during a save: {dict(landed)}"


GC_SCRIPT = textwrap.dedent('''
    import os
    import sys

    from caffe2ckpt.cli import main

    # a start-up paid once: each line of arguments runs ``caffe2ckpt`` in a child forked from
    # this process (nothing here has started a thread yet), whose pid is printed at once; the
    # next line asks for its exit status (or killing signal, negative): until then the child
    # is not reaped, so its pid names it even once it has ended
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:  # its output goes nowhere: this process's answers use stdout
            os.dup2(os.open(os.devnull, os.O_RDWR), 0)
            os.dup2(0, 1)
            os._exit(main(line.split()))
        print(pid, flush=True)
        sys.stdin.readline()
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
''')
GC_ARGS = ["--keep-last", "3", "--keep-every", "5", "--min-age", "0", "--yes"]
GC_KEPT = [0, 5, 10, 11, 12]  # GC_ARGS over epochs 0..12
# kills of one gc test: most land after gc's last removal (its leftover sweep and report), so
# 16 spent a minute of CI on a 2-core machine for two or three kills between removals
GC_KILLS = KILLS // 2


@pytest.fixture(scope="module")
def delta_reference(tmp_path_factory, reference) -> Path:
    """The uninterrupted run again with differential saves (chains of 3), every epoch kept."""
    script = reference[0]
    tmp = tmp_path_factory.mktemp("kill-delta-reference")
    run_to_completion(script, tmp / "prefix", tmp / "out.npz", tmp / "events", tmp / "err.log",
                      "delta-all")
    return tmp / "prefix"


@pytest.mark.parametrize("kind", ["whole", "delta"])
def test_sigkill_during_gc_loses_nothing_kept(tmp_path, reference, delta_reference, kind):
    """``caffe2ckpt gc --keep-last 3 --keep-every 5 --yes`` over the reference run's 13 epochs
    (it removes 8 saves of 2 nodes) is SIGKILLed at a random instant of its run, on a fresh copy
    of the prefix each time: every epoch still committed loads bit-exact, the epochs gc keeps
    are all there, and a gc run to completion then leaves exactly them and no leftovers. With
    ``delta`` the saves are differential (chains of 3): a kept epoch's chain outlives the
    epochs it builds on, and nothing else does."""
    _, ref_prefix, _ = reference
    ref_store = CheckpointStore(Location(str(ref_prefix)))
    source = ref_prefix if kind == "whole" else delta_reference
    script = tmp_path / "gc.py"
    script.write_text(GC_SCRIPT)

    def copy(name: str) -> Path:  # hard links: gc only unlinks, the reference stays whole
        target = tmp_path / name
        shutil.copytree(source, target, copy_function=os.link)
        return target

    forks = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def gc(prefix: Path) -> int:
        """Start ``caffe2ckpt gc`` on ``prefix`` in a new process; its pid."""
        forks.stdin.write(" ".join(["gc", str(prefix), *GC_ARGS]) + "\n")
        forks.stdin.flush()
        return int(forks.stdout.readline())

    def ended() -> int:
        """The last gc's exit status (or killing signal, negative), once it ended."""
        forks.stdin.write("wait\n")
        forks.stdin.flush()
        return int(forks.stdout.readline())

    try:
        gc_killed(tmp_path, ref_store, copy, gc, ended)
    finally:
        forks.stdin.close()
        assert forks.wait(timeout=120) == 0
        forks.stdout.close()


def gc_killed(tmp_path: Path, ref_store: CheckpointStore, copy, gc, ended) -> None:
    """:func:`test_sigkill_during_gc_loses_nothing_kept` once its gc processes can start."""
    durations = []  # how long a whole gc takes (the first also pays the files' first reads)
    for timing in ("timing-1", "timing-2"):
        began = time.monotonic()
        gc(copy(timing))
        assert ended() == 0
        durations.append(time.monotonic() - began)
        assert committed_epochs(CheckpointStore(Location(str(tmp_path / timing))),
                                NODES) == GC_KEPT
    duration = window = min(durations)
    rng = random.Random(SEED)
    landed = Counter()
    for trial in range(GC_KILLS):
        prefix = copy(f"trial-{trial}")
        pid = gc(prefix)
        time.sleep(rng.uniform(0.0, window))
        os.kill(pid, signal.SIGKILL)
        assert ended() in (0, -signal.SIGKILL)
        store = CheckpointStore(Location(str(prefix)))
        survivors = committed_epochs(store, NODES)
        where = ("before any removal" if len(survivors) == EPOCHS + 1 else
                 "after the last removal" if survivors == GC_KEPT else "between removals")
        landed[where] += 1
        # under load a gc may start removing later than the timed ones did: aim later after a
        # kill that came before any removal, earlier after one that came after the last
        window = (min(window * 1.5, 20 * duration) if where == "before any removal" else
                  max(duration, window / 1.5) if where == "after the last removal" else window)
        assert set(GC_KEPT) <= set(survivors), f"trial {trial}: committed {survivors}"
        assert newest_epoch(store, NODES) == EPOCHS
        check_epochs(store, ref_store, survivors)
        with contextlib.redirect_stdout(io.StringIO()):  # in this process: no second start-up
            assert cli_main(["gc", str(prefix), *GC_ARGS]) == 0
        assert committed_epochs(store, NODES) == GC_KEPT
        assert find_leftovers(store, min_age=0) == []
        assert unreferenced_groups(store) == []
        check_epochs(store, ref_store, GC_KEPT)
    print(f"\ngc took {duration:.3f} s; {GC_KILLS} kills: {dict(landed)}")
    assert landed["before any removal"] < GC_KILLS, \
        f"no kill landed after gc began removing: {landed}"
