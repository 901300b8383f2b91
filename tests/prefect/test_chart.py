"""The summary's chart: an SVG image (a data URL in markdown) of the run's history per epoch."""

from __future__ import annotations

import base64
import math
import xml.etree.ElementTree as ET

from caffe2ckpt.prefect.chart import CHART_ID, MAX_POINTS, Series, chart_markdown, chart_svg
from caffe2ckpt.prefect.summary import chart_series, reason_from_states

SVG = "{http://www.w3.org/2000/svg}"


def points_of(svg: str) -> list[list[tuple[float, float]]]:
    """Each panel's polyline as (x, y) pixel pairs."""
    root = ET.fromstring(svg)
    return [[tuple(map(float, p.split(","))) for p in line.get("points").split()]
            for line in root.iter(f"{SVG}polyline")]


def test_each_series_is_a_panel_with_its_finite_values():
    svg = chart_svg([Series("loss", [(1, 4.0), (2, math.nan), (3, 2.0), (4, math.inf), (5, 1.0)]),
                     Series("save seconds", [(0, 0.5), (1, 0.25)])])
    root = ET.fromstring(svg)
    assert root.get("id") == CHART_ID
    loss, seconds = points_of(svg)
    assert len(loss) == 3 and len(seconds) == 2  # NaN and inf are left out
    xs, ys = zip(*loss)
    assert xs == tuple(sorted(xs)) and ys == tuple(sorted(ys))  # falling loss: y grows downwards
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "loss" in texts and "epoch" in texts and "4" in texts


def test_a_loss_over_orders_of_magnitude_is_drawn_on_a_log_scale():
    wide = chart_svg([Series("loss", [(e, 10.0 ** -e) for e in range(5)])])
    narrow = chart_svg([Series("loss", [(e, 1.0 + e) for e in range(5)])])
    assert "loss (log scale)" in wide and "log scale" not in narrow
    ys = [y for _, y in points_of(wide)[0]]
    gaps = [b - a for a, b in zip(ys, ys[1:])]
    assert max(gaps) - min(gaps) < 0.2  # evenly spaced decades


def test_long_series_are_thinned_and_text_is_escaped():
    svg = chart_svg([Series("<script>alert(1)</script>", [(e, float(e)) for e in range(5000)])])
    root = ET.fromstring(svg)  # still well-formed
    assert not list(root.iter(f"{SVG}script"))
    (line,) = points_of(svg)
    assert len(line) == MAX_POINTS and line[-1][0] > line[-2][0]  # the last epoch is kept


def test_the_markdown_is_an_image_with_an_svg_data_url():
    text = chart_markdown([Series("loss", [(1, 1.0), (2, 0.5)])], "per epoch ] [x](y)\nz")
    alt, _, url = text.partition("](data:image/svg+xml;base64,")
    assert alt == f"![{CHART_ID}: per epoch  x(y)z"
    svg = chart_svg([Series("loss", [(1, 1.0), (2, 0.5)])])
    assert base64.b64decode(url.rstrip(")")).decode() == svg
    assert chart_markdown([], "nothing") == ""


def test_the_chart_shows_the_runs_history_only():
    def row(status, loss, seconds=0.1, mbs=10.0):
        return {"status": status, "values": {} if loss is None else {"loss": loss},
                "seconds": seconds, "MB/s": mbs}

    rows = {0: row("committed", None), 1: row("deleted (retention)", 1.0),
            2: row("committed", 0.5, mbs=None), 3: row("superseded", 9.0),
            4: {"status": "FAILED: disk full", "values": {}, "seconds": "", "MB/s": ""}}
    series = chart_series(rows)
    assert [s.title for s in series] == ["loss", "save seconds", "save MB/s"]
    assert [list(s.points) for s in series] == [[(1, 1.0), (2, 0.5)],
                                                [(0, 0.1), (1, 0.1), (2, 0.1)],
                                                [(0, 10.0), (1, 10.0)]]
    assert chart_series({3: row("superseded", 1.0)}) == []
    # rows of saves as the table makes them say what each wrote (a delta writes little)
    rows = {0: row("committed", None) | {"written_bytes": 8 << 20},
            1: row("committed", None) | {"written_bytes": 1 << 19}}
    assert chart_series(rows)[-1] == Series("save MiB written", [(0, 8.0), (1, 0.5)])


def test_the_reason_for_an_attempt_is_read_from_the_state_history():
    from prefect.states import AwaitingRetry, Crashed, Running

    def history(*states):  # oldest first, as read from the server
        return list(states)

    fail = "Flow run encountered an exception: InjectedFailure: in epoch 7"
    put_back = "caffe2ckpt: retrying a crashed run"
    in_process = history(Running(), AwaitingRetry(message=fail), Running())
    assert reason_from_states(in_process, 2) == (
        f"**Attempt 2** of this flow run, a retry: attempt 1 **failed** ({fail}) and Prefect "
        "retried the flow run")
    crashed = history(Running(), Crashed(message="exit code -9"), AwaitingRetry(message=put_back),
                      Running())
    assert reason_from_states(crashed, 2) == (
        "**Attempt 2** of this flow run, a retry after the run ended **Crashed** (exit code -9); "
        f"put back by: {put_back}")
    # one crash reported twice: two attempts start; the later one still finds the crash
    twice = history(Running(), Crashed(message="exit code -9"), AwaitingRetry(message=put_back),
                    AwaitingRetry(message=put_back), Running(), Running())
    assert reason_from_states(twice, 3) == reason_from_states(crashed, 2).replace(
        "Attempt 2", "Attempt 3")
    # a crash, then a failure retried in the process: the failure is the reason now
    both = history(*crashed, AwaitingRetry(message=fail), Running())
    assert reason_from_states(both, 3).startswith(
        f"**Attempt 3** of this flow run, a retry: attempt 2 **failed** ({fail})")
    assert "not on record" in reason_from_states(history(Running(), Running()), 2)


def test_thinning_keeps_the_extremes_and_the_scale():
    points = [(e, 1.0) for e in range(1500)]
    points[8] = (8, 0.001)  # a dip that thinning may drop: still the lowest value, log scale
    svg = chart_svg([Series("loss", points)])
    texts = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert "0.001" in texts and "loss (log scale)" in texts


def test_a_control_character_in_a_metric_name_keeps_the_svg_well_formed():
    root = ET.fromstring(chart_svg([Series("lo\x01ss\u202e", [(1, 1.0), (2, 0.5)])]))
    assert "lo ss" in [t.text for t in root.iter(f"{SVG}text")]


def test_the_mean_of_opposite_infinities_is_nan_not_an_error():
    from caffe2ckpt.prefect.table import checkpoint_row
    from caffe2ckpt.store.format.records import CommitRecord

    def rec(node, loss):
        return CommitRecord(epoch=1, node=node, save_id="s", nodes=["a", "b"], nbytes=1,
                            blob_count=1, seconds=0.1, metrics={"loss": loss, "big": 1e308})

    row = checkpoint_row(1, {"a": rec("a", math.inf), "b": rec("b", -math.inf)})
    assert math.isnan(row["values"]["loss"]) and row["values"]["big"] == 1e308


def test_the_summary_opens_the_newest_committed_epoch_not_a_failed_one():
    from caffe2ckpt.prefect.summary import Summary, summary_markdown

    def row(status):
        return {"status": status, "values": {}, "seconds": 0.1, "MB/s": 1.0, "writer": None}

    summary = Summary(job="j", this_run={"flow_run_id": None, "run_count": 1}, start=0,
                      target=9, url="/ckpt", file_node="trainer_0")
    rows = {3: row("committed"), 4: row("committed"), 5: row("FAILED: disk full")}
    text = summary_markdown(summary, rows, epoch=5, final=False)
    assert "- Training: at epoch **5** of 9, started from epoch 0" in text
    assert "zarr.open_group('/ckpt/trainer_0.4', mode='r')" in text
    assert "open_group" not in summary_markdown(summary, {5: row("FAILED: x")}, epoch=5,
                                                final=False)


# -- one epoch axis, ticks and markers (issue 28) ------------------------------------------------

def panels_of(svg: str) -> list[dict]:
    """Per panel, top to bottom: the top and bottom of its plot, its x tick labels as
    (x, text), its y tick labels as (y, text) and its polyline's points."""
    root = ET.fromstring(svg)
    frames = sorted(float(r.get("y")) for r in root.iter(f"{SVG}rect") if r.get("fill") == "none")
    out = []
    for top in frames:
        bottom = top + 102  # the plot's height
        def inside(el, key, lo=top - 6, hi=bottom + 20):
            return lo <= float(el.get(key)) <= hi
        out.append({
            "top": top, "bottom": bottom,
            "xticks": [(float(t.get("x")), t.text) for t in root.iter(f"{SVG}text")
                       if t.get("class") == "xtick" and inside(t, "y")],
            "yticks": [(float(t.get("y")), t.text) for t in root.iter(f"{SVG}text")
                       if t.get("class") == "ytick" and inside(t, "y", top, bottom + 5)],
        })
    for panel, line in zip(out, points_of(svg)):
        panel["points"] = line
    return out


def test_every_panel_shares_one_epoch_axis():
    loss = Series("loss", [(e, 1.0 / e) for e in range(1, 11)])  # from epoch 1
    seconds = Series("save seconds", [(e, 0.1) for e in range(0, 11) if e != 4])  # no epoch 4
    speed = Series("save MB/s", [(e, 10.0 * e) for e in range(3, 8)])  # a few epochs only
    panels = panels_of(chart_svg([loss, seconds, speed]))
    assert len(panels) == 3
    x_of = [dict(zip([e for e, _ in s.points], (x for x, _ in p["points"])))
            for s, p in zip([loss, seconds, speed], panels)]
    for epoch in range(11):
        xs = {round(xs[epoch], 1) for xs in x_of if epoch in xs}
        assert len(xs) == 1, (epoch, xs)  # the same x in every panel that has the epoch
    assert x_of[1][0] < x_of[0][1] < x_of[2][3] < x_of[1][5]  # one axis from epoch 0 to 10
    assert round(x_of[1][3], 1) < round(x_of[1][5], 1) and 4 not in x_of[1]


def test_both_axes_have_a_few_round_ticks_within_range():
    seconds = [(e, 0.0067 + 0.005 * (e % 13)) for e in range(0, 13)]
    svg = chart_svg([Series("loss", [(e, 10.0 ** -e) for e in range(1, 13)]),
                     Series("save seconds", seconds)])
    loss, seconds = panels_of(svg)
    # x: the same 4-8 whole epochs under every panel, at the x of those epochs' points
    assert loss["xticks"] == seconds["xticks"]
    epochs = [int(text) for _, text in loss["xticks"]]
    assert 4 <= len(epochs) <= 8 and epochs[0] >= 0 and epochs[-1] <= 12
    point_x = {e: x for e, (x, _) in zip(range(0, 13), seconds["points"])}
    assert all(abs(x - point_x[int(text)]) < 0.11 for x, text in loss["xticks"])
    # y, log scale: powers of ten within the values' range
    values = [float(text) for _, text in loss["yticks"]]
    assert 2 <= len(values) <= 5 and all(1e-12 <= v <= 0.1 for v in values)
    assert all(math.log10(v) == round(math.log10(v)) for v in values)
    # y, linear: 3-5 round values within the range, higher values further up
    ys, texts = zip(*seconds["yticks"])
    values = [float(t) for t in texts]
    assert 3 <= len(values) <= 5 and all(0.0067 <= v <= 0.0667 for v in values)
    assert list(ys) == sorted(ys, reverse=True) and values == sorted(values)
    assert all(seconds["top"] <= y - 4 <= seconds["bottom"] + 0.1 for y in ys)


def test_nice_ticks_are_round_and_few():
    from caffe2ckpt.prefect.chart import nice_ticks

    assert nice_ticks(0, 12, 8, least_step=1) == [0, 2, 4, 6, 8, 10, 12]
    assert nice_ticks(0.0067, 0.067, 5) == [0.02, 0.04, 0.06]
    assert nice_ticks(43, 429, 5) == [100, 200, 300, 400]
    assert nice_ticks(2.75, 2.75, 5) == [2.75]  # one value: one tick
    assert nice_ticks(0, 1, 8, least_step=1) == [0, 1]  # whole epochs only


def test_markers_cross_every_panel_at_their_epoch_and_are_labelled():
    from caffe2ckpt.prefect.chart import Marker

    series = [Series("loss", [(e, 1.0 / e) for e in range(1, 9)]),
              Series("save seconds", [(e, 0.1) for e in range(0, 9)])]
    markers = [Marker(5, "resumed", "attempt 2 resumed"), Marker(6, "failed", "attempt 1 <b>")]
    svg = chart_svg(series, markers)
    root = ET.fromstring(svg)
    point_x = {e: x for e, (x, _) in zip(range(0, 9), points_of(svg)[1])}
    lines = [ln for ln in root.iter(f"{SVG}line") if "marker" in (ln.get("class") or "")]
    for marker in markers:
        mine = [ln for ln in lines if ln.get("class") == f"marker {marker.kind}"]
        assert len(mine) == 2  # one per panel
        assert all(abs(float(ln.get("x1")) - point_x[marker.epoch]) < 0.11 for ln in mine)
    labels = {t.text for t in root.iter(f"{SVG}text") if "marker-label" in (t.get("class") or "")}
    assert labels == {"attempt 2 resumed", "attempt 1 <b>"}  # escaped, still the text
    assert not list(root.iter(f"{SVG}b"))
    # a marker past the last saved epoch widens the shared axis to it
    wide = panels_of(chart_svg(series, [Marker(12, "failed", "save failed")]))
    assert wide[0]["xticks"][-1][1] == "12"


def _writer(count, rid="e5864d48-0000-4000-8000-000000000001", name="eminent-doberman"):
    return {"flow_run_id": rid, "flow_run_name": name, "run_count": count}


def test_the_summary_marks_where_runs_resumed_and_attempts_failed():
    from caffe2ckpt.prefect.chart import Marker
    from caffe2ckpt.prefect.summary import Summary, chart_markers, summary_markdown

    other = _writer(1, rid="1a2b3c4d-0000-4000-8000-000000000002", name="crimson-otter")

    def row(writer, status="committed"):
        return {"status": status, "values": {"loss": 1.0}, "seconds": 0.1, "MB/s": 1.0,
                "writer": writer}

    # another run wrote 0-3; this run resumed from 3, attempt 1 failed after committing 5,
    # attempt 2 resumed from 5; a save of attempt 2 failed at epoch 8
    rows = {e: row(other) for e in range(4)} | {e: row(_writer(1)) for e in (4, 5)}
    rows |= {6: row(_writer(2)), 7: row(_writer(2)), 8: row(None, "FAILED: disk full")}
    summary = Summary(job="j", this_run=_writer(2), start=5, target=9, resumed=(5, _writer(1)))
    assert chart_markers(rows, summary) == [
        Marker(3, "resumed", "attempt 1 resumed"), Marker(5, "resumed", "attempt 2 resumed"),
        Marker(6, "failed", "attempt 1 failed"), Marker(8, "failed", "save failed")]
    # seen from a later flow run: the other run's resume is named
    assert Marker(3, "resumed", "eminent-doberman resumed") in chart_markers(rows)
    # a retry that resumed but saved nothing yet still shows both
    fresh = Summary(job="j", this_run=_writer(2), start=5, target=9, resumed=(5, _writer(1)))
    early = {e: row(_writer(1)) for e in range(6)}
    assert chart_markers(early, fresh) == [Marker(5, "resumed", "attempt 2 resumed"),
                                           Marker(6, "failed", "attempt 1 failed")]
    # attempt 2 resumed epoch 6 from worker memory (storage held 5) and committed it: one
    # marker, where it resumed, not also where the epoch it committed first was saved from
    memory = Summary(job="j", this_run=_writer(2), start=6, target=9, resumed=(6, _writer(1)),
                     memory="epoch 6 from worker memory; storage holds epoch 5")
    mem_rows = {e: row(_writer(1)) for e in (0, 5)} | {e: row(_writer(2)) for e in (6, 7)}
    assert chart_markers(mem_rows, memory) == [Marker(6, "resumed", "attempt 2 resumed"),
                                               Marker(7, "failed", "attempt 1 failed")]
    assert "- **Resumed** epoch 6 from worker memory; storage holds epoch 5\n" in \
        summary_markdown(memory, mem_rows, epoch=7, final=False)
    # a fresh start, one attempt: no markers
    assert chart_markers(early, Summary(job="j", this_run=_writer(1), start=0, target=9)) == []
    # the summary's chart carries them
    text = summary_markdown(summary, rows, epoch=8, final=False)
    svg = base64.b64decode(text.partition("base64,")[2].partition(")")[0]).decode()
    labels = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")
              if "marker-label" in (t.get("class") or "")]
    assert labels == ["attempt 1 resumed", "attempt 2 resumed", "attempt 1 failed", "save failed"]
