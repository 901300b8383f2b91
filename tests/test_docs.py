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


def test_every_fence_opens_with_a_language_and_closes_bare():
    """A stray fence (a code fragment pasted outside its block) turns the rest of a page inside
    out, yet builds: every block opens with its language (``text`` for drawings and output) and
    closes with a bare fence."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        inside = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if not line.strip().startswith("```"):
                continue
            tag = line.strip()[3:]
            where = f"{page.relative_to(REPO)}:{number}"
            assert bool(tag) != inside, f"{where}: a fence that {'closes' if inside else 'opens'}" \
                                        f" a block must be {'bare' if inside else 'tagged'}"
            inside = not inside
        assert not inside, f"{page.relative_to(REPO)}: a block is never closed"


def test_every_image_under_docs_is_shown_by_a_page():
    text = "".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    images = [p for p in (REPO / "docs").rglob("*.png")]
    unused = [str(p.relative_to(REPO)) for p in images if p.name not in text]
    assert not unused, f"images no page shows (the site would copy them): {unused}"


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.MULTILINE | re.DOTALL)


def test_getting_started_shows_the_readmes_own_job_as_it_is():
    readme = next(b for b in _python_blocks(REPO / "README.md") if "def build_job" in b)
    assert readme in _python_blocks(REPO / "docs" / "getting-started.md")


def test_every_help_text_is_plain_text():
    for command in (["-m", "caffe2ckpt.example"], [str(REPO / "flows" / "regression.py")],
                    [str(REPO / "flows" / "evaluate.py")]):
        out = subprocess.run([sys.executable, *command, "--help"], capture_output=True,
                             text=True, timeout=120, check=True)
        assert "usage:" in out.stdout and "``" not in out.stdout, command
