"""Screenshots of the flow run graph of the example flow, taken by headless Chromium.

    pip install playwright    # once; this script only. Do NOT run `playwright install`:
                              # it drives the system Chromium (/usr/bin/chromium)
    python docs/ui/graph_screenshot.py [--out docs/ui/graph.png] [--epochs 100] [--expand 7]

Starts a real ``prefect server`` (with its UI) on a free port of 127.0.0.1 with a home of its
own, runs ``flows/regression.py --epochs N`` of ``--repo`` (default: this checkout; another
checkout, e.g. an older commit, gives the graph as it was) against it, prints what the graph-v2
API says (nodes, root nodes, nodes nested under another), and opens the flow run page in
Chromium through Playwright: the graph full screen (key ``f``), layout "Temporal sequence" (one
row per top-level task run), zoomed in with the mouse wheel until the bars' labels show, panned
so that epoch 0 is at the top left. It saves that view (the first 15-20 ``epoch N`` bars,
labelled) in ``--out``, then expands epoch ``--expand`` (a click on its bar's chevron, found by
its colour in the screenshot) and saves that view, its nested task runs labelled, in ``--out``
with ``-epoch`` added to its name (``graph-epoch.png``). Exits 1 when the flow fails, 2 when no
Chromium or no Playwright is found.
"""

from __future__ import annotations

import argparse
import base64
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from screenshots import BROWSERS, REPO, api, prefect_server  # noqa: E402

# The graph is a WebGL canvas: its bars are found by their colour (a completed run's green) in a
# screenshot, decoded in the page. Returns the boxes of green runs at least 8 px wide, stacked.
FIND_BARS = """async (png) => {
  const img = new Image(); img.src = 'data:image/png;base64,' + png; await img.decode();
  const canvas = new OffscreenCanvas(img.width, img.height), ctx = canvas.getContext('2d');
  ctx.drawImage(img, 0, 0);
  const d = ctx.getImageData(0, 0, img.width, img.height).data, bars = [];
  const green = (x, y) => { const i = 4 * (y * img.width + x);
    return d[i + 1] > 120 && d[i + 1] - d[i] > 60 && d[i + 1] - d[i + 2] > 40; };
  for (let y = 0; y < img.height; y++) for (let x = 0; x < img.width; x++) {
    if (!green(x, y)) continue;
    const s = x; while (x < img.width && green(x, y)) x++;
    if (x - s < 8) continue;
    const bar = bars.find(b => b.y1 === y - 1 && s < b.x1 && x > b.x0);
    if (bar) Object.assign(bar, {y1: y, x0: Math.min(bar.x0, s), x1: Math.max(bar.x1, x)});
    else bars.push({x0: s, x1: x, y0: y, y1: y});
  }
  return bars;
}"""


def graph_summary(api_url: str, flow_run_id: str) -> tuple[str, list[str]]:
    """What the graph-v2 API holds for the run (nodes by kind, roots, nested nodes), and the
    labels of the top-level nodes in start order: the rows of the "Temporal sequence" layout."""
    graph, count = {"nodes": []}, -1
    for _ in range(30):  # task runs reach the server after the flow ends: wait for the last
        graph = api(api_url, f"/flow_runs/{flow_run_id}/graph-v2")
        if len(graph["nodes"]) == count:
            break
        count = len(graph["nodes"])
        time.sleep(2)
    nodes = [node for _, node in graph["nodes"]]
    nested = sum(1 for node in nodes if node["encapsulating"])
    kinds = Counter(node["kind"] for node in nodes)
    top = sorted((n for n in nodes if not n["encapsulating"]), key=lambda n: n["start_time"])
    summary = (f"{len(nodes)} nodes ({dict(kinds)}), {len(graph['root_node_ids'])} root nodes, "
               f"{nested} nested under another, {len(nodes) - nested} shown before expanding")
    return summary, [node["label"] for node in top]


def run_flow(repo: Path, work: Path, env: dict[str, str], epochs: int) -> None:
    run = subprocess.run(
        [sys.executable, str(repo / "flows" / "regression.py"), "--checkpoint-url",
         str(work / "checkpoints"), "--epochs", str(epochs)],
        env={**env, "PYTHONPATH": str(repo)}, cwd=work, capture_output=True, text=True,
        timeout=1200)
    if run.returncode != 0:
        print(run.stdout, run.stderr, sep="\n", file=sys.stderr)
        raise SystemExit(f"flows/regression.py of {repo} failed (exit {run.returncode})")


def rows(page) -> list[dict]:
    """The bars on screen, top to bottom, below the time axis and above the controls."""
    png = base64.b64encode(page.screenshot()).decode()
    height = page.viewport_size["height"]
    bars = [b for b in page.evaluate(FIND_BARS, png)
            if b["y1"] - b["y0"] >= 3 and b["y0"] > 30 and b["y1"] < height - 40]
    return sorted((b for b in bars if not any(o["y0"] < b["y0"] and b["y1"] <= o["y1"]
                                                 for o in bars)), key=lambda b: b["y0"])


def drag(page, dx: float, dy: float) -> None:
    page.mouse.move(800, 500)
    page.mouse.down()
    page.mouse.move(800 + dx, 500 + dy, steps=10)
    page.mouse.up()
    page.wait_for_timeout(800)


def screenshots(chromium: str, url: str, out: Path, expand_row: int | None) -> list[Path]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium,
                                             args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(url)
        page.locator(".run-graph canvas").wait_for()
        page.wait_for_timeout(4000)  # the graph fetches its nodes, then lays them out
        page.keyboard.press("f")  # full screen
        page.locator(".run-graph-settings").first.click()
        page.get_by_text("Temporal sequence", exact=True).click()
        page.keyboard.press("Escape")
        page.wait_for_timeout(2500)
        page.mouse.move(10, 40)  # zoom in on the top left, where the run starts
        for _ in range(10):
            page.mouse.wheel(0, -100)
            page.wait_for_timeout(300)
        drag(page, 150, 150)
        first = rows(page)[0]
        drag(page, 80 - first["x0"], 70 - first["y0"])  # the first row at (80, 70)
        page.screenshot(path=out)
        saved = [out]
        if expand_row is not None:
            bar = rows(page)[expand_row]
            page.mouse.click(bar["x0"] + 9, (bar["y0"] + bar["y1"]) / 2)  # its chevron
            page.wait_for_timeout(2500)
            saved.append(out.with_name(f"{out.stem}-epoch{out.suffix}"))
            page.screenshot(path=saved[-1])
        browser.close()
    return saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "ui" / "graph.png")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--expand", type=int, default=7, metavar="EPOCH",
                        help="the epoch to expand in the second screenshot (-1: none)")
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--chromium", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    chromium = args.chromium or next(filter(None, map(shutil.which, BROWSERS)), None)
    if chromium is None:
        print(f"no Chromium found (tried {', '.join(BROWSERS)})", file=sys.stderr)
        return 2
    try:
        import playwright  # noqa: F401
    except ImportError:
        print("no Playwright: pip install playwright (not `playwright install`)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="caffe2ckpt-graph-") as tmp:
        work = Path(tmp)
        with prefect_server(work) as (api_url, env):
            run_flow(args.repo.resolve(), work, env, args.epochs)
            runs = api(api_url, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
            summary, top = graph_summary(api_url, runs[0]["id"])
            print(f"graph of {args.repo} ({args.epochs} epochs): {summary}")
            expand = f"epoch {args.expand}"
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page = f"{api_url.removesuffix('/api')}/runs/flow-run/{runs[0]['id']}"
            for png in screenshots(chromium, page, args.out,
                                   top.index(expand) if expand in top else None):
                print(f"graph: {png} ({page})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
