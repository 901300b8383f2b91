"""Parsing JSON read back from storage: commit records, group manifests, claims, root metadata.

Such a file may be damaged or crafted. Whatever it holds must fail as one ``ValueError`` (which
callers turn into :class:`~caffe2ckpt.errors.CheckpointCorruptedError` for that file's node and
epoch), never as a ``RecursionError``, an ``OverflowError`` later, or a value that breaks
``json.dumps(..., allow_nan=False)`` in the CLI. So :func:`loads` refuses:

- ``NaN``, ``Infinity`` and numbers that overflow a float (``1e999``): our writers emit none
  (``allow_nan=False``; non-finite metrics are stored as the strings ``"nan"``, ``"inf"``);
- integers longer than Python's ``sys.get_int_max_str_digits()`` (4300 digits by default).
  Shorter ones parse (a per-integer hook would cost a function call for each of the tens of
  thousands of integers of a large manifest); every reader checks the range of each number it
  uses before any arithmetic or ``float()`` (a 400-digit int would overflow it);
- nesting deeper than the interpreter's recursion limit.

The size of what is parsed is bounded before it is read: readers pass :data:`MAX_BYTES` to
:meth:`~caffe2ckpt.fs.location.Location.read_bytes`, and writers check it with :func:`check_size`
so that nothing we write is later refused. The bound is generous: a group manifest of 10,000
packed blobs measured 0.7 MB (4.0 MB with 60 non-ASCII characters per name and 8-d shapes), and
a commit record names one metadata file per array (about 1.3 MB for 10,000 arrays).
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["MAX_BYTES", "check_size", "loads"]

MAX_BYTES = 64 << 20


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in stored JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]!r} overflows a float")
    return value


def loads(raw: bytes | str) -> Any:
    """Parse ``raw`` as strict JSON (see the module docstring).

    Raises:
        ValueError: not JSON, or JSON holding something refused above.
    """
    try:
        return json.loads(raw, parse_constant=_constant, parse_float=_float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def check_size(data: bytes, what: str) -> bytes:
    """``data`` if readers will accept its size, else ValueError naming ``what``."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{what} would be {len(data)} bytes, more than the {MAX_BYTES} that "
                         "are read back")
    return data
