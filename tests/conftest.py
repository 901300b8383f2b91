"""Shared fixtures: checkpoint prefixes on real filesystems (memory:// and a local temp dir)."""

from __future__ import annotations

import os
import tempfile
import uuid

# Never touch a developer's ~/.prefect or their server, and keep Prefect quiet and offline.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="caffe2ckpt-prefect-home-")
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import fsspec
import pytest


@pytest.fixture
def memory_fs():
    """fsspec's process-global memory filesystem, emptied before and after the test."""
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    yield fs
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")


@pytest.fixture(params=["memory", "local"])
def prefix(request, tmp_path, memory_fs) -> str:
    """A fresh checkpoint prefix: ``memory://...`` or a local directory."""
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    return str(tmp_path / "ckpt")
