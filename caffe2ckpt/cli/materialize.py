"""``caffe2ckpt materialize``: write a committed epoch as ordinary Zarr groups, every blob an
array of its own (a differential epoch included), for readers without caffe2ckpt."""

from __future__ import annotations

import argparse

from caffe2ckpt.cli._context import EXIT_OK, EXIT_USAGE, CLIError, Context, Document
from caffe2ckpt.steps.plainzarr import materialize

__all__ = ["cmd_materialize"]


def cmd_materialize(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    try:
        written = materialize(args.prefix, args.epoch, args.dest, nodes=args.node,
                              storage_options=args.storage_options,
                              dest_storage_options=args.dest_storage_options)
    except FileExistsError as exc:  # DEST names a group already there: the arguments are wrong
        raise CLIError(str(exc), EXIT_USAGE) from exc
    return {"prefix": args.prefix, "epoch": args.epoch, "dest": args.dest,
            "groups": written}, EXIT_OK
