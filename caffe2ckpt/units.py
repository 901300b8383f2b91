"""Text for people: sizes, lists of epochs and who wrote a checkpoint. Shared by the command
line, the library's messages, the Prefect artifacts and log lines."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["epochs_summary", "epochs_text", "human_bytes", "nodes_text", "writer_phrase"]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def nodes_text(count: int) -> str:
    """``"1 node"``, ``"4 nodes"``."""
    return f"{count} node{'' if count == 1 else 's'}"


def _runs(epochs: Iterable[int]) -> list[tuple[int, int]]:
    """``[0, 1, 2, 5, 7, 8]`` -> ``[(0, 2), (5, 5), (7, 8)]``."""
    runs: list[list[int]] = []
    for epoch in sorted(set(epochs)):
        if runs and epoch == runs[-1][1] + 1:
            runs[-1][1] = epoch
        else:
            runs.append([epoch, epoch])
    return [(a, b) for a, b in runs]


def _text(runs: list[tuple[int, int]]) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def epochs_text(epochs: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    return _text(_runs(epochs))


def epochs_summary(epochs: Iterable[int], what: str = "committed", most: int = 5) -> str:
    """``"committed epochs: 0-5"``; past ``2 * most`` runs of consecutive epochs, their count,
    range and the newest ``most`` runs: ``"31 committed epochs (0 to 61), the newest: 52, 54,
    56, 58, 61"``."""
    epochs = sorted(set(epochs))
    runs = _runs(epochs)
    if len(runs) <= 2 * most:
        return f"{what} epochs: {_text(runs)}"
    return (f"{len(epochs)} {what} epochs ({epochs[0]} to {epochs[-1]}), the newest: "
            f"{_text(runs[-most:])}")


def _where(writer: Mapping[str, Any]) -> str:
    """`` on host h, pid 7`` (what of it the writer says)."""
    parts = [f"host {writer['host']}" if writer.get("host") else "",
             f"pid {writer['pid']}" if writer.get("pid") is not None else ""]
    text = ", ".join(p for p in parts if p)
    return f" on {text}" if text else ""


def _who(writer: Mapping[str, Any]) -> str | None:
    """``flow run crimson-otter (<id>) attempt 2``, ``StepCheckpointManager``, ``a local
    session``; None when the writer says none of these."""
    name, run_id = writer.get("flow_run_name"), writer.get("flow_run_id")
    if name or run_id:
        run = f"{name} ({run_id})" if name and run_id else str(name or run_id)
        count = writer.get("run_count")
        return f"flow run {run}" + (f" attempt {count}" if count is not None else "")
    if writer.get("manager"):
        return str(writer["manager"])
    return f"a {writer['session']} session" if writer.get("session") else None


def writer_phrase(writer: Mapping[str, Any] | None) -> str:
    """Who wrote a checkpoint (a commit record's ``writer``), as words for a log line:
    ``flow run crimson-otter (<flow run id>) attempt 2 on host h, pid 7``,
    ``StepCheckpointManager on host h, pid 7``, ``a local session on host h, pid 7``; when the
    node's data was written by another process (a Dask worker), ``...; its data on host w,
    pid 8``. A writer of another kind is listed as ``key=value`` pairs."""
    if not isinstance(writer, Mapping) or not writer:
        return "an unknown writer"
    who = _who(writer)
    if who is None:
        return ", ".join(f"{k}={v}" for k, v in sorted(writer.items()))
    worker = writer.get("worker")
    other = (isinstance(worker, Mapping) and _where(worker) != ""
             and (worker.get("host"), worker.get("pid")) != (writer.get("host"), writer.get("pid")))
    return who + _where(writer) + (f"; its data{_where(worker)}" if other else "")
