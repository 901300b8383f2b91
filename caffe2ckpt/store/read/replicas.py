"""What a layout (:class:`caffe2ckpt.Layout`) requires of a save's blobs, checked before anything
is written, so that no save is committed that another node count could not restore.

Replicated blobs are written once per save, by the first node holding them; the others'
records name that node. So a save whose nodes hold different values of one would keep only the
writer's: every holder's value must be the writer's (compared by the xxh3-128 of its bytes in
stored form, with its dtype and shape), else the save fails naming the blob and the nodes.

A ``rows`` blob must be held by every node of the save, with an axis 0, and with one dtype, row
shape and memory order on all of them (a shard holding no element, or with at most one axis
longer than 1, fits either order: :func:`~caffe2ckpt.sharding.order_counts`); with
``partition="mod"`` the nodes' row counts must be a ``mod`` split of their total (node k of N
holding the rows r with r % N == k)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from caffe2ckpt.errors import InvalidBlobError
from caffe2ckpt.sharding import old_rows, orders_of
from caffe2ckpt.store.delta.write import stored_digest
from caffe2ckpt.store.format.zarrgroup import stored_form

__all__ = ["RowSpec", "check_replicas", "check_rows", "replica_digests", "row_specs"]

RowSpec = tuple[str, tuple[int, ...], str]  # dtype, shape, memory order ("C" or "F")


def replica_digests(blobs: Mapping[str, np.ndarray]) -> dict[str, str]:
    """A digest of each blob's value: dtype, shape and bytes."""
    return {name: f"{arr.dtype.str}{arr.shape}:"
                  f"{stored_digest(stored_form(np.ascontiguousarray(arr)))}"
            for name, arr in blobs.items()}


def check_replicas(epoch: int, digests: Mapping[str, Mapping[str, str]],
                   writers: Mapping[str, str], where: str) -> None:
    """``digests`` (node -> blob -> :func:`replica_digests`) agree with each blob's writer
    (``writers``: blob -> node).

    Raises:
        InvalidBlobError: a node holds another value of a replicated blob than its writer.
    """
    for name, writer in writers.items():
        differ = sorted(node for node, held in digests.items()
                        if name in held and held[name] != digests[writer][name])
        if differ:
            raise InvalidBlobError(
                f"cannot save epoch {epoch} under {where!r}: replicated blob {name!r} differs "
                f"between node {writer!r} and nodes {differ} (a replicated blob is written "
                f"once, by {writer!r}, for every node holding it: nothing was written)")


def row_specs(blobs: Mapping[str, np.ndarray]) -> dict[str, RowSpec]:
    """Each blob's dtype, shape and memory order, as its manifest will give them: ``"C"`` for
    an array laid out alike in both orders (one of 0 rows, say), whose order
    :func:`~caffe2ckpt.sharding.orders_of` does not count."""
    return {name: (arr.dtype.str, tuple(arr.shape),
                   "C" if arr.flags.c_contiguous or not arr.flags.f_contiguous else "F")
            for name, arr in blobs.items()}


def check_rows(epoch: int, specs: Mapping[str, Mapping[str, RowSpec]], names: Sequence[str],
               order: Sequence[str], partition: str, where: str) -> None:
    """The ``rows`` blobs ``names`` as the nodes ``order`` hold them (``specs``: node -> blob ->
    :func:`row_specs`) fit the layout (see the module docstring).

    Raises:
        InvalidBlobError: one does not, naming the blob and the nodes (nothing was written).
    """
    for name in names:
        held = {node: specs.get(node, {}).get(name) for node in order}
        problem = _rows_problem(held, partition)
        if problem:
            raise InvalidBlobError(f"cannot save epoch {epoch} under {where!r}: rows blob "
                                   f"{name!r} {problem} (a "
                                   "rows blob is split along axis 0 across every node of the "
                                   "job: nothing was written)")


def _rows_problem(held: Mapping[str, RowSpec | None], partition: str) -> str | None:
    missing = [node for node, spec in held.items() if spec is None]
    if missing:
        return f"is not held by nodes {missing}"
    specs = {node: spec for node, spec in held.items() if spec is not None}
    flat = [node for node, (_, shape, _) in specs.items() if not shape]
    if flat:
        return f"has no axis 0 on nodes {flat} (declare a single value replicated)"
    problem = _rows_shape_problem(specs)
    if problem:
        return problem
    if partition == "mod":
        try:
            old_rows("mod", [s[0] for _, s, _ in specs.values()])
        except ValueError as exc:
            return f"cannot be partition='mod' (node k of N holding the rows r % N == k): {exc}"
    return None


def _rows_shape_problem(specs: Mapping[str, RowSpec]) -> str | None:
    """Whether the nodes' shards of one rows blob differ in dtype, row shape or (where it
    means something: :func:`~caffe2ckpt.sharding.orders_of`) memory order."""
    first, (dtype, shape, _) = next(iter(specs.items()))
    differ = [node for node, (d, s, _) in specs.items() if (d, s[1:]) != (dtype, shape[1:])]
    if differ:
        return (f"holds rows of another dtype or row shape on nodes {differ} than on node "
                f"{first!r} ({dtype}, rows of shape {shape[1:]})")
    if len(orders_of([(s, m) for _, s, m in specs.values()])) < 2:
        return None
    by_order = {m: [n for n, (_, s, o) in specs.items() if o == m and orders_of([(s, o)])]
                for m in "CF"}
    return (f"is held in C order on nodes {by_order['C']} and in Fortran order on nodes "
            f"{by_order['F']}")
