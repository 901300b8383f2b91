"""The summary artifact's markdown: why this attempt runs, where it started, how far it is, a
chart of the epochs, where the checkpoints are and which flow run wrote which epochs.

Pure functions of what :class:`~caffe2ckpt.prefect.artifacts.CheckpointArtifacts` keeps (the
table's rows, keyed by epoch) and of the flow run's state history (:func:`attempt_reason`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType

from caffe2ckpt.naming import db_name
from caffe2ckpt.prefect.chart import Marker, Series, chart_markdown
from caffe2ckpt.prefect.table import (
    COMMITTED,
    DELETED,
    md_text,
    plain_text,
    run_id,
    writer_cell,
)
from caffe2ckpt.units import epochs_text, nodes_text

__all__ = ["CHARTED", "Summary", "attempt_reason", "chart_markers", "chart_series",
           "reason_from_states", "summary_markdown"]

logger = logging.getLogger(__name__)

CHARTED = (COMMITTED, DELETED)  #: the statuses of the rows of the run's history, charted
_METRIC_PANELS = 4  # at most this many metrics are charted (the table has them all)
_MESSAGE_LIMIT = 200


@dataclass
class Summary:
    """What the summary says besides the rows."""

    job: str
    this_run: dict[str, Any]  # flow_run_id, flow_run_name, run_count
    start: int  # the epoch the attempt started from (0: fresh)
    target: int | None  # the job's epoch limit
    resumed: tuple[int, Any] | None = None  # (epoch, writer of the save it resumed from)
    # an elastic resume: (nodes that saved the epoch resumed from, nodes of this run)
    elastic: tuple[int, int] | None = None
    memory: str | None = None  # a resume from worker memory: what it took, what storage holds
    reason: str | None = None  # why this attempt runs (a retry), see attempt_reason
    url: str | None = None
    file_node: str | None = None
    recoveries: list[str] = field(default_factory=list)  # lost workers the run went on after


def attempt_reason(flow_run_id: str, run_count: int) -> str | None:
    """Markdown: why attempt ``run_count`` of the flow run runs, from its state history: the
    last *Failed* or *Crashed* state before this attempt's *Running*, and the *AwaitingRetry*
    that put the run back. None for attempt 1, or when the history cannot be read (the
    summary is a view: it says nothing rather than fail).

    A flow retry (``@flow(retries=N)``) records no *Failed* state: the server turns the
    proposed one into *AwaitingRetry*, which keeps its message. A killed process leaves
    *Crashed*, and the crash-retry automation's *AwaitingRetry* says who put the run back.
    Prefect may report one crash twice and start two attempts for it: the later one then finds
    the crash before the other attempt's *Running*."""
    if run_count <= 1:
        return None
    try:
        with get_client(sync_client=True) as client:
            states = sorted(client.read_flow_run_states(UUID(flow_run_id)),
                            key=lambda s: s.timestamp)
    except Exception as exc:  # noqa: BLE001 - a view: never a reason to fail the artifacts
        logger.warning("could not read the state history of flow run %s: %s", flow_run_id, exc)
        return None
    return reason_from_states(states, run_count)


def reason_from_states(states: Sequence[Any], run_count: int) -> str:
    """:func:`attempt_reason` of a flow run's states, oldest first."""
    running = [i for i, s in enumerate(states) if s.type == StateType.RUNNING]
    before = states[:running[-1]] if running else states  # up to this attempt's Running
    retries = [i for i, s in enumerate(before) if s.name == "AwaitingRetry"]
    back = before[retries[-1]] if retries else None
    # what ended the attempt before: a state between the Running before `back` and `back`
    since = max([i for i in running if back is not None and i < retries[-1]], default=-1)
    window = before[since + 1:retries[-1]] if back is not None else before
    ended = next((s for s in reversed(window)
                  if s.type in (StateType.FAILED, StateType.CRASHED)), None)
    head = f"**Attempt {run_count}** of this flow run, a retry"
    if ended is not None:
        text = f"{head} after the run ended **{md_text(ended.name)}**{_message(ended)}"
        if back is not None and back.message and back.message != ended.message:
            text += f"; put back by: {md_text(back.message, _MESSAGE_LIMIT)}"
        return text
    if back is not None:
        return (f"{head}: attempt {run_count - 1} **failed**{_message(back)} and Prefect "
                "retried the flow run")
    return f"{head} (how the attempt before it ended is not on record)"


def _message(state: Any) -> str:
    return f" ({md_text(state.message, _MESSAGE_LIMIT)})" if state.message else ""


def chart_series(rows: Mapping[int, dict[str, Any]]) -> list[Series]:
    """Panels for the run's history (rows in :data:`CHARTED`): each metric (the first
    ``_METRIC_PANELS`` names), then the save seconds, the save MB/s and the MiB each save
    wrote (a differential save writes only what changed) per epoch."""
    kept = [(e, rows[e]) for e in sorted(rows) if rows[e]["status"] in CHARTED]
    names = list(dict.fromkeys(n for _, r in kept for n in r.get("values", {})))
    series = [Series(name, [(e, r["values"][name]) for e, r in kept if name in r.get("values", {})])
              for name in names[:_METRIC_PANELS]]
    series.append(Series("save seconds", [(e, r["seconds"]) for e, r in kept]))
    series.append(Series("save MB/s", [(e, r["MB/s"]) for e, r in kept if r["MB/s"] is not None]))
    written = [(e, r["written_bytes"] / (1 << 20)) for e, r in kept
               if r.get("written_bytes") is not None]
    if written:
        series.append(Series("save MiB written", written))
    return series if kept else []


def _who(writer: Any) -> tuple[Any, Any]:
    """Who wrote a save, to tell writers apart: (flow run id, attempt), or for a save made
    outside Prefect (host, process id)."""
    writer = writer if isinstance(writer, Mapping) else {}
    rid = run_id(writer)
    return (rid, writer.get("run_count")) if rid else (writer.get("host"), writer.get("pid"))


def _handovers(rows: Mapping[int, dict[str, Any]],
               summary: Summary | None) -> dict[tuple[int, Any], tuple[Any, Mapping[str, Any]]]:
    """Where one writer took over from another: (epoch it started from, who took over) ->
    (who wrote that epoch, the new writer's record). From the charted rows (an epoch written
    by another run or attempt than the one before it) and from the epoch this attempt
    resumed from (it may have saved nothing yet)."""
    kept = [(e, rows[e].get("writer")) for e in sorted(rows) if rows[e]["status"] in CHARTED]
    found = {(e, _who(new)): (_who(old), new) for (e, old), (_, new) in zip(kept, kept[1:])
             if _who(old) != _who(new)}
    if summary is not None and summary.resumed is not None:
        epoch, old = summary.resumed
        me = _who(summary.this_run)
        if _who(old) != me:  # this attempt took over where it resumed (from worker memory,
            found = {k: v for k, v in found.items() if k[1] != me}  # after the epoch saved)
            found.setdefault((epoch, me), (_who(old), summary.this_run))
    return found


def _resume_label(writer: Mapping[str, Any], this_run: str | None) -> str:
    """``attempt 2 resumed`` (this flow run), ``crimson-otter resumed`` (another one)."""
    if run_id(writer) is not None and run_id(writer) == this_run:
        count = writer.get("run_count")
        return f"attempt {plain_text(count, 6)} resumed" if count not in (None, "") \
            else "resumed"
    name = writer.get("flow_run_name") or (run_id(writer) or "")[:8] or "a run"
    return f"{plain_text(name, 20)} resumed"


def chart_markers(rows: Mapping[int, dict[str, Any]],
                  summary: Summary | None = None) -> list[Marker]:
    """The chart's markers, from the writers of the charted rows (and ``summary``'s resume):
    a run or attempt resumed at the epoch it started from; when a later attempt of the same
    flow run took over, the attempt before it failed in the epoch after its last commit (the
    epoch it was in: exact when every epoch is saved, its first possible one otherwise); a
    save that failed (a ``FAILED`` row) at its epoch."""
    this_run = summary.this_run.get("flow_run_id") if summary is not None else None
    markers = {(e, "failed"): Marker(e, "failed", "save failed")
               for e, r in rows.items() if str(r["status"]).startswith("FAILED")}
    for (epoch, new), (old, writer) in _handovers(rows, summary).items():
        markers[(epoch, f"resumed {new}")] = Marker(epoch, "resumed",
                                                    _resume_label(writer, this_run))
        if old[0] is not None and old[0] == new[0] and (old[1] or 0) < (new[1] or 0):
            markers.setdefault((epoch + 1, "failed"), Marker(
                epoch + 1, "failed", f"attempt {plain_text(old[1], 6)} failed"))
    return sorted(markers.values())


def _writers(rows: Mapping[int, dict[str, Any]], this_run: str | None) -> list[str]:
    """Markdown lines: which flow run (linked) and attempt wrote which epochs of the table."""
    epochs: dict[str, list[int]] = {}
    for epoch, row in sorted(rows.items()):
        if row.get("writer") is not None:  # None: a failed save
            epochs.setdefault(writer_cell(row["writer"], this_run, link=True), []).append(epoch)
    return (["", "Written by (epochs in the checkpoints table):", ""]
            + [f"- {who}: epochs {epochs_text(es)}" for who, es in epochs.items()]
            if epochs else [])


def _inspect(summary: Summary, epoch: int, delta: bool) -> list[str]:
    """Python lines that open the newest epoch's group with plain zarr (a differential epoch
    through :func:`caffe2ckpt.zarr_store`, which resolves what it builds on)."""
    if delta:
        return ["import caffe2ckpt, zarr",
                f"store = caffe2ckpt.zarr_store({summary.url!r}, {epoch}, {summary.file_node!r})",
                "g = zarr.open_group(store=store, mode='r')",
                "print(list(g.array_keys()))"]
    path = db_name(epoch, summary.file_node, summary.url)  # type: ignore[arg-type]
    return ["import zarr", f"g = zarr.open_group({path!r}, mode='r')",
            "m = g.attrs['caffe2ckpt']", "print(list(m['arrays']), m['packed']['names'])"]


def summary_markdown(summary: Summary, rows: Mapping[int, dict[str, Any]], *,
                     epoch: int, final: bool) -> str:
    """The summary at ``epoch`` (the newest the attempt reached; its end when ``final``)."""
    run = summary.this_run
    lines = [f"# Job {md_text(summary.job)}", ""]
    if summary.reason is not None:
        lines.append(f"- {summary.reason}")
    if summary.memory is not None:
        lines.append(f"- **Resumed** {md_text(summary.memory)}")
    elif summary.resumed is not None:
        resumed, writer = summary.resumed
        elastic = "" if summary.elastic is None else (
            f", saved by {nodes_text(summary.elastic[0])}, on {nodes_text(summary.elastic[1])}")
        lines.append(f"- **Resumed** from epoch {resumed}, written by "
                     f"{writer_cell(writer, run['flow_run_id'], link=True)}{elastic}")
    else:
        lines.append("- **Fresh start** (no committed checkpoint to resume from)")
    lines += [f"- **Recovered**: {md_text(text)}" for text in summary.recoveries]
    lines.append(f"- This run: {writer_cell(run, None, link=True)}")
    target = f" of {summary.target}" if summary.target is not None else ""
    statuses = {e: r["status"] for e, r in sorted(rows.items())}
    if final:
        failed = [e for e, status in statuses.items() if status.startswith("FAILED")]
        committed = sum(status == COMMITTED for status in statuses.values())
        lines.append(f"- Finished at epoch **{epoch}**{target}; {committed} committed checkpoints"
                     + (f"; **failed saves: {failed}**" if failed else ""))
    else:
        lines.append(f"- Training: at epoch **{epoch}**{target}, started from epoch "
                     f"{summary.start}")
    chart = chart_markdown(chart_series(rows),
                           "metrics, save seconds, save MB/s and MiB written per epoch, "
                           "where runs resumed and attempts failed",
                           chart_markers(rows, summary))
    if chart:
        lines += ["", "## Epochs", "", chart]
    newest = max((e for e, r in rows.items() if r["status"] == COMMITTED), default=None)
    if summary.url is not None and summary.file_node is not None and newest is not None:
        lines += ["", f"Checkpoints: `{summary.url}`", "", "Inspect them with:", "", "```python",
                  *_inspect(summary, newest, bool(rows[newest].get("delta"))), "```"]
    return "\n".join(lines + _writers(rows, run["flow_run_id"]))
