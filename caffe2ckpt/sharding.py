"""How a job's blobs are spread over its nodes: declared once (:class:`Layout`), stored with
every save (:class:`SavedLayout`), so that a save of N nodes can be restored on M.

A blob is one of three kinds, by the first glob pattern (``fnmatch``, case-sensitive) it
matches:

- **rows**: split along axis 0 across the job's nodes, in the job's node order. With
  ``partition="range"`` node k holds a block of consecutive rows (any sizes: the global array
  is the nodes' blocks concatenated); with ``partition="mod"`` node k of N holds the global rows
  r with ``r % N == k``, in order (hash-sharded tables).
- **replicated**: every node holds the same value (data-parallel weights).
- **local**: anything else; it belongs to its node and cannot be moved to another node count.

The blobs :func:`~caffe2ckpt.job.epoch_limiter` adds (``epoch_limiter.<i>/...``, on one node)
are replicated unless a pattern matches them first, so a job with an epoch limit can change its
node count without declaring them.

Every node's rows of a ``rows`` blob, in global row numbers, are a Python :class:`range`
(``range(start, stop)`` or ``range(k, total, N)``), so what one old node gives one new node
is the intersection of two arithmetic progressions (:func:`overlap`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from caffe2ckpt.errors import JobDefinitionError

__all__ = ["PARTITIONS", "Layout", "SavedLayout", "new_rows", "old_rows", "order_counts", "orders_of",
           "overlap"]

PARTITIONS = ("range", "mod")
ROWS, REPLICATED, LOCAL = "rows", "replicated", "local"
# Blobs the library itself adds to a job's workspace (epoch_limiter's count and stop flag, on
# one node): replicated unless one of the layout's patterns matches them.
LIBRARY_REPLICATED = ("epoch_limiter.*",)


def _patterns(value: Any, field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    out = tuple(value)
    if not all(isinstance(p, str) and p for p in out):
        raise JobDefinitionError(f"Layout({field}=...) takes blob-name glob patterns "
                                 f"(non-empty strings), got {list(out)!r:.200}")
    return out


@dataclass(frozen=True)
class Layout:
    """Which blobs are split by rows across the nodes and which are the same on every node.

    Args:
        rows: glob patterns of the blobs split along axis 0 across the nodes.
        replicated: glob patterns of the blobs every node holds identically.
        partition: how ``rows`` blobs are split: ``"range"`` (node k holds a block of
            consecutive rows) or ``"mod"`` (node k of N holds the rows r with r % N == k).

    A blob's kind is that of the pattern it matches (``fnmatch``, case-sensitive); a blob
    matching both a ``rows`` and a ``replicated`` pattern is refused when it is saved. Blobs
    matching neither are local to their node: a save holding one can be restored only on
    the nodes that saved it; but ``epoch_limiter``'s blobs (``epoch_limiter.<i>/...``) are
    replicated unless a pattern matches them.
    """

    rows: Sequence[str] = ()
    replicated: Sequence[str] = ()
    partition: str = "range"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", _patterns(self.rows, "rows"))
        object.__setattr__(self, "replicated", _patterns(self.replicated, "replicated"))
        if self.partition not in PARTITIONS:
            raise JobDefinitionError(f"Layout(partition={self.partition!r}): use one of "
                                     f"{', '.join(map(repr, PARTITIONS))}")

    def kind(self, name: str) -> str:
        """``"rows"``, ``"replicated"`` or ``"local"`` for the blob ``name``."""
        row = next((p for p in self.rows if fnmatchcase(name, p)), None)
        same = next((p for p in self.replicated if fnmatchcase(name, p)), None)
        if row is not None and same is not None:
            raise JobDefinitionError(f"blob {name!r} matches both rows pattern {row!r} and "
                                     f"replicated pattern {same!r} of the layout")
        if row is not None:
            return ROWS
        if same is not None or any(fnmatchcase(name, p) for p in LIBRARY_REPLICATED):
            return REPLICATED
        return LOCAL

    def rows_among(self, names: Iterable[str]) -> list[str]:
        """The blobs of ``names`` split by rows, sorted and each once."""
        return sorted({name for name in names if self.kind(name) == ROWS})

    def saved(self, order: Sequence[str], names: Iterable[str],
              written_by: dict[str, str] | None = None) -> SavedLayout:
        """What one node's record stores: the save's node order, which of its blobs
        ``names`` are rows and replicated, and which replicated ones another node wrote."""
        kinds = {name: self.kind(name) for name in names}
        return SavedLayout(self.partition, tuple(order),
                           tuple(sorted(n for n, k in kinds.items() if k == ROWS)),
                           tuple(sorted(n for n, k in kinds.items() if k == REPLICATED)),
                           dict(sorted((written_by or {}).items())))

    def writers(self, order: Sequence[str], names: dict[str, Iterable[str]]) -> dict[str, str]:
        """Which node writes each replicated blob of a save (the first in ``order`` holding
        it), given each node's blob names."""
        out: dict[str, str] = {}
        for node in order:
            for name in names.get(node, ()):
                if name not in out and self.kind(name) == REPLICATED:
                    out[name] = node
        return out


@dataclass(frozen=True)
class SavedLayout:
    """The layout as one node's commit record stores it: resolved to blob names, so a reader
    needs no code of the job."""

    partition: str
    order: tuple[str, ...]  # the save's nodes, in the job's order
    rows: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    # replicated blobs this node holds that another node of the save wrote (once for all)
    written_by: dict[str, str] = field(default_factory=dict)

    def kind(self, name: str) -> str:
        return ROWS if name in self.rows else REPLICATED if name in self.replicated else LOCAL

    def to_dict(self) -> dict[str, Any]:
        return {"partition": self.partition, "order": list(self.order), "rows": list(self.rows),
                "replicated": list(self.replicated), "written_by": dict(self.written_by)}

    @classmethod
    def from_dict(cls, data: Any) -> SavedLayout:
        """Parse a stored layout (ValueError if it is not one)."""
        if not isinstance(data, dict) or set(data) != _FIELDS:
            raise ValueError(f"bad layout {data!r:.120}")
        if data["partition"] not in PARTITIONS:
            raise ValueError(f"bad layout partition {data['partition']!r:.40}")
        order, rows, replicated = (_names(data, key) for key in ("order", "rows", "replicated"))
        if not order or set(rows) & set(replicated):
            raise ValueError("a layout needs its nodes, and no blob both rows and replicated")
        written_by = data["written_by"]
        if not isinstance(written_by, dict) or not set(written_by) <= set(replicated) or not all(
                isinstance(v, str) and v in order for v in written_by.values()):
            raise ValueError("a layout's written_by must map replicated blobs to its nodes")
        return cls(data["partition"], order, rows, replicated, dict(written_by))


_FIELDS = frozenset({"partition", "order", "rows", "replicated", "written_by"})


def _names(data: dict[str, Any], key: str) -> tuple[str, ...]:
    """``data[key]``: a list of distinct strings (ValueError otherwise)."""
    value = data[key]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value) or len(
            set(value)) != len(value):
        raise ValueError(f"a layout's {key} must be a list of distinct strings")
    return tuple(value)


def new_rows(partition: str, index: int, count: int, total: int) -> range:
    """The global rows node ``index`` of ``count`` holds of a ``total``-row blob, split anew:
    ``range`` splits evenly (rows ``index * total // count`` to ``(index + 1) * total //
    count``: sizes differ by one row at most), ``mod`` takes every ``count``-th row."""
    if partition == "mod":
        return range(index, total, count)
    return range(index * total // count, (index + 1) * total // count)


def old_rows(partition: str, sizes: Sequence[int]) -> list[range]:
    """The global rows each node of a save holds, given each node's row count in node order
    (``range``: blocks of any size, one after the other). ValueError when the sizes cannot be
    a ``mod`` split of their total."""
    total = sum(sizes)
    if partition == "mod":
        out = [range(k, total, len(sizes)) for k in range(len(sizes))]
        if [len(r) for r in out] != list(sizes):
            raise ValueError(f"row counts {list(sizes)} are not a mod split of {total} rows")
        return out
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def overlap(src: range, dst: range) -> tuple[range, range] | None:
    """The global rows both progressions hold, as indices into ``src`` and into ``dst`` (two
    ranges of one length), or None when they share none."""
    if not src or not dst:
        return None
    low = max(src.start, dst.start)
    high = min(src[-1], dst[-1]) + 1
    x = dst.start + -(-(low - dst.start) // dst.step) * dst.step  # first of dst at or above low
    for _ in range(src.step // math.gcd(src.step, dst.step)):
        if (x - src.start) % src.step == 0:
            break
        x += dst.step
    else:
        return None
    if x >= high:
        return None
    step = math.lcm(src.step, dst.step)
    count = len(range(x, high, step))
    first_src, first_dst = (x - src.start) // src.step, (x - dst.start) // dst.step
    by_src, by_dst = step // src.step, step // dst.step
    return (range(first_src, first_src + count * by_src, by_src),
            range(first_dst, first_dst + count * by_dst, by_dst))


def orders_of(shards: Sequence[tuple[tuple[int, ...], str]]) -> set[str]:
    """The memory orders (``"C"``, ``"F"``) that the shards ``(shape, order)`` of one rows
    blob say anything about: only those of the shards :func:`order_counts` for."""
    return {order for shape, order in shards if order_counts(shape)}


def order_counts(shape: Sequence[int]) -> bool:
    """Whether an array of ``shape`` is laid out differently in C and Fortran order. One that
    holds no element (a shard of 0 rows, whatever its row shape) or has at most one axis longer
    than 1 (a shard of 1 row of a 2-D table, say) is laid out alike in both: numpy flags it both
    C- and Fortran-contiguous and its manifest records it as C order, so its stored order says
    nothing about the order of the blob's other shards."""
    return 0 not in shape and sum(1 for n in shape if n > 1) > 1

