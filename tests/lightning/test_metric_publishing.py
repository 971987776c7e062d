"""The ``ckpt/*`` metrics reach Lightning without ``LightningModule.log``.

Each ``self.log`` call costs the training thread about 2 ms of Lightning's result-collection bookkeeping (the
``_ResultMetric``'s move to the value's device walks the metric object), paid at every cut and commit: more than a
quarter of the callback's time in its hooks on the CPU preset. The callback publishes the values itself: into
``trainer.callback_metrics`` and ``trainer.logged_metrics`` when they change, ``ckpt/committed_step`` into the
progress bar, and to the loggers at Lightning's own logging cadence (``log_every_n_steps``).
"""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_async_ckpt import AsyncCheckpointCallback
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs


class _CountsLogCalls(BNDropoutModel):
    """Counts ``self.log`` calls for ``ckpt/*`` keys, and logs its own loss every step (Lightning's cadence)."""

    def __init__(self) -> None:
        super().__init__()
        self.ckpt_log_calls = 0

    def log(self, name: str, *args, **kwargs) -> None:  # noqa: D102 - counts, then Lightning's own log
        if name.startswith("ckpt/"):
            self.ckpt_log_calls += 1
        super().log(name, *args, **kwargs)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("own_loss", loss.detach(), on_step=True, on_epoch=False)
        return loss


def _rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(f"{logger.log_dir}/metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _fit(
    tmp_path, every: int, log_every: int
) -> tuple[pl.Trainer, _CountsLogCalls, AsyncCheckpointCallback, CSVLogger]:
    pl.seed_everything(0)
    model = _CountsLogCalls()
    cb = AsyncCheckpointCallback(str(tmp_path / "ckpt"), every_n_train_steps=every)
    logger = CSVLogger(tmp_path / "logs")
    trainer = pl.Trainer(callbacks=[cb], **trainer_kwargs(max_steps=12, logger=logger, log_every_n_steps=log_every))
    trainer.fit(model, make_loader())
    return trainer, model, cb, logger


def test_ckpt_metrics_are_published_without_lightning_module_log(tmp_path):
    trainer, model, cb, logger = _fit(tmp_path, every=2, log_every=4)

    assert model.ckpt_log_calls == 0
    assert cb.committed_step == 12
    metrics = trainer.callback_metrics
    assert float(metrics["ckpt/requested_step"]) == 12
    assert isinstance(metrics["ckpt/blocked_s"], torch.Tensor) and float(metrics["ckpt/bytes"]) > 0
    assert "ckpt/backlog" in metrics and "ckpt/cut_to_committed_s" in metrics
    assert float(trainer.logged_metrics["ckpt/requested_step"]) == 12
    assert trainer.progress_bar_metrics["ckpt/committed_step"] == 12
    assert isinstance(trainer.progress_bar_metrics["ckpt/committed_step"], int)  # the bar shows 12, not 12.00

    rows = _rows(logger)
    own_steps = {int(r["step"]) for r in rows if r.get("own_loss")}
    ckpt_steps = {int(r["step"]) for r in rows if r.get("ckpt/requested_step")}
    # Sent to the loggers only when Lightning flushes its own step metrics (every 4 steps here), not at every change.
    assert ckpt_steps and ckpt_steps <= own_steps | {12}
    assert [float(r["ckpt/committed_step"]) for r in rows if r.get("ckpt/committed_step")][-1] == 12


def test_a_metric_unchanged_since_the_last_flush_is_sent_again(tmp_path):
    """As with ``self.log``'s step metrics, every flush carries the current value of each ``ckpt/*`` metric."""
    _, _, _, logger = _fit(tmp_path, every=4, log_every=1)
    rows = [r for r in _rows(logger) if r.get("ckpt/skipped")]
    assert len({int(r["step"]) for r in rows}) >= 10  # ckpt/skipped never changes (0), yet is in every flush
