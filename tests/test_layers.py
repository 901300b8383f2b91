"""The package's layer contract (pyproject.toml, ``[tool.importlinter]``): each layer imports only
its own layer and the ones below, and zarr, fsspec, prefect and distributed are each imported in
one place. import-linter checks the real import graph, so a new import across a boundary fails
here."""

from __future__ import annotations

import ast
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


# what reads a stored group, chain or share itself; outside store/read/ only save.py's
# SaveReader (and what it offers) may be used
BYTE_READERS = {"read_node", "read_arrays", "row_reads", "row_calls", "read_chained",
                "read_cut", "Reshard", "destination"}


def test_every_reader_reads_through_the_one_read_path():
    """Restore, elastic restore, read_epoch, materialize, consolidation, zarr_store and the
    command line read stored bytes through ``store/read/save.py``: no module outside
    ``store/read/`` imports what reads groups, chains or shares itself."""
    offenders = []
    for path in sorted((ROOT / "caffe2ckpt").rglob("*.py")):
        if path.parent == ROOT / "caffe2ckpt" / "store" / "read":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.module is None:
                continue
            names = {a.name for a in node.names}
            if node.module.startswith("caffe2ckpt.store.read."):
                bad = names & BYTE_READERS
            else:
                bad = names & {"group", "chain", "reshard"} if node.module == (
                    "caffe2ckpt.store.read") else set()
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in sorted(bad)]
    assert offenders == []
