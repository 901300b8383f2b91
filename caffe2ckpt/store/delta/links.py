"""Differential saves, writer side: which older groups a blob's rows still come from.

A large blob's rows are cut into parts (:func:`part_edges`). Each group a differential save
builds on gives rows of a blob in one of three ways (a :class:`Link`): it holds the blob whole
(every part), one part as a *span*, or a *row overlay* (rows of other parts, changed since the
save before it). A row's value is the one of the newest group holding it, so a group still
gives rows when it is the newest dense source (whole or span) of some part, or when its overlay
touches a part whose newest dense source is older (:func:`live`). Every other group gives
nothing any more and is dropped from the blob's chain.

So a part nothing changed in keeps its old dense source for as long as it stays unchanged: a
frozen blob, or a frozen part of one, is written by no later save. A part that changed is a
*dirty* part (:func:`dirty_parts`): the writer rewrites it as a span at its next turn, so an
overlay gives rows for at most ``parts - 1`` saves after the one that wrote it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from caffe2ckpt.fs.localio import DIRECT_ALIGN

__all__ = ["Link", "dirty_parts", "live", "part_edges", "parts_of", "span_rows", "turn"]


@dataclass(frozen=True)
class Link:
    """One group's part in rebuilding a blob: the arrays used from it and what vouches for them
    (``files``: relative metadata file -> SHA-256, the group's ``zarr.json`` first; ``crcs``:
    array -> chunk CRC32Cs), and what it gives: the blob ``whole``, the part ``span`` (its
    index), an overlay touching the parts ``touched``, of ``overlay_bytes`` bytes."""

    group: str
    save_id: str
    files: dict[str, str]
    crcs: dict[str, tuple[int, ...]]
    whole: bool = False
    span: int | None = None
    touched: frozenset[int] = frozenset()
    overlay_bytes: int = 0

    def dense(self, parts: int) -> list[int]:
        """The parts (of ``parts``) it holds whole: all, its span's, or none."""
        if self.whole:
            return list(range(parts))
        return [] if self.span is None else [self.span]


def part_edges(rows: int, row_bytes: int, parts: int) -> list[int]:
    """The first row of each of the ``parts`` parts of a blob of ``rows`` rows of ``row_bytes``
    bytes, and ``rows`` last. Parts start on :data:`~caffe2ckpt.fs.localio.DIRECT_ALIGN`
    boundaries where the row size allows, so a restore reads each span's chunks straight from
    the disk into their place."""
    step = DIRECT_ALIGN // math.gcd(max(row_bytes, 1), DIRECT_ALIGN)
    step = step if step * parts <= rows else 1
    return [part * rows // parts // step * step for part in range(parts)] + [rows]


def span_rows(rows: int, row_bytes: int, parts: int, depth: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the part a save at ``depth`` may write whole (its *turn*:
    part ``depth mod parts``) of a blob of ``rows`` rows of ``row_bytes`` bytes."""
    edges = part_edges(rows, row_bytes, parts)
    part = depth % parts
    return edges[part], edges[part + 1]


def parts_of(rows: np.ndarray, edges: list[int]) -> frozenset[int]:
    """The parts holding the rows ``rows`` (ids, ascending)."""
    if not rows.size:
        return frozenset()
    found = np.searchsorted(np.asarray(edges[1:-1]), rows, side="right")
    return frozenset(np.unique(found).tolist())


def _sources(links: list[Link], edges: list[int]) -> list[int]:
    """Per part: the index in ``links`` (oldest first) of its newest dense source (-1: none, or
    the part has no rows)."""
    source = [-1] * (len(edges) - 1)
    for index, link in enumerate(links):
        for part in link.dense(len(source)):
            source[part] = index
    return [s if edges[p] < edges[p + 1] else -1 for p, s in enumerate(source)]


def live(links: list[Link], edges: list[int]) -> tuple[list[Link], int] | None:
    """Of ``links`` (a blob's groups, oldest first), those that still give rows, in order, and
    the bytes of the overlays among them that do; None when some part with rows has no dense
    source (the blob must be written whole)."""
    source = _sources(links, edges)
    if any(s < 0 for p, s in enumerate(source) if edges[p] < edges[p + 1]):
        return None
    kept = set(source) - {-1}
    overlays = {i for i, link in enumerate(links) if any(source[p] < i for p in link.touched)}
    return ([links[i] for i in sorted(kept | overlays)],
            sum(links[i].overlay_bytes for i in overlays))


def dirty_parts(links: list[Link], edges: list[int]) -> frozenset[int]:
    """The parts an overlay of ``links`` (oldest first) changed after their newest dense
    source: those whose rows are not all in one group."""
    source = _sources(links, edges)
    return frozenset(p for i, link in enumerate(links) for p in link.touched if source[p] < i)


def turn(rows: int, row_bytes: int, parts: int, depth: int, links: list[Link]
         ) -> tuple[list[int], int, bool]:
    """For a blob of ``rows`` rows of ``row_bytes`` bytes cut into ``parts`` parts, whose
    groups are ``links``: its part edges, the part a save at ``depth`` may write whole, and
    whether an overlay changed that part since its newest whole copy or span (then the save
    writes it whole, whatever its rows' digests say)."""
    edges = part_edges(rows, row_bytes, parts)
    part = depth % parts
    return edges, part, part in dirty_parts(links, edges)
