"""Checkpoint locations kept in Prefect blocks: a URL with its credentials, stored encrypted by
the Prefect server and shown masked in the UI, given wherever a checkpoint prefix is taken.

- :class:`CheckpointStorage`, this package's block (``prefect block register -m
  caffe2ckpt.prefect.blocks`` adds it to the UI's Blocks page): ``url`` and ``storage_options``
  (fsspec options such as ``key``, ``secret``, ``endpoint_url``), the options a secret field;
- Prefect's ``RemoteFileSystem``: its ``basepath`` is the prefix and its ``settings`` the
  storage options (``settings`` is not a secret field: the UI shows it; prefer
  :class:`CheckpointStorage` for credentials);
- prefect-aws's ``S3Bucket`` (``pip install "caffe2ckpt[aws]"``): ``s3://<bucket_name>/
  <bucket_folder>`` with its ``AwsCredentials`` or ``MinIOCredentials`` (key, secret, session
  token, region, endpoint).

A block object, or a reference ``prefect-block://<block-type-slug>/<block-name>`` (e.g.
``prefect-block://checkpoint-storage/nightly``, loaded from the Prefect API; the command line
takes it too when ``PREFECT_API_URL`` is set), is accepted by every manager, ``read_epoch``,
``materialize``, ``zarr_store`` and the ``caffe2ckpt`` commands once this package is
imported. Pass a flow the block's *name*, never the block: flow-run parameters are stored in
the clear. The secret values go to the filesystem only; the prefix everywhere else (logs,
records, artifacts, events, errors) is the URL.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from prefect.filesystems import RemoteFileSystem
from prefect.types import SecretDict
from pydantic import Field

from caffe2ckpt.errors import InvalidLocationError
from caffe2ckpt.fs.location import BLOCK_REFERENCE, register_source

__all__ = ["BLOCK_SCHEME", "CheckpointStorage", "block_location", "register"]

BLOCK_SCHEME = BLOCK_REFERENCE


class CheckpointStorage(Block):
    """Where a job's checkpoints live: a checkpoint prefix (a folder, ``s3://bucket/run``,
    ``gs://...``) and the fsspec storage options its filesystem needs, kept secret."""

    _block_type_name = "Checkpoint Storage"
    _description = ("A caffe2ckpt checkpoint prefix and the storage options (endpoint, "
                    "credentials) its filesystem needs; the options are stored encrypted.")

    url: str = Field(description="The checkpoint prefix: a local folder or an fsspec URL "
                                 "(s3://bucket/run, gs://bucket/run, memory://run).")
    storage_options: SecretDict = Field(
        default_factory=lambda: SecretDict({}),
        description="fsspec options for the prefix's filesystem, e.g. {\"key\": ..., "
                    "\"secret\": ..., \"endpoint_url\": ...}; stored encrypted, shown masked.")

    def location(self) -> tuple[str, dict[str, Any]]:
        """The prefix and its storage options (secret values included)."""
        return self.url, dict(self.storage_options.get_secret_value())


def _s3_bucket(block: Any) -> tuple[str, dict[str, Any]]:
    """The prefix and s3fs options of a prefect-aws ``S3Bucket``."""
    folder = str(block.bucket_folder or "").strip("/")
    url = f"s3://{block.bucket_name}" + (f"/{folder}" if folder else "")
    creds, options = block.credentials, {}
    key = getattr(creds, "aws_access_key_id", None) or getattr(creds, "minio_root_user", None)
    secret = (getattr(creds, "aws_secret_access_key", None)
              or getattr(creds, "minio_root_password", None))
    if key:
        options["key"] = key
    if secret is not None:
        options["secret"] = secret.get_secret_value()
    if getattr(creds, "aws_session_token", None):
        options["token"] = creds.aws_session_token
    client_kwargs = {k: v for k, v in (
        ("region_name", getattr(creds, "region_name", None)),
        ("endpoint_url", getattr(getattr(creds, "aws_client_parameters", None),
                                 "endpoint_url", None))) if v}
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    return url, options


def block_location(block: Any) -> tuple[str, dict[str, Any]] | None:
    """The prefix and storage options a supported block names (None for other objects)."""
    if isinstance(block, CheckpointStorage):
        return block.location()
    if isinstance(block, RemoteFileSystem):
        return block.basepath, dict(block.settings or {})
    if type(block).__name__ == "S3Bucket" and type(block).__module__.startswith("prefect_aws"):
        return _s3_bucket(block)
    return None


def _resolve(source: Any) -> tuple[str, dict[str, Any]] | None:
    """A source resolver (:func:`caffe2ckpt.fs.location.register_source`): blocks, and
    ``prefect-block://<type-slug>/<name>`` references loaded from the Prefect API."""
    if isinstance(source, str):
        if not source.startswith(BLOCK_SCHEME):
            return None
        slug, _, name = source[len(BLOCK_SCHEME):].partition("/")
        if not slug or not name or "/" in name:
            raise InvalidLocationError(f"block reference {source!r} must be "
                                       f"{BLOCK_SCHEME}<block-type-slug>/<block-name>")
        try:
            source = Block.load(f"{slug}/{name}")
        except (ValueError, KeyError) as exc:
            raise InvalidLocationError(f"cannot load block {slug}/{name} ({source!r}): "
                                       f"{exc}") from exc
        found = block_location(source)
        if found is None:
            raise InvalidLocationError(f"block {slug}/{name} is a {type(source).__name__}, "
                                       "which names no checkpoint location (use Checkpoint "
                                       "Storage, Remote File System or S3 Bucket)")
        return found
    return block_location(source) if isinstance(source, Block) else None


def register() -> None:
    """Accept blocks wherever a checkpoint prefix is taken (done on import of
    ``caffe2ckpt.prefect``)."""
    register_source(_resolve)
