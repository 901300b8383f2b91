"""The memory tier as an operation of a seeded model check, on a real 3-worker process
LocalCluster and a local prefix: every operation is a ``JobRunner.train`` of one job (three
nodes whose state depends on every run that trained it: each run mixes its own token into the
epochs it runs), drawn by ``random.Random(seed)``:

* with the memory tier (``DaskSession(memory_tier=True)``, copies kept 600 s or 0 s) or without;
* an automatic resume, or ``resume_from_epoch=k`` for a committed lineage epoch (going back);
* saves every 1-3 epochs, sync or async, to an epoch limit drawn anew (it may be below the
  newest epoch);
* ending: the job finishes; a task raises in epoch c (the run fails, its session closes); the
  same, but the session's client goes away without closing it (its flow process died); or,
  rarely, a worker is SIGKILLed in epoch c (the run recovers in the same ``train()`` call) and
  the job finishes.

The reference model is the storage model of ``test_model_check.py`` (claims, commits, the
lineage) plus what worker memory holds: the newest complete epoch (and its trace) snapshotted by
the newest tier run that did not finish, unless its copies were kept 0 s. An automatic resume
with the tier takes that epoch from memory exactly when it is at or after the lineage's newest
save, no run has claimed the prefix since the copies' run, and that save is the copies' run's
own or the one it started from; it then commits that epoch in its new run before training on.
Otherwise it resumes the newest save from storage. After every operation the oracle checks where
the run resumed from (the ``caffe2ckpt.run.resumed`` event: source, epoch, stored), the epochs
it committed, the final workspaces of a run that finished, and every lineage save on disk, each
against the model's trace replayed in numpy.

    CAFFE2CKPT_TIER_MODEL_SEEDS=50 CAFFE2CKPT_TIER_MODEL_OPS=10 \\
        python -m pytest tests/safety/test_model_check_tier.py
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from caffe2ckpt import Job, JobRunner, MultiNodeCheckpointManager, Node, Task, events
from caffe2ckpt.fs.location import Location
from caffe2ckpt.job import epoch_limiter
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.safety.test_model_check import Model, should_save
from tests.stores import load
from tests.tierjobs import Recoveries

distributed = pytest.importorskip("distributed")
from caffe2ckpt.dask import DaskSession
from tests.daskcluster import client_of, local_cluster

pytestmark = pytest.mark.slow

SEEDS = int(os.environ.get("CAFFE2CKPT_TIER_MODEL_SEEDS", "3"))
OPS = int(os.environ.get("CAFFE2CKPT_TIER_MODEL_OPS", "6"))
FIRST_SEED = int(os.environ.get("CAFFE2CKPT_TIER_MODEL_FIRST_SEED", "0"))
NODES = ["trainer_0", "trainer_1", "trainer_2"]
FAM = ",".join(NODES)


# -- the job, and its state replayed in numpy ------------------------------------------------------


def _mix(w: np.ndarray, epoch: int, token: int) -> np.ndarray:
    return np.tanh(w * 1.01 + epoch * 0.1 + token * 0.001)


def _initial(index: int) -> np.ndarray:
    return np.random.default_rng(index).standard_normal((40, 6))


def state(index: int, trace: tuple[int, ...]) -> np.ndarray:
    """Node ``index``'s ``w`` after the epochs of ``trace`` (the token of the run of each)."""
    w = _initial(index)
    for epoch, token in enumerate(trace[1:], 1):
        w = _mix(w, epoch, token)
    return w


def _init(index: int):
    def init(ws):
        ws["w"] = _initial(index)
        ws["step"] = np.int64(0)
    return init


def _epoch(token: int, fail_at: int | None, marker: str | None):
    def train(ws):
        step = int(ws["step"]) + 1
        if fail_at == step and marker and os.path.exists(marker):
            os.unlink(marker)
            if marker.endswith("kill"):
                os._exit(1)  # the worker dies in the middle of the epoch
            raise RuntimeError(f"injected failure in epoch {step}")
        ws["w"] = _mix(ws["w"], step, token)
        ws["step"] = np.int64(step)
        ws["loss"] = np.float64(ws["w"].sum())
    return train


def build(limit: int, token: int, fail_at: int | None, marker: str | None,
          on: str = "trainer_1") -> Job:
    with Job(name="tier-model") as job:
        for i, node in enumerate(NODES):
            with Node(node):
                with job.init_group:
                    Task(_init(i), name="init")
                train = Task(_epoch(token, fail_at if node == on else None, marker),
                             name="train", outputs=["loss"])
                if i == 0:
                    job.add_metric("loss", train.outputs()[0])
        epoch_limiter(job, limit)
    return job


# -- the model -------------------------------------------------------------------------------------


@dataclass
class Memory:
    """The newest complete epoch the workers keep copies of, of run ``gen``."""

    gen: int
    epoch: int
    trace: tuple[int, ...]


def draw(rng: random.Random, model: Model, op_index: int) -> dict[str, Any]:
    lineage = model.lineage(FAM)
    newest = lineage[0].epoch if lineage else 0
    resume: Any = "auto"
    if lineage and rng.random() < 0.2:
        resume = rng.choice([s.epoch for s in lineage])
    end = rng.choices(["finish", "fail", "die", "kill"], [3, 3, 3, 1])[0]
    return {"tier": rng.random() < 0.8, "keep": rng.choice([600.0, 600.0, 600.0, 0.0]),
            "resume": resume, "interval": rng.choice([1, 2, 3]), "async": rng.random() < 0.4,
            "limit": max(1, newest + rng.randint(-1, 5)), "end": end,
            "at": newest + rng.randint(1, 4), "token": 100 + op_index}


@dataclass
class Plan:
    source: str | None  # None (fresh start), "storage" or "memory"
    start: int
    trace: tuple[int, ...]
    stored: int | None  # the lineage's newest save when resuming automatically
    parent: tuple[int, int] | None


def plan(model: Model, memory: Memory | None, op: dict[str, Any]) -> Plan:
    newest = model.newest(FAM)
    if op["resume"] != "auto":
        save = model.lineage_save(FAM, op["resume"])
        return Plan("storage", save.epoch, save.trace, save.epoch, save.key)
    if newest is None:
        return Plan(None, 0, (0,), None, None)
    usable = (op["tier"] and memory is not None and memory.epoch >= newest.epoch
              and model.gens == memory.gen
              and (newest.gen == memory.gen or model.runs[memory.gen].parent == newest.key))
    if usable:
        return Plan("memory", memory.epoch, memory.trace, newest.epoch, newest.key)
    return Plan("storage", newest.epoch, newest.trace, newest.epoch, newest.key)


# -- the harness -----------------------------------------------------------------------------------


class Harness:
    def __init__(self, seed: int, root: Path, cluster: Any, client: Any) -> None:
        self.seed, self.root, self.cluster, self.client = seed, root, cluster, client
        self.url = str(root / "ckpt")
        self.model = Model()
        self.memory: Memory | None = None
        self.ops: list[dict[str, Any]] = []

    def expect(self, what: str, expected: Any, actual: Any) -> None:
        if expected != actual:
            ops = ",\n".join(f"    {op!r}" for op in self.ops)
            pytest.fail(f"seed {self.seed}, op {len(self.ops)}: {what}: expected {expected!r}, "
                        f"got {actual!r}\nops = [\n{ops}\n]")

    def apply(self, op: dict[str, Any]) -> None:
        self.ops.append(op)
        p = plan(self.model, self.memory, op)
        finished_at_start = p.start >= op["limit"]
        final = p.start if finished_at_start else op["limit"]
        fail_at = op["at"] if op["end"] != "finish" and p.start < op["at"] <= final else None
        if op["end"] == "kill" and (not op["tier"] or fail_at is None):
            fail_at = None  # without the tier a kill fails the run: not drawn
        marker = None
        if fail_at is not None:
            marker = str(self.root / f"op{len(self.ops)}-{'kill' if op['end'] == 'kill' else 'fail'}")
            Path(marker).touch()
        heard = Recoveries(events.RUN_RESUMED)
        unsubscribe = events.subscribe(heard)
        runner = JobRunner(build(op["limit"], op["token"], fail_at, marker),
                           MultiNodeCheckpointManager(self.url, async_save=op["async"]),
                           resume_from_epoch=None if op["resume"] == "auto" else op["resume"],
                           options=StepManagerOptions(save_interval_steps=op["interval"]))
        fails = fail_at is not None and op["end"] != "kill"
        client = (distributed.Client(self.cluster.scheduler_address) if op["end"] == "die"
                  else self.client)
        session = DaskSession(client, memory_tier=op["tier"], memory_tier_keep=op["keep"])
        try:
            got = runner.train(session)
            finals = {n: session.workspace(n)["w"] for n in NODES}
            error = None
        except RuntimeError as exc:
            got, finals, error = None, {}, exc
        finally:
            unsubscribe()
            if op["end"] == "die" and fails:
                client.close()  # the flow process died: its session is never closed
            else:
                session.close()
                if client is not self.client:
                    client.close()
        if op["end"] == "kill":
            self.client.wait_for_workers(3, timeout=120)
        if os.environ.get("CAFFE2CKPT_TIER_MODEL_VERBOSE"):
            print(f"seed {self.seed} op {len(self.ops)}: {p.source} {p.start} "
                  f"(stored {p.stored}), {op['end']} at {fail_at}, tier {op['tier']}")
        self.expect("whether the run failed", fails, error is not None)
        self._check(op, p, runner, got, finals, fail_at, heard.seen)

    def _check(self, op: dict[str, Any], p: Plan, runner: JobRunner, got: int | None,
               finals: dict[str, np.ndarray], fail_at: int | None,
               resumed: list[dict[str, Any]]) -> None:
        model = self.model
        seen = [(r["source"], r["epoch"], r["stored"]) for r in resumed]
        self.expect("the resume", [] if p.source is None else [(p.source, p.start, p.stored)],
                    seen)
        gen = model.claim(FAM, p.parent)
        trace, committed = list(p.trace), []
        if p.source == "memory" and p.start > p.stored:
            committed.append(p.start)
        if p.source is None:
            committed.append(0)
        last = p.start if fail_at is None or op["end"] == "kill" else fail_at - 1
        end = max(p.start, op["limit"]) if fail_at is None or op["end"] == "kill" else last
        for epoch in range(p.start + 1, end + 1):
            trace.append(op["token"])
            if should_save(op["interval"], epoch, final=epoch == op["limit"]):
                committed.append(epoch)
        self.expect("the epochs committed", committed, runner.saved_epochs)
        for epoch in committed:
            model.commit(FAM, epoch, gen, tuple(trace[:epoch + 1]), stop=epoch >= op["limit"])
        if got is not None:
            self.expect("the final epoch", end, got)
            for i, node in enumerate(NODES):
                if not np.array_equal(finals[node], state(i, tuple(trace))):
                    self.expect(f"the final w of {node}", "the model's", "another")
            self.memory = self.memory if not op["tier"] else None  # a finished job drops them
        elif op["tier"]:
            self.memory = None if op["keep"] == 0 else Memory(gen, end, tuple(trace))
        store = CheckpointStore(Location(self.url))
        for save in model.lineage(FAM):
            for i, node in enumerate(NODES):
                if not np.array_equal(load(store, node, save.epoch)["w"], state(i, save.trace)):
                    self.expect(f"the saved w of {node} at epoch {save.epoch}", "the model's",
                                "another")


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(3) as c:
        yield c


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SEEDS))
def test_the_memory_tier_against_the_model(seed, tmp_path, cluster):
    rng = random.Random(seed)
    with client_of(cluster) as client:
        harness = Harness(seed, tmp_path, cluster, client)
        for i in range(OPS):
            harness.apply(draw(rng, harness.model, i))
