"""Parsing ``strace -f -y`` logs, for the tests that check what the kernel saw of a save."""

from __future__ import annotations

import re

CALL = re.compile(r"^(?P<pid>\d+)\s+(?:(?P<name>\w+)\((?P<args>.*?)(?: <unfinished \.\.\.>|\) += "
                  r"(?P<ret>.*))$|<\.\.\. (?P<rname>\w+) resumed>.*\) += (?P<rret>.*)$)")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')  # the quoted paths of a call's arguments
FD_PATH = re.compile(r"^-?\d+<(?P<path>.*)>$")  # a descriptor as ``-y`` shows it: 3</a/b>


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
