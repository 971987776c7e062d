"""The :class:`AccelerateCheckpointer`: hooks on the ``Accelerator``, optimizer-step fences and collectives."""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from typing import Any

from lightning_async_ckpt.accelerate._collective import collective_for
from lightning_async_ckpt.accelerate._fences import deferral_proof, install_fences
from lightning_async_ckpt.accelerate._folder import _FolderSave, _FolderStore, _release_unsettled
from lightning_async_ckpt.accelerate._folder_saves import FolderSaves
from lightning_async_ckpt.accelerate._fsdp import FSDP2_HOOK_PATH, is_fsdp2, save_fsdp2
from lightning_async_ckpt.accelerate._layout import (
    _ATTR,
    INCOMPLETE_MARKER,
    _clean,
    _expected_sync_files,
    _indexed,
    _layout_state,
    _LayoutSerializer,
    _log,
    _model_weights,
    _rng_state,
)
from lightning_async_ckpt.accelerate._mirrors import MirrorBook
from lightning_async_ckpt.accelerate._numbering import (
    automatic_root,
    continue_numbering,
    next_free_index,
    uncommitted_load_message,
)
from lightning_async_ckpt.accelerate._prehooks import remove_when_done, run_save_pre_hooks
from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.collective import RankFailedError, agree
from lightning_async_ckpt.core.commit_hooks import CommitFanOut
from lightning_async_ckpt.core.engine import AsyncCheckpointer, CheckpointOptions, SaveHandle
from lightning_async_ckpt.core.handle import DrainOnExit
from lightning_async_ckpt.core.workers import register_at_exit
from lightning_async_ckpt.errors import CheckpointError, ConfigError, check_number
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest
from lightning_async_ckpt.storage.store import CheckpointStore


class AccelerateCheckpointer(FolderSaves, CommitFanOut, DrainOnExit):
    """Asynchronous checkpoints for one ``Accelerator``; create it with :func:`attach` on every process.

    Thread-safety: every method and hook runs on the training thread. In multi-process runs, ``save_state``,
    ``close``, ``accelerator.save_state``/``load_state`` and the first optimizer step after a save are collectives:
    every process must reach them, and errors are raised on every process at once.

    Attributes:
        step: Optimizer updates seen (of the first prepared optimizer), restored from a manifest on load; the
            default step of :meth:`save_state` and the manifest step of hook-path folders.
        uri: Store of the fully asynchronous path, or ``None``.
        handles: Recent save handles of this process (hook path and fully asynchronous path).
    """

    def __init__(
        self,
        accelerator: Any,
        uri: str | None,
        *,
        storage_options: dict[str, Any] | None,
        defer: bool,
        options: CheckpointOptions,
    ) -> None:
        self.accelerator = accelerator
        self.uri = uri
        self.storage_options = storage_options
        self.defer = defer
        self.options = options
        self.step = 0
        self.handles: deque[SaveHandle] = deque(maxlen=100)
        self._multi = accelerator.num_processes > 1
        self._main = accelerator.is_main_process
        on_each_node = accelerator.project_configuration.save_on_each_node
        self._folder_writer = accelerator.is_local_main_process if on_each_node else self._main
        self._engine: AsyncCheckpointer | None = None
        self._folder_engine: AsyncCheckpointer | None = None
        self._sharded: AsyncCheckpointer | None = None  # FSDP2 (_fsdp.py)
        self._folder_store: _FolderStore | None = None
        self._unsettled: list[_FolderSave] = []
        self._pending_settle = False
        self._collective_group = collective_for(accelerator)
        self._book = MirrorBook(self._main)
        self._fences: dict[int, Any] = {}
        self._counted: Any = None
        self._closed = False
        self._final_save = False  # set for the duration of save_state(final=True)
        self._retention_lock = threading.Lock()
        self._warned_total_limit = self._warned_fsdp2 = False
        self.run_id = self._collective(payload=CheckpointStore.new_run_id(), doing="attach")[0]
        self._hooks = [
            accelerator.register_save_state_pre_hook(self._on_save_state),
            accelerator.register_load_state_pre_hook(self._on_load_state),
        ]
        self._install_fences()
        self._exit_hook = register_at_exit(self._exit)
        # Dropped without close(): no upload thread may wait forever for a confirmation that cannot come.
        self._finalizer = weakref.finalize(self, _release_unsettled, self._unsettled, self._multi)

    # -- public -------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def committed_step(self) -> int | None:
        """Newest step committed by the fully asynchronous path on this process (main process only)."""
        engine = self._engine or self._sharded
        return engine.committed_step if engine is not None else None

    def save_state(self, step: int | None = None, *, automatic: bool | None = None, final: bool = False) -> SaveHandle:
        """Capture everything ``accelerator.save_state`` would save and write it as one generation, asynchronously.

        Collective: every process must call it. Weights and optimizer state are staged behind the optimizer-step fence
        when proven; everything else is copied at the cut. accelerate's save-state pre-hooks run first; what they write is
        part of the generation. Only the main process writes (the other processes' RNG states are gathered to it).

        Where: generation ``step`` of the store at :attr:`uri`; or, with ``automatic`` (the default without :attr:`uri`)
        and ``ProjectConfiguration(automatic_checkpoint_naming=True)``, accelerate's own
        ``<project_dir>/checkpoints/checkpoint_<iteration>``, with its iteration and ``total_limit`` (which never removes
        a folder still being written nor the newest committed one).

        Args:
            step: The manifest's step; default :attr:`step`.
            automatic: Write accelerate's automatically named folder instead of a generation of :attr:`uri`.
            final: The checkpoint that ends training: everything is copied at the cut (no deferral).

        Returns:
            The save's handle. On other processes ``staged`` resolves at the cut and ``uploaded``/``committed`` at
            the next collective call.

        Raises:
            ConfigError: No :attr:`uri` and no automatic checkpoint naming, or a bad ``step``.
        """
        self._check_open()
        auto = self.uri is None if automatic is None else automatic
        if auto and automatic_root(self.accelerator) is None:
            raise ConfigError(
                "save_state without a uri writes accelerate's automatically named checkpoint_N folders: pass "
                "Accelerator(project_config=ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)), "
                "or attach(accelerator, uri=...) and save to that uri"
            )
        step = self.step if step is None else step
        check_number("step", step)
        self._install_fences()
        acc = self.accelerator
        rngs = self._settle_collectively(payload=_rng_state(acc))
        if is_fsdp2(acc):
            return save_fsdp2(self, step, rngs, automatic=auto, final=final)
        handle: SaveHandle | None = None
        error: BaseException | None = None
        index: int | None = None
        hook_files: str | None = None
        try:
            weights = _model_weights(acc)
            files, hook_files = run_save_pre_hooks(acc, weights, self._is_own, keep=self._main)
            self._final_save = final
            if self._main:
                state = {**files, **_layout_state(acc, rngs, weights)}
                if auto:
                    index, handle = self._save_automatic(step, state)
                else:
                    handle = self._save(self._get_engine(), step, state, extra={"layout": "accelerate"})
                if self._multi:  # only other processes need its outcome
                    self._book.track(handle)
        except Exception as exc:  # noqa: BLE001 - raised on every process by the collective below
            error = exc
        finally:
            self._final_save = False
            remove_when_done(hook_files, handle)
        decision, index = self._collective(
            error,
            payload=(handle.decision, index) if handle is not None else (None, None),
            doing=f"save_state(step={step})",
        )[0]
        if index is not None:
            acc.project_configuration.iteration = index + 1  # as accelerate's save_state does, on every process
        if handle is None:  # this process wrote nothing: a mirror of the main process's save
            handle = self._book.mirror_of(step, decision)
            self.handles.append(handle)
        return handle

    def wait(self) -> float:
        """Block until every outstanding save's deferred state is staged (what the step fence does)."""
        return sum(e.wait(Fence.OPTIMIZER_STEP, raise_errors=not self._multi) for e in self._engines())

    def close(self, timeout: float | None = None) -> None:
        """Confirm pending hook-path folders, drain every save, remove the hooks; collective, idempotent.

        Raises:
            CheckpointError: A save failed (on any process).
        """
        if self._closed:
            return
        self._closed = True
        self._exit_hook.unregister()
        self._finalizer.detach()
        error: BaseException | None = None
        try:
            self._settle_collectively()
        except Exception as exc:  # noqa: BLE001 - the engines still drain; raised below, on every process
            error = exc
        for engine in self._engines():
            try:
                engine.close(timeout)
            except CheckpointError as exc:
                error = error or exc
        for save in self._unsettled:
            save.abandon()
        for hook in [*self._hooks, *self._fences.values()]:
            hook.remove()
        self._hooks, self._fences = [], {}
        if getattr(self.accelerator, _ATTR, None) is self:
            delattr(self.accelerator, _ATTR)
        try:
            self._collective(error, doing="close")
        finally:
            self._book.cancel_all()
            release = getattr(self._collective_group, "release", None)
            if callable(release):
                release()  # a private gloo group left to interpreter exit can abort the process

    # -- hooks (training thread) ----------------------------------------------------------------------------
    def _on_save_state(self, models: list, weights: list, output_dir: str) -> None:
        if is_fsdp2(self.accelerator):  # accelerate already wrote the shards, synchronously (see _fsdp.py)
            if not self._warned_fsdp2:
                self._warned_fsdp2 = True
                _log.warning(FSDP2_HOOK_PATH)
            return
        if len(weights) < len(models):
            raise ConfigError(
                f"accelerate passed {len(weights)} state dicts for {len(models)} models to the save_state pre-hook "
                f"(distributed_type={self.accelerator.distributed_type}): FSDP, DeepSpeed and Megatron-LM models "
                "are saved by accelerate before the hook runs, or a pre-hook registered earlier took over weight "
                "saving. lightning_async_ckpt supports single-device and DDP models: do not attach() here."
            )
        project = self.accelerator.project_configuration
        limit = project.total_limit if project.automatic_checkpoint_naming else None
        if limit is not None and limit <= self.options.max_outstanding:
            # accelerate deletes old folders before any hook runs: an asynchronous folder could be deleted while
            # still being written. Step aside (every process alike): accelerate saves this folder itself.
            if not self._warned_total_limit:
                self._warned_total_limit = True
                _log.warning(
                    "ProjectConfiguration(total_limit=%d) <= max_outstanding=%d: accelerator.save_state would delete "
                    "a folder still being written, so accelerate saves these folders itself, synchronously and "
                    "without a manifest. Use total_limit >= max_outstanding + 1, or "
                    "lightning_async_ckpt.accelerate.save_state(accelerator), whose total_limit never deletes a "
                    "folder in flight",
                    limit,
                    self.options.max_outstanding,
                )
            return
        taken = list(weights)
        weights.clear()  # we take over weight saving; accelerate writes the rest synchronously after this hook
        self._install_fences()
        self._settle_collectively()
        error: BaseException | None = None
        self._pending_settle = True
        if self._folder_writer:
            try:
                state = {
                    _indexed("model", i, ".safetensors"): ("safetensors", _clean(sd)) for i, sd in enumerate(taken)
                }
                expected = _expected_sync_files(self.accelerator)
                self._save_folder(os.path.abspath(os.fspath(output_dir)), state, self.step, expected)
            except Exception as exc:  # noqa: BLE001 - raised on every process by the collective below
                error = exc
        self._collective(error, doing=f"save_state({output_dir!r})")

    def _on_load_state(self, models: list, input_dir: str) -> None:
        folder = os.path.abspath(os.fspath(input_dir))
        self._quiesce(folder)
        manifest_path = os.path.join(folder, MANIFEST_NAME)
        if os.path.exists(manifest_path):
            with open(manifest_path, "rb") as f:
                self.step = Manifest.from_json(f.read(), where=manifest_path).step
            # A restarted job is back at iteration 0: its next automatic save goes past every folder there.
            continue_numbering(self.accelerator, next_free_index(self.accelerator))
        elif os.path.exists(os.path.join(folder, INCOMPLETE_MARKER)):
            raise CheckpointError(uncommitted_load_message(folder))

    def _on_load_weights(self, *_: Any) -> None:
        # model.load_state_dict(...) is about to overwrite weights a save may still be staging: stage them first.
        self.wait()

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer is self._counted:
            self.step += 1
        if self._pending_settle:
            self._settle_collectively()
        self.wait()

    # -- internals -----------------------------------------------------------------------------------------
    def _save(self, engine: AsyncCheckpointer, step: int, state: dict, extra: dict[str, Any], **how: Any) -> SaveHandle:
        acc = self.accelerator
        handle = engine.save(
            step,
            state,
            modules=acc._models,
            optimizers=acc._optimizers,
            proof=deferral_proof(acc, self._is_own) if self.defer and not self._final_save else None,
            defer=self.defer,
            cut={"accelerator_step": acc.step, "num_processes": acc.num_processes},
            extra=extra,
            final=self._final_save,
            **how,
        )
        self.handles.append(handle)
        return handle

    def _is_own(self, hook: Any) -> bool:
        return getattr(hook, "__self__", None) is self

    def _install_fences(self) -> None:
        first = install_fences(self.accelerator, self._fences, self._on_optimizer_step, self._on_load_weights)
        self._counted = first if self._counted is None else self._counted

    def _get_engine(self) -> AsyncCheckpointer:
        if self._engine is None:
            store = CheckpointStore(self.uri, self.storage_options, run_id=self.run_id)
            self._engine = self._new_engine(store, self.options)
        return self._engine

    def _new_engine(self, store: CheckpointStore, options: CheckpointOptions, target: Any = None) -> AsyncCheckpointer:
        engine = AsyncCheckpointer(store, options, target=target, serializer=_LayoutSerializer())
        engine.declare_fences({Fence.OPTIMIZER_STEP})
        self.commit_callbacks_to(engine)  # add_commit_callback (core/commit_hooks.py)
        # Our exit handler must run before the engine's (newest first): it confirms pending folders first.
        self._exit_hook.unregister()
        self._exit_hook = register_at_exit(self._exit)
        return engine

    def _engines(self) -> list[AsyncCheckpointer]:
        return [e for e in (self._folder_engine, self._engine, self._sharded) if e is not None]

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this AccelerateCheckpointer is closed; attach() a new one")

    def _take_pending(self) -> BaseException | None:
        errors = [e.take_pending_error() for e in self._engines()]
        return next((e for e in errors if e is not None), None)

    def _settle_collectively(self, payload: Any = None) -> list[Any]:
        """Collective: every process returned from earlier ``save_state`` calls; raise pending errors everywhere."""
        return self._collective(
            self._take_pending(), payload=payload, agreed=self._mark_settled, doing="a checkpoint operation"
        )

    def _mark_settled(self) -> None:
        self._pending_settle = False
        for save in self._unsettled:
            save.settle()
        self._unsettled.clear()

    def _collective(
        self, local_error: BaseException | None = None, payload: Any = None, *, doing: str, agreed: Any = None
    ) -> list[Any]:
        """Share each process's error and payload through the collective seam; raise on every process if any failed.

        ``agreed`` runs once every process reached this point, before any error is raised. The main process's
        ended saves travel with the payload, so the other processes can resolve their mirror handles.
        """
        report = self._book.report() if self._collective_group is not None else []
        try:
            gathered = agree(self._collective_group, local_error, (payload, report), doing=doing)
        except BaseException as exc:
            if agreed is not None and (exc is local_error or isinstance(exc, RankFailedError)):
                agreed()  # every process reached the exchange; only then may their folders be confirmed
            raise
        self._book.delivered(len(report))
        self._book.absorb(gathered[0][1])
        if agreed is not None:
            agreed()
        return [p for p, _ in gathered]

    def _exit(self) -> None:
        if self._closed:
            return
        # With several processes close() is a collective: a script's `save_state()` then `sys.exit()` reaches it on
        # every process, which confirms and commits the last folders. A process that never comes (killed, stuck)
        # fails it within the collective bound, and the folders not confirmed everywhere stay uncommitted.
        unsettled = len(self._unsettled)
        try:
            self.close(timeout=self.options.drain_timeout_s)
        except Exception:  # noqa: BLE001 - nothing can be raised at exit; it is logged
            left = f" ({unsettled} save_state folder(s) may be left uncommitted)" if self._multi and unsettled else ""
            _log.warning("checkpoint error at interpreter exit%s", left, exc_info=True)
