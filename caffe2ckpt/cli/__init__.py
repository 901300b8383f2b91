"""The ``caffe2ckpt`` command: inspect, verify, clean up and compare a checkpoint prefix.

Commands (``caffe2ckpt COMMAND --help`` for each)::

    caffe2ckpt ls PREFIX                       epochs, nodes, committed or not, bytes, metrics
    caffe2ckpt show PREFIX [--epoch N]         the blobs of an epoch (add --verify to read them)
    caffe2ckpt verify PREFIX [--epoch N]       re-read every committed checkpoint, check checksums
    caffe2ckpt gc PREFIX [--keep-last N] ...   remove leftovers and old epochs (dry run: no --yes)
    caffe2ckpt diff PREFIX A B                 which blobs changed between epochs A and B
    caffe2ckpt materialize PREFIX --epoch E DEST   an epoch as plain Zarr, an array per blob

Every command takes ``--json`` (one JSON document on stdout) and ``--storage-options JSON``.
``main(argv)`` returns the exit code instead of exiting, so it can be called in-process.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from caffe2ckpt import events, plugins
from caffe2ckpt.cli._context import (
    EXIT_DAMAGED,
    EXIT_IO,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    CLIError,
    Context,
    Document,
)
from caffe2ckpt.cli.diff import cmd_diff
from caffe2ckpt.cli.gc import cmd_gc
from caffe2ckpt.cli.ls import cmd_ls
from caffe2ckpt.cli.materialize import cmd_materialize
from caffe2ckpt.cli.render import Progress, render
from caffe2ckpt.cli.show import cmd_show
from caffe2ckpt.cli.verify import cmd_verify
from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
    InvalidLocationError,
    JobDefinitionError,
    StorageCredentialsError,
)
from caffe2ckpt.naming import check_epoch, check_node_name
from caffe2ckpt.urls import public_url

__all__ = ["build_parser", "main"]

PROG = "caffe2ckpt"
COMMANDS: dict[str, Callable[[Context, argparse.Namespace], tuple[Document, int]]] = {
    "ls": cmd_ls, "show": cmd_show, "verify": cmd_verify, "gc": cmd_gc, "diff": cmd_diff,
    "materialize": cmd_materialize,
}

DESCRIPTION = """\
Inspect, verify, clean up and compare caffe2ckpt checkpoints.

PREFIX is a checkpoint prefix: a local folder or any fsspec URL (s3://bucket/run,
gs://..., memory://...), the same string given to JobRunner's checkpoint manager or
StepCheckpointManager. Only commit records decide what is committed; nothing here ever
changes a committed checkpoint except `gc --yes` deleting epochs outside the retention
policy you give it."""

EXIT_CODES = """\
exit codes:
  0  success (also: gc dry run, diff with differences)
  1  damage found: verify, show --verify or diff read a checksum or record that fails
  2  wrong arguments (usage error, bad --storage-options JSON, unknown metric, a URL
     whose filesystem package is not installed, a materialize DEST that exists)
  3  not found: nothing at PREFIX, or the epoch / node asked for is not committed there
  4  the storage failed: no credentials found, permission denied (also credentials
     the store rejects), network error, or a gc deletion failed
"""

EPILOGS = {
    None: f"""\
examples:
  caffe2ckpt ls checkpoints/regression
  caffe2ckpt show checkpoints/regression --epoch 7 --node trainer_0
  caffe2ckpt verify s3://bucket/run --storage-options '{{"anon": false}}'
  caffe2ckpt gc checkpoints/regression --keep-last 3 --keep-every 10      # dry run
  caffe2ckpt diff checkpoints/regression 6 7 --json

{EXIT_CODES}""",
    "ls": """\
One row per epoch: committed (every node of its save has a commit record), superseded
(committed, but a later run resumed from an earlier epoch and went on from there: never a
resume point; retention deletes it), partial (some records are missing: not committed) or
"damaged record" (a record that cannot be read). Leftovers are data no record references (interrupted saves); `gc` removes them.

examples:
  caffe2ckpt ls checkpoints/regression
  caffe2ckpt ls memory://runs/a --json | jq '.epochs[] | {epoch, state, bytes}'
""",
    "show": """\
Without --verify only metadata is read: "crc32c recorded" means the manifest holds a
CRC32C for every chunk. --verify reads every blob and checks them (ok / BAD; exit 1 if
any is BAD).

examples:
  caffe2ckpt show checkpoints/regression                     # the newest epoch
  caffe2ckpt show checkpoints/regression --epoch 7 --node trainer_1 --verify
""",
    "verify": """\
Reads every blob of every committed node checkpoint (or only --epoch / --node) and checks
the record, the metadata digests and every chunk's CRC32C. Exit 1 if anything is damaged;
each damage names the node, epoch and blob. A progress bar is drawn on stderr when it is a
terminal.

examples:
  caffe2ckpt verify checkpoints/regression
  caffe2ckpt verify s3://bucket/run --epoch 12 --node trainer_0 --json
""",
    "gc": """\
A dry run unless --yes: prints the uncommitted leftovers older than --min-age and the
epochs outside the retention policy, and why each kept epoch is kept. Retention keeps the
union of --keep-last, --keep-every and --keep-best; the newest committed epoch is always
kept; with no --keep-* option no committed epoch is deleted (only leftovers). Epochs are
deleted records first, then data, so an interrupted gc leaves only leftovers. With
--node, only those nodes' checkpoints are considered and deleted; an epoch saved together
with other nodes is never split. With --drop-old-node-sets, a job that changed its node
count (2 -> 3 -> 1 nodes) also lets go of every epoch of the node sets it left, once the
node set it runs on now has committed epochs of its own; that node set's epochs and other
jobs on the prefix stay (the --keep-* options apply to them as ever).

examples:
  caffe2ckpt gc checkpoints/regression                         # leftovers only, dry run
  caffe2ckpt gc checkpoints/regression --keep-last 3 --keep-every 10 --yes
  caffe2ckpt gc checkpoints/regression --keep-best 2 --metric loss --mode min --keep-last 1
  caffe2ckpt gc checkpoints/elastic --drop-old-node-sets --keep-last 3 --yes
""",
    "diff": """\
For every node and blob: added, removed, changed or same. Changed blobs of equal dtype and
shape report how many elements differ and the largest |b - a| (NaN == NaN counts as same);
dtype and shape changes are reported as such. Both epochs are read and verified blob by
blob. The exit code is 0 whether or not anything changed.

When both epochs were saved with a layout (caffe2ckpt.Layout), the global arrays are
compared instead, whatever nodes saved them: each blob split by rows as the whole table
(node "(global)", and which global rows differ), each replicated blob once, local blobs per
node. So a job resumed on another number of nodes diffs as identical when its tables moved
bit for bit. The line under the summary (--json: "compared", "compared_why") says which
comparison was made and why; --node always compares per node.

examples:
  caffe2ckpt diff checkpoints/regression 6 7
  caffe2ckpt diff checkpoints/elastic 12 13          # 4 nodes -> 3: global arrays
  caffe2ckpt diff checkpoints/regression 0 7 --node trainer_0 --all --json
""",
    "materialize": """\
Reads every node of the epoch (or only --node), verified as a restore is (a differential
epoch's chain resolved, its digests checked), one blob at a time, and writes each as
DEST/<node>.<epoch>: an ordinary Zarr v3 group in which every blob, small ones included, is
an array of its own at its blob path, whatever kind the epoch is. An existing group at DEST
is never overwritten (exit 2, before anything is read).

examples:
  caffe2ckpt materialize checkpoints/regression --epoch 7 /tmp/epoch7
  caffe2ckpt materialize s3://bucket/run --epoch 12 --node trainer_0 ./plain
  caffe2ckpt materialize s3://bucket/run --epoch 12 --consolidate ./global
""",
}


def _epoch(text: str) -> int:
    try:
        return check_epoch(int(text))
    except (ValueError, InvalidLocationError) as exc:
        raise argparse.ArgumentTypeError(f"not an epoch number (0 or more): {text!r}") from exc


def _node(text: str) -> str:
    try:
        return check_node_name(text)
    except InvalidLocationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from exc
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


def _storage_options(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({exc.msg} at character {exc.pos}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"anon\": true}}', got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose "invalid choice" (a mistyped command, a ``--mode``) says which
    choice was probably meant."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is None or value in choices or not isinstance(value, str):
            super()._check_value(action, value)
            return
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
        meant = f"; did you mean {close[0]!r}?" if close else ""
        raise argparse.ArgumentError(action, f"invalid choice: {value!r}{meant} (choose from "
                                             f"{', '.join(map(repr, choices))})")


def _common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """--json, --storage-options, --no-progress: before or after the command name."""
    default: Any = argparse.SUPPRESS if suppress else None
    parser.add_argument("--json", action="store_true",
                        default=argparse.SUPPRESS if suppress else False,
                        help="print one JSON document on stdout instead of tables")
    parser.add_argument("--storage-options", metavar="JSON", type=_storage_options,
                        default=default,
                        help="fsspec options for PREFIX as a JSON object, e.g. "
                             "'{\"client_kwargs\": {\"endpoint_url\": \"http://minio:9000\"}}'")
    parser.add_argument("--no-progress", action="store_true",
                        default=argparse.SUPPRESS if suppress else False,
                        help="never draw a progress bar (it is only drawn when stderr is a "
                             "terminal)")


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog=PROG, description=DESCRIPTION,
                     epilog=EPILOGS[None], formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _common(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                           epilog=EPILOGS[name] + "\n" + EXIT_CODES, formatter_class=formatter)
        p.add_argument("prefix", metavar="PREFIX",
                       help="checkpoint prefix: local folder or fsspec URL")
        _common(p, suppress=True)
        return p

    def nodes(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--node", metavar="NODE", type=_node, action="append",
                       help=f"{what} (repeat for several; default: every node)")

    command("ls", "list epochs (committed or not, nodes, bytes, metrics) and leftovers")

    p = command("show", "list the blobs of one epoch: dtype, shape, bytes, checksum state")
    p.add_argument("--epoch", metavar="N", type=_epoch,
                   help="the epoch (default: the newest committed one)")
    nodes(p, "only this node")
    p.add_argument("--verify", action="store_true",
                   help="read every blob and check its checksums (ok / BAD)")

    p = command("verify", "re-read committed checkpoints and check every checksum")
    p.add_argument("--epoch", metavar="N", type=_epoch, help="only this epoch (default: all)")
    nodes(p, "only this node")

    p = command("gc", "remove uncommitted leftovers and epochs outside a retention policy "
                      "(dry run unless --yes)")
    policy = p.add_argument_group("retention (an epoch is kept if any rule keeps it)")
    policy.add_argument("--keep-last", metavar="N", type=_positive,
                        help="keep the newest N committed epochs")
    policy.add_argument("--keep-every", metavar="K", type=_positive,
                        help="keep every epoch divisible by K")
    policy.add_argument("--keep-best", metavar="N", type=_positive,
                        help="keep the best N epochs by --metric (needs --metric)")
    policy.add_argument("--metric", metavar="NAME",
                        help="the metric --keep-best ranks by, e.g. loss")
    policy.add_argument("--mode", choices=["min", "max"], default="min",
                        help="whether a smaller (min, default) or larger metric is better")
    p.add_argument("--min-age", metavar="SECONDS", type=_seconds, default=3600.0,
                   help="only remove leftovers at least this old, so saves in progress are left "
                        "alone (default: 3600)")
    nodes(p, "only this node's checkpoints and leftovers")
    p.add_argument("--drop-old-node-sets", action="store_true",
                   help="also delete every epoch of the node sets a resized job has left, once "
                        "its current node set has committed epochs of its own (see "
                        "docs/elastic.md)")
    p.add_argument("--yes", action="store_true", help="really delete (default: dry run)")

    p = command("diff", "which blobs changed between two epochs, and by how much")
    p.add_argument("epoch_a", metavar="A", type=_epoch, help="the older epoch")
    p.add_argument("epoch_b", metavar="B", type=_epoch, help="the newer epoch")
    nodes(p, "only this node, compared per node even when both saves have a layout")
    p.add_argument("--all", action="store_true",
                   help="also list unchanged blobs (always listed with --json)")

    p = command("materialize", "write an epoch as plain Zarr groups, an array per blob "
                               "(deltas resolved)")
    p.add_argument("--epoch", metavar="E", type=_epoch, help="the epoch (required)")
    p.add_argument("dest", metavar="DEST", help="where to write <node>.<epoch> groups")
    nodes(p, "only this node (with --consolidate: the job holding it; all its nodes are "
             "written)")
    p.add_argument("--dest-storage-options", metavar="JSON", type=_storage_options,
                   help="fsspec options for DEST as a JSON object (default: none)")
    p.add_argument("--consolidate", action="store_true",
                   help="one global group DEST/consolidated.<epoch>: each blob split by rows "
                        "as one array, each replicated blob once, local blobs under <node>/ "
                        "(the layout the save was made with); always every node of the save")
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("caffe2ckpt")
    except Exception:  # noqa: BLE001 - not installed: still print something
        return "unknown"


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The parser :func:`main` uses, built once per process: building it costs ~2 ms (a few
    hundred argparse actions and gettext look-ups), as much as a small command's work, and a
    process may run many commands (the test suite runs thousands). Parsing leaves a parser as
    it was, so one serves every call, from any thread."""
    return build_parser()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (exit 2)
        return int(exc.code or 0)
    problem = _argument_problem(args, extra)
    if problem:
        return _usage(args, problem)
    plugins.load()  # with PREFECT_API_URL: Prefect events, prefect-block:// prefixes
    try:
        outcome = _run(args)
        if isinstance(outcome, int):
            return outcome
        doc, code = outcome
        _print(args, doc)
        return code
    finally:  # after the result is shown: sending events may wait for a slow API
        events.flush()


def _print(args: argparse.Namespace, doc: Document) -> None:
    text = (json.dumps(doc, indent=2, allow_nan=False) if args.json
            else render(args.command, doc))
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into `head`: not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _argument_problem(args: argparse.Namespace, extra: list[str]) -> str | None:
    """What is wrong with the arguments that argparse cannot tell (None: nothing)."""
    if args.command == "materialize" and args.epoch is None:
        return _materialize_epoch_problem(args, extra)
    if extra:  # named with its command, not after the whole program's usage
        hint = (f": an epoch is given as --epoch {extra[0]}"
                if extra[0].isdigit() and args.command in ("show", "verify") else "")
        return f"unrecognized arguments: {' '.join(extra)}{hint}"
    if args.command == "gc" and args.keep_best is not None and not args.metric:
        return "--keep-best needs --metric NAME (the metric to rank by)"
    if args.command == "gc" and args.metric and args.keep_best is None:
        return "--metric is only used with --keep-best N"
    return None


def _materialize_epoch_problem(args: argparse.Namespace, extra: list[str]) -> str:
    """materialize without --epoch: if the epoch was given where DEST goes, say how to give it."""
    if args.dest.isdigit() and len(extra) == 1:
        return (f"the epoch is given as --epoch {args.dest}, e.g. caffe2ckpt materialize PREFIX "
                f"--epoch {args.dest} DEST")
    return "the following argument is required: --epoch E" + (
        f" (and unrecognized arguments: {' '.join(extra)})" if extra else "")


def _run(args: argparse.Namespace) -> tuple[dict, int] | int:
    """The command's document and exit code, or the exit code of its failure (reported)."""
    progress = Progress(sys.stderr, enabled=False if args.no_progress else None)
    ctx = Context(storage_options=args.storage_options, progress=progress)
    try:
        return COMMANDS[args.command](ctx, args)
    except CLIError as exc:
        return _fail(args, str(exc), exc.code)
    except CheckpointCorruptedError as exc:
        return _fail(args, str(exc), EXIT_DAMAGED)
    except StorageCredentialsError as exc:  # the arguments may be right: the storage refused
        return _fail(args, str(exc), EXIT_IO)
    except (InvalidLocationError, JobDefinitionError) as exc:
        return _fail(args, str(exc), EXIT_USAGE)
    except (CheckpointNotFoundError, FileNotFoundError) as exc:
        return _fail(args, str(exc) or repr(exc), EXIT_NOT_FOUND)
    except (CheckpointError, OSError) as exc:
        # an OSError naming its file (the prefix's, or materialize's DEST) needs no prefix
        where = "" if getattr(exc, "filename", None) else f"{public_url(args.prefix)}: "
        return _fail(args, f"{where}{exc or type(exc).__name__}", EXIT_IO)
    except KeyboardInterrupt:
        return _fail(args, "interrupted", 130)
    finally:
        progress.close()


def _usage(args: argparse.Namespace, message: str) -> int:
    prog = f"{PROG} {args.command}"
    sys.stderr.write(f"usage: {prog} ... (see {prog} --help)\n{prog}: error: {message}\n")
    return EXIT_USAGE


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    sys.stderr.write(f"{PROG} {args.command}: error: {message}\n")
    if args.json:
        sys.stdout.write(json.dumps({"error": message, "exit_code": code}) + "\n")
    return code
