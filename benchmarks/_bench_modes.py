"""The modes ``bench`` compares: how each one is wired into the Trainer, and what it reports afterwards.

Each mode is a function from a :class:`ModeContext` to a :class:`ModeSetup` (callbacks, plugins, and a ``finish``
that reads the mode's own figures into the :class:`ModeResult` after ``fit``). ``MODE_SETUPS`` maps the names
``--modes`` accepts to those functions, in the order they run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["MODE_SETUPS", "ModeContext", "ModeResult", "ModeSetup", "StepTimer"]


@dataclass
class ModeResult:
    """Figures of one mode (``error`` is ``"Type: message"`` when the mode failed and the run went on)."""

    mode: str
    median_step_s: float = 0.0
    mean_step_s: float = 0.0
    overhead_pct: float | None = None
    own_overhead_pct: float | None = None
    blocking_median_s: float | None = None
    blocking_max_s: float | None = None
    reported_blocking_s: float | None = None
    cut_to_committed_s: float | None = None
    bytes: int | None = None
    peak_rss_mb: float = 0.0
    peak_retained_mb: float | None = None
    persist_mbps: float | None = None
    checkpoints: int = 0
    fit_s: float = 0.0
    sync_s: float = 0.0
    note: str = ""
    error: str | None = None
    step_times: list[float] = field(default_factory=list)


@dataclass
class ModeContext:
    """What a mode's setup gets: the bench arguments, its own folder, and the checkpoint steps of the run."""

    args: argparse.Namespace
    target: str
    ckpt_steps: set[int]
    timings: dict[str, list[float]] = field(default_factory=lambda: {"cut": [], "committed": [], "fence": []})


@dataclass
class ModeSetup:
    """How a mode runs: extra callbacks and plugins, whether Lightning's checkpointing is on, and ``finish``.

    ``finish(result, sizes)`` runs after ``fit`` with the sizes of every file the mode wrote under its folder.
    """

    callbacks: list[Any] = field(default_factory=list)
    plugins: list[Any] = field(default_factory=list)
    checkpointing: bool = False
    finish: Callable[[ModeResult, list[int]], None] = lambda result, sizes: None


class StepTimer:
    """Records the start time of every training batch (it runs before the checkpoint callbacks)."""

    def __init__(self) -> None:
        from lightning.pytorch.callbacks import Callback

        timer = self

        class _Cb(Callback):
            lightning_async_ckpt_read_only = True  # it only reads the clock

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                timer.starts.append(time.perf_counter())

            def on_train_end(self, trainer, pl_module):
                timer.starts.append(time.perf_counter())

        self.starts: list[float] = []
        self.callback = _Cb()

    def step_times(self) -> list[float]:
        """Seconds between consecutive batch starts (the last one ends at ``on_train_end``)."""
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def _none(ctx: ModeContext) -> ModeSetup:
    return ModeSetup()


def _model_checkpoint(ctx: ModeContext, async_io: bool = False, staged_io: bool = False) -> ModeSetup:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    callback = ModelCheckpoint(
        dirpath=ctx.target,
        every_n_train_steps=ctx.args.every,
        save_top_k=-1,
        filename="{step}",
        save_on_train_epoch_end=False,
    )
    plugins = []
    if async_io:

        class _TimedIO(TorchCheckpointIO):
            def save_checkpoint(self, checkpoint, path, storage_options=None):
                super().save_checkpoint(checkpoint, path, storage_options)
                ctx.timings["committed"].append(time.time())

        plugins.append(AsyncCheckpointIO(_TimedIO()))
    staged = None
    if staged_io:
        from lightning_async_ckpt.lightning import StagedCheckpointIO

        staged = StagedCheckpointIO(host_memory_budget=None)
        plugins.append(staged)

    def finish(result: ModeResult, sizes: list[int]) -> None:
        result.bytes = max(sizes) if sizes else None
        if staged is not None and staged.committed:
            files = list(staged.committed)
            result.reported_blocking_s = statistics.median(f.blocked_s for f in files)
            result.cut_to_committed_s = statistics.median(f.write_s for f in files)
            result.peak_retained_mb = staged.pool.peak_bytes / 1e6
        if not (async_io or staged_io) and result.blocking_median_s:
            result.cut_to_committed_s = result.blocking_median_s
            if result.bytes:
                result.persist_mbps = result.bytes / result.blocking_median_s / 1e6

    return ModeSetup(callbacks=[callback], plugins=plugins, checkpointing=True, finish=finish)


def _dcp(ctx: ModeContext, async_staging: bool = False) -> ModeSetup:
    def finish(result: ModeResult, sizes: list[int]) -> None:
        timings = ctx.timings
        result.bytes = sum(sizes) // max(1, len(ctx.ckpt_steps)) if sizes else None
        if timings["cut"]:
            fences = timings["fence"] or [0.0] * len(timings["cut"])
            result.reported_blocking_s = statistics.median(c + f for c, f in zip(timings["cut"], fences, strict=False))
        if timings["committed"]:
            result.cut_to_committed_s = statistics.median(timings["committed"])

    return ModeSetup(callbacks=[_dcp_callback(ctx, async_staging)], finish=finish)


def _dcp_callback(ctx: ModeContext, async_staging: bool) -> Any:
    import torch.distributed.checkpoint as dcp
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint.state_dict import get_state_dict

    every, timings = ctx.args.every, ctx.timings

    class DcpAsync(Callback):
        """What a user writes today with DCP: async_save at the cut, wait for the previous save first."""

        def __init__(self) -> None:
            self.pending = None
            self.staging = None
            self.stager = None
            if async_staging:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                opts = StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=torch.cuda.is_available(),
                )
                self.stager = DefaultStager(opts)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if self.staging is not None:  # the source must not mutate before the copy is done
                t0 = time.perf_counter()
                self.staging.result()
                timings["fence"].append(time.perf_counter() - t0)
                self.staging = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step % every:
                return
            t0 = time.perf_counter()
            if self.pending is not None:
                self.pending.result()
            model_sd, optim_sd = get_state_dict(pl_module, trainer.optimizers)
            t_req = time.time()
            kwargs: dict[str, Any] = {"checkpoint_id": os.path.join(ctx.target, f"step-{step}")}
            if self.stager is not None:
                kwargs["async_stager"] = self.stager
            # A TypeError here (an older torch without these arguments) fails this mode, recorded in the results.
            resp = dcp.async_save({"model": model_sd, "optim": optim_sd}, no_dist=True, **kwargs)
            upload = getattr(resp, "upload_completion", resp)  # AsyncSaveResponse where the stager is async
            self.staging = getattr(resp, "staging_completion", None)
            upload.add_done_callback(lambda _f, t=t_req: timings["committed"].append(time.time() - t))
            self.pending = upload
            timings["cut"].append(time.perf_counter() - t0)

        def on_train_end(self, trainer, pl_module):
            if self.pending is not None:
                self.pending.result()
            if self.stager is not None:
                self.stager.close()

    return DcpAsync()


def _ours(ctx: ModeContext, defer: bool = False) -> ModeSetup:
    from lightning_async_ckpt.lightning import AsyncCheckpointCallback

    ours = AsyncCheckpointCallback(
        dirpath=ctx.target,
        every_n_train_steps=ctx.args.every,
        defer=defer,
        save_on_train_end=False,
        host_memory_budget=None,
        upload_nice=ctx.args.upload_nice,
        max_outstanding=ctx.args.max_outstanding,
    )

    def finish(result: ModeResult, sizes: list[int]) -> None:
        if ours.checkpointer is None:
            return
        records = [r for r in ours.checkpointer.records if r.outcome == "committed"]
        if records:
            result.bytes = records[-1].bytes
            result.reported_blocking_s = statistics.median(r.blocked_s + sum(r.fence_wait_s.values()) for r in records)
            result.cut_to_committed_s = statistics.median(r.cut_to_committed_s for r in records)
            result.persist_mbps = statistics.median(r.bytes / r.upload_s / 1e6 for r in records if r.upload_s)
            result.peak_retained_mb = max(r.peak_retained_bytes for r in records) / 1e6

    return ModeSetup(callbacks=[ours], checkpointing=True, finish=finish)


MODE_SETUPS: dict[str, Callable[[ModeContext], ModeSetup]] = {
    "none": _none,
    "model_checkpoint": _model_checkpoint,
    "async_checkpoint_io": lambda ctx: _model_checkpoint(ctx, async_io=True),
    "ours_checkpoint_io": lambda ctx: _model_checkpoint(ctx, staged_io=True),
    "dcp_async_save": _dcp,
    "dcp_async_staging": lambda ctx: _dcp(ctx, async_staging=True),
    "ours_copy": _ours,
    "ours_defer": lambda ctx: _ours(ctx, defer=True),
}
