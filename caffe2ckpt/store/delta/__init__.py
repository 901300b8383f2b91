"""Differential saves, writer side: which rows of a large blob changed (``rowhash``, with the
compiled kernel of ``rowjit``), which older groups still hold the rest (``links``), the plan of
one save (``plan``: the tracker and the planner) and the state it seals at commit (``write``).
Reading a differential save is :mod:`caffe2ckpt.store.read.chain`'s."""
