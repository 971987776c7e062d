"""One rank of a two-process DDP run on CPU (gloo), launched by tests/lightning/test_lightning_ddp.py.

Usage: python _ddp_worker.py DIRPATH MODE   (MODE: ok | fail | final | hooks | hookfail)
Prints one line ``RESULT {json}`` on success.
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback  # noqa: E402
from tests.helpers.models import BNDropoutModel, make_loader  # noqa: E402


class _Unpicklable:
    """Deep-copies fine at the cut, fails when the upload thread pickles it."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


class PoisonOnRankZero(BNDropoutModel):
    def on_save_checkpoint(self, checkpoint):
        if self.global_step == 4 and self.global_rank == 0:
            checkpoint["poison"] = _Unpicklable()


def main() -> None:
    dirpath, mode = sys.argv[1], sys.argv[2]
    pl.seed_everything(3)
    model = PoisonOnRankZero() if mode == "fail" else BNDropoutModel()
    told: list[int] = []

    def on_commit(committed) -> None:  # issue 43: rank 0 only; "hookfail" raises there
        told.append(committed.step)
        if mode == "hookfail":
            raise RuntimeError("the hook refused")

    hook = on_commit if mode in ("hooks", "hookfail") else None
    callback = AsyncCheckpointCallback(dirpath=dirpath, every_n_train_steps=2, retries=0, on_commit=hook)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy="ddp",
        max_steps=7 if mode == "final" else 8,  # final: not a multiple of the interval
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, make_loader(n=64))
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": trainer.global_rank,
                "writer": callback.checkpointer is not None,
                "requested": callback.requested_step,
                "committed": callback.committed_step,
                "skipped": callback.skipped,
                "told": told,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
