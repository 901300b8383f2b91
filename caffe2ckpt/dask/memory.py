"""The memory tier, client side: which worker keeps a copy of which node, and how a session
whose worker died goes back to the newest epoch every node has a copy of.

:meth:`MemoryTier.snapshot` asks every node's actor to copy its workspace (its *own* copy) and
to send that copy to its *buddy*: a node on the next worker in address order, on another host
when the cluster has several (:func:`buddies`). :meth:`MemoryTier.recover` lists the copies
the live workers hold, chooses the newest epoch of which every node (the lost ones too) has a
complete copy of this run (:func:`choose`), places each lost node again on a live worker, sends
it its copy, puts every node back to that epoch (each copy verified against its digests), and
sends the own copy of each node whose other copy was on the lost worker to its buddy, so that
the next loss is covered too.

The copies of a session that went without finishing its job stay on the workers for a while
(``DaskSession(memory_tier_keep=...)``): :meth:`MemoryTier.adopt` places the nodes of the next
session of the job where their copies are and lets their actors take them over, and
:meth:`MemoryTier.recover` then restores them as after a loss. The worker side is
:mod:`caffe2ckpt.dask.tier`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from caffe2ckpt.dask import tier
from caffe2ckpt.errors import NodeLostError
from caffe2ckpt.session import token_run

if TYPE_CHECKING:
    from caffe2ckpt.dask.session import DaskSession

__all__ = ["MemoryTier", "Source", "buddies", "choose"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Source:
    """Where a node's copy of the chosen epoch is: a worker, the node whose actor there sends
    it, and which copy (``"own"``: the node's own worker; ``"held"``: a buddy's)."""

    worker: str
    via: str
    role: str


def buddies(workers: Mapping[str, str], hosts: Mapping[str, str]) -> dict[str, str | None]:
    """Each node's buddy (None while all nodes are on one worker): the first node of the next
    worker in (host, address) order whose host differs, else of the next worker."""
    ring = sorted(set(workers.values()), key=lambda w: (hosts.get(w, w), w))
    first = {w: min(n for n, at in workers.items() if at == w) for w in ring}
    chosen: dict[str, str | None] = {}
    for node, worker in workers.items():
        i = ring.index(worker)
        others = ring[i + 1:] + ring[:i]
        away = [w for w in others if hosts.get(w, w) != hosts.get(worker, worker)]
        target = (away or others or [None])[0]
        chosen[node] = None if target is None else first[target]
    return chosen


def choose(nodes: Iterable[str], held: Mapping[str, list[dict[str, Any]]], token: str,
           homes: Mapping[str, str], at_least: int = 0) -> tuple[int, dict[str, Source]] | None:
    """The newest epoch (``at_least`` or newer) of which every node in ``nodes`` has a complete
    copy of run ``token`` on a live worker (``held``: worker -> what it holds, each entry
    naming a node there in ``"via"``), and where each node's copy is (its own, on its live home
    worker, first); None when there is no such epoch."""
    found: dict[str, dict[int, list[Source]]] = {}
    for worker, entries in held.items():
        for e in entries:
            if e["complete"] and e["token"] == token and e["epoch"] >= at_least:
                found.setdefault(e["node"], {}).setdefault(e["epoch"], []).append(
                    Source(worker, e["via"], e["role"]))
    nodes = list(nodes)
    common = set.intersection(*(set(found.get(n, {})) for n in nodes)) if nodes else set()
    if not common:
        return None
    epoch = max(common)

    def best(node: str) -> Source:
        return min(found[node][epoch], key=lambda s: (s.worker != homes.get(node), s.role))
    return epoch, {node: best(node) for node in nodes}


class MemoryTier:
    """A :class:`~caffe2ckpt.dask.DaskSession`'s copies of its nodes in worker memory."""

    def __init__(self, session: DaskSession) -> None:
        self._session = session
        self.epoch: int | None = None  # the newest epoch snapshotted by every node

    def snapshot(self, epoch: int, token: str) -> float:
        """Copy every node's workspace as of ``epoch`` (then, in the background, to its buddy;
        an actor drops the held copies of nodes it is no longer the buddy of); return the
        longest time a node's copy took."""
        session = self._session
        workers = session.placed()
        pairs = buddies(workers, session.hosts())
        buddied = {node: {n for n, b in pairs.items() if b == node} for node in workers}
        took = _each(list(workers), lambda node: session._call(
            node, "snapshot", epoch, token,
            None if pairs[node] is None else (workers[pairs[node]], session.key_of(pairs[node])),
            buddied[node]))
        self.epoch = epoch
        return max(took.values(), default=0.0)

    def recover(self, token: str, at_least: int = 0) -> int | None:
        """Put every node back to the newest epoch (``at_least`` or newer) of which each has a
        complete copy of this run (``token``) on a live worker, placing lost nodes on live
        workers; return that epoch, or None (nothing changed) when there is none."""
        session = self._session
        lost, workers, held = self._inventory()
        chosen = choose(list(workers) + lost, held, token, workers, at_least)
        if chosen is None:
            logger.warning("worker memory has no epoch from %d on of which every node has a "
                           "complete copy%s: storage is used", at_least,
                           f" (lost: {', '.join(lost)})" if lost else "")
            return None
        epoch, sources = chosen
        self.replace_lost()
        homes = session.placed()
        away = _copies_away(held, epoch, token, homes)

        def send_home(node: str) -> None:
            src = sources[node]
            session._call(src.via, "tier_send", node, src.role, epoch,
                          (homes[node], session.key_of(node)))
        # the copies that travel first, with the cores to themselves, then every restore
        _each([n for n, src in sources.items() if (src.role, src.worker) != ("own", homes[n])],
              send_home)
        _each(list(homes), lambda node: session._call(
            node, "tier_restore", epoch, token, bool(away[node])))
        self._protect(epoch, homes, away)
        return epoch

    def _protect(self, epoch: int, homes: Mapping[str, str],
                 away: Mapping[str, set[str]]) -> None:
        """Start sending each node without a copy of ``epoch`` on another worker (``away``)
        its own copy to its buddy, in the background."""
        session = self._session
        pairs = buddies(homes, session.hosts())
        needy = [n for n in homes if not away[n] and pairs[n] is not None]
        _each(needy, lambda node: session._call(
            node, "tier_push", epoch, (homes[pairs[node]], session.key_of(pairs[node]))))
        self.epoch = epoch

    def adopt(self, key: str, nodes: Iterable[str]) -> dict[str, int]:
        """Place ``nodes`` (those not placed yet: each on the worker keeping its own copy of
        the newest run, if any) and let their actors take over the copies the job's earlier session left for the
        prefix ``key``; return the runs whose complete copies the nodes' actors now hold, each
        token with the newest epoch it has a copy of."""
        session = self._session
        left = session._client.run(tier.kept, key, on_error="ignore")
        newest: dict[str, tuple[tuple[int, int], str]] = {}  # node -> (run, epoch), worker
        for worker, entries in left.items():
            for e in entries:
                order = ((token_run(e["token"]) or (-1, 0.0))[0], e["epoch"])
                if e["role"] == "own" and e["complete"] and order > newest.get(
                        e["node"], ((-2, -1), ""))[0]:
                    newest[e["node"]] = (order, worker)
        session.prefer({node: worker for node, (_, worker) in newest.items()})
        _each(list(nodes), lambda node: session._call(node, "tier_adopt", key))
        tokens: dict[str, int] = {}
        for entries in self._inventory()[2].values():
            for e in entries:
                if e["complete"]:
                    tokens[e["token"]] = max(tokens.get(e["token"], -1), e["epoch"])
        return tokens

    def drop(self) -> None:
        """Drop every copy the nodes' actors keep (the job finished)."""
        _each(list(self._session.placed()), lambda node: self._session._call(node, "tier_drop"))
        self.epoch = None

    def lost(self) -> list[str]:
        """The nodes lost with their workers (until :meth:`recover` places them again)."""
        return self._session.lost_nodes()

    def replace_lost(self, *, clear: bool = False) -> None:
        """Place every lost node again, with an empty workspace, on a running worker; with
        ``clear``, empty every other node's workspace too (as before a load from storage)."""
        session = self._session
        others = session.placed()
        for node in session.lost_nodes():
            session.replace(node)
        if clear:
            _each(list(others), lambda node: session._call(node, "clear"))

    def settle(self, dead: Iterable[str] = (), *, give_up: bool = False) -> None:
        """Wait until every live node's last copy reached its buddy (or failed: a copy to a
        ``dead`` worker is given up at once; with ``give_up``, every copy on its way is). A
        node found lost meanwhile stays lost."""
        dead = list(dead)

        def settle(node: str) -> None:
            with contextlib.suppress(NodeLostError):
                self._session._call(node, "tier_settle", dead, give_up)
        _each(list(self._session.placed()), settle)

    def _inventory(self) -> tuple[list[str], dict[str, str], dict[str, list[dict[str, Any]]]]:
        """The lost nodes, the others' workers, and what the copies each live worker holds are
        (``via``: the node whose actor keeps them), asked once :meth:`settle`d, and again while
        asking finds more losses."""
        session = self._session
        for _ in range(3):
            self.settle({session.lost_worker(n) for n in session.lost_nodes()})
            lost, workers = session.lost_nodes(), session.placed()
            try:
                kept = _each(list(workers), lambda node: session._call(node, "tier_copies"))
            except NodeLostError:
                continue
            held: dict[str, list[dict[str, Any]]] = {w: [] for w in workers.values()}
            for node, entries in kept.items():
                held[workers[node]] += [{**e, "via": node} for e in entries]
            return lost, workers, held
        raise NodeLostError(f"workers kept leaving while the memory tier listed its copies: "
                            f"lost {session.lost_nodes()}")


def _copies_away(held: Mapping[str, list[dict[str, Any]]], epoch: int, token: str,
                 homes: Mapping[str, str]) -> dict[str, set[str]]:
    """Per node, the live workers other than its home that hold a complete held copy of it at
    ``epoch`` of run ``token``."""
    away: dict[str, set[str]] = {node: set() for node in homes}
    for worker, entries in held.items():
        for e in entries:
            if (e["role"] == "held" and e["complete"] and e["token"] == token
                    and e["epoch"] == epoch and e["node"] in away and homes[e["node"]] != worker):
                away[e["node"]].add(worker)
    return away


def _each(nodes: list[str], fn: Callable[[str], T]) -> dict[str, T]:
    """``fn(node)`` for every node at once; raises the first failure."""
    if not nodes:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(nodes), 32)) as pool:
        futures = {node: pool.submit(fn, node) for node in nodes}
        return {node: f.result() for node, f in futures.items()}
