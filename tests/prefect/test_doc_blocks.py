"""Every code block of README.md and of the docs pages runs as written, or is checked by the test
named for it here. ```python blocks run each in its own ``python`` process with a fresh working
directory, importing this checkout; ```bash blocks run line by line in a shell as a user's
terminal would (``pip install`` lines aside: this environment has the test extra, which holds
them). Here, under tests/prefect, because blocks run flows: they reach the test harness's
Prefect server (PREFECT_API_URL) instead of starting a temporary server of their own."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager
from caffe2ckpt.example import build_job
from tests import prefectdb
from tests.procs import free_port

REPO = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


def python_blocks() -> dict[str, str]:
    """``{"<page> > <section> #<n>": code}`` for every ```python block."""
    return doc_blocks("python")


def doc_blocks(language: str) -> dict[str, str]:
    """``{"<page> > <section> #<n>": code}`` for every ```<language> block of README.md and the
    docs pages, numbered per section."""
    blocks: dict[str, str] = {}
    for page in PAGES:
        section = f"{page} > (top)"
        lines = iter((REPO / page).read_text().splitlines())
        for line in lines:
            if line.startswith("#"):
                section = f"{page} > {line.lstrip('#').strip()}"
            elif line.strip() == f"```{language}":
                code = []
                for body in lines:
                    if body.strip() == "```":
                        break
                    code.append(body)
                n = sum(key.startswith(section + " #") for key in blocks) + 1
                blocks[f"{section} #{n}"] = "\n".join(code) + "\n"
    return blocks


def regression_checkpoints(cwd: Path) -> None:
    """What the README's first command leaves in checkpoints/regression (epochs 0-10)."""
    cm = MultiNodeCheckpointManager(str(cwd / "checkpoints" / "regression"))
    JobRunner(build_job(10), cm).train(LocalSession())


# Per ```python block: what must be there before it runs, and a line its output must contain (the
# value its comments state, so they are checked too).
BLOCKS = {
    "README.md > A short example #1": (None, "10"),
    "docs/getting-started.md > Your own job #1": (None, "10"),
    "docs/prefect.md > A flow #1": (None, "4"),
    "docs/prefect.md > Credentials in blocks #1": (None, "blocks-demo [0]"),
    "docs/concepts.md > Save policies, retention, metrics and preemption #1":
        (None, "[0, 10, 12, 15, 20]"),
    "docs/steps.md > The Orbax-style step API #1": (None, None),
    "docs/deltas.md > In short #1": (None, "True [2, 3, 4]"),
    "docs/elastic.md > In short #1": (None, "2000.0 (500, 4)"),
    "docs/dask.md > A memory tier: recover a lost worker in seconds #1": (None, "6 6.0"),
    "docs/storage.md > Layout #1": (regression_checkpoints, "trainer_0.10 True"),
    "docs/storage.md > Layout #2": (regression_checkpoints, "(32768, 8) 0.50399417"),
    "docs/storage.md > Plain groups (materialize) #1": (regression_checkpoints, "0.50399417 <f4"),
}
# ```python blocks that a ```bash block's test runs (they need what that block starts).
RUN_BY_BASH = {"docs/dask.md > Scale-out with Dask #1": "test_the_dask_block_runs_in_order",
               "docs/prefect.md > Events and automations #1":
                   "test_the_deployment_block_runs_in_order"}

# How each ```bash block is checked: the test that runs it, or why the suite does not.
TWO_COMMANDS = ("the two commands: .ci/run runs the second in a fresh virtualenv; "
                "test_regression_flow.py runs the first one's flow")
BASH = {
    "README.md > caffe2ckpt #1": TWO_COMMANDS,
    "docs/index.md > Try it #1": TWO_COMMANDS + " (tests/test_docs.py: the README's, exactly)",
    "docs/getting-started.md > Getting started #1": TWO_COMMANDS,
    "docs/getting-started.md > Try resuming #1": "test_the_resuming_block_runs_in_order",
    "docs/prefect.md > Scheduled deployments #1": "test_the_deployment_block_runs_in_order",
    "docs/prefect.md > Events and automations #1": "test_the_deployment_block_runs_in_order",
    "docs/storage.md > A local S3 server to try it #1": "test_the_local_s3_block_runs_in_order",
    "docs/dask.md > Scale-out with Dask #1": "test_the_dask_block_runs_in_order",
    "docs/dask.md > As a deployment #1": ("tests/prefect/test_dask_deployment.py runs it with a "
                                          "real worker"),
    "docs/cli.md > Command line #1": "test_the_command_line_block_runs_in_order",
    "docs/elastic.md > Letting old node sets go #1": "test_the_letting_go_block_runs_in_order",
    "docs/performance.md > Performance #1": ("its --smoke line: tests/test_benchmarks.py; the "
                                             "full run takes tens of minutes"),
}


NOT_CODE = {"", "json", "text"}  # fences that hold data or a drawing, not commands


def test_every_block_is_covered():
    fences = {line.strip()[3:] for page in PAGES for line in (REPO / page).read_text().splitlines()
              if line.strip().startswith("```")}
    assert fences <= {"python", "bash"} | NOT_CODE, fences - {"python", "bash"} - NOT_CODE
    assert sorted(python_blocks()) == sorted([*BLOCKS, *RUN_BY_BASH])
    assert sorted(doc_blocks("bash")) == sorted(BASH)
    tests = {name for name in globals() if name.startswith("test_")}
    assert {how for how in [*BASH.values(), *RUN_BY_BASH.values()]
            if how.startswith("test_")} <= tests


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_python_block_runs_as_written(name, tmp_path):
    prepare, expected = BLOCKS[name]
    if prepare is not None:
        prepare(tmp_path)
    script = tmp_path / "block.py"
    script.write_text(python_blocks()[name])
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value()}
    with _automations_removed_after():
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, f"block {name!r} failed:\n{out.stdout}\n{out.stderr}"
    if expected is not None:
        assert expected in out.stdout.splitlines(), (name, out.stdout)
    noise = [line for line in (out.stdout + out.stderr).splitlines()
             if "ERROR" in line or "Traceback" in line]
    assert not noise, f"block {name!r} succeeded but printed errors: {noise}"


@contextlib.contextmanager
def _automations_removed_after():
    """Delete the automations a block creates on the harness's server when it ends: they would
    act on the events of every later test of this worker (one in docs/prefect.md starts a
    deployment run on every fifth epoch any checkpoint commits)."""
    with get_client(sync_client=True) as client:
        before = {a.id for a in client.read_automations()}
        try:
            yield
        finally:
            for automation in client.read_automations():
                if automation.id not in before:
                    client.delete_automation(automation.id)


def test_the_command_line_block_runs_in_order(tmp_path):
    """The ``caffe2ckpt`` lines of docs/cli.md, top to bottom, on what the first command leaves
    (the S3 line needs a bucket and is left out): each exits 0 (before, ``gc --yes`` deleted
    the epochs the next line compared)."""
    regression_checkpoints(tmp_path)
    block = doc_blocks("bash")["docs/cli.md > Command line #1"]
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    commands = [line for line in lines if line.startswith("caffe2ckpt ") and "s3://" not in line]
    assert len(commands) >= 8, commands
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for line in commands:
        out = subprocess.run([sys.executable, "-m", "caffe2ckpt.cli", *shlex.split(line)[1:]],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 0, f"{line!r} exited {out.returncode}:\n{out.stderr}"


def test_the_letting_go_block_runs_in_order(tmp_path):
    """The ``gc --drop-old-node-sets`` lines of docs/elastic.md on what its "In short" block
    leaves, once the 2 nodes saved a step of their own: the dry run removes nothing, the next
    line removes the 4-node saves, the last (with ``--keep-last``) leaves the 2-node one."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    setup = python_blocks()["docs/elastic.md > In short #1"] + (
        "with StepCheckpointManager('checkpoints/elastic', nodes=new, layout=layout) as mgr:\n"
        "    mgr.save(8, mgr.restore())\n")
    (tmp_path / "setup.py").write_text(setup)
    subprocess.run([sys.executable, "setup.py"], cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=120)
    block = doc_blocks("bash")["docs/elastic.md > Letting old node sets go #1"]
    commands = [line.split("#")[0].strip() for line in block.splitlines()
                if line.startswith("caffe2ckpt ")]
    assert len(commands) == 3, commands
    nodes_left = []
    for line in commands:
        out = subprocess.run([sys.executable, "-m", "caffe2ckpt.cli", *shlex.split(line)[1:]],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 0, f"{line!r} exited {out.returncode}:\n{out.stderr}"
        ls = subprocess.run([sys.executable, "-m", "caffe2ckpt.cli", "ls", "--json",
                             "checkpoints/elastic"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120, check=True)
        nodes_left.append(sorted({len(row["nodes"]) for row in json.loads(ls.stdout)["epochs"]
                                  if row["state"] == "committed"}))
    assert nodes_left == [[2, 4], [2], [2]], nodes_left


@pytest.mark.slow
def test_the_deployment_block_runs_in_order(tmp_path):
    """The "Scheduled deployments" block of docs/prefect.md, then its "Events and automations"
    blocks, as a user goes on from one to the other, from a copy of the repo's prefect.yaml and
    flows/, with a server of its own on a free port for 4200 (the last line of the first block,
    which stops the worker and then the server, comes last). The server starts, the deployment
    run completes, the automations created with the prefix as the deployment names it (a
    relative path) make the worker run the evaluation for epochs 4 and 5 (before, given that
    path, they never fired: nothing ran), and the last line stops the worker and the server."""
    block = doc_blocks("bash")["docs/prefect.md > Scheduled deployments #1"]
    assert "prefect worker start" in block and block.rstrip().endswith("then the server")
    *lines, stop = block.rstrip().splitlines()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "automations.py").write_text(
        python_blocks()["docs/prefect.md > Events and automations #1"])
    (scratch / "wait.py").write_text(_WAIT_FOR_EVALUATIONS)
    script = "\n".join([*lines, "python scratch/automations.py",
                        doc_blocks("bash")["docs/prefect.md > Events and automations #1"].rstrip(),
                        "python scratch/wait.py", stop])
    shutil.copy(REPO / "prefect.yaml", tmp_path)
    env = _block_env(tmp_path, own_server=True)
    env["PREFECT_WORKER_QUERY_SECONDS"] = "2"  # the worker looks for runs every 2 s, not 10
    code, text, leftovers = _run_block(script.replace("4200", str(free_port())), tmp_path, env,
                                       logs=["scratch/worker.log", "scratch/server.log"])
    assert code == 0, f"the block exited {code}:\n{text}"
    assert "automations created: True" in text.splitlines(), text
    assert "Flow run finished successfully in 'Completed'" in text, text
    assert "evaluated epochs: [4, 5]" in text.splitlines(), text
    assert "Worker '" in text and "' stopped!" in text, text  # kill %2: the worker, in its log
    assert re.search(r"Terminated +prefect server start", text), text  # kill %1: the server
    assert not leftovers, (leftovers, text)
    assert _resume_epoch(tmp_path / "checkpoints" / "regression") == 7  # 2, then 5 more


# What a user waits for before stopping the worker: the evaluation runs the automations made,
# finished (Completed, or the test fails naming their states).
_WAIT_FOR_EVALUATIONS = """
import time
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

deadline = time.monotonic() + 120
with get_client(sync_client=True) as client:
    while True:
        runs = client.read_flow_runs(flow_filter=FlowFilter(
            name=FlowFilterName(any_=["evaluate-checkpoint"])))
        if len(runs) >= 2 and all(r.state.is_final() for r in runs):
            break
        assert time.monotonic() < deadline, [(r.parameters, r.state_name) for r in runs]
        time.sleep(1)
assert all(r.state.is_completed() for r in runs), [(r.parameters, r.state_name) for r in runs]
print("evaluated epochs:", sorted(r.parameters["epoch"] for r in runs))
"""


@pytest.mark.slow
def test_the_resuming_block_runs_in_order(tmp_path):
    """The "Try resuming" block of docs/getting-started.md, as written, against the harness's
    server: the planned failure is retried and resumes from epoch 4, the later lines continue to
    12 and 15, going back to 6 ends at 8, and the plain example trains without Prefect."""
    block = doc_blocks("bash")["docs/getting-started.md > Try resuming #1"]
    code, text, leftovers = _run_block(block, tmp_path, _block_env(tmp_path))
    assert code == 0 and not leftovers, f"the block exited {code} ({leftovers}):\n{text}"
    assert "Resuming from epoch 4" in text, text
    assert [line for line in text.splitlines() if line.startswith("final epoch:")] == [
        "final epoch: 8", "final epoch: 12", "final epoch: 15", "final epoch: 8"], text
    assert _resume_epoch(tmp_path / "checkpoints" / "demo") == 8
    assert _resume_epoch(tmp_path / "checkpoints" / "plain") == 10


S3_DEFAULT_PORTS = (8333, 9333, 8080, 8888, 18333, 19333, 18080, 18888)  # weed mini's


@pytest.mark.slow
def test_the_local_s3_block_runs_in_order(tmp_path):
    """The "A local S3 server to try it" block of docs/storage.md: SeaweedFS starts on its
    default ports (its first line, less the ``pip install``), the example trains on
    s3://checkpoints/demo and resumes there when run again, and the last line stops SeaweedFS.
    Between the first line and the second the test waits until the bucket answers, as a user
    typing the next line does."""
    busy = [port for port in S3_DEFAULT_PORTS if _listening(port)]
    if busy:
        pytest.skip(f"weed mini's default ports {busy} are in use on 127.0.0.1")
    start, *rest = _without_pip(doc_blocks("bash")["docs/storage.md > A local S3 server to try "
                                                   "it #1"]).splitlines()
    flow_line = next(line for line in rest if line.startswith("python flows/regression.py"))
    env = _block_env(tmp_path)
    code, text, leftovers = _run_block(start, tmp_path, env, keep_running=True)
    assert code == 0, text
    try:
        _wait_for_bucket("checkpoints")
        code, text, leftovers = _run_block("\n".join([flow_line, *rest]), tmp_path, env,
                                           keep_running=True)
    finally:  # the last line stopped SeaweedFS: it shuts down in seconds, more under load
        leftovers += _stop_leftovers(tmp_path, env, grace=60)
    assert code == 0 and not leftovers, f"the block exited {code} ({leftovers}):\n{text}"
    finals = [line for line in text.splitlines() if line.startswith("final epoch:")]
    assert finals == ["final epoch: 10", "final epoch: 10"], text
    assert "Resuming from epoch 10" in text, text


@pytest.mark.slow
def test_the_dask_block_runs_in_order(tmp_path):
    """The block of docs/dask.md with its flow saved as my_cluster_flow.py, as written (a free
    port for 8786; ``pip install`` left out): a scheduler and two workers start, the example
    and the flow train with each node on a worker, and the last line stops the workers and then
    the scheduler."""
    port = str(free_port())
    block = _without_pip(doc_blocks("bash")["docs/dask.md > Scale-out with Dask #1"])
    flow = python_blocks()["docs/dask.md > Scale-out with Dask #1"]
    env = _block_env(tmp_path)
    (Path(env["TMPDIR"]) / "my_cluster_flow.py").write_text(flow.replace("8786", port))
    assert block.rstrip().endswith("# when you are done: stop the workers, then the scheduler")
    code, text, leftovers = _run_block(block.replace("8786", port), tmp_path, env,
                                       logs=["scratch/dask.log"])
    assert code == 0 and not leftovers, f"the block exited {code} ({leftovers}):\n{text}"
    assert "final epoch: 10" in text.splitlines() and "10" in text.splitlines(), text
    assert _resume_epoch(tmp_path / "checkpoints" / "cluster") == 10
    assert _resume_epoch(tmp_path / "checkpoints" / "my-cluster-job", ["trainer_0",
                                                                       "trainer_1"]) == 10


def _block_env(tmp_path: Path, own_server: bool = False) -> dict[str, str]:
    """A terminal's environment for a block: this environment's ``python``, ``prefect`` and
    ``dask`` first on PATH, a PREFECT_HOME of its own (which also finds what the block left
    running), and the harness's server unless the block starts its own."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    (tmp_path / "scratch").mkdir(exist_ok=True)
    env.update(PREFECT_HOME=str(prefectdb.seed_home(tmp_path / "home")),
               PATH=f"{venv_bin}:{env.get('PATH', '')}", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(REPO), TMPDIR=str(tmp_path / "scratch"))
    if not own_server:
        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    return env


def _run_block(script: str, tmp_path: Path, env: dict, *, logs: tuple | list = (),
               keep_running: bool = False, timeout: float = 300) -> tuple:
    """Run ``script`` with ``bash -x`` in ``tmp_path`` (with a copy of flows/) as a terminal's
    shell runs it (``set -em``: stop at the first failure, job control on). Returns the exit
    code, the output (and the tails of ``logs``), and what it left running (stopped, unless
    ``keep_running``)."""
    if not (tmp_path / "flows").exists():
        shutil.copytree(REPO / "flows", tmp_path / "flows")
    (tmp_path / "block.sh").write_text("set -em\n" + script)
    log = tmp_path / "block.log"
    leftovers: list[str] = []
    try:
        with open(log, "wb") as out:
            code = subprocess.run(["bash", "-x", "block.sh"], cwd=tmp_path, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout, check=False,
                                  preexec_fn=_as_from_a_terminal).returncode
    except subprocess.TimeoutExpired:
        code = f"timed out after {timeout} s"
    finally:
        if not keep_running:
            leftovers = _stop_leftovers(tmp_path, env)
    text = log.read_text(errors="replace")
    # a block leaves nothing in the directory it runs in (the repository, for a user) but the
    # checkpoints it writes: logs, data and files to save go to $TMPDIR
    left = {p.name for p in tmp_path.iterdir()} - {"flows", "prefect.yaml", "block.sh",
                                                   "block.log", "home", "scratch", "checkpoints"}
    assert not left, f"the block left {sorted(left)} in the directory it ran in"
    for name in logs:
        path = tmp_path / name
        text += f"\n--- {name}:\n" + (path.read_text(errors="replace")[-6000:]
                                       if path.exists() else "(none)")
    return code, text, leftovers


def _without_pip(block: str) -> str:
    """The block less its ``pip install`` steps (this environment has the test extra)."""
    lines = []
    for line in block.splitlines():
        line = re.sub(r"^pip install [^&]*&& ", "", line)
        if not line.startswith("pip install "):
            lines.append(line)
    return "\n".join(lines) + "\n"


def _resume_epoch(url: Path, nodes: list[str] | None = None) -> int | None:
    cm = MultiNodeCheckpointManager(str(url))
    cm.set_params(nodes=nodes or ["trainer_0", "trainer_1"])
    return cm.get_resume_from_epoch_id()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for_bucket(bucket: str, timeout: float = 90) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(key="demo", secret="demo-secret", skip_instance_cache=True,
                           endpoint_url="http://127.0.0.1:8333")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fs.ls(bucket, refresh=True)
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _as_from_a_terminal() -> None:
    """SIGINT as a terminal's shell has it. A suite started in the background of a script
    inherits it ignored, and a shell cannot undo that for its jobs: Prefect's worker turns
    SIGTERM into a SIGINT to itself, which then does nothing, and ``kill %1; wait`` hangs (seen
    in CI: "Received SIGTERM. Sending SIGINT to the process worker", then nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_leftovers(tmp_path: Path, env: dict, grace: float = 15) -> list[str]:
    """Stop what the block left running (stopping takes a moment: ``grace`` seconds); the
    command lines of those that had to be killed."""
    ours = []
    for proc in psutil.process_iter(["environ"]):
        try:
            if (proc.info["environ"] or {}).get("PREFECT_HOME") == env["PREFECT_HOME"]:
                ours.append(proc)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(ours, timeout=grace)
    found = []
    for proc in alive:
        try:
            found.append(" ".join(proc.cmdline()))
            proc.kill()
        except psutil.Error:
            continue
    return found
