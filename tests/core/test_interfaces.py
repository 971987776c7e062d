"""The declared seams: every implementation satisfies its Protocol, and the callback no longer tells them apart by type."""

from __future__ import annotations

import inspect

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.core.interfaces import SaveTarget, TrainingCheckpointer
from lightning_async_ckpt.lightning import callback, rerun
from lightning_async_ckpt.sharded import ShardedCheckpointer


def test_the_engine_is_a_training_checkpointer_that_writes_one_stream(tmp_path):
    with AsyncCheckpointer(CheckpointStore(str(tmp_path))) as ck:
        assert isinstance(ck, TrainingCheckpointer)
        assert ck.writes_dcp is False


def test_the_sharded_checkpointer_is_the_engine_with_a_dcp_persister(tmp_path):
    # One lifecycle: the sharded checkpointer adds no save path of its own, only the parts that differ.
    assert issubclass(ShardedCheckpointer, AsyncCheckpointer)
    assert "save" not in vars(ShardedCheckpointer) and "wait" not in vars(ShardedCheckpointer)
    with ShardedCheckpointer(str(tmp_path)) as ck:
        assert isinstance(ck, TrainingCheckpointer)
        assert ck.writes_dcp is True
        assert ck.persister.collective and ck.persister.coordinator


def test_save_is_written_once_in_the_package():
    # Every other save entry point hands its request to an engine (a facade adds its own bookkeeping only).
    import ast
    import pathlib

    import lightning_async_ckpt

    root = pathlib.Path(lightning_async_ckpt.__file__).parent
    lifecycles, facades = [], []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.name in ("save", "save_checkpoint"):
                body = ast.get_source_segment(source, node) or ""
                if body.rstrip().endswith("..."):
                    continue  # a Protocol's declaration
                where = f"{path.relative_to(root)}:{node.name}"
                delegates = "engine.save(" in body or "super().save(" in body  # to an engine or the engine class
                (facades if delegates else lifecycles).append(where)
    assert lifecycles == ["core/engine.py:save"], lifecycles
    assert facades, "expected facades that drive an engine (the CheckpointIO plugin)"
    # Tiers live beneath the engine (its commit target): they add no save door of their own.
    assert not [f for f in facades if f.startswith("tiers/")], facades


def test_a_checkpoint_store_is_a_save_target(tmp_path):
    assert isinstance(CheckpointStore(str(tmp_path)), SaveTarget)


def test_the_callback_asks_the_seam_not_the_type():
    for module in (callback, rerun):
        assert "isinstance(self.checkpointer" not in inspect.getsource(module)
        assert "isinstance(callback.checkpointer" not in inspect.getsource(module)
