"""Filesystems: the only code that imports fsspec. :class:`~caffe2ckpt.fs.location.Location` is
a checkpoint prefix on some filesystem with the few operations the commit protocol needs;
``localio`` has the Linux fast paths, ``strictjson`` the reader and writer checks of every stored
JSON file, ``iopool`` the chunk I/O threads, ``clienterrors`` the translation of filesystem
clients' exceptions."""
