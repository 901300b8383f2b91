"""What importing ``caffe2ckpt.prefect`` installs, also the entry point a command-line run
loads when ``PREFECT_API_URL`` is set (:mod:`caffe2ckpt.plugins`)."""

from __future__ import annotations

from caffe2ckpt.prefect import blocks, events

__all__ = ["install"]


def install() -> None:
    """Checkpoint events become Prefect events (:mod:`.events`), and Prefect blocks and
    ``prefect-block://`` references name checkpoint prefixes (:mod:`.blocks`). Idempotent."""
    events.subscribe_publisher()
    blocks.register()
