"""The memory tier, worker side: copies of node workspaces kept in Dask worker processes.

After an epoch, each node's actor copies its workspace into buffers it keeps from the previous
snapshot (its *own* copy: after the first snapshot a copy allocates nothing), then, in the
background while the next epoch runs, digests it (xxh3-128, as a save records) and sends it in
pieces to a *buddy* node's actor on another worker, which keeps it as a *held* copy in
buffers it also reuses. So a worker keeps, per node it holds, the live workspace and its own
copy, plus the held copies of its buddied nodes: for one buddy per node, about three times its
own workspace.

A copy is marked incomplete while it is overwritten and complete once all of it arrived and its
digests are known; a restore verifies every blob's digest and the run's token. Nothing here is
written to storage or seen by the checkpoint store: a copy is never a committed checkpoint.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash
from distributed.protocol import to_serialize

from caffe2ckpt.errors import CheckpointCorruptedError
from caffe2ckpt.workspace import Workspace

__all__ = ["PIECE_BYTES", "Copy", "copies", "drop", "held", "keep_held", "receive", "restore",
           "seal", "send", "take"]

PIECE_BYTES = 32 * 1024 * 1024  # one message of a copy sent to another worker
SEND_TIMEOUT = 120.0  # seconds one piece may take before the send is given up


@dataclass
class Copy:
    """One node's workspace as of ``epoch``, for the run holding ``token``."""

    node: str
    epoch: int
    token: str
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    complete: bool = False
    sent: bool = False  # an own copy: whether its buddy holds all of it

    def describe(self) -> dict[str, Any]:
        return {"node": self.node, "epoch": self.epoch, "token": self.token,
                "complete": self.complete}

    def reshape(self, specs: dict[str, Spec]) -> None:
        """Make the buffers match ``specs``, keeping those that do."""
        old, self.arrays = self.arrays, {}
        for name, spec in specs.items():
            buf = old.get(name)
            if buf is None or spec_of(buf) != spec:
                buf = np.empty(spec[1], spec[0], order=spec[2])
                flat(buf)[:] = 0  # its pages now, at once: see below
            self.arrays[name] = buf


Spec = tuple[np.dtype, tuple[int, ...], str]  # a blob's dtype, shape and memory order


def spec_of(arr: np.ndarray) -> Spec:
    """What a copy's buffer for ``arr`` is: its dtype, shape and order (Fortran order kept)."""
    fortran = arr.flags.f_contiguous and not arr.flags.c_contiguous
    return arr.dtype, arr.shape, "F" if fortran else "C"


def flat(arr: np.ndarray) -> np.ndarray:
    """The bytes of a copy's buffer (contiguous in its own order), as a view."""
    return arr.reshape(-1, order=spec_of(arr)[2]).view(np.uint8)


def digest(arr: np.ndarray) -> str:
    """The xxh3-128 of a copy's buffer's bytes."""
    return xxhash.xxh3_128_hexdigest(memoryview(flat(arr)))


# (tier, node, role) -> copy; role "own" (on the node's worker) or "held" (a buddy's copy)
_copies: dict[tuple[str, str, str], Copy] = {}
_lock = threading.Lock()


def _slot(tier: str, node: str, role: str) -> Copy:
    with _lock:
        return _copies.setdefault((tier, node, role), Copy(node, -1, ""))


def copies(tier: str) -> list[dict[str, Any]]:
    """What this process holds for ``tier``: one entry per copy, with its role."""
    with _lock:
        return [{**c.describe(), "role": role} for (t, _, role), c in _copies.items()
                if t == tier]


def held(tier: str, node: str, role: str, epoch: int) -> Copy:
    """This process's complete ``role`` copy of ``node`` at ``epoch``."""
    with _lock:
        copy = _copies.get((tier, node, role))
    if copy is None or not copy.complete or copy.epoch != epoch:
        raise CheckpointCorruptedError(
            f"memory-tier copy of node {node!r}, epoch {epoch}: this worker has "
            + ("none" if copy is None else f"epoch {copy.epoch} (complete: {copy.complete})"))
    return copy


def keep_held(tier: str, nodes: set[str]) -> None:
    """Drop this process's held copies of ``tier`` but those of ``nodes`` (it is no longer
    their buddy's worker)."""
    with _lock:
        for key in [k for k in _copies if k[0] == tier and k[2] == "held" and k[1] not in nodes]:
            del _copies[key]


def drop(tier: str) -> None:
    """Forget every copy of ``tier`` in this process."""
    with _lock:
        for key in [k for k in _copies if k[0] == tier]:
            del _copies[key]


def take(tier: str, node: str, ws: Workspace, epoch: int, token: str) -> Copy:
    """Copy ``ws`` into the node's own copy (digests not yet computed: see :func:`seal`)."""
    own = _slot(tier, node, "own")
    own.complete = own.sent = False
    names = ws.local_names()
    own.reshape({n: spec_of(ws[n]) for n in names})
    for name in names:
        np.copyto(own.arrays[name], ws[name])
    own.epoch, own.token, own.digests = epoch, token, {}
    return own


def seal(copy: Copy) -> None:
    """Digest a copy just taken, and mark it complete."""
    copy.digests = {name: digest(arr) for name, arr in copy.arrays.items()}
    copy.complete = True


async def send(copy: Copy, rpc: Any, key: str, tier: str, role: str) -> None:
    """Send a complete ``copy`` to the actor ``key`` that ``rpc`` reaches, as its ``role``
    copy, in pieces of at most :data:`PIECE_BYTES`."""
    specs = {name: spec_of(arr) for name, arr in copy.arrays.items()}
    await _message(rpc, key, ("begin", tier, copy.node, role, copy.epoch, copy.token, specs))
    for name, arr in copy.arrays.items():
        data = flat(arr)
        for start in range(0, data.size, PIECE_BYTES):
            piece = data[start:start + PIECE_BYTES]
            await _message(rpc, key, ("piece", tier, copy.node, role, name, start, piece))
    await _message(rpc, key, ("end", tier, copy.node, role, copy.epoch, copy.digests))


async def _message(rpc: Any, key: str, message: tuple[Any, ...]) -> None:
    reply = await asyncio.wait_for(rpc.actor_execute(
        actor=key, function="tier_receive", args=[to_serialize(message)], kwargs={}),
        SEND_TIMEOUT)
    if reply.get("status") != "OK":
        raise RuntimeError(f"the worker refused a piece of a memory-tier copy: "
                           f"{reply.get('exception')!r}")


def receive(message: tuple[Any, ...]) -> None:
    """Apply one message of :func:`send` to this process's copies."""
    kind, tier, node, role, *rest = message
    copy = _slot(tier, node, role)
    if kind == "begin":
        epoch, token, specs = rest
        copy.complete, copy.epoch, copy.token, copy.digests = False, epoch, token, {}
        copy.reshape(specs)
    elif kind == "piece":
        name, start, piece = rest
        flat(copy.arrays[name])[start:start + piece.size] = piece
    else:
        epoch, digests = rest
        if epoch != copy.epoch:
            raise RuntimeError(f"memory-tier copy of node {node!r}: epoch {epoch} ended, "
                               f"{copy.epoch} began")
        copy.digests, copy.complete = digests, True


def restore(tier: str, node: str, ws: Workspace, epoch: int, token: str, *,
            adopt: bool = False) -> None:
    """Replace ``ws``'s blobs with the node's own copy of ``epoch`` (verified first: every
    digest, the epoch and the run's token); blobs the copy does not have are dropped.

    A blob is copied into the array ``ws`` holds under its name when that array is writeable,
    of the same dtype, shape and order, and no other name's array is, or is a view of, the same
    memory (no other blob sees the copy land); into a new array otherwise. With ``adopt``, an empty ``ws`` (a
    node placed again) takes the copy's buffers themselves: the own copy is then gone (the next
    snapshot makes one), so the caller does that only while another worker holds a copy."""
    own = _verified(tier, node, epoch, token)
    if adopt and not ws.local_names():
        ws.restore(own.arrays)
        own.arrays, own.complete, own.epoch = {}, False, -1
        return
    for name in ws.local_names():
        if name not in own.arrays:
            del ws[name]
    held = {name: ws[name] for name in ws.local_names()}
    roots = [id(_root(a)) for a in held.values()]
    shared = {r for r in roots if roots.count(r) > 1}
    ws.restore({name: _into(held.get(name), arr, shared) for name, arr in own.arrays.items()})


def _root(arr: np.ndarray) -> object:
    """The object whose memory ``arr`` is (itself, or what its chain of views ends at)."""
    while isinstance(arr, np.ndarray) and arr.base is not None:
        arr = arr.base
    return arr


def _into(target: np.ndarray | None, arr: np.ndarray, shared: set[int]) -> np.ndarray:
    """``arr``'s values in ``target`` when that is safe (see :func:`restore`), else a copy."""
    if (target is not None and target.flags.writeable and id(_root(target)) not in shared
            and spec_of(target) == spec_of(arr)):
        np.copyto(target, arr)
        return target
    return arr.copy(order="K")


def _verified(tier: str, node: str, epoch: int, token: str) -> Copy:
    """The node's own copy, checked: complete, of ``epoch`` and run ``token``, every digest."""
    own = _slot(tier, node, "own")
    where = f"memory-tier copy of node {node!r}, epoch {epoch}"
    if not own.complete or own.epoch != epoch or own.token != token:
        raise CheckpointCorruptedError(f"{where}: this worker holds epoch {own.epoch} "
                                       f"(complete: {own.complete}) of run {own.token!r}")
    for name, arr in own.arrays.items():
        if digest(arr) != own.digests.get(name):
            raise CheckpointCorruptedError(f"{where}: blob {name!r} does not match its digest")
    return own
