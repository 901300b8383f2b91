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
    assert "loss" in texts and "epoch 1" in texts and "epoch 5" in texts and "4" in texts


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
    assert base64.b64decode(url.rstrip(")")).decode() == chart_svg([Series("loss", [(1, 1.0), (2, 0.5)])])
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
    from caffe2ckpt.store.records import CommitRecord

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
