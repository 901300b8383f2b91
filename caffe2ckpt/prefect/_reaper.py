"""``python -I -S _reaper.py``: when the process that started us dies, mark its flow runs
*Crashed* on its temporary Prefect server, then stop that server.

Reads lines from stdin, written by its parent (see ``localserver.py``):

- a process id: a process to stop (each process of the temporary server);
- ``api <url>``: the server's API URL;
- ``owner <host>:<pid>``: the ``infrastructure_pid`` the parent's flow runs carry;
- ``release``: the parent stopped the server itself; end without doing anything.

End of input without ``release`` means the parent is gone (the kernel closes the pipe as it
dies, so this is the time of death). At once, every flow run of ``owner`` left in a state that
is not final (*Running*, *Pending*, ...) is marked *Crashed*: the server stamps the state with
its clock, so the run's end time and duration stop at the death, not at the next run that would
notice it (``orphans.py``, still the fallback on a real server). Then, once the server has
recorded the task-run events the parent sent last, their unfinished task runs are marked
*Crashed* too, their checkpoint artifacts are brought up to date from the commit records
(``python -m caffe2ckpt.prefect refresh-crashed``, see ``crashed.py``), and each process gets
SIGKILL. Not SIGTERM: a server told to shut down cancels
its services mid-write, and each of them prints an ERROR traceback ("Error flushing 1 events")
into the terminal the parent was started from, after the user's prompt is back. Its SQLite
database survives a kill like any crash.

Only the standard library: it talks to the REST API with ``urllib``, with short timeouts and a
bounded total; a server that does not answer is stopped all the same. It prints nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

SETTLE_SECONDS = 2.0  #: the server records what the parent sent last
REQUEST_TIMEOUT = 3.0  #: seconds, per API request
BUDGET_SECONDS = 30.0  #: for all API work, after which the server is stopped regardless
TASKS_STILL_SECONDS = 2.0  #: task-run counts unchanged this long: the server recorded them
NOT_FINAL = ["SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING"]
PAGE = 200
# a task run that never started keeps the name Prefect gave it at creation, "<task name>-<key>"
# (3 hex digits of its dynamic key when run in the flow's threads, the whole key otherwise)
# (caffe2ckpt's task name is the run's label: "epoch_group[trainer_1] e7-1de")
GENERIC_NAME = re.compile(r"^(.*\S\[.+\](?: e\d+)?)-[0-9a-f-]+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else: not ours to stop
        return False
    return True


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Api:
    """The few REST calls to a Prefect server the reaper needs, each bounded in time."""

    def __init__(self, url: str, deadline: float) -> None:
        self.url = url.rstrip("/")
        self.deadline = deadline
        # the server is local: never through an HTTP(S)_PROXY of the environment
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call(self, method: str, path: str, body: object) -> object:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"out of time for {method} {self.url}{path}")
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method=method,
            headers={"Content-Type": "application/json"})
        with self.opener.open(request, timeout=min(REQUEST_TIMEOUT, left)) as response:
            text = response.read()
        return json.loads(text) if text else None

    def crash(self, kind: str, run_id: str, message: str) -> None:
        """Force run ``run_id`` (``kind``: flow_runs or task_runs) into *Crashed*."""
        self.call("POST", f"/{kind}/{run_id}/set_state", {
            "state": {"type": "CRASHED", "name": "Crashed", "message": message},
            "force": True})

    def pages(self, kind: str, criteria: dict) -> list[dict]:
        """Every run ``kind`` matching ``criteria`` (a filter body), page by page."""
        found: list[dict] = []
        while True:
            page = self.call("POST", f"/{kind}/filter",
                             {**criteria, "limit": PAGE, "offset": len(found)})
            found.extend(page)
            if len(page) < PAGE:
                return found


def crash_flow_runs(api: Api, owner: str) -> list[str]:
    """Mark the flow runs of process ``owner`` that are not final *Crashed*; their ids."""
    runs = api.pages("flow_runs", {"flow_runs": {
        "state": {"type": {"any_": NOT_FINAL}}, "deployment_id": {"is_null_": True}}})
    crashed = []
    for run in runs:
        if run.get("infrastructure_pid") == owner:
            api.crash("flow_runs", run["id"], _message(owner))
            crashed.append(run["id"])
    return crashed


def _message(owner: str) -> str:
    return (f"caffe2ckpt: the process that ran this flow run ({owner}) died; marked Crashed "
            f"by the reaper of its temporary Prefect server")


def wait_until_recorded(api: Api, flow_run_ids: list[str]) -> None:
    """Until the counts of those flow runs' task runs (all, unfinished) stop changing."""
    runs = {"flow_runs": {"id": {"any_": flow_run_ids}}}
    unfinished = {**runs, "task_runs": {"state": {"type": {"any_": NOT_FINAL}}}}

    def counts() -> tuple[object, object]:
        return (api.call("POST", "/task_runs/count", runs),
                api.call("POST", "/task_runs/count", unfinished))

    seen, since = counts(), time.monotonic()
    while time.monotonic() - since < TASKS_STILL_SECONDS:
        time.sleep(0.25)
        now = counts()
        if now != seen:
            seen, since = now, time.monotonic()


def crash_task_runs(api: Api, flow_run_ids: list[str], owner: str) -> int:
    """Mark the unfinished task runs of those flow runs *Crashed*, naming the ones that never
    started as caffe2ckpt does once they start; how many."""
    tasks = api.pages("task_runs", {"flow_runs": {"id": {"any_": flow_run_ids}},
                                    "task_runs": {"state": {"type": {"any_": NOT_FINAL}}}})
    for task in tasks:
        generic = GENERIC_NAME.match(task.get("name") or "")
        if generic:
            api.call("PATCH", f"/task_runs/{task['id']}", {"name": generic.group(1)})
        api.crash("task_runs", task["id"], _message(owner))
    return len(tasks)


def crash_orphans(url: str, owner: str) -> None:
    """What the dead parent's flow runs and task runs should have ended as: *Crashed*."""
    api = Api(url, time.monotonic() + BUDGET_SECONDS)
    flow_run_ids = crash_flow_runs(api, owner)
    if flow_run_ids:
        wait_until_recorded(api, flow_run_ids)
        crash_task_runs(api, flow_run_ids, owner)
        refresh_artifacts(url, flow_run_ids, api.deadline)


def refresh_artifacts(url: str, flow_run_ids: list[str], deadline: float) -> None:
    """Bring the crashed runs' checkpoint artifacts up to date from their records: a process
    with caffe2ckpt and Prefect (``python -m caffe2ckpt.prefect refresh-crashed``), within the
    reaper's time budget."""
    left = deadline - time.monotonic()
    if left <= 1:
        return
    subprocess.run([sys.executable, "-m", "caffe2ckpt.prefect", "refresh-crashed",
                    "--why", "its process died, and the reaper of its temporary server marked "
                    "it Crashed", *flow_run_ids],
                   env={**os.environ, "PREFECT_API_URL": url}, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=left,
                   check=False)


def read_parent(lines) -> tuple[set[int], dict[str, str]] | None:
    """The processes and settings the parent sent; None once it sent ``release``."""
    pids: set[int] = set()
    said: dict[str, str] = {}
    for line in lines:
        word, _, value = line.strip().partition(" ")
        if word == "release":
            return None
        if word in ("api", "owner") and value:
            said[word] = value.strip()
        elif word.isdigit() and int(word) > 1:
            pids.add(int(word))
    return pids, said


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the parent
    sent = read_parent(sys.stdin)
    if sent is None:
        return 0
    pids, said = sent
    died = time.monotonic()
    try:
        if "api" in said and "owner" in said:
            crash_orphans(said["api"], said["owner"])
    except Exception:  # noqa: BLE001 - unreachable, refused, out of time: the next run's sweep
        pass  # (orphans.py) marks the runs then; the server must stop all the same
    time.sleep(max(0.0, SETTLE_SECONDS - (time.monotonic() - died)))
    _signal({p for p in pids if _alive(p)}, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
