"""Stored saves turned back into arrays, every byte checked (sizes, CRC32C, metadata digests)
before it is returned: one group's arrays (``group``), reads run on the I/O threads in bounded
windows and rounds (``rounds``), a differential save's chains (``chain``), rows of blobs split
across nodes (``rows``, ``reshard``, ``shared``) and replicated blobs' copies (``replicas``).
What a reader needs of the store it reads is
:class:`~caffe2ckpt.store.read.source.ReadableStore`."""
