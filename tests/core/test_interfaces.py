"""The declared seams: every implementation satisfies its Protocol, and the callback no longer tells them apart by type."""

from __future__ import annotations

import inspect

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.core.interfaces import SaveTarget, TrainingCheckpointer
from lightning_async_ckpt.lightning import callback, rerun
from lightning_async_ckpt.lightning.sharded import ShardedCallbackCheckpointer


def test_the_engine_is_a_training_checkpointer_that_writes_one_stream(tmp_path):
    with AsyncCheckpointer(CheckpointStore(str(tmp_path))) as ck:
        assert isinstance(ck, TrainingCheckpointer)
        assert ck.writes_dcp is False


def test_the_sharded_adapter_declares_every_member_of_the_protocol():
    members = {name for name in dir(TrainingCheckpointer) if not name.startswith("_")}
    missing = {name for name in members if not hasattr(ShardedCallbackCheckpointer, name)}
    # Instance attributes set in __init__ (committed_step, pool, events) are annotations on the Protocol.
    init = inspect.getsource(ShardedCallbackCheckpointer.__init__)
    missing = {name for name in missing if f"self.{name} =" not in init}
    assert not missing
    assert ShardedCallbackCheckpointer.writes_dcp is True


def test_a_checkpoint_store_is_a_save_target(tmp_path):
    assert isinstance(CheckpointStore(str(tmp_path)), SaveTarget)


def test_the_callback_asks_the_seam_not_the_type():
    for module in (callback, rerun):
        assert "isinstance(self.checkpointer" not in inspect.getsource(module)
        assert "isinstance(callback.checkpointer" not in inspect.getsource(module)
