"""The rows of the checkpoint table artifact, and markdown-safe text for what commit records say.

Columns: ``epoch``, ``status``, a column per metric, ``nodes``, ``bytes`` (``"12.3 MiB"``: what
the epoch holds), ``written`` (what its save wrote: all of it, or for a differential save
``"640.0 KiB delta"``), ``seconds``, ``MB/s`` (written), ``written by`` and ``path``.

``written by`` names the flow run that committed the epoch, relative to the run showing the
table: ``this run, attempt 2`` for the run's own saves (of any of its attempts), else the writing
run's name and the first 8 hex digits of its id, ``crimson-otter (1a2b3c4d), attempt 1``
(``flow run 1a2b3c4d`` for records without a name; ``no flow run (local session on host)`` for
saves made outside Prefect). The table has no links: the UI Prefect 3.8 opens by default shows
table cells as plain text (only the older UI renders markdown in them), so the summary artifact
links each writing flow run instead (:func:`run_link`).

``path`` is where each node's checkpoint of the epoch lives relative to the checkpoint root
(``trainer_0.3, trainer_1.3``); the root itself is in the table's description and the summary.

Commit records are files anyone may have written: every text taken from one goes through
:func:`md_text`, which makes it inert in both UIs (plain text in one, markdown in the other).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any
from uuid import UUID

from prefect.utilities.urls import url_for

from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.units import human_bytes

__all__ = ["COLUMNS", "COMMITTED", "DELETED", "SUPERSEDED", "checkpoint_row", "checkpoint_table",
           "failed_row", "format_metric", "md_text", "plain_text", "run_id",
           "run_link", "writer_cell"]

COLUMNS = ["epoch", "status", "nodes", "bytes", "written", "seconds", "MB/s", "written by",
           "path"]
COMMITTED, SUPERSEDED, DELETED = "committed", "superseded", "deleted (retention)"  # statuses
METRICS_AFTER = "status"  # metric columns go right after this one
_MARKDOWN = re.compile(r"([\\`*\[\]<>|#])")  # links, images, HTML, code, emphasis, tables
_SPACE = re.compile(r"[\x00-\x1f\x7f-\x9f\s\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff]+")
_NAME_LIMIT = 60  # characters of a writer field shown


def plain_text(value: Any, limit: int | None = None) -> str:
    """``value`` as one line: whitespace, control and bidi/invisible format characters become
    one space, lone surrogates ``?`` (not UTF-8); with ``limit`` cut to that many characters
    (ending in ``…``)."""
    text = str(value).encode("utf-8", "replace").decode("utf-8")
    text = _SPACE.sub(" ", text).strip()
    return text[:limit - 1] + "…" if limit is not None and len(text) > limit else text


def md_text(value: Any, limit: int | None = None) -> str:
    """``value`` as one line (:func:`plain_text`) that markdown shows as written: ``\\ ` * [ ] < > |
    #`` get a backslash, so no link, image, HTML, code span or table can come out of it.
    Underscores stay: inside words (``trainer_0``) they are text. Escape once, at the end."""
    return _MARKDOWN.sub(r"\\\1", plain_text(value, limit))


def format_metric(value: float) -> str:
    """A metric value for the table: 4 significant digits, ``NaN``, ``inf``, ``-inf``."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, ".4g")


# -- who wrote an epoch ------------------------------------------------------------------------

def _writer(records: Mapping[str, CommitRecord]) -> Mapping[str, Any]:
    writer = next(iter(records.values())).writer if records else {}
    return writer if isinstance(writer, Mapping) else {}


def run_id(writer: Mapping[str, Any]) -> str | None:
    """The writer's flow run id in canonical form, or None if it has none that is a UUID."""
    value = writer.get("flow_run_id")
    try:
        return str(UUID(value)) if isinstance(value, str) else None
    except ValueError:
        return None


def _run_label(writer: Mapping[str, Any]) -> str:
    """``crimson-otter (1a2b3c4d)``, ``flow run 1a2b3c4d`` or what the writer is (plain text)."""
    rid, raw = run_id(writer), writer.get("flow_run_id")
    short = rid[:8] if rid else plain_text(raw, 12) if raw not in (None, "") else ""
    name = plain_text(writer.get("flow_run_name") or "", _NAME_LIMIT)
    if name or short:
        return f"{name} ({short})" if name and short else name or f"flow run {short}"
    session, host = writer.get("session"), writer.get("host")
    return ("no flow run (" + (f"{plain_text(session, 20)} session" if session else "unknown writer")
            + (f" on {plain_text(host, 40)}" if host else "") + ")")


def writer_cell(writer: Mapping[str, Any], this_run: str | None, *, link: bool = False) -> str:
    """The ``written by`` cell, plain text: ``this run, attempt 2`` when the writer is flow run
    ``this_run``, else ``crimson-otter (1a2b3c4d), attempt 1`` (see the module docstring).
    With ``link``: markdown, other runs linked (:func:`run_link`)."""
    if not isinstance(writer, Mapping):
        writer = {}
    rid, count = run_id(writer), writer.get("run_count")
    text = md_text if link else plain_text
    if rid is not None and rid == this_run:
        who = "this run"
    else:
        who = run_link(writer) if link else _run_label(writer)
    return who + (f", attempt {text(count, 12)}" if count not in (None, "") else "")


def run_link(writer: Mapping[str, Any]) -> str:
    """The writer's flow run as a markdown link to it in the Prefect UI (``url_for``, from
    ``PREFECT_UI_URL``); its label alone when it has no valid id or no UI URL is configured."""
    label, rid = md_text(_run_label(writer)), run_id(writer)
    url = url_for("flow-run", obj_id=rid) if rid else None
    return f"[{label}]({url})" if url else label


# -- rows --------------------------------------------------------------------------------------

def _mean_metrics(records: Mapping[str, CommitRecord]) -> dict[str, float]:
    """Each metric's mean over the nodes that report it (for charts); NaN if any is NaN, or
    when the mean is not a number (inf and -inf)."""
    by_name: dict[str, list[float]] = {}
    for record in records.values():
        for name, value in (getattr(record, "metrics", None) or {}).items():
            try:
                by_name.setdefault(str(name), []).append(float(value))
            except (TypeError, ValueError):  # a hand-written record: not a number
                continue
    return {name: _mean(values) for name, values in by_name.items()}


def _mean(values: list[float]) -> float:
    try:
        return math.fsum(v / len(values) for v in values)  # divided first: no overflow
    except ValueError:  # inf and -inf
        return math.nan


def _epoch_metrics(records: Mapping[str, CommitRecord]) -> dict[str, str]:
    """One text per metric name; nodes that disagree are listed as ``node: value``."""
    by_name: dict[str, dict[str, str]] = {}
    for node in sorted(records):
        for name, value in (getattr(records[node], "metrics", None) or {}).items():
            by_name.setdefault(str(name), {})[node] = format_metric(value)
    return {name: (next(iter(texts.values())) if len(set(texts.values())) == 1
                   else ", ".join(f"{node}: {text}" for node, text in texts.items()))
            for name, texts in by_name.items()}


def checkpoint_row(epoch: int, records: Mapping[str, CommitRecord],
                   this_run: str | None = None) -> dict[str, Any]:
    """The table row of a committed epoch, as seen by flow run ``this_run`` (its metrics as
    text under ``"metrics"`` and as numbers under ``"values"``, the writer's record under
    ``"writer"``, the bytes written under ``"written_bytes"`` and whether it is a differential
    save under ``"delta"``: none is a column)."""
    nbytes = sum(r.nbytes for r in records.values())
    written = sum(r.bytes_written for r in records.values())
    delta = any(r.delta is not None for r in records.values())
    seconds = max((r.seconds for r in records.values()), default=0.0)
    writer = _writer(records)
    return {
        "epoch": epoch,
        "status": COMMITTED,
        "metrics": _epoch_metrics(records),
        "values": _mean_metrics(records),
        "writer": writer,
        "nodes": ", ".join(sorted(records)),
        "bytes": human_bytes(nbytes),
        "written": human_bytes(written) + (" delta" if delta else ""),
        "written_bytes": written,
        "delta": delta,
        "seconds": round(seconds, 4),
        "MB/s": round(written / seconds / 1e6, 1) if seconds > 0 else None,
        "written by": writer_cell(writer, this_run),
        "path": ", ".join(records[node].group for node in sorted(records)),
    }


def failed_row(epoch: int, error: str | None) -> dict[str, Any]:
    """The row of a save that failed."""
    return {c: "" for c in COLUMNS} | {"epoch": epoch, "status": f"FAILED: {plain_text(error, 120)}",
                                       "metrics": {}, "values": {}, "writer": None}


def checkpoint_table(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table artifact's rows: ``COLUMNS`` with a column per metric name (in the order the
    names first appear) after ``status``; every row has every column ("" when absent), every
    text goes through :func:`md_text` here (rows hold plain text)."""
    rows = list(rows)
    names = list(dict.fromkeys(n for r in rows for n in r.get("metrics", {})))
    columns = {n: (n if n not in COLUMNS else f"metric {n}") for n in names}
    table = []
    for row in rows:
        out: dict[str, Any] = {}
        metrics = row.get("metrics", {})
        for column in COLUMNS:
            out[column] = row.get(column, "")
            if column == METRICS_AFTER:
                out.update({columns[n]: metrics.get(n, "") for n in names})
        table.append({k: md_text(v) if isinstance(v, str) else v for k, v in out.items()})
    return table
