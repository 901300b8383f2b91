"""Every call a DaskSession makes ends: it answers, raises what the node raised, or fails with
NodeLostError naming the node and the call, never waits for ever. Real workers are SIGKILLed and
their nannies restart them, at the same address (a worker with a fixed port) or at a new one.
Each call runs under a watchdog (:func:`ended`) so that a call that does not end fails the test
instead of hanging it."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from caffe2ckpt import Task, TaskGroup, WorkspaceType
from caffe2ckpt.errors import NodeLostError
from tests.daskcluster import CLUSTER_CONFIG

dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")
from caffe2ckpt.dask import DaskSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NODES = ["trainer_0", "trainer_1"]
CALL_BOUND = 20.0  # every call here ends within this (its worker dies at once or never)


def ended(what: str, call: Callable[[], Any], bound: float = CALL_BOUND) -> tuple[Any, float]:
    """Run ``call()`` in a thread: what it returned or raised, and its seconds. A call still
    running after ``bound`` seconds fails the test with its stack (the thread is left behind,
    a daemon)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        started = time.monotonic()
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            outcome["value"] = exc
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=target, name=f"call {what}", daemon=True)
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident)
        stack = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
        pytest.fail(f"{what} did not end within {bound:.0f} s; it waits in:\n{stack}")
    return outcome["value"], outcome["seconds"]


def lost_or_answered(what: str, value: Any, node: str, *, answered_ok: bool) -> str:
    """``"lost"`` for a NodeLostError naming ``node``, ``"answered"`` for anything that is not
    an exception (when ``answered_ok``); any other outcome fails the test."""
    if isinstance(value, NodeLostError):
        assert value.node == node and repr(node) in str(value), (what, value)
        return "lost"
    if isinstance(value, BaseException) or not answered_ok:
        pytest.fail(f"{what}: expected NodeLostError naming {node!r}"
                    + (" or an answer" if answered_ok else "") + f", got {value!r}")
    return "answered"


def free_low_port() -> int:
    """A free TCP port below Linux's ephemeral range, so that no outgoing connection takes it
    while its worker restarts."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free port in 20000-32000")


@pytest.fixture(scope="module")
def restarting_cluster() -> Iterator[distributed.SpecCluster]:
    """Two worker processes under nannies: ``fixed`` listens on a fixed port (its restarted
    process takes the same address back; a spare port if that one is taken), ``free`` on
    a port the OS picks (a restart moves it)."""
    common = {"nthreads": 1, "host": "127.0.0.1", "dashboard_address": ":0", "silence_logs": 40}
    workers = {
        "fixed": {"cls": distributed.Nanny,
                  "options": {**common, "worker_port": [free_low_port(), free_low_port()]}},
        "free": {"cls": distributed.Nanny, "options": {**common, "worker_port": 0}}}
    scheduler = {"cls": distributed.Scheduler,
                 "options": {"host": "127.0.0.1", "port": 0, "dashboard_address": ":0"}}
    with dask.config.set(CLUSTER_CONFIG), distributed.SpecCluster(
            workers=workers, scheduler=scheduler, silence_logs=40) as cluster:
        yield cluster


@pytest.fixture
def client(restarting_cluster) -> Iterator[distributed.Client]:
    with distributed.Client(restarting_cluster) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


def workers_by_name(client) -> dict[str, str]:
    """``{"fixed": address, "free": address}`` once both workers are up."""
    client.wait_for_workers(2, timeout=60)
    deadline = time.monotonic() + 60
    while True:
        info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
        names = {w["name"]: a for a, w in info.items() if w.get("status") == "running"}
        if len(names) == 2 or time.monotonic() > deadline:
            return names
        time.sleep(0.1)


def sigkill(session: DaskSession, client, node: str) -> None:
    """SIGKILL the process of ``node``'s worker (asked through the client, not the node)."""
    worker = session.worker_of(node)
    pid = client.run(os.getpid, workers=[worker])[worker]
    os.kill(pid, signal.SIGKILL)


def sleeper(seconds: float, value: float) -> Callable[[Any], None]:
    def sleep_then_set(ws) -> None:
        time.sleep(seconds)
        ws["x"] = np.float32(value)
    return sleep_then_set


def group_of(fn: Callable[[Any], None], nodes: list[str]) -> TaskGroup:
    group = TaskGroup(WorkspaceType.GLOBAL, name="chaos")
    for node in nodes:
        Task(fn, name="step", group=group, node=node)
    return group


def die_when_placed(marker: str) -> None:
    """Run on one worker: the next NodeActor started there SIGKILLs the process first (while
    the file ``marker`` exists)."""
    from caffe2ckpt.dask import actor

    start = getattr(actor.NodeActor.__init__, "original", actor.NodeActor.__init__)

    def dying(self, *args, **kwargs):
        if os.path.exists(marker):
            os.unlink(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        start(self, *args, **kwargs)

    dying.original = start
    actor.NodeActor.__init__ = dying


def placed(client, placement: dict[str, str] | None = None) -> DaskSession:
    """A session with both nodes placed (one per worker) and holding blob ``x``."""
    session = DaskSession(client, placement=placement)
    for node in NODES:
        value, _ = ended(f"placing {node}", lambda n=node: session.workspace(n).__setitem__(
            "x", np.float32(1)))
        assert value is None, value
    assert len({session.worker_of(n) for n in NODES}) == 2
    return session


def kill_during_group_run(client, rng, outcomes) -> None:
    """Both nodes run a 0.8 s step; one node's worker is killed partway through."""
    with contextlib.closing(placed(client)) as session:
        node = rng.choice(NODES)
        killer = threading.Timer(rng.uniform(0.05, 0.5), sigkill, (session, client, node))
        killer.start()
        value, _ = ended("a group run", lambda: session.run(group_of(sleeper(0.8, 2),
                                                                            NODES)))
        killer.join()
        outcomes[lost_or_answered("group run", value, node, answered_ok=False)] += 1
        other = next(n for n in NODES if n != node)
        value, _ = ended("a get of the other node", lambda: session.workspace(other)["x"])
        assert value == 2, value  # the other node finished its step and still answers


def kill_then_call(client, rng, outcomes, method: str) -> None:
    """One node's worker is killed while no call runs; a call follows after a pause (long
    enough, sometimes, for the nanny to restart the worker, at the same address or not)."""
    calls = {"get": lambda s, n: s.workspace(n)["x"],
             "set": lambda s, n: s.workspace(n).__setitem__("y", np.float32(3)),
             "names": lambda s, n: list(s.workspace(n)),
             "run": lambda s, n: s.run(Task(sleeper(0, 4), node=n))}
    with contextlib.closing(placed(client)) as session:
        node = rng.choice(NODES)
        sigkill(session, client, node)
        time.sleep(rng.choice([0.0, 0.1, 0.5, 1.5, 2.5]))
        value, _ = ended(f"{method} after a kill", lambda: calls[method](session, node))
        outcomes[lost_or_answered(method, value, node, answered_ok=False)] += 1
        value, _ = ended(f"a second {method}", lambda: calls[method](session, node))
        lost_or_answered(f"a second {method}", value, node, answered_ok=False)


def kill_during_long_call(client, rng, outcomes) -> None:
    """A 5 s step is cut short by its worker's death: the call fails long before 5 s."""
    with contextlib.closing(placed(client)) as session:
        node = rng.choice(NODES)
        killer = threading.Timer(0.5, sigkill, (session, client, node))
        killer.start()
        value, seconds = ended("a long run", lambda: session.run(Task(sleeper(5, 5), node=node)))
        killer.join()
        outcomes[lost_or_answered("long run", value, node, answered_ok=False)] += 1
        assert seconds < 4.5, seconds


def kill_during_placement(client, rng, outcomes, tmp_path, name: str) -> None:
    """The worker a node is being placed on dies as its actor starts: the placement ends
    (placed on the restarted process at the same address, or NodeLostError) in seconds."""
    worker = workers_by_name(client)[name]
    marker = tmp_path / f"die-when-placed-{rng.random()}"
    marker.touch()
    client.run(die_when_placed, str(marker), workers=[worker])
    with contextlib.closing(DaskSession(client, placement={"trainer_0": worker})) as session:
        value, seconds = ended("placing a node", lambda: session.workspace("trainer_0")["x"])
    assert not marker.exists()  # the worker died placing it
    if not isinstance(value, KeyError):  # placed on the restarted process: no "x" there
        outcomes[lost_or_answered("placement", value, "trainer_0", answered_ok=False)] += 1
    else:
        outcomes["answered"] += 1
    assert seconds < 15, seconds  # not place_timeout's 60 s


def test_every_call_ends_through_worker_kills_and_restarts(client, tmp_path):
    """Group runs, workspace gets and sets, and placements through SIGKILLs of the workers
    holding the nodes; the nannies restart them (the ``fixed`` one at its address). Each call
    answers or fails with NodeLostError naming its node within seconds; none waits."""
    rng = random.Random(int(os.environ.get("CHAOS_SEED", "25")))
    outcomes: Counter[str] = Counter()
    rounds: list[Callable[[], None]] = [
        *(lambda: kill_during_group_run(client, rng, outcomes) for _ in range(2)),
        *(lambda m=m: kill_then_call(client, rng, outcomes, m)
          for m in ("get", "set", "names", "run")),
        lambda: kill_during_long_call(client, rng, outcomes),
        *(lambda n=n: kill_during_placement(client, rng, outcomes, tmp_path, n)
          for n in ("fixed", "free"))]
    rng.shuffle(rounds)
    for run_round in rounds:
        workers_by_name(client)  # the killed worker is back
        run_round()
    assert sum(outcomes.values()) == len(rounds) and outcomes["lost"] >= len(rounds) - 2, outcomes
    # the cluster is whole again and a new session works on it
    names = workers_by_name(client)
    assert sorted(names) == ["fixed", "free"], names
    with contextlib.closing(placed(client)) as session:
        session.run(group_of(sleeper(0, 7), NODES))
        assert [ended("a last get", lambda n=n: session.workspace(n)["x"])[0] for n in NODES] == [
            7, 7]


def drop_actor(key: str, dask_worker=None) -> None:
    """Run on a worker: forget the actor ``key`` there, behind the scheduler's back (which
    still lists it on the worker), as a process that took over the worker's address would."""
    del dask_worker.state.actors[key]


def test_a_worker_that_no_longer_holds_the_actor_the_scheduler_lists_fails_the_call(client):
    """The state a hung chaos run ended in: the scheduler lists the node's actor on a live
    worker that does not hold it. Dask's actor call then fails with a KeyError, which its actor
    handle never hands to its caller (only an OSError ends it): the call waited for ever."""
    with contextlib.closing(placed(client)) as session:
        future, worker = session._futures["trainer_1"], session.worker_of("trainer_1")
        client.run(drop_actor, future.key, workers=[worker])
        assert list(client.who_has([future])[future.key]) == [worker]  # it still lists it
        for method, call in [("get", lambda: session.workspace("trainer_1")["x"]),
                             ("run", lambda: session.run(Task(sleeper(0, 2), node="trainer_1")))]:
            value, seconds = ended(method, call)
            lost_or_answered(method, value, "trainer_1", answered_ok=False)
            assert "'get'" in str(value) and worker in str(value), value
            assert seconds < 5, seconds
        assert ended("a get of the other node", lambda: session.workspace("trainer_0")["x"]) [
            0] == 1


def test_what_cannot_be_sent_or_loaded_fails_naming_the_node_and_the_call(client, tmp_path,
                                                                          monkeypatch):
    """A value that cannot be pickled, and a task that imports a module the workers cannot
    import (on this process's path only), fail the call at once with an error naming the node
    and the call; the node stays usable. (Both waited for ever before.) A task function of such
    a module itself goes to the workers by value (caffe2ckpt.dask.scripts) and runs."""
    (tmp_path / "client_only_steps.py").write_text(
        "def bump(ws):\n    ws['x'] = ws['x'] + 1\n\n"
        "def use_helper(ws):\n    import client_only_helper  # noqa: F401\n")
    (tmp_path / "client_only_helper.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers started before: not on theirs
    import client_only_steps

    with contextlib.closing(placed(client)) as session:
        worker = session.worker_of("trainer_0")
        value, _ = ended("set", lambda: session.workspace("trainer_0").__setitem__(
            "lock", threading.Lock()))
        assert isinstance(value, TypeError), value
        assert "'set'" in str(value) and "'trainer_0'" in str(value) and worker in str(value)
        session.run(Task(client_only_steps.bump, node="trainer_0"))  # by value
        value, _ = ended("run", lambda: session.run(Task(client_only_steps.use_helper,
                                                         node="trainer_0")))
        assert isinstance(value, ModuleNotFoundError), value
        notes = "\n".join(value.__notes__)
        assert "'run'" in notes and "'trainer_0'" in notes and worker in notes, notes
        assert ended("get", lambda: session.workspace("trainer_0")["x"])[0] == 2


def test_calls_go_through_the_session_s_client_not_the_newest_one(client, restarting_cluster):
    """Dask's actor handles bind to the newest Client of the process, not to the one that made
    them: with another client made after the session's, closing it lost every node (the handles'
    futures were cancelled), and a call whose worker died waited on a future that client never
    hears of."""
    other = distributed.Client(restarting_cluster.scheduler_address)
    try:
        with contextlib.closing(placed(client)) as session:
            other.close()
            assert [ended("get", lambda n=n: session.workspace(n)["x"])[0] for n in NODES] == [
                1, 1]
            other = distributed.Client(restarting_cluster.scheduler_address)
            session.workspace("trainer_0")["x"] = np.float32(5)  # a call with the other open
            sigkill(session, client, "trainer_1")
            value, seconds = ended("get", lambda: session.workspace("trainer_1")["x"])
            lost_or_answered("get", value, "trainer_1", answered_ok=False)
            assert seconds < 5, seconds
    finally:
        other.close()
