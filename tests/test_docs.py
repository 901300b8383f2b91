"""The documentation site builds without a warning (a broken link, a missing or wrong
reference, a docstring naming a parameter the signature lacks fails ``.ci/run``), and its API
reference names every public name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import caffe2ckpt
import caffe2ckpt.dask
import caffe2ckpt.prefect

REPO = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                          str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").exists()


def test_the_front_page_gives_the_readmes_two_commands():
    readme = [line for line in (REPO / "README.md").read_text().splitlines()
              if line.startswith(("pip", "python"))][:2]
    front = (REPO / "docs" / "index.md").read_text()
    assert all(command in front for command in readme), readme


def test_the_api_reference_names_every_public_name():
    text = (REPO / "docs" / "reference.md").read_text()
    named = set(re.findall(r"^::: ([\w.]+)$", text, re.MULTILINE))
    public = {f"caffe2ckpt.{n}" for n in caffe2ckpt.__all__}
    public |= {f"caffe2ckpt.prefect.{n}" for n in caffe2ckpt.prefect.__all__}
    public |= {f"caffe2ckpt.dask.{n}" for n in caffe2ckpt.dask.__all__}
    assert named == public
