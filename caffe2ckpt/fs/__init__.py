"""Filesystems: the only code that imports fsspec. :class:`~caffe2ckpt.fs.location.Location` is
a checkpoint prefix on some filesystem and the contract of the operations the commit protocol
needs, with one class per backend (``local``: a local disk; ``remote``: object stores,
``memory://`` and other fsspec filesystems). ``localio`` has the Linux fast paths,
``strictjson`` the reader and writer checks of every stored JSON file, ``iopool`` the chunk I/O
threads, ``clienterrors`` the translation of filesystem clients' exceptions."""
