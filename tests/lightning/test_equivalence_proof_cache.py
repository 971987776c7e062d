"""The proof is reused from cut to cut, and a hook registered mid-fit is seen at the next cut: every commit equals
ModelCheckpoint's."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from tests.helpers.models import TableModel, fit_compare_every_step, table_loader


class _HooksTheTableAtStep5(pl.Callback):
    """Registers a forward hook that writes the table's last rows in every later forward (before the next update).

    Declared read-only: the callback itself writes nothing; the hook it registers is what the proof must see.
    """

    lightning_async_ckpt_read_only = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == 5:

            def clamp(module: torch.nn.Module, args: Any, out: Any) -> None:
                with torch.no_grad():
                    module.weight[-64:].clamp_(-0.5, 0.5)
                    module.weight.data[-64:] *= 0.99  # past the version counter too

            pl_module.table.register_forward_hook(clamp)


def test_a_forward_hook_registered_between_two_cuts_demotes_the_next_cut(tmp_path):
    store = fit_compare_every_step(
        tmp_path, TableModel("embedding_plain"), table_loader(), callbacks=[_HooksTheTableAtStep5()]
    )
    assert [g.step for g in store.generations()] == list(range(1, 11))  # none refused: each proof was right
    fences = {
        g.step: {r["category"]: r["fence"] for r in store.manifest(g.step).plan["rows"]} for g in store.generations()
    }
    assert {fences[s]["parameter"] for s in range(1, 5)} == {"optimizer_step"}
    assert {fences[s]["parameter"] for s in range(5, 10)} == {"batch_start"}
    assert any("forward/backward hook" in f for f in store.manifest(5).plan["failures"])
