"""Stopping what a test started: a process, its process group and all its descendants.

A Prefect worker needs more than one SIGTERM to stop, and the flow runs it starts are in new
sessions of their own: signalling one process (or one group) leaks the rest. So the whole tree
is collected first, then sent SIGTERM, and whatever is left after a bounded wait gets SIGKILL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import psutil


def tree(pid: int) -> list[psutil.Process]:
    """``pid``, its descendants, and the members of its process group (when it leads one)."""
    try:
        root = psutil.Process(pid)
        found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    except psutil.NoSuchProcess:
        found = {}
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pid and p.pid not in found:
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return list(found.values())


def stop_tree(proc: subprocess.Popen, grace: float = 15.0) -> list[int]:
    """Stop ``proc`` and everything it started: SIGTERM, then SIGKILL after ``grace`` seconds.

    Returns the pids that needed SIGKILL. Leaves ``proc`` reaped.
    """
    procs = tree(proc.pid)
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=10)
    proc.wait(timeout=10)
    assert not still, f"processes survived SIGKILL: {[p.pid for p in still]}"
    return [p.pid for p in alive]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
