"""``python -I -S _reaper.py``: stop processes when the process that started us dies.

Reads process ids from stdin, one per line. A ``release`` line ends it without stopping anything
(the parent stopped them itself). End of input without it means the parent is gone: after a
short pause (the server records what the parent sent last) each process gets SIGKILL. Not
SIGTERM: a server told to shut down cancels its services mid-write, and each of them prints an
ERROR traceback ("Error flushing 1 events") into the terminal the parent was started from, after
the user's prompt is back. Its SQLite database survives a kill like any crash.
"""

from __future__ import annotations

import os
import signal
import sys
import time

SETTLE_SECONDS = 2.0


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
    time.sleep(SETTLE_SECONDS)
    _signal({p for p in pids if _alive(p)}, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
