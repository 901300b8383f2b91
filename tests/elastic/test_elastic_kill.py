"""SIGKILL during the first save after an elastic resume loses nothing: a job saved by 4 nodes
resumes on 2 in a subprocess that is killed inside its first save (once its first node's group
is written, once its first record is, once every record is); the 4-node epochs still load
bit-exact, and the job run again finishes bit-exact as an uninterrupted run does (resuming from
the 4-node epoch again, or from its own epoch when that one committed). ``gc`` then removes what
the killed save left and nothing else."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager, StepCheckpointManager
from caffe2ckpt.cli import main as cli_main
from tests.elastic.elasticjob import build, layout, reference, share

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import os, signal, sys
    sys.path.insert(0, sys.argv[3])
    from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager
    from caffe2ckpt.store.commit import protocol
    from tests.elastic.elasticjob import build, layout

    url, point = sys.argv[1], sys.argv[2]
    write_record, records = protocol.write_record, []

    def dying(location, record):
        if point == "group":  # the first node's group is written, its record is not
            os.kill(os.getpid(), signal.SIGKILL)
        write_record(location, record)
        records.append(record.node)
        if point == "record" or (point == "all" and len(records) == 2):
            os.kill(os.getpid(), signal.SIGKILL)

    if point != "none":
        protocol.write_record = dying
    JobRunner(build(2, 5), MultiNodeCheckpointManager(url, layout=layout())).train(LocalSession())
''')


def run(script: Path, url: str, point: str) -> int:
    return subprocess.run([sys.executable, str(script), url, point, str(REPO)],
                          capture_output=True, text=True, timeout=120).returncode


@pytest.mark.parametrize("point", ["group", "record", "all"])
def test_a_kill_in_the_first_save_after_a_reshard_loses_nothing(tmp_path, point):
    url = str(tmp_path / "ckpt")
    JobRunner(build(4, 3), MultiNodeCheckpointManager(url, layout=layout())).train(LocalSession())
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    assert run(script, url, point) == -9
    old = [f"trainer_{k}" for k in range(4)]
    with StepCheckpointManager(url, nodes=old, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [0, 1, 2, 3]
        for epoch in range(4):
            table, weights = reference(epoch)
            got = mgr.restore(epoch)
            assert all(got[n]["emb"].tobytes() == share(table, "range", k, 4).tobytes()
                       for k, n in enumerate(old))
            assert np.array_equal(got["trainer_3"]["w"], weights)
    assert run(script, url, "none") == 0
    new = ["trainer_0", "trainer_1"]
    with StepCheckpointManager(url, nodes=new, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [4, 5]
        table, weights = reference(5)
        got = mgr.restore(5)
        assert all(got[n]["emb"].tobytes() == share(table, "range", k, 2).tobytes()
                   for k, n in enumerate(new))
        assert np.array_equal(got["trainer_0"]["w"], weights)
    assert cli_main(["gc", url, "--min-age", "0", "--yes"]) == 0
    assert cli_main(["verify", url]) == 0
    with StepCheckpointManager(url, nodes=old, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [0, 1, 2, 3]  # no rule given: gc deletes no save
