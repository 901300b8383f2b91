"""Filesystem clients' exceptions as caffe2ckpt errors naming the prefix, and what an object
store's answer behind an ``OSError`` said.

botocore, google-auth and friends raise their own classes (not ``OSError``) for missing
credentials, bad profiles or regions and the like; s3fs/gcsfs pass them through. s3fs turns an
S3 error answer into an ``OSError`` of its choice whose ``__cause__`` is botocore's
``ClientError``, which holds the answer (``s3fs/errors.py``, ``translate_boto_error``):
:func:`s3_answer` reads its HTTP status and error code.

:func:`translate` maps by the table :data:`TRANSLATIONS` (first match wins): credentials the
store rejects (an answer 403, or ``SignatureDoesNotMatch``, ``InvalidAccessKeyId``,
``AccessDenied``, ``InvalidToken``, ``ExpiredToken``; s3fs makes most of them a bare
``PermissionError``) and missing credentials to
:class:`~caffe2ckpt.errors.StorageCredentialsError`, bad options to
:class:`~caffe2ckpt.errors.InvalidLocationError`, anything else to an ``OSError`` (EIO).
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from caffe2ckpt.errors import InvalidLocationError, StorageCredentialsError
from caffe2ckpt.urls import public_url, redact

__all__ = ["TRANSLATIONS", "credentials_rejected", "is_credentials_error", "precondition_failed",
           "s3_answer", "translate"]

_CREDENTIALS = ("Credential", "Token")  # NoCredentialsError, TokenRetrievalError, ...
_OPTIONS = ("Profile", "Region", "ParamValidation", "Unsigned", "Config")
# S3 error codes of credentials the store rejects (AWS answers 403 or 400 with them)
_REJECTED = frozenset({"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied",
                       "InvalidToken", "ExpiredToken"})


def s3_answer(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and S3 error code of the answer behind ``exc``: botocore's
    ``ClientError`` itself, or the one s3fs set as the ``__cause__`` of the ``OSError`` it made
    of it; (None, None) if there is none (a connection error, another client)."""
    for candidate in (exc, exc.__cause__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return status, (response.get("Error") or {}).get("Code")
    return None, None


def precondition_failed(exc: BaseException) -> bool:
    """Whether the store answered 412 (``PreconditionFailed``): for an ``If-None-Match: *``
    PUT, the key exists. s3fs makes that ``FileExistsError`` only when the answer names the
    ``If-None-Match`` condition (AWS, moto); SeaweedFS's names none (an ``OSError(EINVAL)``)."""
    status, code = s3_answer(exc)
    return status == 412 or code == "PreconditionFailed"


def credentials_rejected(exc: BaseException) -> bool:
    """Whether the store refused the request's credentials: an answer 403 (a HEAD's has no
    code) or one of the codes of rejected credentials."""
    status, code = s3_answer(exc)
    return status == 403 or code in _REJECTED


def is_credentials_error(exc: Exception) -> bool:
    """Whether a filesystem client failed for want of credentials (botocore's
    ``NoCredentialsError``, ``PartialCredentialsError``, ``TokenRetrievalError``, google-auth's
    ``DefaultCredentialsError``...): these clients raise no ``OSError`` for it."""
    return any(word in type(exc).__name__ for word in _CREDENTIALS)


def _bad_options(exc: Exception) -> bool:  # a TypeError here comes from options it refused
    return isinstance(exc, TypeError) or any(w in type(exc).__name__ for w in _OPTIONS)


# each: whether it matches a client exception, and the error made of it from the prefix's public
# URL, the exception's class and its message (both with the URL's secrets hidden) and the exception
TRANSLATIONS: list[tuple[Callable[[Exception], bool],
                         Callable[[str, str, Exception], Exception]]] = [
    (credentials_rejected, lambda url, text, exc: StorageCredentialsError(
        f"cannot use checkpoint prefix {url!r}: the store rejected the credentials "
        f"({s3_answer(exc)[1]}: {text}; check the key, secret and token given in the "
        "environment, a config file or storage_options, and what they may access)")),
    (is_credentials_error, lambda url, text, exc: StorageCredentialsError(
        f"cannot use checkpoint prefix {url!r}: no usable credentials: {type(exc).__name__}: "
        f"{text} (give them in the environment, a config file or storage_options)")),
    (_bad_options, lambda url, text, exc: InvalidLocationError(
        f"cannot use checkpoint prefix {url!r}: {type(exc).__name__}: {text} (check the "
        "credentials, region and storage_options of this filesystem)")),
    (lambda exc: True, lambda url, text, exc: OSError(
        errno.EIO, f"checkpoint prefix {url!r}: {type(exc).__name__}: {text}")),
]


def translate(url: str, exc: Exception) -> Exception:
    """The caffe2ckpt error for client exception ``exc`` raised while using prefix ``url`` (as
    given: the error names its public form and hides its secrets in the client's message)."""
    text = redact(str(exc), url)
    return next(make(public_url(url), text, exc) for matches, make in TRANSLATIONS
                if matches(exc))
