"""Credentials the object store rejects, on SeaweedFS (moto accepts any key and allows
everything, so it cannot show this): ``StorageCredentialsError`` naming the prefix, from the
API and the command line, never a bare ``PermissionError`` and never "damaged".

SeaweedFS answers a wrong secret with ``SignatureDoesNotMatch``, an unknown key with
``InvalidAccessKeyId``, a request its identity may not make with ``AccessDenied`` (and a HEAD
with a bare 403); s3fs makes each a ``PermissionError``. The session's server knows a key that
may only read and list (``reader``) and one that may only list (``lister``): tests/s3server.py.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from caffe2ckpt import (
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    StepCheckpointManager,
    StorageCredentialsError,
    Task,
    epoch_limiter,
)
from caffe2ckpt.cli import main
from caffe2ckpt.metadata import ZarrMetadataHandler

pytestmark = pytest.mark.slow
NODE = "n"


@pytest.fixture
def weed(seaweedfs_server, monkeypatch):
    """(server, url of a prefix holding committed epochs 0..2 of node ``n``); plain ``s3://``
    URLs reach the server with the admin's credentials."""
    seaweedfs_server.configure(monkeypatch)
    url = f"s3://{seaweedfs_server.new_bucket()}/run"
    assert JobRunner(job(2), manager(url, seaweedfs_server.options())).train(LocalSession()) == 2
    return seaweedfs_server, url


def job(epochs: int) -> Job:
    with Job(name="creds") as j:
        with Node(NODE):
            with j.init_group:
                Task(lambda ws: ws.update({"w": np.zeros(4)}), name="init")
            Task(lambda ws: ws.update({"w": ws["w"] + 1}), name="train")
        epoch_limiter(j, epochs)
    return j


def manager(url: str, options: dict) -> MultiNodeCheckpointManager:
    return MultiNodeCheckpointManager(url, storage_options={**options, "skip_instance_cache": True},
                                      metadata_handler=ZarrMetadataHandler())


def rejected(info: pytest.ExceptionInfo, url: str, code: str) -> bool:
    message = str(info.value)
    return repr(url) in message and code in message and "rejected the credentials" in message


WRONG = {"secret": "not-the-secret"}


def test_a_wrong_secret_fails_a_resume_and_a_fresh_start_naming_the_prefix(weed):
    server, url = weed
    for where in (url, url.replace("/run", "/fresh")):  # committed epochs, and nothing yet
        runner = JobRunner(job(4), manager(where, server.options(**WRONG)))
        with pytest.raises(StorageCredentialsError) as info:
            runner.train(LocalSession())
        assert rejected(info, where, "SignatureDoesNotMatch"), info.value
    unknown = server.options(key="nobody", secret="x")
    with pytest.raises(StorageCredentialsError) as info:
        JobRunner(job(4), manager(url, unknown)).train(LocalSession())
    assert rejected(info, url, "InvalidAccessKeyId"), info.value


def test_a_wrong_secret_fails_the_step_manager_naming_the_prefix(weed):
    server, url = weed
    options = {**server.options(**WRONG), "skip_instance_cache": True}
    with pytest.raises(StorageCredentialsError) as info:
        with StepCheckpointManager(url, storage_options=options, handle_preemption=False) as mgr:
            mgr.save(3, {NODE: {"w": np.ones(4)}})
    assert rejected(info, url, "SignatureDoesNotMatch"), info.value
    with pytest.raises(StorageCredentialsError) as info:
        StepCheckpointManager(url, storage_options=options, handle_preemption=False).restore()
    assert rejected(info, url, "SignatureDoesNotMatch"), info.value


def test_a_key_that_may_only_read_resumes_and_its_saves_fail_per_on_save_error(weed, caplog):
    """The resume reads (allowed); the run's claim and every save are refused: a save failure,
    logged and kept going with ``on_save_error="warn"``, raised with ``"raise"``."""
    server, url = weed
    reader = server.options_of("reader")
    caplog.set_level(logging.WARNING, logger="caffe2ckpt")
    runner = JobRunner(job(4), manager(url, reader))
    assert runner.train(LocalSession()) == 4
    assert runner.resumed_from == 2 and runner.failed_saves == [3, 4], runner.failed_saves
    assert "AccessDenied" in caplog.text and repr(url) in caplog.text
    runner = JobRunner(job(4), manager(url, reader), on_save_error="raise")
    with pytest.raises(StorageCredentialsError) as info:
        runner.train(LocalSession())
    assert rejected(info, url, "AccessDenied"), info.value
    assert runner.resumed_from == 2


def test_a_key_that_may_not_read_is_refused_not_reported_as_damage(weed, capsys):
    """Listing is allowed, every GET refused: a resume and ``caffe2ckpt ls`` stop on the
    credentials (exit 4), they do not call the refused records or groups damaged."""
    server, url = weed
    lister = server.options_of("lister")
    with pytest.raises(StorageCredentialsError) as info:
        JobRunner(job(4), manager(url, lister)).train(LocalSession())
    assert rejected(info, url, "AccessDenied") or rejected(info, url, "403"), info.value
    code = main(["ls", url, "--storage-options", json.dumps(lister)])
    out, err = capsys.readouterr()
    assert code == 4 and out == "" and "damaged" not in err, (code, out, err)
    assert repr(url) in err and "rejected the credentials" in err, err


def test_cli_with_a_wrong_secret_exits_4_naming_the_prefix(weed, capsys):
    server, url = weed
    wrong = json.dumps({**server.options(**WRONG), "skip_instance_cache": True})
    for command in (["ls"], ["show"], ["verify"], ["gc", "--keep-last", "1", "--yes"]):
        code = main([command[0], url, *command[1:], "--storage-options", wrong])
        out, err = capsys.readouterr()
        assert (code, out) == (4, ""), (command, err)
        assert err.startswith(f"caffe2ckpt {command[0]}: error: cannot use checkpoint prefix "
                              f"{url!r}: the store rejected the credentials"), err
        assert err.count("\n") == 1 and "Traceback" not in err
