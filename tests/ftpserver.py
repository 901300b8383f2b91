"""A real FTP server on 127.0.0.1 (pyftpdlib, in a thread): a filesystem that logs in with the
user name and password of its URL (``ftp://user:password@127.0.0.1:port/path``)."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

with warnings.catch_warnings():  # Python 3.11's asyncore, which pyftpdlib uses there
    warnings.simplefilter("ignore", DeprecationWarning)
    from pyftpdlib.authorizers import DummyAuthorizer
    from pyftpdlib.handlers import FTPHandler
    from pyftpdlib.servers import ThreadedFTPServer


@dataclass
class FTPServer:
    port: int

    def url(self, user: str, password: str, path: str) -> str:
        return f"ftp://{user}:{password}@127.0.0.1:{self.port}/{path.lstrip('/')}"


@contextmanager
def ftp_server(home: str, users: dict[str, tuple[str, str]]) -> Iterator[FTPServer]:
    """A server whose ``users`` (name -> (password, pyftpdlib permissions)) share ``home``."""
    logging.getLogger("pyftpdlib").setLevel(logging.WARNING)
    authorizer = DummyAuthorizer()
    for name, (password, perm) in users.items():
        authorizer.add_user(name, password, home, perm=perm)
    handler = type("Handler", (FTPHandler,), {"authorizer": authorizer})
    server = ThreadedFTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"timeout": 0.2}, daemon=True)
    thread.start()
    try:
        yield FTPServer(server.socket.getsockname()[1])
    finally:
        server.close_all()
        thread.join(10)
