"""Class B of issue 12 end to end: hooks that run before a fence write state; every commit equals ModelCheckpoint.

Each setup failed before the proof knew the hook (torn and committed, or refused by the guard and never committed).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override

from tests.helpers.models import TableModel, fit_compare_every_step, table_loader


class _ClampsBeforeZeroGrad(pl.Callback):
    """Lightning 2.6 runs a callback's on_before_zero_grad inside the closure, before on_before_optimizer_step."""

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        with torch.no_grad():
            w = pl_module.table.weight
            w[-64:] = w[-64:].clamp(-0.5, 0.5)


def test_a_callback_writing_in_on_before_zero_grad_demotes_parameters_to_batch_start(tmp_path):
    store = fit_compare_every_step(
        tmp_path, TableModel("embedding_plain"), table_loader(), callbacks=[_ClampsBeforeZeroGrad()]
    )
    assert [g.step for g in store.generations()] == list(range(1, 11))
    plan = store.manifest(9).plan  # 10 ends training: copied at the cut
    fences = {r["category"]: r["fence"] for r in plan["rows"]}
    assert fences["parameter"] == "batch_start"
    assert any("on_before_zero_grad" in f for f in plan["failures"])


class _NormalizingData(pl.LightningDataModule):
    """Updates a running per-row count on the module as each batch arrives (before on_train_batch_start)."""

    @override
    def train_dataloader(self) -> Any:
        return table_loader()

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        idx, _ = batch
        module = self.trainer.lightning_module
        module.seen.index_add_(0, idx, torch.ones(len(idx)))
        module.seen[:4096].add_(1.0)  # a dense part too, so the buffer is worth tearing
        return batch


def test_a_datamodule_batch_transfer_hook_writing_a_buffer_puts_everything_at_the_cut(tmp_path):
    store = fit_compare_every_step(tmp_path, TableModel("embedding_plain"), datamodule=_NormalizingData())
    assert [g.step for g in store.generations()] == list(range(1, 11))  # none refused: the proof knew the hook
    plan = store.manifest(9).plan  # 10 ends training: copied at the cut
    assert {r["fence"] for r in plan["rows"]} == {"cut"}
    assert any("on_after_batch_transfer" in f for f in plan["failures"])


class _ValidatedTable(TableModel):
    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        idx, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(idx), y))


def test_validation_mid_epoch_with_a_max_norm_table_matches_model_checkpoint(tmp_path):
    # validation_step (and its forward, which renormalizes looked-up rows) runs between the cut and the next batch.
    store = fit_compare_every_step(
        tmp_path,
        _ValidatedTable("embedding"),
        table_loader(),
        val_data=table_loader(n=16),
        val_check_interval=3,
        limit_val_batches=2,
    )
    assert [g.step for g in store.generations()] == list(range(1, 11))
    rows = store.manifest(9).plan["rows"]
    assert any(r["category"] == "parameter" and r["fence"] == "cut" and "max_norm" in r["rule"] for r in rows)
