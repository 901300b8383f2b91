"""The storage and resume protocol on object storage: a real S3-protocol server (moto's server
mode) on 127.0.0.1, reached through s3fs. No renames are needed for first saves, and commit
records are created with an exclusive PUT (If-None-Match)."""

from __future__ import annotations

import numpy as np
import pytest

from caffe2ckpt import (
    CheckpointCorruptedError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
)
from caffe2ckpt.commit import CommitRecord, write_record
from caffe2ckpt.example import InjectedFailure, build_job
from caffe2ckpt.location import Location
from caffe2ckpt.metadata import ZarrMetadataHandler

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

pytestmark = pytest.mark.slow
NODES = ["trainer_0", "trainer_1"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(storage_options, bucket) for a fresh bucket on a moto server on 127.0.0.1."""
    mp = pytest.MonkeyPatch()
    for key, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        mp.setenv(key, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "anon": False,
               "skip_instance_cache": True}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("ckpt-bucket")
    yield options, "ckpt-bucket"
    server.stop()
    mp.undo()


def manager(options, url: str, **kw) -> MultiNodeCheckpointManager:
    return MultiNodeCheckpointManager(url, storage_options=options,
                                      metadata_handler=ZarrMetadataHandler(), **kw)


def snapshot(session) -> dict:
    return {n: {k: v.tobytes() for k, v in session.workspace(n).items()} for n in NODES}


def test_train_fail_resume_bit_identical_on_s3(s3, tmp_path):
    options, bucket = s3
    url = f"s3://{bucket}/resume"
    with pytest.raises(InjectedFailure):
        JobRunner(build_job(4, fail_at_epoch=3), manager(options, url)).train(LocalSession())
    runner, session = JobRunner(build_job(4), manager(options, url)), LocalSession()
    assert runner.train(session) == 4 and runner.resumed_from == 2
    reference = LocalSession()
    JobRunner(build_job(4), MultiNodeCheckpointManager(str(tmp_path / "ref"))).train(reference)
    assert snapshot(session) == snapshot(reference)
    store = manager(options, url).store
    assert store.latest_epoch(NODES) == 4
    for node in NODES:  # every committed epoch loads and verifies
        for epoch in range(5):
            assert "model/w" in store.load_node(node, epoch)


def test_records_are_created_exclusively_on_s3(s3):
    options, bucket = s3
    location = Location(f"s3://{bucket}/exclusive", options)
    record = CommitRecord(epoch=1, node="n", save_id="abc", nodes=["n"], nbytes=0, blob_count=0,
                          seconds=0.0)
    write_record(location, record)
    with pytest.raises(FileExistsError):
        write_record(location, record)


def test_resave_and_corruption_fallback_on_s3(s3):
    options, bucket = s3
    url = f"s3://{bucket}/resave"
    JobRunner(build_job(3), manager(options, url)).train(LocalSession())
    # an explicit resume from epoch 1 re-saves committed epochs 2 and 3 (copy-based move on S3)
    runner = JobRunner(build_job(3), manager(options, url), resume_from_epoch=1)
    assert runner.train(LocalSession()) == 3
    store = manager(options, url).store
    assert store.latest_epoch(NODES) == 3
    fs = s3fs.S3FileSystem(**options)
    chunk = sorted(p for p in fs.find(f"{bucket}/resave/trainer_1.3") if "/c." in p)[0]
    data = bytearray(fs.cat_file(chunk))
    data[0] ^= 1
    fs.pipe_file(chunk, bytes(data))
    with pytest.raises(CheckpointCorruptedError) as info:
        store.load_node("trainer_1", 3)
    assert (info.value.node, info.value.epoch) == ("trainer_1", 3)
    runner, session = JobRunner(build_job(4), manager(options, url)), LocalSession()
    assert runner.train(session) == 4 and runner.resumed_from == 2
    assert np.isfinite(session.workspace("trainer_0")["model/w"]).all()
