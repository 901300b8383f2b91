"""The storage format and the commit protocol: node groups (``zarrgroup``, the only module that
imports zarr, and their ``manifest``), commit ``records``, and the ``protocol`` that writes,
commits and reads one node's checkpoint."""
