"""A password or token in a checkpoint URL never leaves the filesystem: a real FTP server logs in
with the URL's user and password, and neither they nor the URL's query string appear in any
message, log line (this process's and the flow run's on the server), event, artifact, flow-run
state, exception or command-line output. A memory or local URL carrying them is refused, by a
message that does not repeat them, before anything is written."""

from __future__ import annotations

import json
import logging
import traceback
import uuid

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from prefect import flow
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)

from caffe2ckpt import MultiNodeCheckpointManager, StepCheckpointManager
from caffe2ckpt.cli import main as cli
from caffe2ckpt.errors import CheckpointError, InvalidLocationError
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location, canonical_prefix
from caffe2ckpt.prefect import PrefectSession, run_job
from tests.ftpserver import ftp_server
from tests.prefect.conftest import poll
from tests.prefect.eventfeed import event_feed

PASSWORD = "Pw-planted-4f1d9c"  # what must never show
TOKEN = "Tk-planted-8e02b7"
SECRETS = (PASSWORD, TOKEN)


class Everything(logging.Handler):
    """Every record any logger of this process emits, as text, with its traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "".join(traceback.format_exception(*record.exc_info))
        self.texts.append(text)


@pytest.fixture
def everything():
    handler, root = Everything(), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler.texts
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _exception_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc)


def _assert_nowhere(texts: list[str]) -> None:
    leaks = [text for text in texts for secret in SECRETS if secret in text]
    assert not leaks, leaks[:3]


def test_a_password_and_a_token_in_an_ftp_url_show_nowhere(tmp_path, client, everything,
                                                           capsys):
    """The FTP server lets its user list but not write: every save fails, on the server's
    answer, and each failure is reported (event, log, state) as a user would see it."""
    with ftp_server(str(tmp_path), {"reader": (PASSWORD, "elr")}) as server:
        url = server.url("reader", PASSWORD, "run") + f"?token={TOKEN}"
        public = f"ftp://127.0.0.1:{server.port}/run"
        assert canonical_prefix(url) == public  # host and port kept, credentials not
        shown: list[str] = []

        @flow(name="ftp-secrets")
        def ftp_job() -> None:  # the URL is no parameter: a flow's parameters are stored
            cm = MultiNodeCheckpointManager(url)
            assert cm.url == public and repr(cm.store.location) == f"FsspecLocation({public!r})"
            run_job(build_job(2), cm, session=PrefectSession(), on_save_error="warn")

        with event_feed(["caffe2ckpt."]) as feed:
            state = ftp_job(return_state=True)
            failed = feed.wait_for("caffe2ckpt.save.failed", lambda es: len(es) >= 3)
            shown += [e.model_dump_json() for e in feed.received]
        assert failed and all(e.resource.id == f"caffe2ckpt.checkpoint.{public}" for e in failed)
        assert public in failed[0].payload["message"]  # it names where, publicly
        run_id = state.state_details.flow_run_id
        run = client.read_flow_run(run_id)
        shown += [run.model_dump_json(), json.dumps(str(state.message))]
        logs = poll(lambda: client.read_logs(log_filter=LogFilter(
            flow_run_id=LogFilterFlowRunId(any_=[run_id]))),
            lambda ls: any("save" in log.message for log in ls))
        shown += [log.message for log in logs]
        shown += [a.model_dump_json() for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))]
        with pytest.raises(CheckpointError) as direct, StepCheckpointManager(url) as mgr:
            mgr.save(0, {"n0": {"w": np.zeros(4)}})
        shown.append(_exception_text(direct.value))
        with pytest.raises(InvalidLocationError) as refused:  # a fragment: part of a path there
            Location(server.url("reader", PASSWORD, "run") + f"#{TOKEN}")
        shown.append(_exception_text(refused.value))
        for args in (["ls"], ["ls", "--json"], ["show", "--json"], ["verify"], ["gc", "--yes"]):
            cli([args[0], url, *args[1:]])
            shown += list(capsys.readouterr())
    wrong = server.url("reader", "not-" + PASSWORD, "run")  # a login the server refuses
    with pytest.raises(CheckpointError) as login:
        StepCheckpointManager(wrong)
    shown.append(_exception_text(login.value))
    _assert_nowhere(shown + everything)
    assert len(shown) > 20 and any("ftp://127.0.0.1" in text for text in everything)


@pytest.mark.parametrize("url", [
    "memory://alice:{password}@host/{run}",
    "memory://{run}?sig={token}",
    "s3://key:{password}@bucket/run",
    "file://alice:{password}@/{folder}/run",
    "file:///{folder}/run?sig={token}",
], ids=["memory-password", "memory-token", "s3-password", "file-password", "file-token"])
def test_a_url_whose_filesystem_would_keep_its_secret_in_a_path_is_refused(url, tmp_path,
                                                                             everything):
    url = url.format(password=PASSWORD, token=TOKEN, folder=str(tmp_path).lstrip("/"),
                     run=f"run-{uuid.uuid4().hex[:6]}")
    memory_before = set(MemoryFileSystem.store)
    for make in (Location, canonical_prefix, MultiNodeCheckpointManager):
        with pytest.raises(InvalidLocationError) as refused:
            make(url)
        _assert_nowhere([_exception_text(refused.value)])
        assert "storage_options" in str(refused.value)
    assert cli(["ls", url]) == 2
    assert set(MemoryFileSystem.store) == memory_before and not list(tmp_path.iterdir())
    _assert_nowhere(everything)
