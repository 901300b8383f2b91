"""Screenshots of caffe2ckpt's artifacts in the Prefect UI, taken by headless Chromium.

    python docs/ui/screenshots.py [--out docs/ui] [--epochs 12] [--prefect-home DIR]

Starts a real ``prefect server`` (with its UI) on a free port of 127.0.0.1 with a home of its
own (``--prefect-home``: that folder, kept, so the next run's server finds its database
migrated and starts sooner), runs the example's failure demo against it
(``flows/regression.py --fail-at-epoch``: attempt 1 fails, attempt 2 resumes, so the summary
says why attempt 2 ran and its chart marks both) in a temporary folder, checkpointing to the
relative ``checkpoints/regression`` so that no machine's temporary path shows in the pages,
then opens the flow run's summary, checkpoints and progress artifact pages in Chromium and
saves a PNG of each (``summary.png``, ``checkpoints.png``, ``progress.png``) in ``--out``; then
registers the Checkpoint Storage block type, saves one such block, and saves the Event Feed
(``events.png``: the run's ``caffe2ckpt.epoch.committed`` events) and the block's page in the
UI's Blocks section (``blocks.png``: its URL shown, its storage options masked, the secret
nowhere). It checks what the browser rendered, not what was sent: the summary page must show
the chart (an ``<img>`` whose source is an SVG data URL and whose alt text starts with
``caffe2ckpt-chart``), the table page a table whose first row is the newest epoch, the progress
page the epoch against the target.
Exits 1 naming what is missing, 2 when no Chromium is found (``--chromium PATH`` or one of
``chromium``, ``chromium-browser``, ``google-chrome`` on PATH; Debian: ``apt-get install
chromium``). ``tests/prefect/test_ui_screenshots.py`` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# Relative to the flow's working folder (a temporary one): the pages then show this neutral
# path, the example's default, rather than where the temporary folder happened to be.
CHECKPOINTS = "checkpoints/regression"
CHART = re.compile(r'<img[^>]*alt="caffe2ckpt-chart[^"]*"[^>]*src="data:image/svg\+xml;base64,'
                   r'|<img[^>]*src="data:image/svg\+xml;base64,[^"]*"[^>]*alt="caffe2ckpt-chart')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None):
    request = urllib.request.Request(
        url + path, data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def wait_healthy(api_url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if api(api_url, "/health") is True:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the Prefect server at {api_url} did not answer within {timeout:.0f} s")


class Browser:
    """Headless Chromium from the command line: a screenshot, or the DOM after the page's
    scripts ran (``--virtual-time-budget`` lets the UI fetch from the API and render)."""

    def __init__(self, executable: str, profile: Path) -> None:
        self.base = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                     "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                     f"--user-data-dir={profile}", "--virtual-time-budget=20000",
                     "--window-size=1600,1100"]

    def dom(self, url: str) -> str:
        return subprocess.run([*self.base, "--dump-dom", url], capture_output=True, text=True,
                              timeout=120).stdout

    def screenshot(self, url: str, png: Path) -> None:
        subprocess.run([*self.base, f"--screenshot={png}", url], capture_output=True,
                       timeout=120, check=True)


@contextlib.contextmanager
def prefect_server(work: Path, home: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A real ``prefect server`` on a free port of 127.0.0.1 with its home in ``home`` and its
    log in ``work``: yields its API URL and the environment that points a flow at it; stopped
    at the end."""
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api_url,
           "PREFECT_UI_API_URL": api_url, "PREFECT_UI_URL": f"http://127.0.0.1:{port}",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    with open(work / "server.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        wait_healthy(api_url)
        yield api_url, env
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def first_row_epoch(dom: str) -> int | None:
    """The epoch in the first cell of the rendered table's first body row."""
    body = dom.partition("<tbody")[2]
    cell = re.search(r"<td[^>]*>(.*?)</td>", body, re.S)
    text = re.sub(r"<[^>]+>", "", cell.group(1)).strip() if cell else ""
    return int(text) if text.isdigit() else None


def checks(epochs: int) -> dict[str, tuple[str, object]]:
    """artifact kind -> (what must be rendered, its check on the page's DOM)."""
    return {
        "summary": ("the chart image (caffe2ckpt-chart, an SVG data URL) and why attempt 2 ran",
                    lambda dom: bool(CHART.search(dom)) and "Attempt 2" in dom),
        "checkpoints": (f"the checkpoint table, newest epoch ({epochs}) first",
                        lambda dom: first_row_epoch(dom) == epochs),
        "progress": (f"the epoch against the target (Epoch {epochs} of {epochs})",
                     lambda dom: f"Epoch {epochs} of {epochs}" in dom),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "ui")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--chromium", default=None, metavar="PATH")
    parser.add_argument("--prefect-home", type=Path, default=None, metavar="DIR",
                        help="the server's home, kept (default: a temporary one)")
    args = parser.parse_args(argv)
    chromium = args.chromium or next(filter(None, map(shutil.which, BROWSERS)), None)
    if chromium is None:
        print(f"no Chromium found (tried {', '.join(BROWSERS)}; Debian: apt-get install "
              "chromium)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="caffe2ckpt-ui-") as tmp:
        work = Path(tmp)
        with prefect_server(work, args.prefect_home or work / "home") as (api_url, env):
            run = subprocess.run(
                [sys.executable, str(REPO / "flows" / "regression.py"), "--checkpoint-url",
                 CHECKPOINTS, "--epochs", str(args.epochs), "--fail-at-epoch",
                 str(max(1, args.epochs // 2))], env=env, cwd=work, capture_output=True,
                text=True, timeout=600)
            if run.returncode != 0:
                print(run.stdout, run.stderr, sep="\n", file=sys.stderr)
                return 1
            runs = api(api_url, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
            artifacts = api(api_url, "/artifacts/filter",
                            {"artifacts": {"flow_run_id": {"any_": [runs[0]["id"]]}}})
            browser = Browser(chromium, work / "profile")
            missing = prefect_pages(api_url, env, work, browser, args.out)
            for kind, (what, check) in checks(args.epochs).items():
                found = [a for a in artifacts if (a["key"] or "").endswith(f"-{kind}")]
                if len(found) != 1:
                    missing.append(f"{kind}: {len(found)} artifacts with a key ending -{kind}")
                    continue
                page = f"{api_url.removesuffix('/api')}/artifacts/artifact/{found[0]['id']}"
                for _ in range(3):  # the UI renders after its API calls: give it three tries
                    if check(browser.dom(page)):
                        break
                else:
                    missing.append(f"{kind}: {page} does not show {what}")
                browser.screenshot(page, args.out / f"{kind}.png")
                print(f"{kind}: {args.out / f'{kind}.png'} ({page})")
    for line in missing:
        print(f"missing: {line}", file=sys.stderr)
    return 1 if missing else 0


BLOCK = ("from caffe2ckpt.prefect import CheckpointStorage; CheckpointStorage("
         "url='s3://checkpoints/regression', storage_options={'endpoint_url': "
         "'http://127.0.0.1:8333', 'key': 'demo', 'secret': 'demo-secret'})"
         ".save('nightly-checkpoints', overwrite=True)")


def prefect_pages(api_url: str, env: dict[str, str], work: Path, browser: Browser,
                  out: Path) -> list[str]:
    """The Event Feed right after the run (its newest events: the run's end and its last
    ``caffe2ckpt.epoch.committed``), then the Blocks page once a Checkpoint Storage block is
    registered and saved: screenshots ``events.png`` and ``blocks.png``; what is missing."""
    ui = api_url.removesuffix("/api")
    missing = _page(browser, f"{ui}/events?events=caffe2ckpt.epoch.committed",
                    out / "events.png", "the committed epochs",
                    lambda dom: "caffe2ckpt.epoch.committed" in dom)
    for argv in ([sys.executable, "-m", "prefect", "block", "register", "-m",
                  "caffe2ckpt.prefect.blocks"], [sys.executable, "-c", BLOCK]):
        subprocess.run(argv, env=env, cwd=work, capture_output=True, check=True, timeout=120)
    block = api(api_url, "/block_documents/filter", {"limit": 1})[0]
    return missing + _page(browser, f"{ui}/blocks/block/{block['id']}", out / "blocks.png",
                           "the Checkpoint Storage block, its secret masked",
                           lambda dom: "nightly-checkpoints" in dom and "Checkpoint Storage" in
                           dom and "********" in dom and "demo-secret" not in dom)


def _page(browser: Browser, page: str, png: Path, what: str, check) -> list[str]:
    """Screenshot ``page`` to ``png`` once it renders what ``check`` looks for."""
    for _ in range(3):
        if check(browser.dom(page)):
            break
    else:
        return [f"{png.stem}: {page} does not show {what}"]
    browser.screenshot(page, png)
    print(f"{png.stem}: {png} ({page})")
    return []


if __name__ == "__main__":
    sys.exit(main())
