"""A writer keeps what it read of the prefix only while it holds a run there: without a run
(a reader, a manager whose resume failed, a claim about to start) every answer is read again,
because any other writer may have changed the prefix since (found by review: each of these
acted on a view read before another writer went back and re-saved an epoch)."""

from __future__ import annotations

import pytest

from caffe2ckpt import (
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    NodeLostError,
    StepManagerOptions,
)
from caffe2ckpt.example import build_job
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.stores import newest_epoch

NODES = ["trainer_0", "trainer_1"]


def newest(store: CheckpointStore) -> tuple[int, int]:
    """(epoch, generation) of the lineage's newest save, asked of a manager that never ran."""
    cm = MultiNodeCheckpointManager(store.location.url)
    cm.set_params(nodes=NODES)
    save = cm.save_of(newest_epoch(store, NODES))
    return save.epoch, save.generation


def go_back_and_resave(prefix: str, epoch: int, until: int) -> None:
    """Another writer resumes from ``epoch`` and saves up to ``until`` again: the first run's
    later epochs are superseded."""
    JobRunner(build_job(until), MultiNodeCheckpointManager(prefix),
              resume_from_epoch=epoch).train(LocalSession())


class LoseANodeWhileLoading(LocalSession):
    def run(self, runnable):
        if getattr(runnable, "name", None) == "checkpoint_load":
            raise NodeLostError("node trainer_1 lost while loading", node="trainer_1")
        return super().run(runnable)


def test_a_manager_whose_resume_failed_resumes_from_the_prefix_as_it_is_now(prefix):
    JobRunner(build_job(3), MultiNodeCheckpointManager(prefix)).train(LocalSession())
    cm = MultiNodeCheckpointManager(prefix)
    with pytest.raises(NodeLostError):
        JobRunner(build_job(5), cm).train(LoseANodeWhileLoading())
    go_back_and_resave(prefix, 2, 3)  # the first run's epoch 3 is superseded
    truth = newest(cm.store)
    runner = JobRunner(build_job(5), cm, options=StepManagerOptions(max_to_keep=10))
    runner.train(LocalSession())  # the same manager again
    assert runner.resumed_from == 3
    assert cm.run.parent == truth
    lineage = [(s.epoch, s.generation) for s in cm.lineage()]
    assert truth in lineage and lineage[-1] == (0, 1), lineage


def test_a_reader_loads_the_newest_save_each_time(prefix):
    JobRunner(build_job(3), MultiNodeCheckpointManager(prefix)).train(LocalSession())
    reader, session = MultiNodeCheckpointManager(prefix), LocalSession()

    def evaluate() -> tuple[int, int]:  # the Caffe2 way of loading the newest checkpoint
        reader.set_params(nodes=NODES)
        epoch = reader.get_resume_from_epoch_id()
        session.run(reader.init(NODES, retrieve_from_epoch=epoch))
        session.run(reader.load(epoch))
        save = reader.save_of(epoch)
        return save.epoch, save.generation

    assert evaluate() == (3, 1)
    go_back_and_resave(prefix, 2, 3)
    assert evaluate() == newest(reader.store) == (3, 2)


def test_claim_continues_the_newest_save_as_the_prefix_is_now(prefix):
    cm = MultiNodeCheckpointManager(prefix)
    JobRunner(build_job(3), cm, options=StepManagerOptions(max_to_keep=10)).train(LocalSession())
    JobRunner(build_job(5), MultiNodeCheckpointManager(prefix)).train(LocalSession())  # 4, 5
    run = cm.claim()  # by default: continue the lineage's newest save
    assert run.parent == newest(cm.store) == (5, 2)


def test_a_resume_continues_the_save_it_loaded(prefix):
    """Another writer re-saves the epoch being resumed from just after it was loaded: the new
    run's parent is still the save whose data it loaded (one reading per resume)."""
    JobRunner(build_job(3), MultiNodeCheckpointManager(prefix)).train(LocalSession())

    class ResavedAfterLoading(LocalSession):
        def run(self, runnable):
            result = super().run(runnable)
            if getattr(runnable, "name", None) == "checkpoint_load":
                go_back_and_resave(prefix, 2, 3)
            return result

    cm = MultiNodeCheckpointManager(prefix)
    runner = JobRunner(build_job(5), cm)
    runner.train(ResavedAfterLoading())
    assert runner.resumed_from == 3
    assert cm.run.parent == (3, 1)  # the first run's epoch 3, which it loaded
    assert [(s.epoch, s.generation) for s in cm.lineage()] == [
        (5, 3), (4, 3), (3, 1), (2, 1), (1, 1), (0, 1)]
