"""Task functions of a flow file loaded the way a Prefect deployment loads its entrypoint (as a
module named after the file, its folder on this process's ``sys.path`` only) and of a module
beside it reach Dask workers that cannot import either, by value; an exception class of the
file comes back as itself (the end-to-end deployment is in tests/prefect/test_dask_deployment.py).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import uuid

import pytest

from caffe2ckpt.workspace import WorkspaceType

pytest.importorskip("distributed")
from caffe2ckpt.dask import DaskSession
from caffe2ckpt.dask.scripts import cannot_import, own_modules

pytestmark = pytest.mark.slow


def load_entrypoint(folder, name: str, monkeypatch):
    """``folder/name.py`` as Prefect loads a deployment's entrypoint file."""
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_a_flow_files_functions_reach_workers_that_cannot_import_it(tmp_path, dask_client,
                                                                     monkeypatch):
    script, beside = f"flowfile_{uuid.uuid4().hex[:8]}", f"beside_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{beside}.py").write_text("def double(ws):\n    ws['w'] = ws['w'] * 2\n")
    (tmp_path / f"{script}.py").write_text(textwrap.dedent(f"""
        import numpy as np
        from {beside} import double

        class Boom(Exception):
            pass

        def fill(ws):
            ws["w"] = np.full(3, 21, np.int64)

        def boom(ws):
            raise Boom("from the flow file")
        """))
    module = load_entrypoint(tmp_path, script, monkeypatch)
    monkeypatch.setitem(sys.modules, beside, sys.modules[beside])  # removed after the test
    assert {script, beside} <= set(own_modules())
    assert dask_client.run(cannot_import, [script, beside, "caffe2ckpt"]) == {
        w: [script, beside] for w in dask_client.scheduler_info()["workers"]}
    with DaskSession(dask_client) as session:
        steps = [(module.fill, (), False), (module.double, (), False)]
        session.run_node("trainer_0", steps, WorkspaceType.GLOBAL)
        assert session.workspace("trainer_0")["w"].tolist() == [42, 42, 42]
        with pytest.raises(module.Boom, match="from the flow file"):
            session.run_node("trainer_0", [(module.boom, (), False)], WorkspaceType.GLOBAL)
