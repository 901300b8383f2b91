"""Exclusive creates whose answer is lost, end to end on both S3 servers (moto and SeaweedFS).

tests/dropproxy.py sits between s3fs and the server: the armed request is forwarded and
applied, its answer is dropped, and s3fs/botocore retry it on their own. The retried
``If-None-Match`` PUT is refused (412), although the object is the writer's own: moto's answer
makes s3fs say ``FileExistsError``, SeaweedFS's an ``OSError(EINVAL)``. A create reads the
object back and takes its own bytes as success (``Location.create_exclusive``), so:

- a commit record answered late is committed and reported saved (review of 1aeae9c, defect 6a:
  it was in ``failed_saves`` and yet the resume point);
- a group's ``zarr.json`` answered late keeps its Caffe2 path ``<node>.<epoch>`` (defect 11:
  the save moved to ``<node>.<epoch>.<save id>``, leaving a leftover gc never removed);
- a run-log entry answered late is the run's claim (it took the next number: two entries).

Everything goes through the public API (JobRunner, MultiNodeCheckpointManager,
ZarrMetadataHandler, the ``caffe2ckpt`` command) on ``s3://`` URLs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager, StepCheckpointManager
from caffe2ckpt.cli import main
from caffe2ckpt.example import build_job
from caffe2ckpt.metadata import ZarrMetadataHandler
from tests.dropproxy import DropProxy

pytestmark = pytest.mark.slow
NODES = ["trainer_0", "trainer_1"]
EPOCHS = 3


@pytest.fixture
def proxied(s3_server, s3_bucket):
    """(proxy, url, storage options reaching the server through the proxy); plain ``s3://``
    URLs (the CLI, the handler) reach the server directly."""
    with DropProxy(s3_server.endpoint) as proxy:
        options = {**s3_server.options(endpoint_url=proxy.endpoint), "skip_instance_cache": True}
        yield proxy, f"s3://{s3_bucket}/run", options


def train(url: str, options: dict) -> JobRunner:
    cm = MultiNodeCheckpointManager(url, storage_options=options,
                                    metadata_handler=ZarrMetadataHandler())
    runner = JobRunner(build_job(EPOCHS, len(NODES), batches_per_epoch=2), cm)
    assert runner.train(LocalSession()) == EPOCHS
    return runner


def last_epoch(url: str) -> int | None:
    handler = ZarrMetadataHandler()
    handler.set_params(db_prefix=url, db_type="zarr", node_names=NODES)
    return handler.last_epoch()


def cli(capsys, *argv: str) -> dict:
    capsys.readouterr()  # the job's own output
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, (code, out, err)
    return json.loads(out)


def names(s3_server, url: str, sub: str = "") -> list[str]:
    root = url.removeprefix("s3://") + (f"/{sub}" if sub else "")
    return sorted(p.rsplit("/", 1)[-1] for p in s3_server.filesystem().ls(root, detail=False))


def test_a_commit_record_answered_late_is_committed_and_reported_saved(s3_server, proxied):
    proxy, url, options = proxied
    rule = proxy.drop("PUT", r"/run/_commits/000000000002\.trainer_1\.")
    runner = train(url, options)
    assert len(rule.dropped) == 1 and rule.dropped[0].endswith(" -> 200"), rule.dropped
    assert runner.failed_saves == [] and 2 in runner.saved_epochs, (runner.failed_saves,
                                                                   runner.saved_epochs)
    assert last_epoch(url) == EPOCHS
    records = [n for n in names(s3_server, url, "_commits") if n.startswith("000000000002.")]
    assert len(records) == len(NODES), records  # one save of epoch 2, no second one


def test_a_group_answered_late_keeps_its_path_and_leaves_nothing_behind(s3_server, proxied,
                                                                       capsys):
    proxy, url, options = proxied
    rule = proxy.drop("PUT", r"/run/trainer_0\.2/zarr\.json$")
    runner = train(url, options)
    assert len(rule.dropped) == 1 and rule.dropped[0].endswith(" -> 200"), rule.dropped
    assert runner.failed_saves == [] and 2 in runner.saved_epochs
    doc = cli(capsys, "ls", url)
    (row,) = [r for r in doc["epochs"] if r["epoch"] == 2]
    assert row["state"] == "committed" and row["paths"]["trainer_0"] == f"{url}/trainer_0.2"
    assert doc["leftovers"] == []
    assert not [n for n in names(s3_server, url) if n.startswith("trainer_0.2.")]
    cli(capsys, "gc", url, "--min-age", "0", "--yes")
    after = cli(capsys, "ls", url)
    assert after["leftovers"] == [] and after["committed_epochs"] == doc["committed_epochs"]
    groups = {f"{n}.{e}" for n in NODES for e in doc["committed_epochs"]}
    assert set(names(s3_server, url)) == groups | {"_commits", "_hints", "_runs"}


def test_a_run_log_entry_answered_late_is_the_claim(s3_server, proxied):
    proxy, url, options = proxied
    rule = proxy.drop("PUT", r"/run/_runs/000000000001\.json$")
    runner = train(url, options)
    assert len(rule.dropped) == 1 and rule.dropped[0].endswith(" -> 200"), rule.dropped
    assert runner.failed_saves == [] and runner.saved_epochs[-1] == EPOCHS
    # no second entry (and the run's mark that it committed)
    assert names(s3_server, url, "_runs") == ["000000000001.committed.json", "000000000001.json"]
    records = names(s3_server, url, "_commits")
    assert records and all(".g1-" in n for n in records), records  # saved by run 1


def test_a_chunk_answer_cut_part_way_is_read_again_and_restores_exactly(s3_server, proxied):
    """A restore reads each chunk straight into its array (fs/s3read.py): an answer that breaks
    off after some of its bytes were copied is read again from the start, like s3fs's own
    reads, and the array holds the stored bytes, not a mix."""
    proxy, url, options = proxied
    weights = np.random.default_rng(7).random(1 << 18)  # 2 MiB: one chunk file of its own
    with StepCheckpointManager(url, storage_options=options) as steps:
        steps.save(1, {"n": {"w": weights}})
    rule = proxy.drop("GET", r"/run/n\.1/w/c\.0$", sent=0.5)
    with StepCheckpointManager(url, storage_options=options) as steps:
        restored = steps.restore(1)
    assert len(rule.dropped) == 1 and rule.dropped[0].endswith(" -> 206"), rule.dropped
    np.testing.assert_array_equal(restored["n"]["w"], weights)


def test_a_changed_s3fs_api_falls_back_to_the_general_read_not_to_damage(s3_server, proxied,
                                                                         monkeypatch):
    """fs/s3read.py uses s3fs's coroutine API; if it behaves differently (a TypeError from a
    changed signature), the chunk is read the general way: a restore, not "damaged" epochs."""
    from caffe2ckpt.fs import s3read

    _, url, options = proxied
    weights = np.random.default_rng(8).random(1 << 18)
    with StepCheckpointManager(url, storage_options=options) as steps:
        steps.save(1, {"n": {"w": weights}})

    async def changed(*args, **kwargs):
        raise TypeError("read() takes 1 positional argument but 2 were given")

    monkeypatch.setattr(s3read, "_fill", changed)
    with StepCheckpointManager(url, storage_options=options) as steps:
        restored = steps.restore(1)
    np.testing.assert_array_equal(restored["n"]["w"], weights)
