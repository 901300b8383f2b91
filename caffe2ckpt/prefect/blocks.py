"""Checkpoint locations kept in Prefect blocks: a URL with its credentials, stored encrypted by
the Prefect server and shown masked in the UI, given wherever a checkpoint prefix is taken.

- :class:`CheckpointStorage`, this package's block (``prefect block register -m
  caffe2ckpt.prefect.blocks`` adds it to the UI's Blocks page): ``url`` and ``storage_options``
  (fsspec options such as ``key``, ``secret``, ``endpoint_url``), the options a secret field;
- Prefect's ``RemoteFileSystem``: its ``basepath`` is the prefix and its ``settings`` the
  storage options (``settings`` is not a secret field: the UI shows it; prefer
  :class:`CheckpointStorage` for credentials);
- prefect-aws's ``S3Bucket`` (``pip install "caffe2ckpt[aws]"``): ``s3://<bucket_name>/
  <bucket_folder>`` with its ``AwsCredentials`` or ``MinIOCredentials``, used as prefect-aws
  uses them: key, secret and session token, or an AWS profile (``profile_name``), region and
  client parameters (endpoint, API version, SSL, certificate checks, botocore ``Config``); a
  role to assume (``assume_role_arn``) is refused.

A block object, or a reference ``prefect-block://<block-type-slug>/<block-name>`` (e.g.
``prefect-block://checkpoint-storage/nightly``, loaded from the Prefect API: from the server
``PREFECT_API_URL`` names within ``PREFECT_API_REQUEST_TIMEOUT`` seconds, at most 15, retries
included; the command line takes it too when ``PREFECT_API_URL`` is set), is accepted by every manager, ``read_epoch``,
``materialize``, ``zarr_store`` and the ``caffe2ckpt`` commands once this package is
imported. Pass a flow the block's *name*, never the block: flow-run parameters are stored in
the clear. The secret values go to the filesystem only; the prefix everywhere else (logs,
records, artifacts, events, errors) is the URL.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx
from prefect.blocks.core import Block
from prefect.filesystems import RemoteFileSystem
from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_API_URL
from prefect.types import SecretDict
from pydantic import Field

from caffe2ckpt.errors import InvalidLocationError
from caffe2ckpt.fs.location import BLOCK_REFERENCE, register_source
from caffe2ckpt.prefect._bounded import in_background
from caffe2ckpt.urls import public_url

__all__ = ["BLOCK_SCHEME", "CheckpointStorage", "block_location", "register"]

BLOCK_SCHEME = BLOCK_REFERENCE
_LOAD_SECONDS = 15.0  # the longest a block lookup waits for the PREFECT_API_URL server


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
    """The prefix and s3fs options of a prefect-aws ``S3Bucket``: its credentials block's keys
    or profile, region and client parameters, as prefect-aws's own session would use them."""
    folder = str(block.bucket_folder or "").strip("/")
    url = f"s3://{block.bucket_name}" + (f"/{folder}" if folder else "")
    creds = block.credentials
    if getattr(creds, "assume_role_arn", None):
        raise InvalidLocationError(
            f"the S3 Bucket block for {url!r} has AwsCredentials with assume_role_arn, which "
            "caffe2ckpt does not use (its short-lived keys would expire during a job): name an "
            "AWS profile holding the role (role_arn, source_profile) as profile_name instead")
    options = {name: value for name, value in (
        ("key", getattr(creds, "aws_access_key_id", None)
         or getattr(creds, "minio_root_user", None)),
        ("secret", getattr(creds, "aws_secret_access_key", None)
         or getattr(creds, "minio_root_password", None)),
        ("token", getattr(creds, "aws_session_token", None)),
        ("profile", getattr(creds, "profile_name", None))) if value}
    if "secret" in options:
        options["secret"] = options["secret"].get_secret_value()
    options.update(_client_options(creds))
    return url, options


def _client_options(creds: Any) -> dict[str, Any]:
    """s3fs options for the region and ``aws_client_parameters`` (endpoint, API version, SSL,
    certificate checks, botocore ``Config``) of a prefect-aws credentials block."""
    params = getattr(creds, "aws_client_parameters", None)
    given = params.model_dump(exclude_defaults=True, exclude_none=True) if params else {}
    if "verify_cert_path" in given:  # prefect-aws: the bundle wins over ``verify``
        given["verify"] = str(given.pop("verify_cert_path"))
    config = dict(given.pop("config", None) or {})
    if getattr(creds, "region_name", None):
        given["region_name"] = creds.region_name
    options: dict[str, Any] = {"client_kwargs": given} if given else {}
    if config.get("signature_version") == "unsigned":  # botocore's UNSIGNED: s3fs's anon
        del config["signature_version"]
        options["anon"] = True
    if config:
        options["config_kwargs"] = config
    return options


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
        source = _load(slug, name)
        found = block_location(source)
        if found is None:
            raise InvalidLocationError(f"block {slug}/{name} is a {type(source).__name__}, "
                                       "which names no checkpoint location (use Checkpoint "
                                       "Storage, Remote File System or S3 Bucket)")
        return found
    return block_location(source) if isinstance(source, Block) else None


def _load(slug: str, name: str) -> Block:
    """Block ``slug/name`` from the Prefect API. From the server ``PREFECT_API_URL`` names it
    waits at most :func:`_load_seconds` in all: Prefect's client retries a request that times
    out, for minutes. Prefect's temporary server (no ``PREFECT_API_URL``) is waited for as
    Prefect waits for it: it may take tens of seconds to start."""
    where = f"block {slug}/{name} ({BLOCK_SCHEME}{slug}/{name})"
    api = PREFECT_API_URL.value()
    load = functools.partial(Block.load, f"{slug}/{name}")
    server = f"the Prefect API at {public_url(api)}" if api else "Prefect's temporary server"
    try:
        if not api:
            return load()
        return in_background(load, name="caffe2ckpt-block-load").result(
            timeout=_load_seconds())
    except (ValueError, KeyError) as exc:
        raise InvalidLocationError(f"cannot load {where} from {server}: {exc}") from exc
    except TimeoutError as exc:
        raise InvalidLocationError(
            f"cannot load {where} from {server}: no answer within {_load_seconds():g} s "
            f"(PREFECT_API_REQUEST_TIMEOUT, at most {_LOAD_SECONDS:g} s)") from exc
    except httpx.HTTPError as exc:
        raise InvalidLocationError(f"cannot load {where} from {server}: "
                                   f"{type(exc).__name__}: {exc}") from exc


def _load_seconds() -> float:
    """How long a block lookup waits for the API: ``PREFECT_API_REQUEST_TIMEOUT`` (one request's
    limit, 60 s by default), at most :data:`_LOAD_SECONDS`."""
    return min(float(PREFECT_API_REQUEST_TIMEOUT.value()), _LOAD_SECONDS)


def register() -> None:
    """Accept blocks wherever a checkpoint prefix is taken (done on import of
    ``caffe2ckpt.prefect``)."""
    register_source(_resolve)
