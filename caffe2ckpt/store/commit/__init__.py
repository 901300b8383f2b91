"""The commit protocol: a node's save written, committed (its record, written last and
exclusively) and read back (``protocol``); runs, their claims, generations and fencing
(``runs``); the marks history leaves in a prefix (``retired``, ``tombstone``). The top of
:mod:`caffe2ckpt.store`."""
