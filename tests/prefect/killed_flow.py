"""A flow run waiting to be killed with SIGKILL, on caffe2ckpt's temporary server (run as a
subprocess by ``test_orphans.py``): ``python killed_flow.py``.

Its node task runs, named as :class:`~caffe2ckpt.prefect.PrefectSession` names them: one
finished (``init[trainer_0]``), one running for ten minutes (``epoch_group[trainer_0] e7``) and
one that never starts (``epoch_group[trainer_1] e7`` waits for the running one).
"""

from __future__ import annotations

import time

from prefect import flow
from prefect.utilities.annotations import quote

from caffe2ckpt.prefect import temporary_server
from caffe2ckpt.prefect.orphans import claim_and_sweep
from caffe2ckpt.prefect.session import _labelled
from caffe2ckpt.workspace import WorkspaceType


def nap(node: str, steps: list[float], workspace_type: WorkspaceType) -> list[float]:
    """A node session's ``run_node`` whose steps are seconds to sleep."""
    time.sleep(sum(steps))
    return steps


def submit(group: str, node: str, seconds: float, **options):
    label = f"{group}[{node}]" + (" e7" if group == "epoch_group" else "")
    return _labelled(group, label).submit(label, quote(nap), node, quote([seconds]),
                                          WorkspaceType.PRIVATE, **options)


@flow(name="killed-mid-epoch")
def killed_mid_epoch() -> None:
    claim_and_sweep()  # as run_job does: this process's <host>:<pid> on the flow run
    submit("init", "trainer_0", 0).wait()
    running = submit("epoch_group", "trainer_0", 600)
    submit("epoch_group", "trainer_1", 0, wait_for=[running])
    running.wait()


if __name__ == "__main__":
    with temporary_server():
        killed_mid_epoch()
