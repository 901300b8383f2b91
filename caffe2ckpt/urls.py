"""Checkpoint URLs as they may be shown: without the parts that can carry a secret.

A prefix may be given with a user name and password (``ftp://alice:PW@host/run``: fsspec's ftp,
sftp and smb filesystems log in with them), or with a token in its query string or fragment.
:func:`public_url` is the one form in which every message, log line, event, artifact and
command-line output names a prefix; :func:`redact` takes such secrets out of text that caffe2ckpt
did not write (a client library's exception naming the URL it was given).
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = ["public_url", "redact", "secret_parts"]

HIDDEN = "***"


def public_url(url: str) -> str:
    """``url`` without user name, password, query string or fragment (a path without a scheme
    is a path: returned as it is)."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    if not parts.netloc:
        return url.split("?", 1)[0].split("#", 1)[0]
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def secret_parts(url: str) -> list[str]:
    """The texts of ``url`` that may be secret, longest first: its user information (with the
    password alone, as written and unquoted), its query string with each value, its fragment."""
    parts = urlsplit(url)
    found = [parts.query, parts.fragment]
    found += [value for pair in parts.query.split("&") for value in pair.split("=", 1)[1:]]
    if "@" in parts.netloc:
        info = parts.netloc.rsplit("@", 1)[0]
        password = info.partition(":")[2]
        found += [info, password, unquote(password)]
    return sorted({text for text in found if text}, key=len, reverse=True)


def redact(text: str, url: str) -> str:
    """``text`` with ``url`` written in its public form and every secret part of it hidden."""
    text = text.replace(url, public_url(url))
    for secret in secret_parts(url):
        text = text.replace(secret, HIDDEN)
    return text
