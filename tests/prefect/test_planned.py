"""planned_failures on real flow runs: a planned failure with a retry left is one WARNING; any
other failure, and a planned one on the last attempt, keep Prefect's ERROR lines."""

from __future__ import annotations

import logging

import pytest
from prefect import flow, task
from prefect.runtime import flow_run

from caffe2ckpt.prefect import planned_failures
from tests.prefect.conftest import Records


class Drill(RuntimeError):
    pass


@pytest.fixture
def records():
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("prefect.task_runs", "prefect.flow_runs")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


@task
def step(error: type[BaseException] | None) -> None:
    if error is not None:
        raise error("in epoch 3")


def failing_once(error: type[BaseException], retries: int):
    @flow(retries=retries, retry_delay_seconds=0)
    def drill() -> int:
        step(error if flow_run.run_count == 1 else None)
        return flow_run.run_count
    return drill


def errors(records) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.ERROR]


def test_a_planned_failure_with_a_retry_left_is_one_warning(records):
    with planned_failures(Drill):
        assert failing_once(Drill, retries=1)() == 2
    assert errors(records) == []
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warnings == ["Planned failure (Drill: in epoch 3); Prefect retries the flow run: "
                        "attempt 2 of 2 resumes from the newest committed epoch"]
    assert not any(r.exc_info for r in records)


def test_another_failure_keeps_its_errors(records):
    with planned_failures(Drill):
        assert failing_once(KeyError, retries=1)() == 2
    assert len(errors(records)) >= 3  # the task run's two lines and the flow run's
    assert not any("Planned failure" in r.getMessage() for r in records)


def test_a_planned_failure_on_the_last_attempt_keeps_its_errors(records):
    with planned_failures(Drill), pytest.raises(Drill):
        failing_once(Drill, retries=0)()
    assert len(errors(records)) >= 3
    assert not any("Planned failure" in r.getMessage() for r in records)
