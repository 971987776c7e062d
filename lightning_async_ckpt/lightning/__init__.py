"""Lightning integration: ``AsyncCheckpointCallback``, ``latest_checkpoint`` and the ``StagedCheckpointIO`` plugin."""

from lightning_async_ckpt.lightning.callback import CHECKPOINT_NAME, AsyncCheckpointCallback, latest_checkpoint
from lightning_async_ckpt.lightning.checkpoint_io import StagedCheckpointIO

__all__ = ["CHECKPOINT_NAME", "AsyncCheckpointCallback", "StagedCheckpointIO", "latest_checkpoint"]
