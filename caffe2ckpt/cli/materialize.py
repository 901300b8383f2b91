"""``caffe2ckpt materialize``: write a committed epoch as ordinary whole Zarr groups (a
differential epoch included), for readers without caffe2ckpt."""

from __future__ import annotations

import argparse

from caffe2ckpt.cli._context import EXIT_OK, Context, Document
from caffe2ckpt.steps.plainzarr import materialize

__all__ = ["cmd_materialize"]


def cmd_materialize(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    written = materialize(args.prefix, args.epoch, args.dest, nodes=args.node,
                          storage_options=args.storage_options,
                          dest_storage_options=args.dest_storage_options)
    return {"prefix": args.prefix, "epoch": args.epoch, "dest": args.dest,
            "groups": written}, EXIT_OK
