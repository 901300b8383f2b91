"""Parsing ``strace -f -y`` logs, for the tests that check what the kernel saw of a save."""

from __future__ import annotations

import posixpath
import re

CALL = re.compile(r"^(?P<pid>\d+)\s+(?:(?P<name>\w+)\((?P<args>.*?)(?: <unfinished \.\.\.>|\) += "
                  r"(?P<ret>.*))$|<\.\.\. (?P<rname>\w+) resumed>.*\) += (?P<rret>.*)$)")
FD_PATH = re.compile(r"^-?\d+<(?P<path>.*)>$")  # a descriptor as ``-y`` shows it: 3</a/b>
# a quoted path, with the directory descriptor before it if any: 3</a>, "b" or AT_FDCWD</c>, "/d"
_AT_PATH = re.compile(r'(?:(?:-?\d+|AT_FDCWD)<(?P<dir>[^>]*)>,\s*)?"(?P<name>(?:[^"\\]|\\.)*)"')


def call_paths(args: str) -> list[str]:
    """The paths a call's arguments name, each relative one resolved against the directory
    descriptor before it: ``mkdirat(3</a>, "b", 0777)`` names ``/a/b``, ``mkdir("/a/b")`` and
    ``renameat(3</a>, "t", 3</a>, "n")`` name ``/a/t`` and ``/a/n``."""
    return [posixpath.join(m["dir"] or "", m["name"]) for m in _AT_PATH.finditer(args)]


def trace_events(log: str) -> list[dict]:
    """The system calls of an ``strace -f -y`` log, completed ones only, in completion order;
    each with its name, arguments, return value (stripped) and the index where it started."""
    started: dict[str, tuple[str, str, int]] = {}
    events = []
    for index, line in enumerate(log.splitlines()):
        m = CALL.match(line)
        if not m:
            continue
        if m["name"] and m["ret"] is None:
            started[m["pid"]] = (m["name"], m["args"], index)
            continue
        if m["name"]:
            name, args, start, ret = m["name"], m["args"], index, m["ret"]
        else:
            name, args, start = started.pop(m["pid"], (m["rname"], "", index))
            ret = m["rret"]
        events.append({"name": name, "args": args, "ret": ret.strip(), "start": start,
                       "end": index})
    return events
