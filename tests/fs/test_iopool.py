"""The chunk I/O threads of a process: a thread count is checked, and changing it moves new work
to a pool of that size."""

from __future__ import annotations

import pytest

from caffe2ckpt.fs import iopool


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4", None])
def test_a_thread_count_must_be_an_int_of_at_least_one(bad):
    with pytest.raises(ValueError, match=f"I/O threads must be an int >= 1, got {bad!r}"):
        iopool.set_io_threads(bad)
    assert iopool.pool()._max_workers == iopool.IO_THREADS


def test_set_io_threads_sizes_the_pool_new_work_uses(monkeypatch):
    monkeypatch.setattr(iopool, "_threads", iopool.IO_THREADS)
    assert iopool.pool()._max_workers == iopool.IO_THREADS
    iopool.set_io_threads(3)
    assert iopool.pool()._max_workers == 3
    assert iopool.pool().submit(lambda: 42).result() == 42
