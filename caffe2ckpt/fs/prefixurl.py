"""What a checkpoint prefix's URL may carry, and the one URL that names the prefix.

Credentials in a URL: fsspec's ftp, sftp and smb filesystems log in with the user name and
password of their URL (``ftp://alice:PW@host:21/run``); every other filesystem would take them
for part of a path (``s3://key:secret@bucket`` names a bucket called ``key:secret@bucket``), so
there they are refused before anything is opened, as is a query string or fragment that would
become part of a path (``memory://run?sig=x``, ``file:///run#1``). Whatever is accepted is shown
only in its public form (:func:`caffe2ckpt.urls.public_url`).

The canonical URL (:func:`canonical`) is the filesystem's protocol, the host and port for
filesystems that log in to one (two FTP servers' ``/run`` are two prefixes), and the prefix's path
there: the same whatever form the prefix was given in (a relative path, ``file://``, a trailing
slash), never with credentials. Events and automations name prefixes by it.
"""

from __future__ import annotations

import functools
from urllib.parse import urlsplit

import fsspec

from caffe2ckpt.errors import InvalidLocationError
from caffe2ckpt.urls import public_url

__all__ = ["canonical", "check_secrets", "logs_in_from_url"]

_PROBE = "{}://caffe2ckpt-user:caffe2ckpt-password@caffe2ckpt-host:21/run"


@functools.cache
def logs_in_from_url(protocol: str) -> bool:
    """Whether ``protocol``'s filesystem takes a user name and password from its URL (False
    when the protocol is unknown or its package is not installed)."""
    try:
        cls = fsspec.get_filesystem_class(protocol)
        kwargs = cls._get_kwargs_from_urls(_PROBE.format(protocol))
    except Exception:  # noqa: BLE001 - unknown, or not installed: opening it says so
        return False
    return "caffe2ckpt-password" in map(str, kwargs.values())


def _stripped(protocol: str, url: str) -> str | None:
    try:
        return fsspec.get_filesystem_class(protocol)._strip_protocol(url)
    except Exception:  # noqa: BLE001 - as above
        return None


def check_secrets(url: str) -> None:
    """Refuse a URL whose user information, query string or fragment its filesystem would not
    use as such (see the module docstring); the message names only the public URL."""
    if "://" not in url or "::" in url:
        return
    protocol = url.partition("://")[0].lower()
    parts = urlsplit(url)
    shown = public_url(url)
    if "@" in parts.netloc and not logs_in_from_url(protocol):
        raise InvalidLocationError(
            f"checkpoint prefix {shown!r} was given with a user name or password, which "
            f"{protocol}:// does not log in with (they would become part of a path): give "
            "credentials in storage_options, the environment or a storage block")
    path = _stripped(protocol, url)
    leftover = [what for what, text, mark in (("query string", parts.query, "?"),
                                              ("fragment", parts.fragment, "#"))
                if text and path is not None and mark + text in path]
    if leftover:
        raise InvalidLocationError(
            f"checkpoint prefix {shown!r} was given with a {' and a '.join(leftover)}, which "
            f"{protocol}:// would make part of its path: leave it out (options go in "
            "storage_options)")


_DEFAULT_PORTS = {"ftp": 21, "sftp": 22, "ssh": 22}  # the ports fsspec connects to unless told


def canonical(protocol: str | tuple[str, ...], root: str, given: str) -> str:
    """The canonical URL of the prefix at ``root`` on a filesystem of ``protocol`` (its
    ``protocol`` attribute), given as ``given`` (see the module docstring)."""
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    url = next((root for p in protocols if root.startswith(f"{p}://")),
               f"{protocols[0]}://{root}")  # as fsspec's unstrip_protocol
    parts, asked = urlsplit(url), urlsplit(given)
    if not parts.netloc and asked.hostname and logs_in_from_url(protocols[0]):
        port = asked.port or _DEFAULT_PORTS.get(protocols[0])  # ftp://h/ is ftp://h:21/
        host = asked.hostname + (f":{port}" if port else "")
        url = f"{protocols[0]}://{host}/{root.lstrip('/')}"
    return public_url(url)
