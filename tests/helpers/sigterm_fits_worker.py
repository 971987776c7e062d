"""Subprocess side of the several-fits SIGTERM test: fits in one process, each with its own callback and
``preemption_signal=SIGTERM`` (a sweep, or a retry after a failure).

``python sigterm_fits_worker.py <dir>`` runs fit 1 to its end, fit 2 into an exception (caught, as a sweep does), fit
3 and fit 4 into a SIGTERM sent to this process at step 3: each of those commits its emergency checkpoint and ends
with Lightning's ``SIGTERMException`` (caught). It prints ``survived`` last; a stale handler ends the process earlier
with SIGTERM's default action.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore  # noqa: E402
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs  # noqa: E402


class _Fails(BNDropoutModel):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("trial failed")
        return super().training_step(batch, batch_idx)


class _SigtermAt3(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(root: str, name: str, model: pl.LightningModule, callbacks: list) -> None:
    ours = AsyncCheckpointCallback(
        dirpath=os.path.join(root, name), every_n_train_steps=2, preemption_signal=signal.SIGTERM
    )
    trainer = pl.Trainer(max_steps=6, callbacks=[*callbacks, ours], **trainer_kwargs())
    try:
        trainer.fit(model, make_loader())
    except (RuntimeError, SystemExit) as exc:  # the failed trial, SIGTERMException
        print(name, "ended by", type(exc).__name__, flush=True)
    else:
        print(name, "ended normally", flush=True)
    steps = [g.step for g in CheckpointStore(os.path.join(root, name), check_writable=False).generations()]
    print(name, "steps", steps, flush=True)


def main(root: str) -> None:
    _fit(root, "normal", BNDropoutModel(), [])
    _fit(root, "exception", _Fails(), [])
    _fit(root, "signal", BNDropoutModel(), [_SigtermAt3()])
    _fit(root, "signal-again", BNDropoutModel(), [_SigtermAt3()])
    print("handler after the fits:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    print("survived", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
