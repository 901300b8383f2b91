"""What is committed, current and deletable under a prefix: the ``lineage`` of runs and the
``catalog`` of a prefix (scan, retention, removal). Reads records, never zarr."""
