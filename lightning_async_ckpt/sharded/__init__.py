"""Sharded checkpoints in torch DCP's own format, committed into a :class:`CheckpointStore` generation.

Every rank writes its data files through :mod:`~lightning_async_ckpt.sharded.dcp_writer`; the coordinator writes
``manifest.json`` last (:mod:`~lightning_async_ckpt.sharded.commit`); :class:`ShardedCheckpointer` drives it.
"""

from lightning_async_ckpt.sharded.checkpointer import ShardedCheckpointer, ShardedSaveError, ShardedSaveHandle
from lightning_async_ckpt.sharded.commit import DCP_FORMAT, commit_generation
from lightning_async_ckpt.sharded.dcp_writer import RankObjects, StoreStorageWriter

__all__ = [
    "DCP_FORMAT",
    "RankObjects",
    "ShardedCheckpointer",
    "ShardedSaveError",
    "ShardedSaveHandle",
    "StoreStorageWriter",
    "commit_generation",
]
