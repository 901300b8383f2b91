"""The stored format and the commit protocol, in four subpackages, each importing only those
listed after it (an import-linter contract in ``pyproject.toml``):

- :mod:`~caffe2ckpt.store.commit`: a save written, committed and read back as one node's
  checkpoint (``protocol``), runs and their fencing (``runs``), history marks (``retired``,
  ``tombstone``);
- :mod:`~caffe2ckpt.store.read`: stored saves turned back into arrays, checked chunk by chunk;
- :mod:`~caffe2ckpt.store.delta`: differential saves, writer side (changed rows, the plan);
- :mod:`~caffe2ckpt.store.format`: what is stored and how it is named (paths, manifests, commit
  records, node groups; ``format.zarrgroup`` is the only module that imports zarr).
"""
