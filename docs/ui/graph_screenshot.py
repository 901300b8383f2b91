"""A screenshot of the flow run graph of the example flow, taken by headless Chromium.

    python docs/ui/graph_screenshot.py [--out docs/ui/graph.png] [--epochs 100] [--repo PATH]

Starts a real ``prefect server`` (with its UI) on a free port of 127.0.0.1 with a home of its
own, runs ``flows/regression.py --epochs N`` of ``--repo`` (default: this checkout; another
checkout, e.g. an older commit, gives the graph as it was) against it, prints what the graph-v2
API says (nodes, root nodes, nodes nested under another), and saves a PNG of the flow run page,
whose top is the graph, in ``--out``. Exits 1 when the flow fails, 2 when no Chromium is found.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from screenshots import BROWSERS, REPO, Browser, api, free_port, wait_healthy  # noqa: E402


def graph_summary(api_url: str, flow_run_id: str) -> str:
    """What the graph-v2 API holds for the run: nodes by kind, roots, nested nodes."""
    graph = api(api_url, f"/flow_runs/{flow_run_id}/graph-v2")
    nodes = [node for _, node in graph["nodes"]]
    nested = sum(1 for node in nodes if node["encapsulating"])
    kinds = Counter(node["kind"] for node in nodes)
    return (f"{len(nodes)} nodes ({dict(kinds)}), {len(graph['root_node_ids'])} root nodes, "
            f"{nested} nested under another, {len(nodes) - nested} shown before expanding")


def run_flow(repo: Path, work: Path, env: dict[str, str], epochs: int) -> None:
    run = subprocess.run(
        [sys.executable, str(repo / "flows" / "regression.py"), "--checkpoint-url",
         str(work / "checkpoints"), "--epochs", str(epochs)],
        env={**env, "PYTHONPATH": str(repo)}, cwd=work, capture_output=True, text=True,
        timeout=1200)
    if run.returncode != 0:
        print(run.stdout, run.stderr, sep="\n", file=sys.stderr)
        raise SystemExit(f"flows/regression.py of {repo} failed (exit {run.returncode})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "ui" / "graph.png")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--chromium", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    import shutil

    chromium = args.chromium or next(filter(None, map(shutil.which, BROWSERS)), None)
    if chromium is None:
        print(f"no Chromium found (tried {', '.join(BROWSERS)})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="caffe2ckpt-graph-") as tmp:
        work, port = Path(tmp), free_port()
        api_url = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_HOME": str(work / "home"), "PREFECT_API_URL": api_url,
               "PREFECT_UI_API_URL": api_url, "PREFECT_UI_URL": f"http://127.0.0.1:{port}",
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
        with open(work / "server.log", "wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                 "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            wait_healthy(api_url)
            run_flow(args.repo.resolve(), work, env, args.epochs)
            runs = api(api_url, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
            print(f"graph of {args.repo} ({args.epochs} epochs): "
                  f"{graph_summary(api_url, runs[0]['id'])}")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page = f"http://127.0.0.1:{port}/runs/flow-run/{runs[0]['id']}"
            Browser(chromium, work / "profile").screenshot(page, args.out)
            print(f"graph: {args.out} ({page})")
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
