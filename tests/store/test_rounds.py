"""The two rounds of a differential restore's reads (caffe2ckpt/store/read/rounds.py): a
second-round read starts only after every first-round read writing a row it may write has finished, however
the reads are timed; every read runs once; a failure stops both rounds and is raised; a body that
fails waits for the reads still running. Checked over seeded random layouts and delays, not on a
few hand-picked cases."""

from __future__ import annotations

import random
import threading
import time

import pytest

from caffe2ckpt.fs.iopool import io_threads
from caffe2ckpt.store.read.rounds import Rounds


class Log:
    """When each read started and finished (by name), thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: dict[str, float] = {}
        self.finished: dict[str, float] = {}

    def read(self, name: str, seconds: float, fails: bool = False):
        def call() -> None:
            with self.lock:
                assert name not in self.started, f"{name} ran twice"
                self.started[name] = time.monotonic()
            time.sleep(seconds)
            if fails:
                raise OSError(f"{name} failed")
            with self.lock:
                self.finished[name] = time.monotonic()
        return call


def layout(rng: random.Random, rows: int = 1000):
    """First-round reads writing disjoint pieces that cover ``rows`` rows of two arrays (each
    read one to three pieces, as a chunk wanted in part is), and second-round reads each
    claiming a random ``[start, stop)`` hull (or None)."""
    first = []
    for key in ("a", "b"):
        edges = sorted(rng.sample(range(1, rows), rng.randint(3, 30)))
        pieces = list(zip([0, *edges], [*edges, rows]))
        rng.shuffle(pieces)
        while pieces:
            take = rng.randint(1, 3)
            first.append((f"{key}{len(first)}", key, pieces[:take]))
            pieces = pieces[take:]
    second = []
    for i in range(rng.randint(0, 40)):
        start = rng.randrange(rows)
        hull = None if rng.random() < 0.1 else (start, min(rows, start + rng.randint(1, 200)))
        second.append((f"late{i}", rng.choice("ab"), hull))
    return first, second


@pytest.mark.parametrize("seed", range(40))
def test_a_second_round_read_starts_after_every_read_writing_its_rows(seed):
    rng = random.Random(seed)
    first, second = layout(rng)
    log = Log()
    with Rounds() as rounds:
        rounds.first((log.read(name, rng.random() * 0.004), key, pieces)
                     for name, key, pieces in first)
        rounds.then((log.read(name, rng.random() * 0.002), key, hull)
                    for name, key, hull in second)
        rounds.finish()
    assert set(log.finished) == {name for name, _, _ in first} | {name for name, _, _ in second}
    for name, key, hull in second:
        if hull is None:
            continue
        writers = [w for w, k, pieces in first
                   if k == key and any(a < hull[1] and b > hull[0] for a, b in pieces)]
        for writer in writers:
            assert log.finished[writer] <= log.started[name], (
                f"{name} (rows {hull} of {key}) started before {writer} finished")


def test_a_second_round_read_does_not_wait_for_first_round_reads_of_other_rows():
    log, release = Log(), threading.Event()

    def held() -> None:
        assert release.wait(10), "the test never released the first round"
        log.read("held", 0)()
    rounds = Rounds()
    rounds.first([(held, "a", [(0, 10)]), (log.read("quick", 0), "b", [(0, 10)])])
    rounds.then([(log.read("late-b", 0), "b", (0, 10)), (log.read("late-a", 0), "a", (0, 5))])
    finishing = threading.Thread(target=rounds.finish)
    finishing.start()
    deadline = time.monotonic() + 10
    while "late-b" not in log.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    finished_early = "late-b" in log.finished and "late-a" not in log.started
    release.set()
    finishing.join()
    assert finished_early  # while "held" (rows of "a") was still running
    assert log.started["late-a"] >= log.finished["held"]


@pytest.mark.parametrize("failing", ["first", "second"])
def test_a_failed_read_stops_both_rounds_and_is_raised(failing):
    log = Log()
    rounds = Rounds()
    with pytest.raises(OSError, match=f"{'x' if failing == 'first' else 'late'} failed"), rounds:
        rounds.first([(log.read("x", 0, fails=failing == "first"), "a", [(0, 10)]),
                       (log.read("y", 0.05), "a", [(10, 20)])])
        rounds.then([(log.read("late-x", 0), "a", (0, 10)),
                     (log.read("late-y", 0), "a", (10, 20))]
                    if failing == "first" else
                    [(log.read("late", 0, fails=True), "a", (0, 5))])
        rounds.finish()
    if failing == "first":  # what needed the failed read's rows never ran
        assert "late-x" not in log.started


def test_a_failing_body_waits_for_the_reads_running_and_starts_no_more():
    log, running = Log(), threading.Event()
    queued = 4 * io_threads()

    def slow() -> None:
        running.set()
        log.read("slow", 0.1)()
    with pytest.raises(ValueError, match="planning failed"), Rounds() as rounds:
        rounds.first([(slow, "a", [(0, 10)])] + [(log.read(f"queued{i}", 0.1), "a", [])
                                                 for i in range(queued)])
        assert running.wait(10)
        raise ValueError("planning failed")
    assert "slow" in log.finished  # waited for: nothing writes into the arrays afterwards
    assert log.started.keys() == log.finished.keys()
    assert len(log.started) <= io_threads()  # the reads still queued were not started
