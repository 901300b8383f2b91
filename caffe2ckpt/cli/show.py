"""``caffe2ckpt show``: the blobs of one epoch (``--verify`` reads and checks them)."""

from __future__ import annotations

import argparse

from caffe2ckpt.cli._context import (
    EXIT_DAMAGED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    CLIError,
    Context,
    Document,
    check_nodes,
    checked_manifest,
    group_epoch,
    json_metrics,
    layout_doc,
    open_prefix,
    require_save,
    save_kind,
    save_nodes,
)
from caffe2ckpt.errors import (
    CheckpointCorruptedError,
)
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import PrefixScan
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.manifest import PACKED_ARRAY, BlobInfo, Manifest
from caffe2ckpt.store.format.records import CommitRecord

__all__ = ["cmd_show"]


def newest_epoch(store: CheckpointStore, found: PrefixScan, nodes: list[str] | None) -> int:
    """The newest epoch of the current lineage of the job holding ``nodes`` (never a
    superseded one)."""
    epoch = found.newest_epoch(nodes or ())
    if epoch is None:
        held = f" holding node(s) {list(nodes)}" if nodes else ""
        jobs = "; ".join(", ".join(sorted(f)) for f in sorted(found.families, key=sorted))
        raise CLIError(f"no committed epoch under {store.location.display()!r}{held}"
                       + (f"; its jobs' nodes: {jobs}" if jobs else ""), EXIT_NOT_FOUND)
    return epoch


def cmd_show(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    epoch = newest_epoch(store, found, args.node) if args.epoch is None else args.epoch
    save = require_save(store, found, epoch, args.node)
    nodes = save_nodes(save, args.node)
    opened, problems = (_verified if args.verify else _recorded)(ctx, store, save, nodes)
    blobs = [entry for node, (manifest, states) in opened.items()
             for entry in _entries(store, save.records[node], manifest, states)]
    layout = layout_doc(list(save.records.values()))
    if layout is not None:
        kinds = {**dict.fromkeys(layout["rows"], "rows"),
                 **dict.fromkeys(layout["replicated"], "replicated")}
        for entry in blobs:
            entry["kind"] = kinds.get(entry["name"], "local")
    doc = {"prefix": store.location.display(), "epoch": epoch, "nodes": nodes,
           "save_id": save.save_id, "superseded": found.is_superseded(save), "layout": layout,
           "paths": {n: store.where(save.records[n]) for n in nodes},
           "verified": bool(args.verify), "blobs": blobs, "problems": problems,
           "metrics": json_metrics(save.metrics),
           **save_kind([save.records[n] for n in nodes], store.location)}
    return doc, EXIT_DAMAGED if problems else EXIT_OK


Opened = dict[str, tuple[Manifest, dict[str, str]]]  # node -> its manifest, its blobs' states


def _recorded(ctx: Context, store: CheckpointStore, save: Save, nodes: list[str]
              ) -> tuple[Opened, list[Document]]:
    """Each node's manifest, its metadata checked (no blob read), and the damage found."""
    opened: Opened = {}
    problems: list[Document] = []
    for node in nodes:
        try:
            opened[node] = (checked_manifest(store, save.records[node]), {})
        except CheckpointCorruptedError as exc:
            problems.append({"node": node, "blob": exc.blob, "error": str(exc)})
    return opened, problems


def _verified(ctx: Context, store: CheckpointStore, save: Save, nodes: list[str]
              ) -> tuple[Opened, list[Document]]:
    """Each node's manifest and the state of each of its blobs, every blob read and checked
    (with the replicated ones it borrows, in their writers' groups), and the damage found."""
    ctx.progress.start(f"verify epoch {save.epoch}", sum(save.records[n].nbytes for n in nodes))
    checks = check_nodes(store, [(save, save.records[n]) for n in nodes], ctx.progress)
    ctx.progress.close()
    problems = [{"node": node, **e} for node, check in zip(nodes, checks) for e in check.errors]
    return {node: (check.manifest, check.blobs) for node, check in zip(nodes, checks)
            if check.manifest is not None}, problems


def _entries(store: CheckpointStore, record: CommitRecord, manifest: Manifest,
             states: dict[str, str]) -> list[Document]:
    """What ``show`` says of each blob of ``record``'s checkpoint (``states``: what
    ``--verify`` found of each)."""
    crcs = manifest.chunk_crcs(record.crcs)
    return [{"node": record.node, "name": info.name, "dtype": info.dtype,
             "shape": list(info.shape), "order": info.order, "bytes": info.nbytes,
             "checksum": states.get(info.name, "recorded"),
             "checksums": _checksums(record, manifest, info, crcs),
             **_storage(store, manifest, info, crcs)}
            for info in manifest.blobs.values()]


def _storage(store: CheckpointStore, manifest: Manifest, info: BlobInfo,
             crcs: dict[str, tuple[int, ...]]) -> Document:
    """Where blob ``info`` of ``manifest``'s checkpoint is stored: its own array, the packed
    array, or (a differential save's) older groups."""
    inherited = manifest.inherited.get(info.name)
    if inherited is not None:  # a differential save's: read through older groups
        return {"storage": inherited.kind,
                "from": [store.location.display(g) for g in inherited.chain],
                "from_epochs": [group_epoch(g) for g in inherited.chain]}
    if info.path is not None:
        return {"storage": "array", "path": info.path, "chunks": len(crcs[info.path]),
                "chunk_rows": info.chunk_rows}
    return {"storage": "packed", "offset": info.offset}


def _checksums(record: CommitRecord, manifest: Manifest, info: BlobInfo,
               crcs: dict[str, tuple[int, ...]]) -> Document:
    """The checksums ``record`` keeps of blob ``info`` (``crcs``: every chunk's CRC32C by
    array): the CRC32C of each chunk of its own array; of a packed blob, those of the packed
    array's chunks its bytes lie in (``packed_chunks``: their indices; other packed blobs may
    share them); of a blob a differential save reads through older groups, the xxh3-128 of
    its bytes as saved (C order, little-endian)."""
    if info.name in manifest.inherited:
        digest = record.delta.digests.get(info.name) if record.delta is not None else None
        return {"xxh3_128": digest} if digest else {}
    if info.path is not None:
        return {"crc32c": list(crcs[info.path])}
    chunks = _packed_chunks(manifest, info)
    packed = crcs.get(PACKED_ARRAY, ())
    return {"crc32c": [packed[i] for i in chunks], "packed_chunks": list(chunks)}


def _packed_chunks(manifest: Manifest, info: BlobInfo) -> range:
    """The chunks of ``manifest``'s packed array that the bytes of packed blob ``info`` lie in
    (none for a blob of 0 bytes)."""
    start, size = info.offset or 0, info.nbytes
    if not size:
        return range(0)
    return range(start // manifest.packed_chunk, (start + size - 1) // manifest.packed_chunk + 1)
