"""One idea, one name: the tiers' cadences are called as on AsyncCheckpointCallback on every surface; the former
names still work, with a FutureWarning, and passing both names is refused."""

from __future__ import annotations

import inspect
import warnings

import pytest

from lightning_async_ckpt.accelerate import attach
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.lightning import AsyncCheckpointCallback
from lightning_async_ckpt.tiers.tiered import TieredCheckpointer
from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer


def test_every_surface_takes_the_callbacks_names():
    callback = inspect.signature(AsyncCheckpointCallback).parameters
    assert {"every_n_train_steps", "local_every_n_train_steps"} <= set(callback)
    assert {"every_n_train_steps", "local_every_n_train_steps"} <= set(inspect.signature(attach).parameters)
    assert "every_n_train_steps" in inspect.signature(TieredCheckpointer).parameters
    assert "every_n_train_steps" in inspect.signature(TieredShardedCheckpointer).parameters


def test_the_new_name_sets_the_cadence_without_a_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ckpt = TieredCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), every_n_train_steps=4)
    try:
        assert ckpt.promote_every_n_steps == 4
    finally:
        ckpt.close()


def test_the_former_name_still_works_and_says_the_new_one(tmp_path):
    with pytest.warns(FutureWarning, match="promote_every_n_steps is now called every_n_train_steps") as record:
        ckpt = TieredCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), promote_every_n_steps=4)
    try:
        assert ckpt.promote_every_n_steps == 4
        assert record[0].filename == __file__  # the warning points at the caller's line
    finally:
        ckpt.close()


def test_both_names_at_once_are_refused_naming_the_one_to_keep(tmp_path):
    with pytest.raises(ConfigError, match="pass every_n_train_steps only"):
        TieredCheckpointer(
            str(tmp_path / "local"), str(tmp_path / "durable"), every_n_train_steps=4, promote_every_n_steps=4
        )
    assert not (tmp_path / "local").exists() or not any((tmp_path / "local").iterdir())
