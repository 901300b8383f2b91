"""The artifacts as a user sees them: ``docs/ui/screenshots.py`` runs the failure demo on a real
``prefect server`` and checks, in headless Chromium, that the summary page shows the chart and
why attempt 2 ran, the table page the newest epoch first and the progress page the epoch
against the target, the Event Feed the committed epochs and a Checkpoint Storage block's page
its storage options masked; then it saves the screenshots (``docs/ui/*.png`` are such
screenshots)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import prefectdb

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docs" / "ui" / "screenshots.py"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def test_the_artifact_pages_render_the_chart_the_table_and_the_progress(tmp_path):
    if not any(shutil.which(b) for b in BROWSERS):
        pytest.skip(f"no Chromium on this machine (none of {', '.join(BROWSERS)} on PATH; "
                    "Debian: apt-get install chromium, which .ci/run tries)")
    home = prefectdb.seed_home(tmp_path / "home")  # the server starts on a migrated database
    out = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--epochs", "6",
                          "--prefect-home", str(home)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for kind in ("summary", "checkpoints", "progress", "events", "blocks"):
        png = (tmp_path / f"{kind}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, (kind, len(png))
