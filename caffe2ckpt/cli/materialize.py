"""``caffe2ckpt materialize``: write a committed epoch as ordinary Zarr groups, every blob an
array of its own (a differential epoch included), for readers without caffe2ckpt."""

from __future__ import annotations

import argparse

from caffe2ckpt.cli._context import (
    EXIT_OK,
    EXIT_USAGE,
    CLIError,
    Context,
    Document,
    open_prefix,
    require_save,
    save_nodes,
)
from caffe2ckpt.steps.consolidate import write_consolidated
from caffe2ckpt.steps.plainzarr import write_plain
from caffe2ckpt.urls import public_url

__all__ = ["cmd_materialize"]


def cmd_materialize(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    save = require_save(store, found, args.epoch, args.node)
    nodes = save_nodes(save, args.node)
    try:
        if args.consolidate:
            written = write_consolidated(store, save, args.dest,
                                         dest_storage_options=args.dest_storage_options)
        else:
            written = write_plain(store, save, args.dest, nodes=nodes,
                                  dest_storage_options=args.dest_storage_options)
    except FileExistsError as exc:  # DEST names a group already there: the arguments are wrong
        raise CLIError(str(exc), EXIT_USAGE) from exc
    return {"prefix": store.location.display(), "epoch": args.epoch,
            "dest": public_url(args.dest), "groups": written, "nodes": nodes,
            "save_id": save.save_id, "consolidated": bool(args.consolidate),
            "superseded": found.is_superseded(save)}, EXIT_OK
