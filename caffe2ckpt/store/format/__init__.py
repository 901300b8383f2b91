"""What a checkpoint stores and what its files are called, and nothing about how saves are
decided or read: path names (``paths``: every stored name built and parsed here), a node
group's manifest (``manifest``) and its Zarr arrays (``zarrgroup``, the only zarr importer),
small blobs packed into one array (``packing``), commit records (``records``) and the chains a
differential save's record names (``chains``). The bottom of :mod:`caffe2ckpt.store`: it
imports no other part of it."""
