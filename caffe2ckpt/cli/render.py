"""Human output of the ``caffe2ckpt`` command: aligned tables built from the same JSON documents
``--json`` prints, byte and age formatting, and a one-line progress bar for terminals.
"""

from __future__ import annotations

import datetime
import math
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from caffe2ckpt.units import epochs_text, human_bytes

__all__ = ["Progress", "render"]


# -- formatting --------------------------------------------------------------------------------


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def human_time(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def number(value: Any) -> str:
    """A metric or difference: floats with 6 significant digits; "nan"/"inf" strings as is."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def metrics_text(metrics: dict[str, Any]) -> str:
    return " ".join(f"{k}={number(v)}" for k, v in sorted(metrics.items())) or "-"


def shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def writer_text(writer: dict[str, Any],
                node_workers: dict[str, dict[str, Any]] | None = None) -> str:
    """Who wrote a checkpoint, short: ``"my-flow-run attempt 2 host:pid"``, followed by the
    processes that wrote the nodes' data where those are others (Dask workers):
    ``"... workers trainer_0 host:pid, trainer_1 host:pid"``."""
    if not writer:
        return "-"
    who = writer.get("flow_run_name") or writer.get("manager") or writer.get("session") or ""
    if "run_count" in writer:
        who += f" attempt {writer['run_count']}"
    where = str(writer.get("host", ""))
    if "pid" in writer:
        where += f":{writer['pid']}"
    text = " ".join(p for p in (who.strip(), where) if p)
    text = text or ", ".join(f"{k}={v}" for k, v in sorted(writer.items()))[:40]
    me = (writer.get("host"), writer.get("pid"))
    others = [f"{n} {w.get('host', '')}:{w.get('pid', '')}"
              for n, w in sorted((node_workers or {}).items())
              if (w.get("host"), w.get("pid")) != me]
    return text + (" workers " + ", ".join(others) if others else "")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[str] = ()) -> str:
    """Rows as aligned columns (``right``: headers of right-aligned columns); the last column
    is never padded."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = []
        for i, cell in enumerate(row):
            if i == len(row) - 1 and headers[i] not in right:
                parts.append(cell)
            elif headers[i] in right:
                parts.append(cell.rjust(widths[i]))
            else:
                parts.append(cell.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


# -- the commands ------------------------------------------------------------------------------


def render_ls(doc: dict[str, Any]) -> str:
    epochs = doc["epochs"]
    out = [_ls_summary(doc)]
    rows = []
    for e in epochs:
        state = e["state"]
        if e.get("missing_nodes"):
            state += f" (missing {', '.join(e['missing_nodes'])})"
        if e.get("error"):
            state += f": {e['error']}"
        layout = e.get("layout")
        nodes = ",".join(e["nodes"]) + (f" ({layout['partition']})" if layout else "")
        rows.append([e["epoch"], nodes, *_sizes(e), metrics_text(e["metrics"]),
                     human_time(e["created"]), writer_text(e["writer"], e.get("node_workers")),
                     state])
    if rows:
        out += ["", table(["EPOCH", "NODES", "STORED", "SIZE", "METRICS", "CREATED", "WRITER",
                           "STATE"], rows, right=["EPOCH", "STORED", "SIZE"])]
    else:
        out.append("no committed epochs")
    if doc["leftovers"]:
        out += ["", ("Uncommitted leftovers (`caffe2ckpt gc --yes` removes those older than "
                    "--min-age):"),
                table(["KIND", "AGE", "BYTES", "PATH"],
                      [[x["kind"] + (" (its run may still be writing it)" if x.get("live") else ""),
                        human_age(x["age_seconds"]), human_bytes(x["bytes"]), x["path"]]
                       for x in doc["leftovers"]], right=["AGE", "BYTES"])]
    return "\n".join(out)


def _ls_summary(doc: dict[str, Any]) -> str:
    """``ls``'s first line: the committed epochs and what they hold on disk (stored bytes),
    with the superseded saves and the older groups differential epochs build on apart."""
    current = [e for e in doc["epochs"] if e["state"] == "committed"]
    epochs = sorted({e["epoch"] for e in current})
    saves = f" in {len(current)} saves" if len(current) > len(epochs) else ""
    superseded = sum(1 for e in doc["epochs"] if e["state"] == "superseded")
    text = f"{doc['prefix']}: {plural(len(epochs), 'committed epoch')}{saves}"
    if superseded:
        text += (f" (+ {plural(superseded, 'superseded save')}, "
                 f"{human_bytes(doc['superseded_bytes_stored'])})")
    if epochs:
        text += f", newest {epochs[-1]}"
    text += f", {human_bytes(doc['bytes_stored'])} stored (blobs {human_bytes(doc['bytes'])})"
    if doc["pinned_bytes_stored"]:
        text += (f" + {human_bytes(doc['pinned_bytes_stored'])} of older groups differential "
                 "epochs build on")
    return text


def _written(row: dict[str, Any]) -> str:
    """The bytes a save wrote, whether it is a delta, and how many large blobs it wrote whole
    with deltas on."""
    written = human_bytes(row.get("bytes_written", row["bytes"]))
    whole = sum(map(len, row.get("written_whole", {}).values()))
    if row.get("kind") == "delta":
        return f"{written} delta" + (f", {whole} whole" if whole else "")
    return f"{written} whole" if whole else written


def _whole_lines(doc: dict[str, Any]) -> list[str]:
    """Why large blobs were written whole by a save made with deltas on."""
    return [f"written whole although delta_saves is on: node {node}, blob {name!r}: {why}"
            for node, blobs in sorted(doc.get("written_whole", {}).items())
            for name, why in sorted(blobs.items())]


def render_show(doc: dict[str, Any]) -> str:
    blobs = doc["blobs"]
    if not doc["verified"]:
        check = "recorded, not read (add --verify to check them)"
    else:
        check = "read and checked: DAMAGE FOUND (below)" if doc["problems"] else "verified"
    kind = (f" ({human_bytes(doc['bytes_written'])} written: a delta)"
            if doc.get("kind") == "delta" else "")
    out = [(f"{doc['prefix']} epoch {doc['epoch']}: nodes {', '.join(doc['nodes'])}; "
           f"{plural(len(blobs), 'blob')}, {human_bytes(sum(b['bytes'] for b in blobs))}{kind}; "
           f"checksums {check}")]
    if doc.get("layout"):
        out.append(layout_text(doc["layout"]))
    out += _whole_lines(doc)
    rows = []
    for b in blobs:
        if b["storage"] == "array":
            storage = f"array {b['path']}, {plural(b['chunks'], 'chunk')}"
        elif b["storage"] == "packed":
            storage = f"packed @{b['offset']}"
        else:  # a differential save's: unchanged, or a row overlay on older groups
            storage = chain_text(b)
        state = {"recorded": "crc32c recorded", "ok": "ok", "bad": "BAD",
                 "error": "READ ERROR"}[b["checksum"]]
        kind = [b["kind"]] if doc.get("layout") else []
        rows.append([b["node"], b["name"], *kind, b["dtype"], shape_text(b["shape"]),
                     human_bytes(b["bytes"]), storage, state])
    if rows:
        kind = ["KIND"] if doc.get("layout") else []
        out += ["", table(["NODE", "BLOB", *kind, "DTYPE", "SHAPE", "BYTES", "STORAGE",
                           "CHECKSUM"], rows, right=["BYTES"])]
    for problem in doc["problems"]:
        out.append(f"{problem['node']}: {problem['error']}")
    return "\n".join(out)


def layout_text(layout: dict[str, Any]) -> str:
    """``"layout: mod over 4 nodes (t0, t1, t2, t3); rows: emb; replicated: w; other blobs
    local"``."""
    def names(key: str) -> str:
        shown = layout[key][:5]
        more = len(layout[key]) - len(shown)
        return ", ".join(shown) + (f" and {more} more" if more else "") if shown else "none"
    order = layout["order"]
    return (f"layout: {layout['partition']} over {plural(len(order), 'node')} "
            f"({', '.join(order)}); rows: {names('rows')}; replicated: {names('replicated')}; "
            "other blobs local")


def chain_text(blob: dict[str, Any]) -> str:
    """Where a differential save's blob comes from, by epoch (``--json`` has the groups'
    URLs): ``"same, from epoch 5"``, ``"rows on epochs 5-7 (3 groups)"``."""
    epochs = [e for e in blob.get("from_epochs", []) if e is not None]
    where = (f"epoch {epochs[0]}" if len(epochs) == 1
             else f"epochs {epochs_text(epochs)} ({plural(len(blob['from']), 'group')})")
    return f"same, from {where}" if blob["storage"] == "same" else f"{blob['storage']} on {where}"


def render_verify(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["results"]:
        detail = "; ".join(e["error"] + packed_note(e) for e in r["errors"])
        rows.append([r["epoch"], r["node"], r["blobs"], human_bytes(r["bytes"]),
                     r["status"].upper() if r["status"] != "ok" else "ok", detail])
    out = [table(["EPOCH", "NODE", "BLOBS", "BYTES", "RESULT", "DETAIL"], rows,
                 right=["EPOCH", "BLOBS", "BYTES"])] if rows else []
    for bad in doc["unreadable_records"]:
        out.append(f"DAMAGED commit record: {bad['error']}")
    s = doc["summary"]
    bad = [text for n, text in ((s["damaged"], f"{s['damaged']} DAMAGED"),
                                (s["error"], f"{s['error']} could not be read"),
                                (len(doc["unreadable_records"]),
                                 plural(len(doc["unreadable_records"]), "DAMAGED commit record")))
           if n]
    out.append(f"{doc['prefix']}: {s['ok']} of {plural(s['checked'], 'node checkpoint')} "
               f"verified ok ({human_bytes(s['bytes'])} read)" + "".join("; " + b for b in bad))
    if doc["partial"]:
        out.append("not committed (partial saves, not checked): " + "; ".join(
            f"epoch {p['epoch']} missing {', '.join(p['missing_nodes'])}" for p in doc["partial"]))
    return "\n".join(out)


def packed_note(error: dict[str, Any]) -> str:
    """The blobs one error hits, when they were read together: a node's packed blobs, or blobs
    a differential save reads from the same place in an older group."""
    names = error.get("packed_blobs") or error.get("blobs")
    if not names:
        return ""
    shown = ", ".join(map(repr, names[:5]))
    if len(names) > 5:
        shown += f" and {len(names) - 5} more"
    what = "the packed array holds" if error.get("packed_blobs") else "it hits"
    return f" ({what} blobs {shown})"


def render_gc(doc: dict[str, Any]) -> str:
    remove_word = "would remove" if doc["dry_run"] else "removed"
    out = [f"REFUSED: {doc['refused']}", ""] if doc.get("refused") else []
    if doc["leftovers"]:
        out += [(f"Uncommitted leftovers older than {human_age(doc['min_age_seconds'])} "
                f"({remove_word}):"),
                table(["KIND", "AGE", "BYTES", "PATH", "RESULT"],
                      [[x["kind"], human_age(x["age_seconds"]), human_bytes(x["bytes"]), x["path"],
                        _gc_result(x, remove_word)] for x in doc["leftovers"]],
                      right=["AGE", "BYTES"]), ""]
    if doc["skipped"]:
        out += ["Left alone:"] + [f"  {x['path']}: {x['reason']}" for x in doc["skipped"]] + [""]
    out += _gc_node_sets(doc)
    out += _gc_epochs(doc, remove_word)
    if doc.get("pinned"):
        out += [(f"Kept for differential epochs that stay (they build on them): "
                 f"{plural(len(doc['pinned']), 'group')}, {human_bytes(doc['bytes_pinned'])}: "
                 + ", ".join(p["path"] for p in doc["pinned"])), ""]
    out.append(_gc_outcome(doc))
    return "\n".join(out)


def _gc_node_sets(doc: dict[str, Any]) -> list[str]:
    """With ``--drop-old-node-sets``: each resized job's current and old node sets."""
    if not doc.get("drop_old_node_sets"):
        return []
    if not doc["node_sets"]:
        return ["Node sets: no job here has epochs of a node set it left.", ""]
    out = ["Node sets:"]
    for job in doc["node_sets"]:
        old = "; ".join(",".join(nodes) for nodes in job["old"])
        now = f"  now on {','.join(job['current'])} (newest epoch {job['newest_epoch']}): "
        out.append(now + (f"letting go of {old}" if job["letting_go"]
                          else f"{old} stay: {job['waiting']}"))
    return out + [""]


def _gc_epochs(doc: dict[str, Any], remove_word: str) -> list[str]:
    out = []
    if doc["delete"]:
        what = ("outside the retention policy or of old node sets"
                if doc.get("drop_old_node_sets") else "outside the retention policy")
        out += [(f"Epochs {what} ({remove_word}; FREES: the stored bytes removing it frees, "
                 "with older groups only it still needed):"),
                table(["EPOCH", "NODES", "FREES", "STORED", "SIZE", "METRICS", "WHY", "RESULT"],
                      [[d["epoch"], ",".join(d["nodes"]), human_bytes(d.get("frees")),
                        *_sizes(d), metrics_text(d["metrics"]), d.get("why", ""),
                        _gc_result(d, remove_word)]
                       for d in doc["delete"]], right=["EPOCH", "FREES", "STORED", "SIZE"]), ""]
    if doc["keep"]:
        out += ["Epochs kept:",
                table(["EPOCH", "NODES", "STORED", "SIZE", "WHY"],
                      [[k["epoch"], ",".join(k["nodes"]), *_sizes(k), ", ".join(k["reasons"])]
                       for k in doc["keep"]], right=["EPOCH", "STORED", "SIZE"]), ""]
    return out


def _sizes(row: dict[str, Any]) -> list[str]:
    """A save's STORED (the bytes it wrote; "delta" if it builds on older groups) and SIZE
    (its blobs' bytes) columns."""
    return [_written(row), human_bytes(row["bytes"])]


def _gc_outcome(doc: dict[str, Any]) -> str:
    """The last line: what was (or would be) removed, and what failed or was not reached."""
    freed = human_bytes(doc["bytes_freed"])
    if doc["dry_run"]:
        return (f"Dry run: {plural(len(doc['delete']), 'epoch')} and "
                f"{plural(len(doc['leftovers']), 'leftover')} ({freed}) would be removed; run "
                "again with --yes to remove them.")
    items = doc["delete"] + doc["leftovers"]
    failed = sum(1 for x in items if x.get("error"))
    missed = sum(1 for x in items if x.get("skipped"))
    epochs = sum(1 for d in doc["delete"] if d.get("done"))
    left = sum(1 for x in doc["leftovers"] if x.get("done"))
    return (f"Removed {plural(epochs, 'epoch')} and {plural(left, 'leftover')} ({freed})"
            + (f"; {failed} failed" if failed else "")
            + (f"; {missed} not reached" if missed else "") + ".")


def _gc_result(item: dict[str, Any], remove_word: str) -> str:
    """What ``gc`` did with one epoch or leftover, for its table."""
    if item.get("error"):
        return item["error"]
    if item.get("skipped"):
        return f"not reached: {item['skipped']}"
    if item.get("done") is False:
        return f"kept: {item.get('kept', 'in use')}"
    return remove_word


def render_diff(doc: dict[str, Any]) -> str:
    a, b = doc["epochs"]
    s = doc["summary"]
    out = [(f"{doc['prefix']} epoch {a} -> {b}: {s['changed']} changed, {s['added']} added, "
           f"{s['removed']} removed, {s['same']} same")]
    whole = str(doc.get("compared", "")).startswith("global")
    out += compared_text(doc, whole)
    rows = []
    for blob in doc["blobs"]:
        if blob["status"] == "same" and not doc["show_same"]:
            continue
        node = "(global)" if blob["node"] is None else blob["node"]
        kind = [blob.get("kind") or "-"] if whole else []
        rows.append([node, blob["name"], *kind, blob["status"], diff_detail(blob)])
    if rows:
        kind = ["KIND"] if whole else []
        out += ["", table(["NODE", "BLOB", *kind, "CHANGE", "DETAIL"], rows)]
    return "\n".join(out)


def compared_text(doc: dict[str, Any], whole: bool) -> list[str]:
    """``diff``'s line saying what was compared and why: global arrays, or per node (none for
    two saves without a layout, the plain case)."""
    if not doc.get("compared_why") or not any(doc.get("layouts") or ()):
        return []
    return [f"compared {'as global arrays' if whole else 'per node'}: {doc['compared_why']}"]


def diff_detail(blob: dict[str, Any]) -> str:
    a, b = blob["a"], blob["b"]
    if a is None or b is None:
        side = a or b
        return f"{side['dtype']} {shape_text(side['shape'])}, {human_bytes(side['bytes'])}"
    if blob["differing"] is None:
        parts = []
        if a["dtype"] != b["dtype"]:
            parts.append(f"dtype {a['dtype']} -> {b['dtype']}")
        if a["shape"] != b["shape"]:
            parts.append(f"shape {shape_text(a['shape'])} -> {shape_text(b['shape'])}")
        return ", ".join(parts)
    if not blob["differing"]:
        return f"{b['dtype']} {shape_text(b['shape'])}, identical"
    text = f"{blob['differing']}/{blob['elements']} elements differ" + rows_text(blob)
    if blob["max_abs_diff"] is not None:
        text += f", max |b-a| {number(blob['max_abs_diff'])}"
    if blob["nan_mismatches"]:
        text += f", {blob['nan_mismatches']} NaN on one side only"
    return text


def rows_text(blob: dict[str, Any]) -> str:
    """Which global rows of a rows blob differ: ``" in 2/1000 rows (rows 338, 999)"`` (the
    first five; empty for other blobs)."""
    if not blob.get("rows_differing"):
        return ""
    first = blob.get("rows_differing_first") or []
    shown = ", ".join(map(str, first[:5])) + (", ..." if blob["rows_differing"] > 5 else "")
    return (f" in {blob['rows_differing']}/{blob['b']['shape'][0]} rows "
            f"(row{'s' if blob['rows_differing'] > 1 else ''} {shown})")


def render_materialize(doc: dict[str, Any]) -> str:
    out = [f"wrote {group}" for group in doc["groups"]]
    if doc.get("superseded"):
        out.append(f"(epoch {doc['epoch']}'s superseded save {doc['save_id']}: a later run of "
                   "its job went back to an earlier epoch)")
    return "\n".join(out)


RENDERERS = {"ls": render_ls, "show": render_show, "verify": render_verify, "gc": render_gc,
             "diff": render_diff, "materialize": render_materialize}


def render(command: str, doc: dict[str, Any]) -> str:
    return RENDERERS[command](doc)


# -- progress ----------------------------------------------------------------------------------


class Progress:
    """A one-line ``\\r`` progress bar on ``stream``, drawn only when ``enabled`` (a terminal).

    Redrawn at most ten times a second; :meth:`close` erases it.
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.label = ""
        self.total = 0
        self.done = 0
        self.unit = "bytes"
        self._drawn = 0.0
        self._width = 0

    def start(self, label: str, total: int, unit: str = "bytes") -> None:
        self.label, self.total, self.done, self.unit = label, total, 0, unit
        self._draw("", force=True)

    def advance(self, amount: int, note: str = "") -> None:
        self.done += amount
        self._draw(note)

    def _draw(self, note: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._drawn < 0.1 and self.done < self.total:
            return
        self._drawn = now
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        bar = "#" * math.floor(fraction * 20)
        if self.unit == "bytes":
            count = f"{human_bytes(self.done)}/{human_bytes(self.total)}"
        else:
            count = f"{self.done}/{self.total}"
        line = f"{self.label} [{bar:<20}] {fraction:4.0%} {count} {note}".rstrip()
        columns = shutil.get_terminal_size((80, 24)).columns
        line = line[: max(columns - 1, 10)]
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
