"""The packed array of a node group: small blobs placed back to back, 64-byte aligned, in one
uint8 array (``_packed``) whose chunks are assembled only when each is written, never held whole.
Pure numpy: :mod:`caffe2ckpt.store.format.zarrgroup` plans and writes the array."""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

__all__ = ["ALIGN", "Packed"]

ALIGN = 64


class Packed:
    """The packed array's bytes, never held whole: :meth:`add` places each small blob at the
    next aligned offset (no copy), and each chunk is assembled when it is written, on the I/O
    threads: from the blobs' own memory when they are large enough to be written one by one,
    else joined (a few chunks at a time, never every small blob of the save at once). W2s
    (bench_phases.py): save 0.97x raw with every chunk joined, 1.19x written from the blobs."""

    def __init__(self) -> None:
        self.parts: list[Any] = []  # the blobs and the zeros between them, back to back
        self.starts: list[int] = []  # where each part starts (ascending)
        self.filled = 0  # where the last part ends
        self.nbytes = 0  # where the next blob may start (before alignment)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.nbytes, 1)  # rows of one byte, like an own array's data

    def add(self, arr: np.ndarray) -> int:
        """Place C-contiguous ``arr`` at the next multiple of :data:`ALIGN`; its offset."""
        offset = -(-self.nbytes // ALIGN) * ALIGN
        if arr.nbytes:
            if offset > self.filled:
                self.starts.append(self.filled)
                self.parts.append(bytes(offset - self.filled))
            self.starts.append(offset)
            self.parts.append(arr)  # C-contiguous: its buffer is its bytes
            self.filled = offset + arr.nbytes
        self.nbytes = offset + arr.nbytes
        return offset

    def __getitem__(self, rows: slice) -> np.ndarray | list[Any]:
        """Bytes ``rows.start`` to ``rows.stop``: the blobs' own buffers (bytes views) and the
        zeros between them, written as they are, if they average :data:`_OWN_WRITE_BYTES` or
        more; else joined into one (bytes, 1) uint8 array (one write, not thousands)."""
        start, stop = rows.start, min(rows.stop, self.filled)
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        last = bisect.bisect_left(self.starts, stop)  # parts[first:last] overlap the window
        parts = self.parts[first:last]
        if parts:
            head, tail = start - self.starts[first], stop - self.starts[last - 1]
            if len(parts) == 1:
                parts[0] = _as_bytes(parts[0])[head:tail]
            else:
                parts[0], parts[-1] = _as_bytes(parts[0])[head:], _as_bytes(parts[-1])[:tail]
        parts.append(bytes(rows.stop - max(stop, start)))  # zeros after the last blob
        if (rows.stop - rows.start) >= _OWN_WRITE_BYTES * len(parts):
            return [_as_bytes(part) for part in parts]
        return np.frombuffer(b"".join(parts), np.uint8).reshape(-1, 1)


# packed chunks whose parts average this many bytes are written from the blobs' own memory
_OWN_WRITE_BYTES = 16 * 1024


def _as_bytes(part: Any) -> Any:
    """A part of :class:`Packed` (an array, or zeros) as one byte per item, to slice."""
    return part.reshape(-1).view(np.uint8) if isinstance(part, np.ndarray) else part
