"""Lightning integration: ``AsyncCheckpointCallback`` and ``latest_checkpoint``."""

from lightning_async_ckpt.lightning.callback import CHECKPOINT_NAME, AsyncCheckpointCallback, latest_checkpoint

__all__ = ["CHECKPOINT_NAME", "AsyncCheckpointCallback", "latest_checkpoint"]
