"""Checkpoint prefixes from Prefect blocks (ours, RemoteFileSystem, prefect-aws's S3Bucket) on a
real S3 server, and a secret kept in a block that is then looked for everywhere a user could
see it: logs, artifacts, events, flow-run parameters, ``caffe2ckpt ls --json``, error messages
and every file under the prefix (commit records included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from uuid import UUID

import numpy as np
import pytest
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.filesystems import RemoteFileSystem
from prefect.settings import PREFECT_API_URL
from prefect_aws import AwsCredentials, S3Bucket

from caffe2ckpt import MultiNodeCheckpointManager, StepCheckpointManager, read_epoch
from caffe2ckpt.errors import CheckpointError, InvalidLocationError
from caffe2ckpt.fs.location import Location
from caffe2ckpt.prefect import CheckpointStorage
from tests.prefect.conftest import poll
from tests.prefect.eventfeed import event_feed
from tests.s3server import CREDENTIALS

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "flows"))
from regression import regression

SECRET = f"s3cr3t-{uuid.uuid4().hex}"  # what must never be shown
KEY = f"AKID{uuid.uuid4().hex[:12].upper()}"


def _items(block) -> dict[str, dict[str, np.ndarray]]:
    return {"a": {"w": np.arange(100_000.0), "b": np.ones(3)}}


def _round_trip(source) -> None:
    with StepCheckpointManager(source, handle_preemption=False) as mgr:
        mgr.save(0, _items(source))
    with StepCheckpointManager(source, handle_preemption=False) as mgr:
        assert np.array_equal(mgr.restore(0)["a"]["w"], np.arange(100_000.0))
    assert read_epoch(source, 0, "a", blobs=["b"])["b"].tolist() == [1.0, 1.0, 1.0]


def test_remote_file_system_and_s3_bucket_blocks_name_prefixes(moto_server):
    bucket = moto_server.new_bucket()
    endpoint = moto_server.endpoint
    _round_trip(RemoteFileSystem(basepath=f"s3://{bucket}/rfs",
                                 settings={"key": KEY, "secret": SECRET,
                                           "endpoint_url": endpoint}))
    s3_bucket = S3Bucket(bucket_name=bucket, bucket_folder="aws/run", credentials=AwsCredentials(
        aws_access_key_id=KEY, aws_secret_access_key=SECRET,
        aws_client_parameters={"endpoint_url": endpoint}))
    _round_trip(s3_bucket)
    s3_bucket.save("ckpt-s3-bucket", overwrite=True)
    with StepCheckpointManager("prefect-block://s3-bucket/ckpt-s3-bucket",
                               handle_preemption=False) as mgr:
        assert mgr.all_steps() == [0] and mgr.directory == f"s3://{bucket}/aws/run"


def test_an_s3_bucket_blocks_aws_profile_is_used_not_the_environments_keys(
        seaweedfs_server, tmp_path, monkeypatch):
    """The profile's keys write (SeaweedFS checks signatures; moto takes any key); the
    environment holds another identity's, valid and read-only, which must not be used."""
    bucket = seaweedfs_server.new_bucket()
    config = tmp_path / "aws-config"
    config.write_text(f"[profile ckpt-writer]\naws_access_key_id = {CREDENTIALS['key']}\n"
                      f"aws_secret_access_key = {CREDENTIALS['secret']}\n")
    reader = seaweedfs_server.options_of("reader")
    for name, value in (("AWS_CONFIG_FILE", config), ("AWS_ACCESS_KEY_ID", reader["key"]),
                        ("AWS_SHARED_CREDENTIALS_FILE", tmp_path / "none"),
                        ("AWS_SECRET_ACCESS_KEY", reader["secret"])):
        monkeypatch.setenv(name, str(value))
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    _round_trip(S3Bucket(bucket_name=bucket, bucket_folder="profile", credentials=AwsCredentials(
        profile_name="ckpt-writer",
        aws_client_parameters={"endpoint_url": seaweedfs_server.endpoint})))


def test_an_s3_bucket_block_with_a_role_to_assume_is_refused_by_name():
    block = S3Bucket(bucket_name="b", bucket_folder="run", credentials=AwsCredentials(
        assume_role_arn="arn:aws:iam::123456789012:role/ckpt"))
    with pytest.raises(InvalidLocationError, match=r"block for 's3://b/run' has AwsCredentials "
                                                   r"with assume_role_arn"):
        StepCheckpointManager(block, handle_preemption=False)


@pytest.mark.parametrize(("reference", "message"), [
    ("prefect-block://checkpoint-storage/no-such-block",
     "cannot load block checkpoint-storage/no-such-block"),
    ("prefect-block://checkpoint-storage", "must be prefect-block://<block-type-slug>/<block"),
    ("prefect-block://secret/ckpt-not-a-location", "names no checkpoint location"),
])
def test_a_bad_block_reference_is_refused_naming_it(reference, message):
    from prefect.blocks.system import Secret

    Secret(value="x").save("ckpt-not-a-location", overwrite=True)
    with pytest.raises(InvalidLocationError, match=message):
        StepCheckpointManager(reference, handle_preemption=False)


def test_a_non_block_object_is_refused():
    with pytest.raises(InvalidLocationError,
                       match=r"must be a path or URL .* got 42 \(of type int\)"):
        MultiNodeCheckpointManager(42)


def _everything_under(url: str, options: dict) -> bytes:
    location = Location(url, options)
    return b"".join(location.fs.cat_file(p) for p in location.fs.find(location.root))


def test_a_secret_in_a_block_never_shows(moto_server, seaweedfs_server, client):
    bucket = moto_server.new_bucket()
    options = {"key": KEY, "secret": SECRET, "endpoint_url": moto_server.endpoint}
    CheckpointStorage(url=f"s3://{bucket}/regression",
                      storage_options=options).save("ckpt-secret", overwrite=True)
    # SeaweedFS checks signatures: the secret is wrong there, and the error names the prefix
    # (and the key), never the secret
    CheckpointStorage(url=f"s3://{seaweedfs_server.new_bucket()}/x", storage_options={
        "key": "testing", "secret": SECRET, "endpoint_url": seaweedfs_server.endpoint,
    }).save("ckpt-broken", overwrite=True)
    shown: list[str] = []
    with event_feed(["caffe2ckpt.", "prefect.flow-run."]) as feed:
        final = regression(epochs=3, checkpoint_block="ckpt-secret")
        feed.wait_for("caffe2ckpt.epoch.committed", lambda es: len(es) >= 4)
        shown += [e.model_dump_json() for e in feed.received]
    assert final == 3
    run_id = next(r.id for r in feed.named("caffe2ckpt.epoch.committed")[0].related
                  if r.role == "flow-run").removeprefix("prefect.flow-run.")
    run = client.read_flow_run(UUID(run_id))
    shown.append(json.dumps(run.parameters))
    assert run.parameters["checkpoint_block"] == "ckpt-secret"
    logs = poll(lambda: client.read_logs(log_filter=LogFilter(
        flow_run_id=LogFilterFlowRunId(any_=[run.id]))),
        lambda ls: any("Epoch 3 " in log.message for log in ls))
    shown += [log.message for log in logs]
    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    assert len(artifacts) >= 3
    shown += [json.dumps([a.data, a.description]) for a in artifacts]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    for args in (["ls", "--json"], ["show", "--epoch", "3", "--json"], ["verify", "--json"]):
        out = subprocess.run([sys.executable, "-m", "caffe2ckpt.cli", args[0],
                              "prefect-block://checkpoint-storage/ckpt-secret", *args[1:]],
                             env=env, capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr
        shown += [out.stdout, out.stderr]
    assert json.loads(shown[-2])["summary"]["ok"] == 8  # verify: 2 nodes x epochs 0-3
    for broken in ("prefect-block://checkpoint-storage/ckpt-broken",
                   CheckpointStorage.load("ckpt-broken")):
        with (pytest.raises(CheckpointError) as failure,
              StepCheckpointManager(broken, handle_preemption=False) as mgr):
            mgr.save(0, _items(None))
        shown.append(f"{failure.value!r} {failure.value} {failure.value.__cause__!r}")
        assert "/x" in str(failure.value)
    on_storage = _everything_under(f"s3://{bucket}/regression", options)
    assert len(on_storage) > 1_000_000  # four epochs of two nodes: records, manifests, data
    assert SECRET.encode() not in on_storage
    leaks = [text for text in shown if SECRET in text]
    assert not leaks, leaks[0][:2000]


def test_the_block_type_registers_for_the_blocks_page(client):
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    out = subprocess.run(["prefect", "block", "register", "-m", "caffe2ckpt.prefect.blocks"],
                         env=env, capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    block_type = client.read_block_type_by_slug("checkpoint-storage")
    assert block_type.name == "Checkpoint Storage"
    schema = client.get_most_recent_block_schema_for_block_type(block_type.id)
    assert schema.fields["secret_fields"] == ["storage_options.*"]  # kept encrypted, masked


def test_a_block_reference_without_a_prefect_api_says_what_to_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    out = subprocess.run([sys.executable, "-m", "caffe2ckpt.cli", "ls",
                          "prefect-block://checkpoint-storage/nightly"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "names a Prefect block" in out.stderr and "PREFECT_API_URL" in out.stderr
