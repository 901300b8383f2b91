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
otherwise), within about :attr:`DaskSession.liveness_interval` of the call even when the call
reached for the dead worker before the scheduler had heard of its death; every later call to that
node fails at once. The job resumes from its newest committed epoch in a new session (a Prefect
retry makes one).

Install with the ``[dask]`` extra."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import cloudpickle
import numpy as np
from distributed import Client

from caffe2ckpt.dask.actor import NodeActor
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
    when the call left before the client heard of the death. A call on a live worker is never
    cut short, however long it runs (a large save can take minutes)."""

    def __init__(self, client: Client | str, *, placement: Mapping[str, str] | None = None,
                 place_timeout: float = 60.0, io_threads: int | None = None) -> None:
        self._own_client = not isinstance(client, Client)
        self._client = Client(client) if self._own_client else client
        self._placement = dict(placement or {})
        self._place_timeout = place_timeout
        self._io_threads = None if io_threads is None else check_io_threads(io_threads)
        self._actors: dict[str, Any] = {}
        self._futures: dict[str, Any] = {}
        self._workers: dict[str, str] = {}
        self._lost: dict[str, str] = {}  # node -> why it was lost (calls to it fail at once)
        self._lock = threading.Lock()
        self.closed = False

    # -- placement -------------------------------------------------------------------------------

    def worker_of(self, node: str) -> str | None:
        """The worker address holding ``node``, once placed."""
        return self._workers.get(node)

    def _running_workers(self) -> dict[str, str]:
        """``{address: host}`` of the workers the scheduler sees running, asked now. (Not
        ``client.scheduler_info()``: it returns a cache that the client's periodic refresh
        overwrites with a copy listing no workers, measured under load.)"""
        info = self._client.sync(self._client.scheduler.identity, n_workers=-1)
        return {address: worker.get("host", address) for address, worker in
                sorted(info["workers"].items()) if worker.get("status", "running") == "running"}

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
        load = {w: 0 for w in workers}
        for w in self._workers.values():
            if w in load:
                load[w] += 1
        return min(workers, key=lambda w: (load[w], w))

    def _actor(self, node: str) -> Any:
        with self._lock:
            if self.closed:
                raise JobDefinitionError(f"this DaskSession is closed: node {node!r} and its "
                                         "workspace are gone; use a new session")
            if node in self._actors:
                return self._actors[node]
            running = self._running_workers()
            worker = self._choose_worker(node, running)
            io_threads = self._io_threads or max(2, IO_THREADS // sum(
                host == running[worker] for host in running.values()))
            if worker in self._workers.values():
                logger.warning("node %r shares Dask worker %s with node(s) %s: their tasks run "
                               "one after another there (add workers for parallel nodes)", node,
                               worker, [n for n, w in self._workers.items() if w == worker])
            future = self._client.submit(NodeActor, node, io_threads, actor=True,
                                         workers=[worker], allow_other_workers=False, pure=False)
            try:
                actor = future.result(timeout=self._place_timeout)
            except Exception as exc:
                future.cancel()
                raise NodeLostError(f"could not start node {node!r} on Dask worker {worker} "
                                    f"within {self._place_timeout:.0f} s: {exc}",
                                    node=node) from exc
            self._actors[node], self._futures[node], self._workers[node] = actor, future, worker
            return actor

    def _call(self, node: str, method: str, *args: Any) -> Any:
        """Call the node's actor. A failure of the call itself (not of what it ran: ``run``
        returns those) means the actor is gone: :class:`NodeLostError`, as does a worker that
        no longer holds the actor while the call waits (:meth:`_result`); the node is then
        lost for good. Errors of other methods (a missing blob) reach the actor's caller as
        they are."""
        self._check_not_lost(node)
        actor = self._actor(node)
        try:
            return self._result(node, getattr(actor, method)(*args))
        except NodeLostError:
            raise
        except KeyError:
            if method in ("get", "delete"):  # the blob is not in the workspace
                raise
            raise self._lose(node, "its actor is gone from the worker") from None
        except Exception as exc:
            raise self._lose(node, f"{type(exc).__name__}: {exc}") from exc

    def _result(self, node: str, call: Any) -> Any:
        """Wait for an actor call's result, however long the call runs, while the node's worker
        holds its actor; raise :class:`NodeLostError` once it does not."""
        while True:
            try:
                return call.result(timeout=self.liveness_interval)
            except TimeoutError:
                if call.done():  # the call itself raised it
                    raise
            gone = self._gone(node)
            if gone is not None:
                raise self._lose(node, gone)

    def _gone(self, node: str) -> str | None:
        """Why the node's worker no longer holds its actor, as this client or else the
        scheduler sees it now; None while it does, or when the scheduler cannot be asked."""
        future, worker = self._futures.get(node), self._workers.get(node)
        if future is None:
            return "its session was closed"
        if future.status not in ("finished", "pending"):
            return f"its actor's future is {future.status!r}"
        try:
            holders = self._client.sync(self._client.scheduler.who_has, keys=[future.key],
                                        callback_timeout=max(10.0, self.liveness_interval))
        except Exception as exc:  # noqa: BLE001 - unknown: keep waiting for the call
            logger.debug("cannot ask the scheduler where node %r's actor is: %s", node, exc)
            return None
        if worker not in (holders.get(future.key) or ()):
            return f"the scheduler no longer has its actor on worker {worker}"
        return None

    def _lose(self, node: str, why: str) -> NodeLostError:
        """Mark ``node`` lost (later calls fail at once) and return the error to raise."""
        message = (f"node {node!r} was lost with its Dask worker {self._workers.get(node)} "
                   f"({why}); its workspace is gone: resume the job from its newest committed "
                   "epoch in a new session")
        with self._lock:
            self._lost.setdefault(node, message)
        return NodeLostError(message, node=node)

    def _check_not_lost(self, node: str) -> None:
        message = self._lost.get(node)
        if message is not None:
            raise NodeLostError(message, node=node)

    # -- the Session protocol ----------------------------------------------------------------------

    def run_node(self, node: str, steps: list[Step], workspace_type: WorkspaceType) -> list[Any]:
        """Run one node's steps in its actor; return what they returned."""
        finished, value = cloudpickle.loads(self._call(node, "run", steps, workspace_type))
        if not finished:
            raise value
        return value

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
        self._actor(str(node))
        return RemoteWorkspace(self, str(node))

    @property
    def workspaces(self) -> dict[str, RemoteWorkspace]:
        return {node: RemoteWorkspace(self, node) for node in self._actors}

    def writer_info(self) -> dict[str, Any]:
        return {**worker_info(), "session": "dask", "scheduler": self._client.scheduler.address}

    def notify(self, event: RunEvent) -> None:
        pass

    def close(self) -> None:
        """Drop every node's actor (and its workspace); close the client if this session
        made it."""
        with self._lock:
            self.closed = True
            futures = list(self._futures.values())
            self._actors.clear()
            self._futures.clear()
            self._workers.clear()
            self._lost.clear()
        try:
            if futures:
                self._client.cancel(futures)
        finally:
            if self._own_client:
                self._client.close()

    def __enter__(self) -> DaskSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
