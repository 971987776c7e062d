"""Restoring: :func:`load_state`, choosing the generation, and preparing the folder accelerate reads.

Loading is never code execution by default: each ``custom_checkpoint_{i}.pkl`` is read with ``weights_only=True``
and re-serialized into a private folder; one that needs arbitrary unpickling is refused unless
``trust_pickled_objects=True``.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from lightning_async_ckpt.accelerate._choose import Choice, choose
from lightning_async_ckpt.accelerate._collective import collective_for
from lightning_async_ckpt.accelerate._layout import _ATTR, _RNG_FILE_RE
from lightning_async_ckpt.accelerate._numbering import continue_numbering, next_free_index
from lightning_async_ckpt.accelerate._replicas import agree_local_location
from lightning_async_ckpt.core.collective import agree
from lightning_async_ckpt.errors import CheckpointError
from lightning_async_ckpt.storage import inflight
from lightning_async_ckpt.storage.io import read_verified
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest
from lightning_async_ckpt.storage.regular import url_to_regular_fs
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.replica_persist import manifest_of
from lightning_async_ckpt.tiers.resume import OneStream, pick_local, pick_with_peers

_log = logging.getLogger("lightning_async_ckpt")
_CUSTOM_RE = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
TRUST_FLAG = "trust_pickled_objects=True"


def load_state(
    accelerator: Any,
    uri: str | None = None,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    trust_pickled_objects: bool = False,
    local_dirpath: str | None = None,
    **load_kwargs: Any,
) -> Manifest | None:
    """Restore the newest committed generation under ``uri`` (or ``step``) with ``accelerator.load_state``.

    ``uri`` is a store root, one committed folder, or a folder of accelerate's automatically named ``checkpoint_N``
    folders (the default ``uri`` with automatic naming: the newest intact committed one). Uncommitted generations
    are never loaded; remote ones are downloaded (checksums verified) first. With a checkpointer attached, the
    restored generation's run id becomes the checkpointer's, so ``keep_last`` counts across the restart.
    Collective: every process must call it; the main process chooses. ``uri`` must be readable by every process.

    Args:
        accelerator: The ``Accelerator``.
        uri: Local folder or fsspec URL; default ``<project_dir>/checkpoints`` with accelerate's automatic
            checkpoint naming.
        step: A specific committed step; default the newest whose objects are all present with their sizes.
        storage_options: fsspec options for ``uri``.
        trust_pickled_objects: Let accelerate unpickle ``custom_checkpoint_{i}.pkl`` files that the restricted
            ``weights_only=True`` unpickler refuses. Unpickling runs code chosen by whoever wrote the file: pass
            it only when everyone who can write ``uri`` is trusted. Default ``False``: such a file is refused.
        local_dirpath: The local tier of ``attach(..., local_dirpath=...)``: resume from the newest verified
            generation of either tier, every process the same step (the one cross-tier resume,
            :mod:`~lightning_async_ckpt.tiers.resume`); with ``replicas=F`` a process lacking it receives it from a
            peer first.
        **load_kwargs: Passed to ``accelerator.load_state``.

    Returns:
        The restored generation's manifest, or ``None`` (with a warning) only when ``uri`` was listed and holds no
        committed generation (empty, missing local folder, or only uncommitted leftovers of a crashed first save,
        named in the warning): a first run starts fresh.

    Raises:
        StoreUnavailableError: ``uri`` cannot be listed (missing bucket, unreachable endpoint, no permission).
        CheckpointError: ``uri`` is an uncommitted folder (a save that never finished), a folder without a
            manifest, holds committed generations none of which is intact, or a custom object needs
            ``trust_pickled_objects=True``; also no ``uri`` without automatic checkpoint naming.
        ManifestError: ``step`` is not a committed generation, or an object does not match its manifest.
    """
    from fsspec.implementations.local import LocalFileSystem

    options = dict(storage_options or {})
    if uri is None:
        project = accelerator.project_configuration
        if not project.automatic_checkpoint_naming:
            raise CheckpointError(
                "load_state(accelerator) without uri needs ProjectConfiguration(automatic_checkpoint_naming=True) "
                "(it then reads <project_dir>/checkpoints); pass the uri you saved to"
            )
        uri = os.path.join(accelerator.project_dir, "checkpoints")
    checkpointer = getattr(accelerator, _ATTR, None)
    # The attached checkpointer's exchange is bounded (a call on some processes only raises instead of hanging).
    attached = checkpointer is not None and not checkpointer.closed
    collective = checkpointer._collective_group if attached else collective_for(accelerator)
    fs, root = url_to_regular_fs(uri, **options)
    root = root.rstrip("/") or "/"
    if checkpointer is not None and not checkpointer.closed:
        # Hook-path saves into this folder (or below it) end first, so the choice sees them committed or failed.
        checkpointer._quiesce(os.path.abspath(root) if isinstance(fs, LocalFileSystem) else None)
    choice: Choice | None = None
    next_index: int | None = None
    error: BaseException | None = None
    if attached and callable(getattr(checkpointer, "drain", None)):
        checkpointer.drain(_wait_bound(collective))  # two tiers: this process's local commits and promotions first
    replicas = getattr(checkpointer, "replicas", None) if attached else None
    if local_dirpath is not None:  # with replicas, a lost local folder is refilled from a peer
        choice = _across_tiers(collective, uri, local_dirpath, options, step, replicas)
    if choice is None:
        if accelerator.is_main_process:
            try:
                # Saves this process has in flight there land first (another Accelerator's too): never an older one.
                inflight.wait_for(uri, options, timeout_s=_wait_bound(collective), doing="load_state")
                choice = choose(fs, root, uri, options, step)
                next_index = next_free_index(accelerator)
            except Exception as exc:  # noqa: BLE001 - raised on every process by agree
                error = exc
        choice, next_index = agree(
            collective, error, (choice, next_index), doing=f"load_state({uri!r}): choosing the generation"
        )[0]
        continue_numbering(accelerator, next_index)
        read_options = options
    else:
        read_options = {}  # this process's own local folder
    if choice is None:
        _log.warning("load_state: no committed checkpoint under %s; nothing was loaded (a first run starts fresh)", uri)
        return None
    prepared: _Prepared | None = None
    error = None
    try:
        prepared = _prepare(choice, read_options, accelerator.process_index, trust_pickled_objects)
    except Exception as exc:  # noqa: BLE001 - raised on every process by agree
        error = exc
    try:
        agree(collective, error, doing=f"load_state({uri!r}): reading step {choice.step}")
        ready: _Prepared = prepared  # type: ignore[assignment] - agree raised if preparing failed anywhere
        _warn_if_rng_unreadable(ready, accelerator.process_index)
        accelerator.load_state(ready.folder, **load_kwargs)
    finally:
        if prepared is not None and prepared.tmp is not None:
            shutil.rmtree(prepared.tmp, ignore_errors=True)
    if checkpointer is not None and not checkpointer.closed:
        checkpointer.step = ready.manifest.step
        _continue_run(checkpointer, ready.manifest.run_id)
        if getattr(checkpointer, "local_dirpath", None) is not None:
            # Two tiers: the resumed run's local location, from the step it resumes (a newer local generation, damaged
            # or another branch's, sends it to a new version folder), agreed (collective) while nothing is saved yet.
            # Chosen at the first cut instead, a cut of that newer step would find it taken (GenerationExistsError).
            where = agree_local_location(collective, checkpointer.local_dirpath, checkpointer.step)
            if checkpointer._engine is None:
                checkpointer.local_uri = where
    return ready.manifest


def _across_tiers(
    collective: Any, uri: str, local_dirpath: str, options: dict[str, Any], step: int | None, replicas: Any
) -> Choice | None:
    """Collective: this process's local generation every process agreed on (with ``step``: that step), or ``None``
    (every process loads from ``uri``); with ``replicas`` a process lacking it receives it from a peer first."""
    durable = CheckpointStore(uri, options, check_writable=False)
    tier = OneStream(local_dirpath, durable, lambda m: m.extra.get("layout") == "accelerate", step)
    beaten_by = None if step is not None else durable  # an asked-for step is never outranked
    if replicas is not None:
        if replicas.group is None:
            raise CheckpointError("the replicas of this checkpointer were closed; attach() a new one")
        local = pick_with_peers(replicas.group, tier, beaten_by, collective=collective)
    else:
        local = pick_local(tier, beaten_by, collective=collective, doing="load_state")
    if local is None or local.beaten_by is not None:
        return None
    manifest = manifest_of(local.store, local.step) if replicas is not None else None  # a peer's copy: being committed
    return Choice(url=local.store.url(local.step), step=local.step, manifest=manifest)


def _wait_bound(collective: Any) -> float:
    """How long the main process may wait for its saves: below the bound of the exchange the others wait in."""
    bound = getattr(collective, "timeout_s", None)
    return inflight.DEFAULT_WAIT_S if bound is None else min(inflight.DEFAULT_WAIT_S, 0.8 * bound)


def _continue_run(checkpointer: Any, run_id: str) -> None:
    """The restored generation's run continues: its run id becomes the checkpointer's and its stores'.

    ``keep_last`` counts and removes only one run's generations (a second writer in the same folder must never
    delete what it did not write); a restarted process attaches with a new run id, so without this the previous
    process's generations were nobody's to retire (``keep_last=3`` kept 6 after one restart).
    """
    if not run_id or run_id == checkpointer.run_id:
        return
    _log.info("load_state: continuing run %s (this process attached as %s)", run_id, checkpointer.run_id)
    checkpointer.run_id = run_id
    engines = (checkpointer._engine, checkpointer._folder_engine, checkpointer._sharded)
    stores = [e.store for e in engines if e is not None]
    promoter = getattr(checkpointer, "promoter", None)  # two tiers: the durable store the promotions write
    if promoter is not None:
        stores.append(promoter.target)
    for store in {id(s): s for s in stores}.values():
        store.run_id = run_id


@dataclass
class _Prepared:
    """The folder accelerate loads, the manifest it came from, and the temporary folder to remove afterwards."""

    folder: str
    manifest: Manifest
    tmp: str | None
    rng_name: str | None


def _prepare(choice: Choice, options: dict[str, Any], rank: int, trusted: bool) -> _Prepared:
    from fsspec.implementations.local import LocalFileSystem

    fs, folder = url_to_regular_fs(choice.url, **options)
    folder = folder.rstrip("/")
    manifest = choice.manifest or Manifest.from_json(
        fs.cat_file(f"{folder}/{MANIFEST_NAME}"), where=f"{choice.url}/{MANIFEST_NAME}"
    )
    rng = next((o.name for o in manifest.objects if o.name == f"random_states_{rank}.pkl"), None)
    safe: dict[str, bytes] = {}
    if not trusted:
        for obj in manifest.objects:
            if _CUSTOM_RE.match(obj.name):
                data = read_verified(fs, f"{folder}/{obj.key}", obj)
                safe[obj.name] = _reserialize_safely(data, f"{choice.url}/{obj.name}")
    local = isinstance(fs, LocalFileSystem)
    # A DCP generation (FSDP2, _fsdp.py): DCP's .metadata files name the data files where they are (token and all).
    dcp = manifest.checkpoint_format == "torch_dcp"
    inside = f"/{manifest.dcp_folder}" if dcp and manifest.dcp_folder else ""
    if local and not safe and (dcp or all(o.key == o.name for o in manifest.objects)):
        return _Prepared(folder=folder + inside, manifest=manifest, tmp=None, rng_name=rng)
    tmp = tempfile.mkdtemp(prefix="lightning_async_ckpt-load-")  # private (0700): nobody else can swap files here
    try:
        for obj in manifest.objects:
            match = _RNG_FILE_RE.match(obj.name)
            if match and int(match.group(1)) != rank:
                continue  # another process's RNG state
            path = os.path.join(tmp, *(obj.key if dcp else obj.name).split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if obj.name in safe:
                with open(path, "wb") as out:
                    out.write(safe[obj.name])
            elif local:
                os.symlink(os.path.join(folder, *obj.key.split("/")), path)
            else:
                with open(path, "wb") as out:
                    read_verified(fs, f"{folder}/{obj.key}", obj, into=out)
        with open(os.path.join(tmp, MANIFEST_NAME), "wb") as out:
            out.write(manifest.to_json())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _Prepared(folder=tmp + inside, manifest=manifest, tmp=tmp, rng_name=rng)


def _reserialize_safely(data: bytes, where: str) -> bytes:
    """Load with the restricted unpickler; return a ``torch.save`` of the result (only what it allowed)."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{where} is a pickle that torch.load(weights_only=True) refuses ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:300]}); accelerate would unpickle it with weights_only=False, which runs "
            f"whatever code its writer chose. Pass load_state(..., {TRUST_FLAG}) only if everyone who can write "
            "this location is trusted, or make the registered object's state_dict() plain tensors and numbers"
        ) from exc
    out = io.BytesIO()
    torch.save(state, out)
    return out.getvalue()


def _warn_if_rng_unreadable(prepared: _Prepared, rank: int) -> None:
    """Accelerate skips RNG states it cannot load with one INFO line; say it where people look."""
    if prepared.rng_name is None:
        _log.warning(
            "load_state: step %d has no random_states_%d.pkl (saved by fewer processes?): process %d's RNG states "
            "are not restored, so dropout and sampling will not replay the saved run",
            prepared.manifest.step,
            rank,
            rank,
        )
        return
    from accelerate.utils import load

    try:
        states = load(os.path.join(prepared.folder, prepared.rng_name))
        missing = [k for k in ("random_state", "numpy_random_seed", "torch_manual_seed") if k not in states]
        if missing:
            raise KeyError(f"no {missing}")
    except Exception as exc:  # noqa: BLE001 - accelerate skips the file too; this is the warning it does not give
        _log.warning(
            "load_state: %s of step %d cannot be loaded (%s: %s): accelerate skips it and process %d's RNG states "
            "are not restored",
            prepared.rng_name,
            prepared.manifest.step,
            type(exc).__name__,
            exc,
            rank,
        )
