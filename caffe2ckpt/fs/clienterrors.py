"""Filesystem clients' own exceptions (not ``OSError``) as caffe2ckpt errors naming the prefix.

botocore, google-auth and friends raise their own classes for missing credentials, bad
profiles or regions and the like; s3fs/gcsfs pass them through. :func:`translate` maps them:
missing credentials to :class:`~caffe2ckpt.errors.StorageCredentialsError`, bad options to
:class:`~caffe2ckpt.errors.InvalidLocationError`, anything else to an ``OSError`` (EIO).
"""

from __future__ import annotations

import errno

from caffe2ckpt.errors import InvalidLocationError, StorageCredentialsError

__all__ = ["is_credentials_error", "translate"]


def is_credentials_error(exc: Exception) -> bool:
    """Whether a filesystem client failed for want of credentials (botocore's
    ``NoCredentialsError``, ``PartialCredentialsError``, ``TokenRetrievalError``, google-auth's
    ``DefaultCredentialsError``...): these clients raise no ``OSError`` for it."""
    name = type(exc).__name__
    return "Credential" in name or "Token" in name


def translate(url: str, exc: Exception) -> Exception:
    """The caffe2ckpt error for client exception ``exc`` raised while using prefix ``url``."""
    name = type(exc).__name__
    if is_credentials_error(exc):
        return StorageCredentialsError(
            f"cannot use checkpoint prefix {url!r}: no usable credentials: {name}: "
            f"{exc} (give them in the environment, a config file or storage_options)")
    if isinstance(exc, TypeError) or any(  # a TypeError here comes from bad options
            word in name for word in ("Profile", "Region", "ParamValidation", "Unsigned",
                                      "Config")):
        return InvalidLocationError(
            f"cannot use checkpoint prefix {url!r}: {name}: {exc} (check the "
            "credentials, region and storage_options of this filesystem)")
    return OSError(errno.EIO, f"checkpoint prefix {url!r}: {name}: {exc}")
