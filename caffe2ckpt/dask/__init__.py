"""Nodes on Dask workers (re-exports only): :class:`DaskSession` keeps each node's workspace in
an actor on a worker; saves and loads run there. Needs ``pip install "caffe2ckpt[dask]"``."""

from caffe2ckpt.dask.actor import NodeActor
from caffe2ckpt.dask.session import DaskSession, RemoteWorkspace

__all__ = ["DaskSession", "NodeActor", "RemoteWorkspace"]
