"""Every ```python block of README.md runs as written: each in its own ``python`` process with a
fresh working directory, importing this checkout. Here, under tests/prefect, because the
"Using it" block runs a flow: it reaches the test harness's Prefect server (PREFECT_API_URL)
instead of starting a temporary server of its own."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from prefect.settings import PREFECT_API_URL

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager
from caffe2ckpt.example import build_job
from tests.procs import free_port

REPO = Path(__file__).resolve().parents[2]


def python_blocks() -> dict[str, str]:
    """``{"<section heading> #<n>": code}`` for every ```python block, numbered per section."""
    return readme_blocks("python")


def readme_blocks(language: str) -> dict[str, str]:
    """``{"<section heading> #<n>": code}`` for every ```<language> block, numbered per
    section."""
    blocks: dict[str, str] = {}
    section = "(top)"
    lines = iter((REPO / "README.md").read_text().splitlines())
    for line in lines:
        if line.startswith("#"):
            section = line.lstrip("#").strip()
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


# Per block: what must be there before it runs, and a line its output must contain (the value
# its comments state, so they are checked too).
BLOCKS = {
    "Using it #1": (None, "10"),
    "Save policies, retention, metrics and preemption #1": (None, "[0, 10, 12, 15, 20]"),
    "The Orbax-style step API #1": (None, None),
    # Only defines its flow: running it needs a Dask scheduler and a prefix every worker can reach
    # (tests/prefect/test_dask_prefect.py runs PrefectSession(nodes=DaskSession(...)) flows).
    "Running on a cluster #1": (None, None),
    "Differential epochs #1": (None, "True [2, 3, 4]"),
    "Storage format #1": (regression_checkpoints, "trainer_0.10 True"),
    "Storage format #2": (regression_checkpoints, "(32768, 8) 0.50399417"),
}


def test_every_python_block_is_covered():
    assert sorted(python_blocks()) == sorted(BLOCKS)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_readme_python_block_runs_as_written(name, tmp_path):
    prepare, expected = BLOCKS[name]
    if prepare is not None:
        prepare(tmp_path)
    script = tmp_path / "block.py"
    script.write_text(python_blocks()[name])
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value()}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, f"README block {name!r} failed:\n{out.stdout}\n{out.stderr}"
    if expected is not None:
        assert expected in out.stdout.splitlines(), (name, out.stdout)
    noise = [line for line in (out.stdout + out.stderr).splitlines()
             if "ERROR" in line or "Traceback" in line]
    assert not noise, f"README block {name!r} succeeded but printed errors: {noise}"


def test_the_command_line_block_runs_in_order(tmp_path):
    """The README's ``caffe2ckpt`` lines, top to bottom, on what the first command leaves
    (the S3 line needs a bucket and is left out): each exits 0 (before, ``gc --yes`` deleted
    the epochs the next line compared)."""
    regression_checkpoints(tmp_path)
    block = readme_blocks("bash")["Command line #1"]
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    commands = [line for line in lines if line.startswith("caffe2ckpt ") and "s3://" not in line]
    assert len(commands) >= 7, commands
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for line in commands:
        out = subprocess.run([sys.executable, "-m", "caffe2ckpt.cli", *shlex.split(line)[1:]],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 0, f"{line!r} exited {out.returncode}:\n{out.stderr}"


@pytest.mark.slow
def test_the_deployment_block_runs_in_order(tmp_path):
    """The "Scheduled deployments" block, top to bottom, as a user's terminal runs it (job
    control on and SIGINT not ignored: a script's background jobs would ignore SIGINT, which
    Prefect's worker turns SIGTERM into) from a copy of the repo's prefect.yaml and flows/, with its own
    PREFECT_HOME and a free port for 4200: the server starts, the deployment run completes,
    and the last line stops the worker and then the server."""
    block = readme_blocks("bash")["Scheduled deployments and the Prefect UI #1"]
    assert "prefect worker start" in block and block.rstrip().endswith("# when you are done")
    shutil.copy(REPO / "prefect.yaml", tmp_path)
    shutil.copytree(REPO / "flows", tmp_path / "flows")
    port = str(free_port())
    (tmp_path / "block.sh").write_text("set -em\n" + block.replace("4200", port))
    venv_bin = str(Path(sys.executable).parent)  # `prefect` and `python` of this environment
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PATH=f"{venv_bin}:{env.get('PATH', '')}",
               PYTHONUNBUFFERED="1")  # the worker's log as it goes, also if it hangs
    log = tmp_path / "block.log"
    try:
        with open(log, "wb") as out:
            code = subprocess.run(["bash", "-x", "block.sh"], cwd=tmp_path, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=240, check=False,
                                  preexec_fn=_as_from_a_terminal).returncode
    except subprocess.TimeoutExpired:
        code = "timed out after 240 s"
    finally:
        leftovers = _stop_leftovers(tmp_path, env)
    text = log.read_text(errors="replace")
    worker = tmp_path / "worker.log"
    evidence = (f"{text[-4000:]}\n--- worker.log:\n"
                + (worker.read_text(errors="replace")[-6000:] if worker.exists() else "(none)"))
    assert code == 0, f"the block exited {code}:\n{evidence}"
    assert "Flow run finished successfully in 'Completed'" in text, evidence
    assert "Server stopped!" in text and not leftovers, (leftovers, evidence)
    cm = MultiNodeCheckpointManager(str(tmp_path / "checkpoints" / "regression"))
    cm.set_params(nodes=["trainer_0", "trainer_1"])
    assert cm.get_resume_from_epoch_id() == 2  # --param epochs_per_run=2 on a first run


def _as_from_a_terminal() -> None:
    """SIGINT as a terminal's shell has it. A suite started in the background of a script
    inherits it ignored, and a shell cannot undo that for its jobs: Prefect's worker turns
    SIGTERM into a SIGINT to itself, which then does nothing, and ``kill %1; wait`` hangs (seen
    in CI: "Received SIGTERM. Sending SIGINT to the process worker", then nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_leftovers(tmp_path: Path, env: dict) -> list[str]:
    """Stop what the block left running (stopping takes a moment: 15 s of grace); the command
    lines of those that had to be killed."""
    ours = []
    for proc in psutil.process_iter(["environ"]):
        try:
            if (proc.info["environ"] or {}).get("PREFECT_HOME") == env["PREFECT_HOME"]:
                ours.append(proc)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(ours, timeout=15)
    found = []
    for proc in alive:
        try:
            found.append(" ".join(proc.cmdline()))
            proc.kill()
        except psutil.Error:
            continue
    return found
