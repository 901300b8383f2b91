"""DaskSession: every node's workspace lives in a Dask actor on one worker, for the whole run.

A group run sends each node's steps (its task functions, pickled with cloudpickle) to the node's
actor and waits for all of them; only the steps go out and their small results (blob names,
commit records, timings) come back. The checkpoint managers' tasks save and load the node's Zarr
group from the worker, so a node's arrays never travel through the scheduler, the client or
Prefect. Inside a Prefect flow, wrap it: ``PrefectSession(nodes=DaskSession(client))`` keeps one
Prefect task run per node and group.

Nodes are placed on the cluster's workers when first used: with ``placement={node: address}``
where given, else on the worker holding the fewest of this session's nodes (ties: address
order). A worker that dies takes its nodes' workspaces with it: the group run fails naming the
node (:class:`~caffe2ckpt.errors.NodeLostError`, also when other nodes of the group failed
otherwise); every later call to that node fails at once. The job resumes from its newest
committed epoch in a new session (a Prefect retry makes one), or, with ``memory_tier=True``,
goes back in the same run to an epoch copied in worker memory, and a new session on the same
cluster resumes from such copies when they are newer than storage
(:mod:`caffe2ckpt.dask.memory`). Every call ends (see
:class:`DaskSession` for the bounds). Task functions of modules that no process can import by
name (a deployed flow file and the modules beside it) travel by value
(:mod:`caffe2ckpt.dask.scripts`).

Install with the ``[dask]`` extra."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future as CallFuture
from concurrent.futures import TimeoutError as CallTimeout
from typing import Any, Self

import cloudpickle
import numpy as np
from distributed import Client
from distributed.protocol import to_serialize

from caffe2ckpt.dask.actor import NodeActor
from caffe2ckpt.dask.memory import MemoryTier
from caffe2ckpt.dask.scripts import ScriptModules
from caffe2ckpt.errors import JobDefinitionError, NodeLostError
from caffe2ckpt.fs.iopool import IO_THREADS, check_io_threads
from caffe2ckpt.job import Task, TaskGroup
from caffe2ckpt.manager._nodeops import worker_info
from caffe2ckpt.session import RunEvent, Step, run_on
from caffe2ckpt.workspace import WorkspaceType

__all__ = ["DaskSession", "RemoteWorkspace"]

logger = logging.getLogger(__name__)


class RemoteWorkspace(Mapping[str, np.ndarray]):
    """A node's workspace seen from the client: every access is a call to the node's actor
    (for inspection, stop conditions and partial loads; never the hot path)."""

    def __init__(self, session: DaskSession, node: str) -> None:
        self._session, self._node = session, node

    def _call(self, method: str, *args: Any) -> Any:
        return self._session._call(self._node, method, *args)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._call("get", name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._call("set", name, value)

    def __delitem__(self, name: str) -> None:
        self._call("delete", name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._call("names"))

    def __len__(self) -> int:
        return len(self._call("names"))

    def __contains__(self, name: object) -> bool:
        return name in self._call("names")

    def __repr__(self) -> str:
        return f"RemoteWorkspace(node={self._node!r}, worker={self._session.worker_of(self._node)!r})"


class DaskSession:
    """Runs each node's tasks in a Dask actor that holds the node's workspace.

    Args:
        client: a ``distributed.Client``, or a scheduler address to connect to (that client is
            closed by :meth:`close`).
        placement: ``{node: worker address}`` for nodes that must run on a given worker.
        place_timeout: seconds to wait for a node's actor to start on its worker.
        io_threads: chunk I/O threads of each worker process holding a node. Default: the
            8 threads one process would use, shared by the cluster's workers on that worker's
            host (at least 2 each), since they share its cores and disks.
        memory_tier: keep a copy of every node's workspace in its worker's memory and one on
            another worker after each epoch (:attr:`memory_tier`), so that a ``JobRunner``
            goes back to it when a worker dies instead of failing the run. It costs about
            twice the workspaces in worker memory.
        memory_tier_keep: seconds the memory-tier copies stay on the workers after this
            session went without its job finishing (its flow process died, or the run failed
            and the session closed), so that the job's next session on the same cluster (a
            Prefect retry) resumes from them (:meth:`MemoryTier.adopt
            <caffe2ckpt.dask.memory.MemoryTier.adopt>`); 0 drops them with the actors. A
            job that finishes drops them at once.

    Every call to a node (a group run, a :class:`RemoteWorkspace` access, placing the node)
    answers, raises what the node raised, or fails with :class:`~caffe2ckpt.errors.NodeLostError`
    naming the node, the call and the worker:

    - at once when the call's connection fails or the worker no longer holds the node's actor
      (its process died, or a restarted one took its address);
    - within :attr:`liveness_interval` of the scheduler dropping the worker: at once for a dead
      process, after ``distributed.scheduler.worker-ttl`` (5 minutes by default) for one that
      stopped answering with its connections open (frozen, cut off);
    - about :attr:`scheduler_timeout` seconds after the scheduler stopped answering;
    - when placing a node: within about :attr:`liveness_interval` of its worker leaving, else
      after ``place_timeout``.

    A call on a live worker is never cut short, however long it runs (a large save can take
    minutes).

    Example:
        >>> from distributed import LocalCluster
        >>> with LocalCluster(n_workers=2, processes=True) as cluster, \\
        ...         DaskSession(cluster.get_client()) as session:  # doctest: +SKIP
        ...     JobRunner(build_job(), MultiNodeCheckpointManager("s3://b/run")).train(session)
    """

    remote = True  # managers run their background-save waits as groups on this session

    liveness_interval = 1.0
    """While a call to a node's actor runs, every this many seconds the session asks whether the
    node's worker still holds the actor (the actor's future here, then the scheduler's
    ``who_has``): if not, the call fails with :class:`NodeLostError` at once. Distributed itself
    would keep trying to reach the dead worker for ``distributed.comm.timeouts.connect`` (30 s)
    when the call left before the client heard of the death."""

    scheduler_timeout = 120.0
    """Seconds a call waits while the scheduler does not answer those questions (a frozen or
    unreachable scheduler) before it fails with :class:`NodeLostError`."""

    def __init__(self, client: Client | str, *, placement: Mapping[str, str] | None = None,
                 place_timeout: float = 60.0, io_threads: int | None = None,
                 memory_tier: bool = False, memory_tier_keep: float = 600.0) -> None:
        if isinstance(memory_tier_keep, bool) or not (
                isinstance(memory_tier_keep, int | float)
                and 0 <= memory_tier_keep < math.inf):
            raise JobDefinitionError(f"memory_tier_keep must be a number of seconds, 0 or "
                                     f"more, got {memory_tier_keep!r}")
        self._own_client = not isinstance(client, Client)
        self._client = Client(client) if self._own_client else client
        self._placement = dict(placement or {})
        self._preferred: dict[str, str] = {}  # node -> a worker to place it on, if running
        self._keep = float(memory_tier_keep) if memory_tier else 0.0
        self._place_timeout = place_timeout
        self._io_threads = None if io_threads is None else check_io_threads(io_threads)
        self._futures: dict[str, Any] = {}  # node -> its actor's future (its key names the actor)
        self._workers: dict[str, str] = {}
        self._lost: dict[str, str] = {}  # node -> why it was lost (calls to it fail at once)
        self._lock = threading.Lock()
        self._scripts = ScriptModules()
        self.closed = False
        self.memory_tier = MemoryTier(self) if memory_tier else None

    # -- placement -------------------------------------------------------------------------------

    def worker_of(self, node: str) -> str | None:
        """The worker address holding ``node``, once placed."""
        return self._workers.get(node)

    def placed(self) -> dict[str, str]:
        """``{node: worker address}`` of the nodes placed and not lost."""
        with self._lock:
            return {n: w for n, w in self._workers.items() if n not in self._lost}

    def lost_nodes(self) -> list[str]:
        with self._lock:
            return sorted(self._lost)

    def lost_worker(self, node: str) -> str:
        """The worker a lost node was on."""
        return self._workers[node]

    def key_of(self, node: str) -> str:
        """The key of a placed node's actor."""
        return self._futures[node].key

    def hosts(self) -> dict[str, str]:
        """``{address: host}`` of the running workers."""
        return self._running_workers()

    def prefer(self, workers: Mapping[str, str]) -> None:
        """Place each of these nodes, when it is placed, on the worker given for it if that
        worker runs then (a ``placement`` given to the session comes first)."""
        self._preferred.update(workers)

    def replace(self, node: str) -> None:
        """Place a lost node again, with an empty workspace, on a running worker."""
        with self._lock:
            self._lost.pop(node, None)
            self._futures.pop(node, None)
            self._workers.pop(node, None)
        self._place(node)

    def _running_workers(self) -> dict[str, str]:
        """``{address: host}`` of the workers the scheduler sees running, asked now. (Not
        ``client.scheduler_info()``: it returns a cache that the client's periodic refresh
        overwrites with a copy listing no workers, measured under load.)"""
        info = self._client.sync(self._client.scheduler.identity, n_workers=-1,
                                 callback_timeout=self._ask_timeout)
        return {address: worker.get("host", address) for address, worker in
                sorted(info["workers"].items()) if worker.get("status", "running") == "running"}

    @property
    def _ask_timeout(self) -> float:
        """Seconds to wait for the scheduler's answer to one question."""
        return min(max(10.0, self.liveness_interval), self.scheduler_timeout)

    def _choose_worker(self, node: str, workers: Mapping[str, str]) -> str:
        scheduler = self._client.scheduler.address
        if not workers:
            raise NodeLostError(f"cannot place node {node!r}: the Dask cluster at {scheduler} "
                                "has no workers", node=node)
        if node in self._placement:
            wanted = self._placement[node]
            if wanted not in workers:
                raise NodeLostError(f"cannot place node {node!r} on worker {wanted!r}: the Dask "
                                    f"cluster at {scheduler} has workers {list(workers)}",
                                    node=node)
            return wanted
        if self._preferred.get(node) in workers:
            return self._preferred[node]
        load = {w: 0 for w in workers}
        for w in self._workers.values():
            if w in load:
                load[w] += 1
        return min(workers, key=lambda w: (load[w], w))

    def _place(self, node: str) -> tuple[str, str]:
        """The key of the node's actor and its worker's address; the first call places the node
        (its actor started on the chosen worker)."""
        with self._lock:
            if self.closed:
                raise JobDefinitionError(f"this DaskSession is closed: node {node!r} and its "
                                         "workspace are gone; use a new session")
            if node not in self._futures:
                self._start(node)
            return self._futures[node].key, self._workers[node]

    def _start(self, node: str) -> None:
        try:
            running = self._running_workers()
        except Exception as exc:
            raise NodeLostError(f"cannot place node {node!r}: the Dask scheduler at "
                                f"{self._client.scheduler.address} did not say which workers "
                                f"run ({type(exc).__name__}: {exc})", node=node) from exc
        worker = self._choose_worker(node, running)
        io_threads = self._io_threads or max(2, IO_THREADS // sum(
            host == running[worker] for host in running.values()))
        if worker in self._workers.values():
            logger.warning("node %r shares Dask worker %s with node(s) %s: their tasks run "
                           "one after another there (add workers for parallel nodes)", node,
                           worker, [n for n, w in self._workers.items() if w == worker])
        future = self._client.submit(NodeActor, node, io_threads, self._keep, actor=True,
                                     workers=[worker], allow_other_workers=False, pure=False)
        try:
            self._started(future, worker)
        except Exception as exc:
            future.cancel()
            raise NodeLostError(f"could not place node {node!r}: its actor did not start on Dask "
                                f"worker {worker} ({type(exc).__name__}: {exc})",
                                node=node) from exc
        self._futures[node], self._workers[node] = future, worker

    def _started(self, future: Any, worker: str) -> None:
        """Wait until the actor of ``future`` runs on ``worker``; raise once it cannot (it
        failed, or its worker left: the actor may only run there), or after ``place_timeout``."""
        deadline = time.monotonic() + self._place_timeout
        while True:
            # (the actor handle that result() returns is not used: calls go through this client)
            with contextlib.suppress(TimeoutError):
                future.result(timeout=min(self.liveness_interval, self._place_timeout))
                return
            if future.status == "finished":  # it started as the wait timed out
                return
            if future.status != "pending":  # it failed as the wait timed out: raise its error
                future.result(timeout=self._ask_timeout)
                raise RuntimeError(f"its actor's future is {future.status!r}")
            if worker not in self._client.sync(self._client.scheduler.ncores, workers=[worker],
                                               callback_timeout=self._ask_timeout):
                raise RuntimeError("the worker left the cluster before the actor started")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the actor did not start within {self._place_timeout:.0f} s")

    # -- calls -----------------------------------------------------------------------------------

    def _call(self, node: str, method: str, *args: Any) -> Any:
        """``method(*args)`` on the node's actor (:meth:`NodeActor.call`): what it returned, or
        what it raised (a missing blob's ``KeyError``, a task's failure). A call that does not
        come back (its connection failed, the worker does not hold the actor) or whose worker
        is gone while it waits (:meth:`_wait`) raises :class:`NodeLostError`, and the node is
        then lost for good."""
        self._check_not_lost(node, method)
        key, worker = self._place(node)
        status = getattr(self._futures.get(node), "status", "finished")
        if status not in ("finished", "pending"):  # this client heard that its worker is gone
            raise self._lose(node, f"before the call {method!r}: its actor's future is {status!r}")
        try:
            pickled = cloudpickle.dumps(args)
        except Exception as exc:
            raise TypeError(f"cannot send the call {method!r} to node {node!r} (Dask worker "
                            f"{worker}): {type(exc).__name__}: {exc}") from exc
        call = self._send(node, method, key, worker, pickled)
        try:
            reply = self._wait(node, method, call)
        finally:
            call.cancel()  # (a no-op once it ended) a lost call stops waiting for its worker
        try:
            finished, value = cloudpickle.loads(reply)
        except Exception as exc:
            raise RuntimeError(f"node {node!r} (Dask worker {worker}) answered the call "
                               f"{method!r} with what cannot be unpickled here: "
                               f"{type(exc).__name__}: {exc}") from exc
        if not finished:
            value.add_note(f"in the call {method!r} to node {node!r} on Dask worker {worker}")
            raise value
        return value

    def _send(self, node: str, method: str, key: str, worker: str, args: bytes) -> CallFuture:
        """Start the call on this client's event loop."""
        execute = self._execute(key, worker, method, args)
        try:
            return asyncio.run_coroutine_threadsafe(execute, self._client.loop.asyncio_loop)
        except RuntimeError as exc:  # the client's loop is closed
            execute.close()
            raise self._lose(node, f"the call {method!r} could not start: {exc}") from exc

    async def _execute(self, key: str, worker: str, method: str,
                       args: bytes) -> tuple[bool, Any]:
        """Run the actor's ``call`` with the RPC Dask's own actor handles use (through the
        scheduler, or straight to the worker when the client connects to workers), and return
        (True, the pickled outcome) or (False, why no answer came back). It never raises, so
        the caller learns how every call ended; Dask's actor handle instead waits for ever when
        the RPC fails with anything but an ``OSError`` (the worker at that address does not
        hold the actor, arguments the worker cannot load), and such a handle may belong to
        another ``Client`` of this process, one that may close or never hear of the actor."""
        msg = {"actor": key, "function": "call", "args": [method, to_serialize(args)],
               "kwargs": {}}
        try:
            if self._client.direct_to_workers:
                response = await self._client.rpc(worker).actor_execute(**msg)
            else:
                response = await self._client.scheduler.proxy(
                    worker=worker, msg={"op": "actor_execute", **msg})
        except Exception as exc:  # noqa: BLE001 - the call did not come back
            return False, exc
        if response.get("status") == "OK":
            return True, response["result"]
        return False, response.get("exception")

    def _wait(self, node: str, method: str, call: CallFuture) -> bytes:
        """Wait for ``call``'s answer, however long the call runs, while the node's worker holds
        its actor; raise :class:`NodeLostError` once the call did not come back, once the
        worker does not hold the actor, or once the scheduler did not answer for
        :attr:`scheduler_timeout` seconds."""
        answered = time.monotonic()  # when the scheduler last answered
        while True:
            try:
                delivered, reply = call.result(timeout=self.liveness_interval)
            except CallTimeout:
                gone, answered = self._gone(node, answered)
                if gone is not None:
                    raise self._lose(node, f"during the call {method!r}: {gone}; what it ran "
                                           "may have finished there") from None
                continue
            if not delivered:
                cause = reply if isinstance(reply, BaseException) else None
                raise self._lose(node, f"the call {method!r} did not come back: "
                                       f"{type(reply).__name__}: {reply}; what it ran may have "
                                       "finished there") from cause
            return reply

    def _gone(self, node: str, answered: float) -> tuple[str | None, float]:
        """Why the node's worker no longer holds its actor, as this client or else the
        scheduler sees it now (None while it does), and when the scheduler last answered
        (``answered``, or now). No answer for :attr:`scheduler_timeout` seconds is a reason."""
        future, worker = self._futures.get(node), self._workers.get(node)
        if future is None:
            return "its session was closed", answered
        if future.status not in ("finished", "pending"):
            return f"its actor's future is {future.status!r}", answered
        try:
            holders = self._client.sync(self._client.scheduler.who_has, keys=[future.key],
                                        callback_timeout=self._ask_timeout)
        except Exception as exc:  # noqa: BLE001 - unknown: keep waiting for the call, a while
            logger.debug("cannot ask the scheduler where node %r's actor is: %s", node, exc)
            silent = time.monotonic() - answered
            if silent < self.scheduler_timeout:
                return None, answered
            return (f"the Dask scheduler at {self._client.scheduler.address} did not answer for "
                    f"{silent:.0f} s ({type(exc).__name__}: {exc})"), answered
        if worker not in (holders.get(future.key) or ()):
            return f"the scheduler no longer has its actor on worker {worker}", time.monotonic()
        return None, time.monotonic()

    def _lose(self, node: str, why: str) -> NodeLostError:
        """Mark ``node`` lost (later calls fail at once) and return the error to raise."""
        loss = f"node {node!r} was lost with its Dask worker {self._workers.get(node)} ({why})"
        message = (f"{loss}; its workspace is gone: resume the job from its newest committed "
                   "epoch in a new session")
        with self._lock:
            self._lost.setdefault(node, message)
        return NodeLostError(message, node=node, loss=loss)

    def _check_not_lost(self, node: str, method: str) -> None:
        message = self._lost.get(node)
        if message is not None:
            raise NodeLostError(f"the call {method!r} to node {node!r} cannot run: {message}",
                                node=node)

    # -- the Session protocol ----------------------------------------------------------------------

    def run_node(self, node: str, steps: list[Step], workspace_type: WorkspaceType) -> list[Any]:
        """Run one node's steps in its actor; return what they returned. Modules of this
        process that the node's worker cannot import go by value (:mod:`.scripts`)."""
        self._check_not_lost(node, "run")
        worker = self._place(node)[1]
        self._scripts.send_by_value(worker, lambda names: self._call(node, "cannot_import",
                                                                     names))
        return self._call(node, "run", steps, workspace_type)

    def run(self, runnable: TaskGroup | Task) -> None:
        """Run a group on its nodes' actors. When a node was lost, the run raises its
        :class:`NodeLostError` even if another node's failure came first (the job cannot go
        on in this session, whatever else failed)."""
        lost: list[NodeLostError] = []

        def run_node(node: str, steps: list[Step], workspace_type: WorkspaceType) -> list[Any]:
            try:
                return self.run_node(node, steps, workspace_type)
            except NodeLostError as exc:
                lost.append(exc)
                raise

        try:
            run_on(self, runnable, run_node)
        except NodeLostError:
            raise
        except Exception as exc:
            if not lost:
                raise
            lost[0].add_note(f"the group's first failure was {type(exc).__name__}: {exc}")
            raise lost[0] from lost[0].__cause__

    def workspace(self, node: str) -> RemoteWorkspace:
        self._place(str(node))
        return RemoteWorkspace(self, str(node))

    @property
    def workspaces(self) -> dict[str, RemoteWorkspace]:
        return {node: RemoteWorkspace(self, node) for node in self._futures}

    def writer_info(self) -> dict[str, Any]:
        return {**worker_info(), "session": "dask", "scheduler": self._client.scheduler.address}

    def notify(self, event: RunEvent) -> None:
        pass

    def close(self) -> None:
        """Drop every node's actor (its workspace goes with it; its memory-tier copies stay
        ``memory_tier_keep`` seconds unless the job finished); close the client if this
        session made it."""
        if self.memory_tier is not None and not self.closed and self._client.status == "running":
            # no copy still on its way to a dropped actor; kept copies are whole first
            self.memory_tier.settle(give_up=self._keep <= 0)
        with self._lock:
            self.closed = True
            futures = list(self._futures.values())
            self._futures.clear()
            self._workers.clear()
            self._lost.clear()
        try:
            if futures:
                self._client.cancel(futures)
        finally:
            if self._own_client:
                self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
