"""Sharded checkpoints in torch DCP's own format, committed into a :class:`CheckpointStore` generation.

Modules:

- :mod:`~lightning_async_ckpt.sharded.dcp_writer`: a DCP ``StorageWriter`` that writes one generation folder
  (``__<rank>_<n>.distcp.<token>`` data files, created once per attempt, and ``.metadata``), checksumming every
  object as its bytes pass, and reports
  each rank's objects to the coordinator inside DCP's own gather of write results.
- :mod:`~lightning_async_ckpt.sharded.commit`: the coordinator's commit: ``manifest.json`` written last, listing
  every rank's objects.
- :mod:`~lightning_async_ckpt.sharded.checkpointer`: :class:`ShardedCheckpointer`, copy-at-cut staging of local
  shards into reused host buffers and ``dcp.save`` on a background thread over a separate gloo group.
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
