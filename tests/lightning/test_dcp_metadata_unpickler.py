"""The library's own DCP loader (``load_lightning_dcp``: a one-device or DDP resume from a DCP folder) never runs
code planted in the folder: ``.metadata`` is read through an allow-listed unpickler (DCP's metadata classes only)
and byte items through ``torch.load(weights_only=True)``, unless the caller trusts every writer.

The planted files are what anyone who can write the store can produce (and re-sign in the manifest): a real DCP
metadata object carrying one extra object whose unpickling creates a marker folder, and a byte item doing the same.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_async_ckpt import AsyncCheckpointCallback
from lightning_async_ckpt.errors import CheckpointError
from lightning_async_ckpt.lightning.sliced import load_lightning_dcp
from lightning_async_ckpt.storage.dcp_metadata import check_dcp_folder
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs


class Planted:
    """Unpickling it runs ``os.mkdir(marker)``: the stand-in for any code an attacker chooses."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _lightning_dcp_folder(tmp_path: Path, *, extra: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any]]:
    """A Lightning DCP folder as ``ddp_layout="sliced"`` writes it: DCP's files for the model and optimizer state,
    ``meta.pt`` for the rest, from a real two-step fit."""
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=2, **trainer_kwargs(enable_checkpointing=False))  # no files in the cwd
    trainer.fit(BNDropoutModel(), make_loader())
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    full = torch.load(tmp_path / "full.ckpt", weights_only=False)
    folder = tmp_path / "dcp"
    state = {"state_dict": full.pop("state_dict"), **(extra or {})}
    for i, osd in enumerate(full.pop("optimizer_states")):
        state[f"optimizer_{i}"] = osd
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    torch.save(full, folder / "meta.pt")
    return folder, state


def _plant_in_metadata(folder: Path, marker: Path) -> None:
    """Re-write ``.metadata`` as the real metadata plus one planted object (the load would otherwise succeed)."""
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by the test just now
    metadata.planner_data["planted"] = Planted(marker)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_a_clean_folder_loads_without_trust(tmp_path: Path) -> None:
    folder, state = _lightning_dcp_folder(tmp_path)
    loaded = load_lightning_dcp(str(folder))
    assert loaded["global_step"] == 2
    for key, value in state["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value), key
    osd = loaded["optimizer_states"][0]
    assert osd["param_groups"][0]["betas"] == state["optimizer_0"]["param_groups"][0]["betas"]
    assert sorted(osd["state"]) == sorted(state["optimizer_0"]["state"])  # integer parameter ids


def test_a_planted_metadata_object_is_refused_and_never_runs(tmp_path: Path) -> None:
    folder, _ = _lightning_dcp_folder(tmp_path)
    marker = tmp_path / "code-ran"
    _plant_in_metadata(folder, marker)
    with pytest.raises(CheckpointError, match=r"posix\.mkdir.*trust_pickled_objects=True"):
        load_lightning_dcp(str(folder))
    assert not marker.exists()


def test_a_planted_byte_item_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    folder, _ = _lightning_dcp_folder(tmp_path, extra={"planted": Planted(marker)})
    with pytest.raises(CheckpointError, match="trust_pickled_objects=True"):
        load_lightning_dcp(str(folder))
    assert not marker.exists()


def test_trusting_the_writers_unpickles_as_dcp_does(tmp_path: Path) -> None:
    folder, _ = _lightning_dcp_folder(tmp_path)
    marker = tmp_path / "code-ran"
    _plant_in_metadata(folder, marker)
    load_lightning_dcp(str(folder), trust_pickled_objects=True)
    assert marker.exists()  # what the flag means: whoever wrote the folder runs code


def test_a_lightning_resume_from_a_planted_folder_fails_without_running_it(tmp_path: Path) -> None:
    folder, _ = _lightning_dcp_folder(tmp_path)
    marker = tmp_path / "code-ran"
    _plant_in_metadata(folder, marker)
    callback = AsyncCheckpointCallback(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)
    trainer = pl.Trainer(max_steps=4, callbacks=[callback], **trainer_kwargs())
    with pytest.raises(CheckpointError, match="trust_pickled_objects=True"):
        trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=str(folder))
    assert not marker.exists()


def test_a_lightning_resume_from_a_clean_folder_continues(tmp_path: Path) -> None:
    folder, _ = _lightning_dcp_folder(tmp_path)
    seen: list[int] = []

    class Counting(BNDropoutModel):
        def training_step(self, batch, batch_idx):
            seen.append(self.trainer.global_step)
            return super().training_step(batch, batch_idx)

    callback = AsyncCheckpointCallback(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)
    trainer = pl.Trainer(max_steps=4, callbacks=[callback], **trainer_kwargs())
    trainer.fit(Counting(), make_loader(), ckpt_path=str(folder))
    assert seen[0] == 2


def test_check_dcp_folder_refuses_what_dcps_own_loader_would_run(tmp_path: Path) -> None:
    """What a caller runs before handing a folder to ``dcp.load`` or Lightning's sharded strategies (they unpickle
    ``.metadata`` and byte items without limits)."""
    folder, _ = _lightning_dcp_folder(tmp_path / "clean")
    check_dcp_folder(str(folder))
    marker = tmp_path / "code-ran"
    planted_item, _ = _lightning_dcp_folder(tmp_path / "item", extra={"planted": Planted(marker)})
    with pytest.raises(CheckpointError, match="'planted'"):
        check_dcp_folder(str(planted_item))
    _plant_in_metadata(folder, marker)
    with pytest.raises(CheckpointError, match="posix.mkdir"):
        check_dcp_folder(str(folder))
    assert not marker.exists()


def test_a_sharded_strategy_s_own_loader_is_guarded_before_it_unpickles(tmp_path: Path) -> None:
    # FSDP / ModelParallelStrategy load DCP folders with plain pickle: the callback checks the folder first.
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_async_ckpt.lightning.sliced import guard_strategy_dcp_loads

    folder, _ = _lightning_dcp_folder(tmp_path)
    marker = tmp_path / "code-ran"
    _plant_in_metadata(folder, marker)
    strategy = ModelParallelStrategy()
    reached: list[Any] = []
    strategy.load_checkpoint = lambda path, weights_only=None: reached.append((path, weights_only))  # type: ignore
    guard_strategy_dcp_loads(strategy)
    guard_strategy_dcp_loads(strategy)  # idempotent
    with pytest.raises(CheckpointError, match="trust_pickled_objects=True|posix.mkdir"):
        strategy.load_checkpoint(folder)
    assert not marker.exists() and not reached
    strategy.load_checkpoint(folder, weights_only=False)  # the caller's explicit trust: handed on unchecked
    strategy.load_checkpoint(tmp_path / "full.ckpt")  # not a DCP folder: handed on
    assert reached == [(folder, False), (tmp_path / "full.ckpt", None)]
