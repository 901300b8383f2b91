"""``python -I -S _reaper.py``: stop processes when the process that started us dies.

Reads process ids from stdin, one per line. A ``release`` line ends it without stopping anything
(the parent stopped them itself). End of input without it means the parent is gone: each process
gets SIGTERM, and SIGKILL if it is still there after a grace period.
"""

from __future__ import annotations

import os
import signal
import sys
import time

GRACE_SECONDS = 10.0


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


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the parent
    pids: set[int] = set()
    for line in sys.stdin:
        word = line.strip()
        if word == "release":
            return 0
        if word.isdigit() and int(word) > 1:
            pids.add(int(word))
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while (alive := {p for p in pids if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(alive, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
