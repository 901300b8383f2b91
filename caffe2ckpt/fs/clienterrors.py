"""Filesystem clients' own exceptions (not ``OSError``) as caffe2ckpt errors naming the prefix.

botocore, google-auth and friends raise their own classes for missing credentials, bad
profiles or regions and the like; s3fs/gcsfs pass them through. :func:`translate` maps them by
the table :data:`TRANSLATIONS` (first match wins): missing credentials to
:class:`~caffe2ckpt.errors.StorageCredentialsError`, bad options to
:class:`~caffe2ckpt.errors.InvalidLocationError`, anything else to an ``OSError`` (EIO).
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from caffe2ckpt.errors import InvalidLocationError, StorageCredentialsError

__all__ = ["TRANSLATIONS", "is_credentials_error", "translate"]

_CREDENTIALS = ("Credential", "Token")  # NoCredentialsError, TokenRetrievalError, ...
_OPTIONS = ("Profile", "Region", "ParamValidation", "Unsigned", "Config")


def is_credentials_error(exc: Exception) -> bool:
    """Whether a filesystem client failed for want of credentials (botocore's
    ``NoCredentialsError``, ``PartialCredentialsError``, ``TokenRetrievalError``, google-auth's
    ``DefaultCredentialsError``...): these clients raise no ``OSError`` for it."""
    return any(word in type(exc).__name__ for word in _CREDENTIALS)


def _bad_options(exc: Exception) -> bool:  # a TypeError here comes from options it refused
    return isinstance(exc, TypeError) or any(w in type(exc).__name__ for w in _OPTIONS)


TRANSLATIONS: list[tuple[Callable[[Exception], bool], Callable[[str, Exception], Exception]]] = [
    (is_credentials_error, lambda url, exc: StorageCredentialsError(
        f"cannot use checkpoint prefix {url!r}: no usable credentials: {type(exc).__name__}: "
        f"{exc} (give them in the environment, a config file or storage_options)")),
    (_bad_options, lambda url, exc: InvalidLocationError(
        f"cannot use checkpoint prefix {url!r}: {type(exc).__name__}: {exc} (check the "
        "credentials, region and storage_options of this filesystem)")),
    (lambda exc: True, lambda url, exc: OSError(
        errno.EIO, f"checkpoint prefix {url!r}: {type(exc).__name__}: {exc}")),
]


def translate(url: str, exc: Exception) -> Exception:
    """The caffe2ckpt error for client exception ``exc`` raised while using prefix ``url``."""
    return next(make(url, exc) for matches, make in TRANSLATIONS if matches(exc))
