"""Accelerate integration: asynchronous ``save_state`` in accelerate's own file layout.

Two paths, both driven by an :class:`AccelerateCheckpointer` that :func:`attach` installs on an ``Accelerator``:

* **Hook path**: ``accelerator.save_state(output_dir)`` as before. A save-state pre-hook takes the model weights out
  of accelerate's hands (it pops them from ``weights``) and stages them in the background, into
  ``model.safetensors`` / ``model_{i}.safetensors``; accelerate still writes optimizers, schedulers, sampler and
  dataloader state, ``scaler.pt``, ``random_states_{rank}.pkl`` and ``custom_checkpoint_{i}.pkl`` synchronously.
  ``output_dir`` is one generation: ``manifest.json`` is written in it last, once both parts are complete.
* **Fully asynchronous path**: :func:`save_state` (or :meth:`AccelerateCheckpointer.save_state`) captures everything
  accelerate would save at the cut and writes the same layout as one generation ``<uri>/step-XXXXXXXX/`` of a
  :class:`~lightning_async_ckpt.store.CheckpointStore` (local or ``s3://``). :func:`load_state` restores the newest
  committed generation with ``accelerator.load_state``.

Fences: an optimizer step pre-hook on each prepared optimizer's inner ``torch.optim.Optimizer`` sits right before the
update; parameters (and, in the second path, optimizer state) are staged behind it when
:func:`~lightning_async_ckpt.capture.prove_deferral` holds. Buffers, RNG, counters and Python state are copied at
the cut.

When is the hook path's folder complete? The pre-hook runs *before* accelerate writes its files, and accelerate has
no post-hook. Without patching accelerate, the first call into this library after ``save_state`` returned (the next
optimizer step, the next ``save_state``, ``load_state`` or :meth:`AccelerateCheckpointer.close`) is where the
training thread knows accelerate's part is done; in multi-process runs that call is a collective, so every rank's
files are done. Only then does the background thread check that accelerate's expected files exist and are complete
``torch.save`` archives, fsync them, and write the manifest.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import io
import json
import logging
import os
import random
import re
import shutil
import struct
import tempfile
import threading
import weakref
import zipfile
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from lightning_async_ckpt.capture import DeferralProof, Fence, prove_deferral
from lightning_async_ckpt.engine import AsyncCheckpointer, CheckpointOptions, SaveHandle
from lightning_async_ckpt.errors import CheckpointError, ConfigError, GenerationExistsError, ManifestError
from lightning_async_ckpt.manifest import MANIFEST_NAME, Manifest, ObjectEntry, validate_object_name
from lightning_async_ckpt.store import CheckpointStore, GenerationWriter, _Checksum, _fsync_dir
from lightning_async_ckpt.telemetry import SaveRecord

__all__ = ["INCOMPLETE_MARKER", "AccelerateCheckpointer", "attach", "load_state", "save_state"]

_log = logging.getLogger("lightning_async_ckpt")
_ATTR = "_lightning_async_ckpt"
INCOMPLETE_MARKER = ".lightning_async_ckpt-incomplete"
_UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")
# accelerate's synchronous files are torch.save zip archives: a truncated one has no central directory.
_ARCHIVE_RE = re.compile(
    r"^((optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|scaler\.pt)$"
)
_RNG_FILE_RE = re.compile(r"^random_states_(\d+)\.pkl$")
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"), ("uint32", "U32")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
if hasattr(torch, "uint64"):
    _ST_DTYPES[torch.uint64] = "U64"


# -- accelerate's file layout ------------------------------------------------------------------------------
def _indexed(base: str, i: int, ext: str) -> str:
    return f"{base}{'' if i == 0 else f'_{i}'}{ext}"


def _write_safetensors(tensors: dict[str, torch.Tensor], stream: Any, metadata: dict[str, str]) -> None:
    """Stream ``tensors`` in safetensors format: 8-byte header length, JSON header, then raw little-endian bytes.

    Larger elements first, so every tensor's offset is aligned to its element size (the header is padded to 8).
    """
    if struct.pack("=H", 1) != struct.pack("<H", 1):
        raise CheckpointError("safetensors streaming needs a little-endian host")
    items = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"model state entry {name!r} ({type(t).__name__}) cannot be written as safetensors")
        items.append((name, t.detach()))
    items.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in items:
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    stream.write(struct.pack("<Q", len(raw)))
    stream.write(raw)
    for _, t in items:
        if t.numel():
            stream.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class _LayoutSerializer:
    """Writes ``{object name: (kind, payload)}``: ``safetensors`` dicts, ``torch`` (``torch.save``) or ``raw`` bytes."""

    def write(self, state: Any, writer: GenerationWriter) -> None:
        for name, (kind, payload) in state.items():
            with writer.open(name) as stream:
                if kind == "safetensors":
                    _write_safetensors(payload, stream, {"format": "pt"})
                elif kind == "torch":
                    torch.save(payload, stream)
                else:
                    stream.write(payload)


def _clean(state_dict: dict) -> OrderedDict:
    # accelerate drops every key after the first that shares a storage before safetensors saving; so do we.
    from accelerate.utils.other import clean_state_dict_for_safetensors

    return clean_state_dict_for_safetensors(OrderedDict(state_dict))


def _rng_state(acc: Any) -> dict[str, Any]:
    """The dict accelerate writes to ``random_states_{rank}.pkl``."""
    import accelerate.utils as au

    def has(name: str) -> bool:
        return bool(getattr(au, name, lambda: False)())

    states: dict[str, Any] = {
        "step": acc.step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if has("is_xpu_available"):
        states["torch_xpu_manual_seed"] = torch.xpu.get_rng_state_all()
    if has("is_mlu_available"):
        states["torch_mlu_manual_seed"] = torch.mlu.get_rng_state_all()
    elif has("is_sdaa_available"):
        states["torch_sdaa_manual_seed"] = torch.sdaa.get_rng_state_all()
    elif has("is_musa_available"):
        states["torch_musa_manual_seed"] = torch.musa.get_rng_state_all()
    if has("is_hpu_available"):
        states["torch_hpu_manual_seed"] = torch.hpu.get_rng_state_all()
    if has("is_neuron_available"):
        states["torch_neuron_manual_seed"] = torch.neuron.get_rng_state_all()
    if has("is_cuda_available"):
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def _layout_state(acc: Any, rng_by_rank: list[dict[str, Any]]) -> dict[str, tuple[str, Any]]:
    """Everything ``accelerator.save_state`` writes, as ``{file name: (kind, payload)}`` aliasing live state."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    objects: dict[str, tuple[str, Any]] = {}
    for i, model in enumerate(acc._models):
        objects[_indexed("model", i, ".safetensors")] = ("safetensors", _clean(acc.get_state_dict(model, unwrap=False)))
    for i, opt in enumerate(acc._optimizers):
        objects[_indexed("optimizer", i, ".bin")] = ("torch", opt.state_dict())
    for i, scheduler in enumerate(acc._schedulers):
        objects[_indexed("scheduler", i, ".bin")] = ("torch", scheduler.state_dict())
    for i, loader in enumerate(acc._dataloaders):
        if isinstance(loader.dataset, IterableDatasetShard):
            sampler = loader.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                # accelerate pickles the sampler object (with its data source); pickling it now is that same cost.
                buf = io.BytesIO()
                torch.save(sampler, buf)
                objects[_indexed("sampler", i, ".bin")] = ("raw", buf.getvalue())
        if getattr(loader, "use_stateful_dataloader", False):
            objects[_indexed("dl_state_dict", i, ".bin")] = ("torch", loader.state_dict())
    if acc.scaler is not None:
        objects["scaler.pt"] = ("torch", acc.scaler.state_dict())
    for rank, rng in enumerate(rng_by_rank):
        objects[f"random_states_{rank}.pkl"] = ("torch", rng)
    for i, obj in enumerate(acc._custom_objects):
        objects[f"custom_checkpoint_{i}.pkl"] = ("torch", obj.state_dict())
    return objects


def _expected_sync_files(acc: Any) -> set[str]:
    """Files accelerate's synchronous part of ``save_state`` must write on a writing process."""
    names = {_indexed("optimizer", i, ".bin") for i in range(len(acc._optimizers))}
    names |= {_indexed("scheduler", i, ".bin") for i in range(len(acc._schedulers))}
    names |= {f"custom_checkpoint_{i}.pkl" for i in range(len(acc._custom_objects))}
    names.add(f"random_states_{acc.process_index}.pkl")
    if acc.scaler is not None:
        names.add("scaler.pt")
    return names


def _check_supported(acc: Any) -> None:
    kind = getattr(acc.distributed_type, "name", str(acc.distributed_type))
    if kind in _UNSUPPORTED:
        raise ConfigError(
            f"lightning_async_ckpt's Accelerate integration supports single-device and DDP runs, not "
            f"distributed_type={kind}: FSDP, DeepSpeed and Megatron-LM models are saved by accelerate itself before "
            "the save_state pre-hook runs (it receives no weights). Use accelerator.save_state without attach() there."
        )


# -- folder generations (hook path) ------------------------------------------------------------------------
@dataclass(eq=False)
class _FolderSave:
    """One hook-path save: the folder, and whether accelerate's synchronous part is known to have finished."""

    folder: str
    step: int
    expected: set[str]
    settled: threading.Event = field(default_factory=threading.Event)
    listing: list[str] = field(default_factory=list)
    abandoned: bool = False
    handle: SaveHandle | None = None

    def settle(self) -> None:
        """Record the files present now (accelerate's part is done) and release the commit."""
        names = []
        for dirpath, _, files in os.walk(self.folder):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), self.folder).replace(os.sep, "/")
                if rel in (MANIFEST_NAME, INCOMPLETE_MARKER) or rel.startswith(f".{MANIFEST_NAME}.tmp-"):
                    continue
                try:
                    names.append(validate_object_name(rel))
                except ManifestError:
                    _log.warning("not listing %s in the manifest of %s: unusual name", rel, self.folder)
        self.listing = sorted(names)
        self.settled.set()

    def abandon(self) -> None:
        self.abandoned = True
        self.settled.set()


class _FolderWriter(GenerationWriter):
    """Writes our objects into accelerate's folder; commit waits for accelerate's part, then seals its files."""

    def __init__(self, store: _FolderStore, save: _FolderSave) -> None:
        super().__init__(store, save.step, store.checksum)
        self._save = save
        self._own: set[str] = set()

    def open(self, name: str) -> Any:
        self._own.add(name)
        return super().open(name)

    def commit(self, **kwargs: Any) -> Manifest:
        save = self._save
        save.settled.wait()
        if save.abandoned:
            raise CheckpointError(
                f"{save.folder}: save_state was never confirmed finished on every process (close() was not called); "
                "the folder stays uncommitted"
            )
        missing = sorted(save.expected - set(save.listing))
        if missing:
            raise CheckpointError(f"accelerate did not write {missing} into {save.folder}; it stays uncommitted")
        for name in save.listing:
            if name not in self._own:
                self._record(self._seal(name))
        _fsync_dir(save.folder)
        manifest = super().commit(**kwargs)
        marker = os.path.join(save.folder, INCOMPLETE_MARKER)
        if os.path.exists(marker):
            os.unlink(marker)
            _fsync_dir(save.folder)
        return manifest

    def _seal(self, name: str) -> ObjectEntry:
        """Checksum and fsync one of accelerate's files; refuse a truncated torch.save archive."""
        path = os.path.join(self._save.folder, name)
        digest, size = _Checksum(self.checksum), 0
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
                size += len(chunk)
            os.fsync(f.fileno())
        if _ARCHIVE_RE.match(name) and not zipfile.is_zipfile(path):
            raise CheckpointError(
                f"{path} is not a complete torch.save archive (did save_state fail while writing it?); "
                "the folder stays uncommitted"
            )
        return ObjectEntry(name=name, size=size, checksum=digest.hexdigest())

    def abort(self) -> None:
        # Only our own objects: accelerate's files in the folder are not ours to delete.
        if self._done:
            return
        self._done = True
        for name in self._own:
            try:
                os.unlink(os.path.join(self._save.folder, name))
            except FileNotFoundError:
                pass
        self.store._end_write(self.step)


class _FolderStore(CheckpointStore):
    """A store whose generations are the folders passed to ``accelerator.save_state`` (not ``<root>/step-N``)."""

    def __init__(self, run_id: str) -> None:
        super().__init__(os.getcwd(), run_id=run_id, check_writable=False)  # the root is never written
        self.saves: dict[int, _FolderSave] = {}

    def _gen_path(self, step: int) -> str:
        save = self.saves.get(step)
        return save.folder if save is not None else super()._gen_path(step)

    def begin(self, step: int) -> GenerationWriter:
        save = self.saves[step]
        with self._lock:
            if step in self._writing:
                raise GenerationExistsError(f"{save.folder} is already being written")
            self._writing.add(step)
        os.makedirs(save.folder, exist_ok=True)
        return _FolderWriter(self, save)

    def gc(self, keep_last: int, **_: Any) -> list[int]:
        return []  # accelerate's ProjectConfiguration(total_limit=...) owns retention of these folders


# -- the checkpointer --------------------------------------------------------------------------------------
class AccelerateCheckpointer:
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
        self._folder_store: _FolderStore | None = None
        self._unsettled: list[_FolderSave] = []
        self._pending_settle = False
        self._mirrors: dict[int, SaveHandle] = {}
        self._reportable: deque[SaveHandle] = deque()
        self._fences: dict[int, Any] = {}
        self._counted: Any = None
        self._closed = False
        self.run_id = self._collective(payload=CheckpointStore.new_run_id())[0]
        self._hooks = [
            accelerator.register_save_state_pre_hook(self._on_save_state),
            accelerator.register_load_state_pre_hook(self._on_load_state),
        ]
        self._install_fences()
        self._atexit = _make_atexit(weakref.ref(self))
        atexit.register(self._atexit)
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
        return self._engine.committed_step if self._engine is not None else None

    def save_state(self, step: int | None = None) -> SaveHandle:
        """Capture everything ``accelerator.save_state`` would save and write it as generation ``step`` of ``uri``.

        Collective: every process must call it. Weights and optimizer state are staged in the background behind
        the optimizer-step fence when proven; buffers, RNG, schedulers, scaler, sampler/dataloader and custom state
        are copied at the cut. Only the main process writes: the other processes' RNG states are gathered to it
        at the cut, so the manifest is written once, after every file of every rank.

        Args:
            step: Generation step; default :attr:`step`.

        Returns:
            The save's handle. On other processes ``staged`` resolves at the cut and ``uploaded``/``committed`` at
            the next collective call (``save_state``, ``close``, a save via ``accelerator.save_state``).
        """
        self._check_open()
        if self.uri is None:
            raise ConfigError("this checkpointer has no uri: attach(accelerator, uri=...) to use save_state")
        step = self.step if step is None else step
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        self._install_fences()
        rngs = self._settle_collectively(payload=_rng_state(self.accelerator))
        handle: SaveHandle | None = None
        error: BaseException | None = None
        if self._main:
            try:
                state = _layout_state(self.accelerator, rngs)
                handle = self._save(self._get_engine(), step, state, extra={"layout": "accelerate"})
                self._reportable.append(handle)
            except Exception as exc:  # noqa: BLE001 - raised on every process by the collective below
                error = exc
        decision = self._collective(error, payload=handle.decision if handle is not None else None)[0]
        if handle is None:
            # This process wrote nothing: its handle mirrors the main process's save (resolved at collectives).
            handle = SaveHandle(step=step, record=SaveRecord(requested_step=step), decision=decision)
            if decision.admitted:
                handle.staged.set_result(step)
                self._mirrors[step] = handle
            else:
                for fut in (handle.staged, handle.uploaded, handle.committed):
                    fut.cancel()
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
        atexit.unregister(self._atexit)
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
            self._collective(error)
        finally:
            for handle in self._mirrors.values():
                for fut in (handle.uploaded, handle.committed):
                    fut.cancel()
            self._mirrors.clear()

    def __enter__(self) -> AccelerateCheckpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close(timeout=self.options.drain_timeout_s)
            except Exception:  # noqa: BLE001 - the body's exception wins; this one is logged
                _log.warning("checkpoint error while unwinding", exc_info=True)

    # -- hooks (training thread) ----------------------------------------------------------------------------
    def _on_save_state(self, models: list, weights: list, output_dir: str) -> None:
        if len(weights) < len(models):
            raise ConfigError(
                f"accelerate passed {len(weights)} state dicts for {len(models)} models to the save_state pre-hook "
                f"(distributed_type={self.accelerator.distributed_type}): FSDP, DeepSpeed and Megatron-LM models "
                "are saved by accelerate before the hook runs, or a pre-hook registered earlier took over weight "
                "saving. lightning_async_ckpt supports single-device and DDP models: do not attach() here."
            )
        taken = list(weights)
        weights.clear()  # we take over weight saving; accelerate writes the rest synchronously after this hook
        self._install_fences()
        self._settle_collectively()
        error: BaseException | None = None
        self._pending_settle = True
        if self._folder_writer:
            try:
                self._save_folder(os.path.abspath(os.fspath(output_dir)), taken)
            except Exception as exc:  # noqa: BLE001 - raised on every process by the collective below
                error = exc
        self._collective(error)

    def _on_load_state(self, models: list, input_dir: str) -> None:
        self._settle_collectively()
        self.wait()
        folder = os.path.abspath(os.fspath(input_dir))
        error: BaseException | None = None
        for save in list(self._folder_store.saves.values()) if self._folder_store else []:
            if save.folder == folder and save.handle is not None:
                try:
                    save.handle.committed.result()
                except Exception as exc:  # noqa: BLE001 - raised on every process by the collective below
                    error = exc
        self._collective(error)
        manifest_path = os.path.join(folder, MANIFEST_NAME)
        if os.path.exists(manifest_path):
            with open(manifest_path, "rb") as f:
                self.step = Manifest.from_json(f.read(), where=manifest_path).step
        elif os.path.exists(os.path.join(folder, INCOMPLETE_MARKER)):
            raise CheckpointError(
                f"{folder} is an uncommitted asynchronous save (its manifest was never written): some of its files "
                "may be missing or partial; load an older checkpoint"
            )

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer is self._counted:
            self.step += 1
        if self._pending_settle:
            self._settle_collectively()
        self.wait()

    # -- internals -----------------------------------------------------------------------------------------
    def _save_folder(self, folder: str, weights: list[dict]) -> None:
        store, engine = self._get_folder_engine()
        # A save still in flight into this folder (or at this step) ends before the folder is rewritten.
        saves = list(store.saves.values())  # a snapshot: the upload thread removes saves as they end
        concurrent.futures.wait(
            [s.handle.committed for s in saves if s.handle and (s.folder == folder or s.step == self.step)]
        )
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, INCOMPLETE_MARKER), "wb") as f:
            f.write(json.dumps({"step": self.step, "run_id": self.run_id}).encode())
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(os.path.join(folder, MANIFEST_NAME)):
            os.unlink(os.path.join(folder, MANIFEST_NAME))  # the folder is being rewritten: un-commit it first
        _fsync_dir(folder)
        state = {_indexed("model", i, ".safetensors"): ("safetensors", _clean(sd)) for i, sd in enumerate(weights)}
        save = _FolderSave(folder=folder, step=self.step, expected=_expected_sync_files(self.accelerator))
        store.saves[self.step] = save
        try:
            save.handle = self._save(engine, self.step, state, extra={"layout": "accelerate", "output_dir": folder})
        except BaseException:
            store.saves.pop(self.step, None)
            raise
        save.handle.committed.add_done_callback(
            lambda _: store.saves.pop(save.step) if store.saves.get(save.step) is save else None
        )
        self._unsettled.append(save)

    def _save(self, engine: AsyncCheckpointer, step: int, state: dict, extra: dict[str, Any]) -> SaveHandle:
        acc = self.accelerator
        handle = engine.save(
            step,
            state,
            modules=acc._models,
            optimizers=acc._optimizers,
            proof=self._proof() if self.defer else None,
            defer=self.defer,
            cut={"accelerator_step": acc.step, "num_processes": acc.num_processes},
            extra=extra,
        )
        self.handles.append(handle)
        return handle

    def _proof(self) -> DeferralProof:
        failures = []
        for model in self.accelerator._models:
            for name, sub in model.named_modules():
                if getattr(sub, "_hf_hook", None) is not None:
                    failures.append(f"module {name or type(sub).__name__} has an accelerate hook that may move weights")
                    break
        return prove_deferral(
            self.accelerator._models,
            self.accelerator._optimizers,
            has_optimizer_step_fence=True,
            has_batch_start_fence=False,
            extra_failures=failures,
        )

    def _install_fences(self) -> None:
        for i, opt in enumerate(self.accelerator._optimizers):
            inner = getattr(opt, "optimizer", opt)
            if i == 0 and self._counted is None:
                self._counted = inner
            if id(inner) not in self._fences:
                self._fences[id(inner)] = inner.register_step_pre_hook(self._on_optimizer_step)

    def _get_engine(self) -> AsyncCheckpointer:
        if self._engine is None:
            store = CheckpointStore(self.uri, self.storage_options, run_id=self.run_id)
            self._engine = self._new_engine(store, self.options)
        return self._engine

    def _get_folder_engine(self) -> tuple[_FolderStore, AsyncCheckpointer]:
        if self._folder_engine is None:
            # Skipping would leave a folder accelerate cannot load: the hook path waits (or aborts).
            admission = "abort" if self.options.admission == "abort" else "wait"
            opts = CheckpointOptions(**{**self.options.__dict__, "admission": admission, "keep_last": None})
            store = _FolderStore(self.run_id)
            self._folder_store, self._folder_engine = store, self._new_engine(store, opts)
        return self._folder_store, self._folder_engine  # type: ignore[return-value]

    def _new_engine(self, store: CheckpointStore, options: CheckpointOptions) -> AsyncCheckpointer:
        engine = AsyncCheckpointer(store, options, serializer=_LayoutSerializer())
        engine.declare_fences({Fence.OPTIMIZER_STEP})
        # Our exit handler must run before the engine's (atexit is LIFO): it confirms pending folders first.
        atexit.unregister(self._atexit)
        atexit.register(self._atexit)
        return engine

    def _engines(self) -> list[AsyncCheckpointer]:
        return [e for e in (self._folder_engine, self._engine) if e is not None]

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this AccelerateCheckpointer is closed; attach() a new one")

    def _take_pending(self) -> BaseException | None:
        errors = [e.take_pending_error() for e in self._engines()]
        return next((e for e in errors if e is not None), None)

    def _settle_collectively(self, payload: Any = None) -> list[Any]:
        """Collective: every process returned from earlier ``save_state`` calls; raise pending errors everywhere."""
        return self._collective(self._take_pending(), payload=payload, agreed=self._mark_settled)

    def _mark_settled(self) -> None:
        self._pending_settle = False
        for save in self._unsettled:
            save.settle()
        self._unsettled.clear()

    def _collective(
        self, local_error: BaseException | None = None, payload: Any = None, *, agreed: Any = None
    ) -> list[Any]:
        """Share each process's error and payload; raise the same failure on every process.

        ``agreed`` runs once every process reached this point (before any error is raised).
        """
        gathered = [{"error": None, "payload": payload}]
        if self._multi:
            from accelerate.utils import gather_object

            message = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
            gathered = gather_object([{"error": message, "payload": payload, "report": self._report()}])
            self._absorb(gathered[0]["report"])
        if agreed is not None:
            agreed()
        if local_error is not None:
            raise local_error
        for rank, item in enumerate(gathered):
            if item["error"]:
                raise CheckpointError(f"a checkpoint operation failed on process {rank}: {item['error']}")
        return [item["payload"] for item in gathered]

    def _report(self) -> list[tuple[int, str, Any]]:
        """The main process's ended fully asynchronous saves, so the other processes can resolve their handles."""
        out: list[tuple[int, str, Any]] = []
        while self._main and self._reportable and self._reportable[0].done:
            handle = self._reportable.popleft()
            fut = handle.committed
            if fut.cancelled():
                out.append((handle.step, "cancelled", None))
            elif fut.exception() is not None:
                out.append((handle.step, "failed", str(fut.exception())))
            else:
                out.append((handle.step, "committed", fut.result()))
        return out

    def _absorb(self, report: list[tuple[int, str, Any]]) -> None:
        if self._main:
            return
        for step, outcome, value in report:
            handle = self._mirrors.pop(step, None)
            if handle is None:
                continue
            if outcome == "committed":
                handle.uploaded.set_result(value.total_bytes)
                handle.committed.set_result(value)
            elif outcome == "failed":
                error = CheckpointError(f"checkpoint for step {step} failed on the main process: {value}")
                handle.uploaded.set_exception(error)
                handle.committed.set_exception(error)
            else:
                handle.uploaded.cancel()
                handle.committed.cancel()

    def _exit(self) -> None:
        if self._closed:
            return
        if self._multi:
            # No collective at interpreter exit: folders not confirmed on every process stay uncommitted.
            for save in self._unsettled:
                save.abandon()
            if self._unsettled:
                _log.warning(
                    "interpreter exit without close(): %d save_state folder(s) left uncommitted", len(self._unsettled)
                )
            return
        try:
            self.close(timeout=self.options.drain_timeout_s)
        except Exception:  # noqa: BLE001 - nothing can be raised at exit; it is logged
            _log.warning("checkpoint error at interpreter exit", exc_info=True)


def _release_unsettled(unsettled: list[_FolderSave], multi: bool) -> None:
    # An unreachable checkpointer means an unreachable accelerator: no save_state of it is running. One process
    # knows its own part is done; several processes cannot agree any more, so their folders stay uncommitted.
    for save in unsettled:
        if multi:
            save.abandon()
        else:
            save.settle()
    unsettled.clear()


def _make_atexit(ref: weakref.ReferenceType) -> Any:
    def _at_exit() -> None:
        checkpointer = ref()
        if checkpointer is not None:
            checkpointer._exit()

    return _at_exit


# -- module-level API --------------------------------------------------------------------------------------
def attach(
    accelerator: Any,
    uri: str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    defer: bool = True,
    **options: Any,
) -> AccelerateCheckpointer:
    """Make ``accelerator.save_state`` asynchronous for the weights, and enable :func:`save_state` to ``uri``.

    Call it on every process, after ``accelerator.prepare``: the fences go on the prepared optimizers, and
    :attr:`AccelerateCheckpointer.step` counts their updates from here on (optimizers prepared later are fenced at
    the next save). Calling it again with no arguments (or the same ``uri``) returns the attached checkpointer.

    Args:
        accelerator: An ``accelerate.Accelerator`` (single device or DDP; not FSDP, DeepSpeed, Megatron-LM, XLA).
        uri: Store of the fully asynchronous path (local folder or fsspec URL such as ``s3://bucket/run``);
            ``None`` for the hook path only.
        storage_options: fsspec options for ``uri``.
        defer: ``False`` copies everything at the cut (no staging behind the optimizer-step fence).
        **options: :class:`~lightning_async_ckpt.engine.CheckpointOptions` fields (``max_outstanding``,
            ``admission`` in ``wait``/``skip``/``abort``, ``host_memory_budget``, ``keep_last`` for ``uri``, ...).

    Returns:
        The checkpointer; ``close()`` it on every process to drain.

    Raises:
        ConfigError: Unsupported distributed type, bad options, or already attached with other settings.
    """
    existing = getattr(accelerator, _ATTR, None)
    if existing is not None and not existing.closed:
        if (uri is None or uri == existing.uri) and not options and storage_options is None and defer:
            return existing
        raise ConfigError(
            f"this accelerator already has a checkpointer attached (uri={existing.uri!r}); close() it first or "
            "call attach(accelerator) without arguments to get it"
        )
    if not callable(getattr(accelerator, "register_save_state_pre_hook", None)):
        raise ConfigError(f"attach needs an accelerate.Accelerator, got {type(accelerator).__name__}")
    _check_supported(accelerator)
    if not isinstance(defer, bool):
        raise ConfigError(f"defer must be True or False, got {defer!r}")
    opts = CheckpointOptions(**options)
    if opts.admission == "coalesce":
        raise ConfigError("admission='coalesce' is not supported with Accelerate; use 'wait', 'skip' or 'abort'")
    if opts.serializer is not None:
        raise ConfigError("serializer cannot be set: the Accelerate integration writes accelerate's own file layout")
    if uri is not None and (not isinstance(uri, str) or not uri.strip()):
        raise ConfigError(f"uri must be None or a non-empty path or URL string, got {uri!r}")
    project = accelerator.project_configuration
    limit = project.total_limit if project.automatic_checkpoint_naming else None
    if limit is not None and limit <= opts.max_outstanding:
        raise ConfigError(
            f"ProjectConfiguration(total_limit={limit}) would let accelerate delete a folder that is still being "
            f"written (max_outstanding={opts.max_outstanding}): use total_limit >= max_outstanding + 1"
        )
    checkpointer = AccelerateCheckpointer(accelerator, uri, storage_options=storage_options, defer=defer, options=opts)
    setattr(accelerator, _ATTR, checkpointer)
    return checkpointer


def save_state(accelerator: Any, uri: str, step: int | None = None, **options: Any) -> SaveHandle:
    """Asynchronously save everything ``accelerator.save_state`` would, as one committed generation under ``uri``.

    Uses the checkpointer attached for ``uri`` (attaching one with ``options`` on first use). Collective: every
    process must call it. Close with ``attach(accelerator).close()``.

    Args:
        accelerator: The ``Accelerator``.
        uri: Local folder or fsspec URL; the generation is ``<uri>/step-XXXXXXXX/``.
        step: Generation step; default: optimizer updates seen by the checkpointer.
        **options: Options for :func:`attach` on first use.

    Returns:
        The save's :class:`~lightning_async_ckpt.engine.SaveHandle`.
    """
    existing = getattr(accelerator, _ATTR, None)
    if existing is None or existing.closed:
        existing = attach(accelerator, uri, **options)
    elif existing.uri != uri or options:
        raise ConfigError(
            f"a checkpointer with uri={existing.uri!r} is attached; pass uri and options to attach() once, "
            "then call save_state(accelerator, that uri)"
        )
    return existing.save_state(step)


def load_state(
    accelerator: Any,
    uri: str,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    **load_kwargs: Any,
) -> Manifest | None:
    """Restore the newest committed generation under ``uri`` (or ``step``) with ``accelerator.load_state``.

    ``uri`` is a store root (generations ``step-XXXXXXXX``) or one committed folder (a hook-path ``output_dir``
    holding ``manifest.json``). Uncommitted generations are never loaded. Local generations are loaded in place;
    others are downloaded to a temporary folder (checksums verified) first. Collective: every process must call
    it; the main process chooses the generation. ``uri`` must be readable by every process.

    Args:
        accelerator: The ``Accelerator``.
        uri: Local folder or fsspec URL.
        step: A specific committed step; default the newest whose objects are all present with their sizes.
        storage_options: fsspec options for ``uri``.
        **load_kwargs: Passed to ``accelerator.load_state``.

    Returns:
        The restored generation's manifest, or ``None`` if ``uri`` holds no committed generation.

    Raises:
        ManifestError: ``step`` is not a committed generation, or an object does not match its manifest.
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    root = root.rstrip("/") or "/"
    single = fs.exists(f"{root}/{MANIFEST_NAME}")
    store = None if single else CheckpointStore(uri, storage_options, check_writable=False)
    choice: int | None = None
    error: BaseException | None = None
    if accelerator.is_main_process:
        try:
            choice = _choose(fs, root, store, step)
        except Exception as exc:  # noqa: BLE001 - raised on every process below
            error = exc
    choice = _together(accelerator, error, choice)  # every process loads the main process's choice
    if choice is None:
        return None
    error, tmp, folder = None, None, root
    try:
        if store is None:
            manifest = _folder_manifest(fs, root)
            urls = {o.name: f"{root}/{o.name}" for o in manifest.objects}
        else:
            manifest = store.manifest(choice)
            urls = {o.name: url for o, url in store.iter_objects(choice)}
            folder = store.url(choice)
        if not isinstance(fs, LocalFileSystem):
            tmp = folder = tempfile.mkdtemp(prefix="lightning_async_ckpt-load-")
            _download(fs, manifest, urls, tmp, accelerator.process_index)
    except Exception as exc:  # noqa: BLE001 - raised on every process below
        error = exc
    try:
        _together(accelerator, error)
        accelerator.load_state(folder, **load_kwargs)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    checkpointer = getattr(accelerator, _ATTR, None)
    if checkpointer is not None and not checkpointer.closed:
        checkpointer.step = manifest.step
    return manifest


def _choose(fs: Any, root: str, store: CheckpointStore | None, step: int | None) -> int | None:
    if store is None:
        manifest = _folder_manifest(fs, root)
        if step is not None and manifest.step != step:
            raise ManifestError(f"{root} holds step {manifest.step}, not {step}")
        return manifest.step
    if step is None:
        info = store.latest()
        return None if info is None else info.step
    problems = store.check_sizes(store.manifest(step))
    if problems:
        raise ManifestError(f"generation step {step} under {store.uri} is damaged: {'; '.join(problems)}")
    return step


def _folder_manifest(fs: Any, folder: str) -> Manifest:
    where = f"{folder}/{MANIFEST_NAME}"
    manifest = Manifest.from_json(fs.cat_file(where), where=where)
    problems = []
    for obj in manifest.objects:
        try:
            size = fs.info(f"{folder}/{obj.name}").get("size")
        except FileNotFoundError:
            problems.append(f"{obj.name}: missing")
            continue
        if size != obj.size:
            problems.append(f"{obj.name}: size {size}, manifest says {obj.size}")
    if problems:
        raise ManifestError(f"{folder} does not match its manifest: {'; '.join(problems)}")
    return manifest


def _together(accelerator: Any, error: BaseException | None, payload: Any = None) -> Any:
    """Collective: raise the same failure on every process; return the main process's payload."""
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        message = None if error is None else f"{type(error).__name__}: {error}"
        gathered = gather_object([(message, payload)])
        failed = [(rank, m) for rank, (m, _) in enumerate(gathered) if m]
        if error is None and failed:
            raise CheckpointError(f"load_state failed on process {failed[0][0]}: {failed[0][1]}")
        payload = gathered[0][1]
    if error is not None:
        raise error
    return payload


def _download(fs: Any, manifest: Manifest, urls: dict[str, str], dest: str, rank: int) -> None:
    for obj in manifest.objects:
        match = _RNG_FILE_RE.match(obj.name)
        if match and int(match.group(1)) != rank:
            continue  # another process's RNG state
        path = os.path.join(dest, *obj.name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        digest, size = _Checksum(obj.checksum.split(":", 1)[0]), 0
        with fs.open(urls[obj.name], "rb") as src, open(path, "wb") as out:
            while chunk := src.read(8 << 20):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        if size != obj.size or digest.hexdigest() != obj.checksum:
            raise ManifestError(f"{urls[obj.name]} does not match its manifest (size {size}, expected {obj.size})")
