"""The package's layer contract (pyproject.toml, ``[tool.importlinter]``): each layer imports only
its own layer and the ones below, and zarr, fsspec, prefect and distributed are each imported in
one place. import-linter checks the real import graph, so a new import across a boundary fails
here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_graph_keeps_every_contract():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint is not None, "import-linter is part of the test extra"
    out = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_no_import_cycle_inside_the_store():
    """store/'s subpackages import downwards (the layers contract); this also holds inside each
    of them: no module of store/ imports, even indirectly, one that imports it."""
    import grimp

    graph = grimp.build_graph("caffe2ckpt", cache_dir=None)
    store = sorted(m for m in graph.modules if m.startswith("caffe2ckpt.store."))
    cycles = [(a, b) for a in store for b in graph.find_modules_directly_imported_by(a)
              if b.startswith("caffe2ckpt.store.") and b != a
              and graph.chain_exists(importer=b, imported=a)]
    assert cycles == []
