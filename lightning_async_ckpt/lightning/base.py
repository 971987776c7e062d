"""The arguments of :class:`~lightning_async_ckpt.lightning.callback.AsyncCheckpointCallback`, validated here, and
the callback's own checkpoint state (its run id, selection and the RNG states at the cut).

They set the attributes ``ModelCheckpoint`` has, so what Lightning and the loggers read means what it means there.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_async_ckpt.core.engine import CheckpointOptions
from lightning_async_ckpt.core.exporter import check_export
from lightning_async_ckpt.core.interfaces import TrainingCheckpointer
from lightning_async_ckpt.lightning.arguments import check_arguments, check_selection, check_tiers, normalize_dirpath
from lightning_async_ckpt.lightning.commits import check_on_commit
from lightning_async_ckpt.lightning.preemption import PreemptionHandler, check_preemption
from lightning_async_ckpt.lightning.rerun import seed_committed_step
from lightning_async_ckpt.lightning.resume import name_loaded_checkpoint
from lightning_async_ckpt.lightning.schedule import CutSchedule
from lightning_async_ckpt.lightning.selection import (
    Selection,
    load_selection_state,
    model_checkpoint_best_k,
    selection_state,
)
from lightning_async_ckpt.lightning.sliced import check_ddp_layout
from lightning_async_ckpt.lightning.tiers import Tiers
from lightning_async_ckpt.lightning.triggers import Triggers
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["CallbackArguments"]


class CallbackArguments(ModelCheckpoint):
    """``AsyncCheckpointCallback``'s constructor and checkpoint state: its arguments, ``ModelCheckpoint``'s attributes,
    ``state_key``, and the state it writes into each checkpoint and restores from one.

    ``ModelCheckpoint``'s own saving never runs: the callback overrides every hook it implements.

    Args:
        dirpath: Local folder or fsspec URL (``s3://bucket/prefix``). Default: ``<default_root_dir>/checkpoints``.
        every_n_train_steps: Take a cut every N optimizer steps.
        every_n_epochs: Take a cut at the end of every N-th training epoch. Default 1 when neither interval is set.
        save_on_train_end: Take a final cut when training ends (if that step was not saved already): at the last
            batch end when the end is known there (``max_steps``, last batch of ``max_epochs``, ``should_stop``
            already set), so it equals ``ModelCheckpoint(every_n_train_steps=...)``'s checkpoint of that step, or at
            that epoch's end when this callback's own schedule saves the step there (then it is ``ModelCheckpoint``'s
            epoch-end file); a stop decided later (early stopping) at the first validation or epoch end that sees
            it, else in ``on_train_end``; never inside an accumulation window (``docs/concepts.md``).
        keep_last: Committed generations to keep (the newest ``keep_last``). By default (neither ``keep_last`` nor
            ``save_top_k``, no ``monitor``) the newest one is kept, like ``ModelCheckpoint``'s ``save_top_k=1``;
            ``save_top_k=-1`` keeps every generation. With ``local_dirpath`` this is ``dirpath``'s retention.
        admission: When a cut arrives while ``max_outstanding`` saves are in flight: ``wait``, ``skip``,
            ``coalesce`` or ``abort``.
        max_outstanding: Saves in flight at once.
        host_memory_budget: Bytes (an int, or a size such as ``"4GiB"``), ``"auto"`` (half the available host
            memory) or ``None`` (unbounded).
        reserved_host_bytes: Host bytes other consumers need, subtracted from the budget.
        defer: ``False`` copies everything at the cut (no fences needed).
        guard: The runtime guard over deferred state: ``True``/``"full"`` (default, exact: version counters and a
            fingerprint of every deferred byte), ``"sample"`` (opt-in: 64 sampled bytes per storage), ``False``.
        storage_options: fsspec options for ``dirpath`` (e.g. S3 endpoint, credentials).
        on_error: ``raise`` a failed save on the training thread at the next hook, or ``warn`` and keep training.
        retries: Extra upload attempts on transient storage errors.
        drain_timeout_s: Bound on draining at exceptions and interpreter exit.
        upload_nice: Nice value (0-19, Linux) of the upload thread; higher lets the training threads go first.
        huge_pages: Opt-in (Linux): back deferred CPU tensors with transparent huge pages after their first save,
            which makes the exact guard's work at each later cut several times shorter (docs/benchmarks.md).
        event_log: Path or URL of a JSONL event log (for ``lightning-async-ckpt timeline`` / ``plan``).
        restore_rng: Restore the RNG states captured at the cut when resuming (Lightning itself does not).
        verbose: Log every committed generation at INFO level, and ``ModelCheckpoint``'s top-k lines.
        log_metrics: Log the ``ckpt/*`` metrics through the Trainer's loggers and progress bar.
        ddp_layout: Under DDP: ``"single"`` (rank 0 writes ``checkpoint.ckpt``) or ``"sliced"`` (every rank writes
            a slice in torch DCP format; see ``docs/sharded.md``). Sharded strategies always write every rank's shards.
        local_dirpath: A node-local folder (NVMe, ``/dev/shm``): every cut is committed there first, and the
            generations due on the ``dirpath`` cadence (``every_n_train_steps``, epoch ends, the final and the
            emergency checkpoint) are promoted to ``dirpath`` in the background (``docs/tiers.md``). It must lie
            outside ``dirpath`` (and ``dirpath`` outside it). Not with ``monitor`` (best-k), refused here: rank with
            a second callback without ``local_dirpath``.
        local_every_n_train_steps: Cut to the local tier every N optimizer steps (``None``: only the ``dirpath``
            cadence).
        local_keep_last: Committed generations kept in the local tier (``None``: all); the newest one due on
            ``dirpath`` stays until its promotion committed.
        replicas: Under DDP, copy each local generation to this many other nodes' local tiers in the background
            (over a separate gloo group; replica ``i`` goes to rank ``i * ranks_per_node``), so a rank that lost its
            node-local folder resumes from a peer, not from ``dirpath`` (``None``: none). Needs ``local_dirpath``
            and fewer replicas than nodes (``docs/tiers.md``).
        preemption_signal: A signal (``signal.SIGTERM``, its name ``"SIGTERM"`` or its number) that asks for an
            emergency checkpoint at the next batch end; training stops after it (``None``: off).
        preemption_grace_s: Bound on waiting for the emergency checkpoint's commit and promotion (``None``: none).
        on_commit: ``fn(committed)``, called once per committed generation on the training thread of rank 0 at the
            first hook after the commit, with a frozen :class:`~lightning_async_ckpt.core.commit_hooks.Committed`
            (any callback's ``on_checkpoint_committed(trainer, pl_module, committed)`` is called there too);
            one that raises is raised once like a failed save (``docs/after_commit.md``).
        export: Export chosen generations' model weights to safetensors in the background, each as a committed
            generation of ``<dirpath>/exports/safetensors``: ``"safetensors"`` (the final one) or a
            :class:`~lightning_async_ckpt.core.exporter.SafetensorsExport` (final, best, every N, dtype, shards).
        filename, monitor, mode, save_top_k, save_last, save_weights_only, auto_insert_metric_name,
            train_time_interval, save_on_train_epoch_end, enable_version_counter, save_on_exception:
            ``ModelCheckpoint``'s arguments with its semantics on the committed generations: see
            ``docs/comparison.md`` (the rendered ``filename`` is recorded in the manifest; best-k retention keeps
            the ``save_top_k`` best committed generations by ``monitor`` and the newest; ``best_model_path`` and
            ``ckpt_path="best"`` name a committed generation).
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = None,
        save_top_k: int | None = None,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: Literal["min", "max"] = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        *,
        save_on_train_end: bool = True,
        keep_last: int | None = None,
        admission: Literal["wait", "skip", "coalesce", "abort"] = "wait",
        max_outstanding: int = 1,
        host_memory_budget: int | str | None = "auto",
        reserved_host_bytes: int = 0,
        defer: bool = True,
        guard: bool | str = True,
        storage_options: dict[str, Any] | None = None,
        on_error: Literal["raise", "warn"] = "raise",
        retries: int = 2,
        drain_timeout_s: float = 120.0,
        upload_nice: int = 0,
        huge_pages: bool = False,
        event_log: str | None = None,
        restore_rng: bool = False,
        ddp_layout: Literal["single", "sliced"] = "single",
        log_metrics: bool = True,
        local_dirpath: str | Path | None = None,
        local_every_n_train_steps: int | None = None,
        local_keep_last: int | None = None,
        replicas: int | None = None,
        preemption_signal: int | str | None = None,
        preemption_grace_s: float | None = None,
        on_commit: Callable[[Any], Any] | None = None,
        export: Any = None,
    ) -> None:
        args = check_selection(
            filename=filename,
            monitor=monitor,
            mode=mode,
            save_top_k=save_top_k,
            save_last=save_last,
            keep_last=keep_last,
            train_time_interval=train_time_interval,
            save_on_train_epoch_end=save_on_train_epoch_end,
            save_on_exception=save_on_exception,
        )
        # ModelCheckpoint's own saving never runs: all of its hooks are overridden. Its attributes are set to what
        # this callback does (loggers and Lightning read them).
        super().__init__(
            filename=filename, monitor=monitor, mode=mode, save_top_k=0, save_last=save_last, every_n_epochs=0
        )
        check_arguments(
            dirpath=dirpath,
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=every_n_epochs,
            flags={
                "save_on_train_end": save_on_train_end,
                "defer": defer,
                "restore_rng": restore_rng,
                "verbose": verbose,
                "save_weights_only": save_weights_only,
                "auto_insert_metric_name": auto_insert_metric_name,
                "enable_version_counter": enable_version_counter,
                "log_metrics": log_metrics,
            },
            storage_options=storage_options,
        )
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_epochs = 1
        # Validates admission, budget, keep_last, on_error, retries... with messages naming the parameter.
        self.options = CheckpointOptions(
            max_outstanding=max_outstanding,
            admission=admission,
            host_memory_budget=host_memory_budget,
            reserved_host_bytes=reserved_host_bytes,
            keep_last=args.keep_last,
            guard=guard,
            on_error=on_error,
            retries=retries,
            drain_timeout_s=drain_timeout_s,
            upload_nice=upload_nice,
            huge_pages=huge_pages,
            event_log=event_log,
        )
        self.dirpath = normalize_dirpath(dirpath)  # ModelCheckpoint's: `~` expanded, absolute, URLs untouched
        self.every_n_train_steps = every_n_train_steps
        self._every_n_epochs = every_n_epochs  # read through ModelCheckpoint's `every_n_epochs` property
        # save_top_k=0 without save_last saves nothing, like ModelCheckpoint (no final checkpoint either).
        self.save_on_train_end = save_on_train_end and not (args.save_top_k == 0 and not save_last)
        self.save_on_exception = save_on_exception  # a file at ModelCheckpoint's path (lightning/on_exception.py)
        self.defer = defer
        self.storage_options = storage_options
        self.restore_rng = restore_rng
        self.verbose = verbose
        self.log_metrics = log_metrics  # the ckpt/* metrics to the loggers and the progress bar (progress.py)
        self.ddp_layout = check_ddp_layout(ddp_layout)  # DDP: rank 0 writes, or every rank a slice (sliced.py)
        self.local_dirpath = check_tiers(
            dirpath=self.dirpath,
            local_dirpath=local_dirpath,
            local_every_n_train_steps=local_every_n_train_steps,
            local_keep_last=local_keep_last,
            every_n_train_steps=every_n_train_steps,
            monitor=monitor,
            replicas=replicas,
        )
        self.tiers = (
            None
            if self.local_dirpath is None
            else Tiers(
                local_dirpath=self.local_dirpath,
                local_every_n_train_steps=local_every_n_train_steps,
                local_keep_last=local_keep_last,
                every_n_train_steps=every_n_train_steps,
                replicas=replicas,
            )
        )
        signum, self.preemption_grace_s = check_preemption(preemption_signal, preemption_grace_s)
        self.preemption = PreemptionHandler(signum)  # the emergency save's signal, or none (lightning/preemption.py)
        self.on_commit = check_on_commit(on_commit)  # told of each commit on the training thread (commits.py)
        self.export = check_export(export)  # safetensors exports of chosen generations (core/exporter.py)
        self.exporter: Any = None  # its background writer, on rank 0 during fit
        self.store: CheckpointStore | None = None
        self.checkpointer: TrainingCheckpointer | None = None
        self.run_id: str | None = None
        self.resumed_location: Any = None  # set at train start: where the resumed generation is (rerun.py)
        self._model_checkpoint_best: dict[str, Any] = {}  # best k of a ModelCheckpoint state in a loaded checkpoint
        self.requested_step: int | None = None
        self.committed_step: int | None = None
        self.skipped = 0
        self._logged: tuple = ()
        self._distributed = False
        self._committed_before: set[int] = set()
        self._sharded: Any = None  # lightning.sharded.ShardedSetup when every rank writes DCP files
        self._last_cut_step: int | None = None
        # The newest step ModelCheckpoint's schedule saved; 0 like its _last_global_step_saved (no step taken yet).
        self._model_checkpoint_step = 0
        self._preallocated = False
        self._fit_start_step = 0
        self._fit_closed = True
        self._schedule = CutSchedule()
        self.save_top_k, self.save_weights_only = args.save_top_k, save_weights_only
        self.auto_insert_metric_name = auto_insert_metric_name
        self._every_n_train_steps, self._train_time_interval = every_n_train_steps or 0, train_time_interval
        self._save_on_train_epoch_end, self._enable_version_counter = save_on_train_epoch_end, enable_version_counter
        self.triggers = Triggers(
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=every_n_epochs,
            train_time_interval=train_time_interval,
            save_on_train_epoch_end=save_on_train_epoch_end,
            monitor=monitor,
        )
        self.selection = Selection(self, args, weights_only=save_weights_only)

    @property
    @override
    def state_key(self) -> str:
        ranking = {"monitor": self.monitor, "mode": self.mode} if self.monitor else {}
        return self._generate_state_key(
            dirpath=self.dirpath,
            every_n_train_steps=self.every_n_train_steps,
            every_n_epochs=self.every_n_epochs,
            **ranking,
        )

    # -- checkpoint state --------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        # RNG states at the cut, in a form torch.load(weights_only=True) accepts.
        # The run id travels with the checkpoint, so a resumed run keeps it and keep_last reaches across restarts.
        return {"rng_states": collect_portable_rng(), "run_id": self.run_id, **selection_state(self)}

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._model_checkpoint_best = model_checkpoint_best_k(checkpoint, self.monitor, self.dirpath)
        name_loaded_checkpoint(self, trainer)  # the real URL, not the "last" marker (resume.py)
        if (step := seed_committed_step(self, trainer.ckpt_path)) is not None:  # recoverable progress already
            self.checkpointer.committed_step = self.committed_step = step

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_selection_state(self, state_dict)
        run_id = state_dict.get("run_id")
        if isinstance(run_id, str) and run_id:
            self.run_id = run_id
            if self.store is not None:
                self.store.run_id = run_id
        rng_states = state_dict.get("rng_states")
        if self.restore_rng and rng_states:
            restore_rng(rng_states)


def collect_portable_rng() -> dict[str, Any]:
    """Every RNG state Lightning tracks, with numpy's key array as a tensor (loadable with ``weights_only``)."""
    out = dict(_collect_rng_states())
    if "numpy" in out:
        kind, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (
            kind,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    return out


def restore_rng(states: dict[str, Any]) -> None:
    """Set the RNG states captured by :func:`collect_portable_rng`."""
    states = dict(states)
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        states["numpy"] = (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    _set_rng_states(states)
