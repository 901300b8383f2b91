"""flows/regression.py and prefect.yaml on the test harness's Prefect server: N more epochs per
run, resuming from a chosen epoch, plan_run across a flow run's retries, the command line, and
the failure demo kept out of every deployment's parameters."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prefect import flow
from prefect.client.schemas.objects import StateType
from prefect.exceptions import Abort
from prefect.flows import load_flow_from_entrypoint
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager
from caffe2ckpt.example import build_job, node_names
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.scan import family_history
from caffe2ckpt.prefect import plan_run, run_job
from caffe2ckpt.store.commit.protocol import CheckpointStore
from flows.regression import regression
from tests.stores import load

REPO = Path(__file__).resolve().parents[2]
NODES = node_names(2)


def assert_uninterrupted(url: str, epoch: int, tmp_path: Path, nodes=NODES) -> None:
    """Epoch ``epoch`` under ``url`` holds, bit for bit, what a LocalSession run of ``epoch``
    epochs that never stopped ends with."""
    reference = LocalSession()
    JobRunner(build_job(epoch, len(nodes)),
              MultiNodeCheckpointManager(str(tmp_path / f"ref-{epoch}"))).train(reference)
    store = CheckpointStore(Location(url))
    for node in nodes:
        restored, expected = load(store, node, epoch), reference.workspace(node)
        assert {"model/w", "model/b", "reader/cursor"} <= restored.keys() <= expected.keys()
        for name, value in restored.items():
            assert value.dtype == expected[name].dtype, (node, name)
            assert value.tobytes() == expected[name].tobytes(), (node, name)


def lineage(url: str, nodes=NODES) -> list:
    """The committed saves of the current lineage, newest first."""
    return list(family_history(CheckpointStore(Location(url)), nodes).lineage())


def writer(save) -> dict:
    return next(iter(save.records.values())).writer


def test_epochs_per_run_and_resume_from_epoch(tmp_path):
    url = str(tmp_path / "ckpt")
    assert regression(url, epochs=10, epochs_per_run=2) == 2
    assert regression(url, epochs=10, epochs_per_run=2) == 4
    assert_uninterrupted(url, 4, tmp_path)
    cm = MultiNodeCheckpointManager(url)  # the next run would stop at `epochs`, never past it
    assert plan_run(cm, NODES, epochs=5, epochs_per_run=2) == (4, 5, None)

    first = lineage(url)
    assert regression(url, epochs=4, resume_from_epoch=2) == 4
    saves = lineage(url)
    assert [s.epoch for s in saves] == [4, 3, 2, 1, 0]
    assert saves[2:] == first[2:]  # epochs 0-2 of the earlier runs; 3 and 4 anew:
    assert writer(saves[0])["flow_run_id"] == writer(saves[1])["flow_run_id"]
    assert writer(saves[1])["flow_run_id"] not in {writer(s)["flow_run_id"] for s in first}
    assert saves[1].parent == (2, saves[2].generation)
    history = family_history(CheckpointStore(Location(url)), NODES)
    for new in saves[:2]:  # the new saves of epochs 3 and 4 wrote at paths of their own: the
        old = [s for s in history.saves_at(new.epoch) if s != new]  # old ones are superseded
        assert len(old) == 1 and old[0] in history.superseded(saves)
        assert new.records["trainer_0"].group == f"trainer_0.{new.epoch}.{new.save_id}"
    assert_uninterrupted(url, 4, tmp_path)


def test_a_retry_keeps_the_start_and_the_stop_of_its_run(tmp_path):
    """Each run fails two epochs past its start on its first attempt; the retry continues from
    the newest epoch the run committed and stops where the first attempt would have."""
    url = str(tmp_path / "ckpt")

    @flow(name="budgeted", retries=1, retry_delay_seconds=0)
    def budgeted(resume_from_epoch: int | None = None) -> int:
        cm = MultiNodeCheckpointManager(url)
        plan = plan_run(cm, NODES, epochs=100, epochs_per_run=3,
                        resume_from_epoch=resume_from_epoch)
        fail = plan.start_epoch + 2 if flow_run.run_count == 1 else None
        job = build_job(plan.num_epochs, fail_at_epoch=fail)
        return run_job(job, cm, resume_from_epoch=plan.resume_from_epoch)

    assert budgeted() == 3  # attempt 1: epochs 0, 1, fails in 2; attempt 2: 2, 3 (not to 4)
    assert budgeted(resume_from_epoch=1) == 4  # attempt 1: 2, fails in 3; attempt 2: 3, 4
    saves = lineage(url)
    assert [s.epoch for s in saves] == [4, 3, 2, 1, 0]
    assert [writer(s)["run_count"] for s in saves] == [2, 2, 1, 1, 1]
    assert saves[2].parent == (1, saves[3].generation)  # the second run went back to 1 once
    assert_uninterrupted(url, 4, tmp_path)


@pytest.mark.parametrize("claims", [("same",), ("other",), ("other", "same")],
                         ids=["newer-attempt", "other-run", "other-run-then-newer-attempt"])
def test_an_attempt_fenced_by_a_newer_attempt_of_its_flow_run_ends_without_a_state(
        tmp_path, client, caplog, claims):
    """Prefect can run two attempts of one flow run at once: a killed run is reported Crashed
    twice, and a second report that lands after the crash-retry automation started the next
    attempt crashes it under it, so the automation starts a third. The older attempt, fenced
    by the newer one, must not fail the run nor retry in process (and fence the newer in
    turn), also when another job claimed the prefix in between. A claim by another flow run
    alone is a real conflict: that attempt fails and retries."""
    url, seen = str(tmp_path / "ckpt"), {}
    same_flow_run = "same" in claims

    @flow(name="overtaken", retries=1, retry_delay_seconds=0)
    def overtaken() -> int:
        seen.setdefault("run", flow_run.id)
        writers = {"same": {"flow_run_id": flow_run.id, "run_count": flow_run.run_count + 1},
                   "other": {"flow_run_id": "another-flow-run", "run_count": 1}}
        job = build_job(6)
        epoch_fn = job.epoch_group.tasks[0].fn

        def newer_attempt_claims(ws):  # during epoch 2, once
            if int(ws["epoch"]) == 1 and not seen.get("claimed"):
                seen["claimed"] = True
                for claim in claims:
                    newer = MultiNodeCheckpointManager(url)
                    newer.set_params(NODES)
                    newer.claim(writers[claim])
            return epoch_fn(ws)
        job.epoch_group.tasks[0].fn = newer_attempt_claims
        return run_job(job, MultiNodeCheckpointManager(url))

    caplog.set_level(logging.WARNING, logger="caffe2ckpt")
    if same_flow_run:
        with pytest.raises(Abort, match="superseded by attempt 2"):
            overtaken()
        run = client.read_flow_run(seen["run"])
        assert run.run_count == 1 and run.state.type == StateType.RUNNING  # the newer's to end
        assert [s.epoch for s in lineage(url)] == [1, 0]
        assert "attempt 1 of flow run" in caplog.text and "stops without a state" in caplog.text
    else:
        assert overtaken() == 6  # attempt 1 fenced and failed; attempt 2 claimed anew
        run = client.read_flow_run(seen["run"])
        assert run.run_count == 2 and run.state.type == StateType.COMPLETED
        assert "stops without a state" not in caplog.text


def test_command_line_options_and_the_failure_demo(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value()}
    url = str(tmp_path / "ckpt")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "flows" / "regression.py"),
                               "--checkpoint-url", url, "--nodes", "1", *args], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=240,
                              check=False)

    out = run("--epochs", "3", "--fail-at-epoch", "2")
    assert out.returncode == 0 and "final epoch: 3" in out.stdout, out.stderr
    # the planned failure reads as one: a WARNING naming it and the retry, no ERROR, no traceback
    log = out.stdout + out.stderr
    assert "ERROR" not in log and "Traceback" not in log, log
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, warnings
    assert ("Planned failure (InjectedFailure: injected failure on trainer_0 in epoch 2); "
            "Prefect retries the flow run: attempt 2 of 3") in warnings[0], warnings
    saves = lineage(url, NODES[:1])
    assert [s.epoch for s in saves] == [3, 2, 1, 0]
    assert {writer(s)["flow_name"] for s in saves} == {"regression-failure-demo"}
    assert [writer(s)["run_count"] for s in saves] == [2, 2, 1, 1]  # failed in 2, retried

    out = run("--resume-from-epoch", "1", "--epochs-per-run", "3")
    assert out.returncode == 0 and "final epoch: 4" in out.stdout, out.stderr
    saves = lineage(url, NODES[:1])
    assert [s.epoch for s in saves] == [4, 3, 2, 1, 0]
    assert {writer(s)["flow_name"] for s in saves[:3]} == {"regression"}
    assert_uninterrupted(url, 4, tmp_path, NODES[:1])

    out = run("--fail-at-epoch", "2", "--resume-from-epoch", "0")
    assert out.returncode == 2
    assert "--fail-at-epoch (the failure demo) does not take --resume-from-epoch" in out.stderr


def test_no_deployment_exposes_the_failure_demo_switch():
    """A deployment's parameter form is its flow's signature: fail_at_epoch is in none, and every
    parameter prefect.yaml sets is one the flow takes."""
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    assert {d["name"] for d in deployments} == {"nightly", "nightly-dask", "evaluate"}
    for deployment in deployments:
        entry = deployment["entrypoint"]
        schema = load_flow_from_entrypoint(str(REPO / entry)).parameters.properties
        assert "fail_at_epoch" not in schema, entry
        assert set(deployment.get("parameters", {})) <= set(schema), (entry, deployment)
        if deployment["name"] == "evaluate":  # an automation passes both, from the event
            assert {"checkpoint_url", "epoch"} <= set(schema)
        else:
            assert {"epochs_per_run", "resume_from_epoch", "checkpoint_block"} <= set(schema)
    nightly = next(d for d in deployments if d["name"] == "nightly")["parameters"]
    assert nightly["epochs_per_run"] >= 1 and nightly["epochs"] > nightly["epochs_per_run"]


@pytest.mark.parametrize("kwargs, message", [
    ({"epochs": 0}, "epochs must be an int >= 1, got 0"),
    ({"epochs": 10, "epochs_per_run": 0}, "epochs_per_run must be an int >= 1, got 0"),
    ({"epochs": 10, "resume_from_epoch": -1}, "resume_from_epoch=-1: epoch -1 is out of range"),
])
def test_plan_run_refuses_bad_numbers_naming_them(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_run(MultiNodeCheckpointManager(str(tmp_path / "ckpt")), NODES, **kwargs)
