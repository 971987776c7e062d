"""Reading torch DCP's ``.metadata`` without running code: an allow-listed unpickler, and a safe folder loader.

DCP pickles ``.metadata`` and loads byte items with ``torch.load(weights_only=False)``. Here ``.metadata`` is read
with an unpickler that builds only DCP's metadata classes and the types they hold (:func:`allowed_globals`), and byte
items with ``weights_only=True``; anything else raises :class:`UntrustedPickleError` unless ``trust=True``.
"""

from __future__ import annotations

import functools
import inspect
import io
import pickle
from dataclasses import is_dataclass
from typing import IO, Any

from lightning_async_ckpt.errors import CheckpointError

__all__ = [
    "TRUST_HINT",
    "UntrustedPickleError",
    "allowed_globals",
    "check_dcp_folder",
    "load_dcp_folder",
    "load_metadata",
]

#: How a caller that trusts every writer of the store lets DCP unpickle (named in every refusal).
TRUST_HINT = "trust_pickled_objects=True (through Lightning: trainer.fit(..., weights_only=False))"
# Builtins and standard-library types a DCP metadata pickle may hold (paths: StorageMeta.checkpoint_id).
_STANDARD = (
    {("builtins", name) for name in ("set", "frozenset", "slice", "complex", "range", "bytearray")}
    | {("collections", "OrderedDict")}
    | {("pathlib", name) for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
)


class UntrustedPickleError(CheckpointError):
    """A DCP file needs unpickling beyond DCP's metadata classes and plain data (it could run code)."""


@functools.cache
def allowed_globals() -> frozenset[tuple[str, str]]:
    """The ``(module, name)`` globals a DCP ``.metadata`` pickle may name, read from the installed torch.

    DCP's metadata classes (every class defined in ``torch.distributed.checkpoint.metadata``), the dataclasses of
    ``torch.distributed.checkpoint.filesystem`` (``_StorageInfo``: where each item's bytes are), ``torch.Size``,
    every ``torch.dtype``, the layout rebuilder ``torch.serialization._get_layout``, and a few standard types.
    """
    import torch
    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    import torch.distributed.checkpoint.metadata as dcp_metadata

    allowed = set(_STANDARD)
    for module, keep in ((dcp_metadata, inspect.isclass), (dcp_filesystem, is_dataclass)):
        for name, value in inspect.getmembers(module, inspect.isclass):
            if value.__module__ == module.__name__ and keep(value):
                allowed.add((module.__name__, name))
    allowed.add(("torch", "Size"))
    allowed |= {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
    if hasattr(torch.serialization, "_get_layout"):
        allowed.add(("torch.serialization", "_get_layout"))
    return frozenset(allowed)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in allowed_globals():
            raise UntrustedPickleError(
                f"{self._where}: refused to unpickle {module}.{name}, which is not one of DCP's metadata types "
                "(unpickling it could run code planted by whoever wrote the store); pass "
                f"{TRUST_HINT} only when every writer of the store is trusted"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedPickleError(f"{self._where}: a persistent id in DCP metadata is refused")


def load_metadata(stream: IO[bytes], *, where: str = ".metadata", trust: bool = False) -> Any:
    """Read a DCP ``.metadata`` stream into its ``Metadata`` object.

    Args:
        stream: The open file (binary).
        where: The file's name for messages.
        trust: Unpickle with plain ``pickle`` (runs any code the file names): only when every writer is trusted.

    Raises:
        UntrustedPickleError: The file names a global outside :func:`allowed_globals` (nothing was run).
        CheckpointError: The file is not a DCP metadata pickle.
    """
    if trust:
        return pickle.load(stream)  # noqa: S301 - the caller trusts every writer of the store
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(stream, where).load()
    except UntrustedPickleError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{where}: not a readable DCP metadata file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def load_dcp_folder(folder: str, *, trust: bool = False) -> dict[str, Any]:
    """Read a local DCP checkpoint folder into one state dict (as ``dcp_to_torch_save``), without a process group.

    Args:
        folder: The folder holding ``.metadata`` and the ``*.distcp`` files.
        trust: Let DCP unpickle ``.metadata`` and byte items as it does by default (runs code they name).

    Raises:
        UntrustedPickleError: ``.metadata`` or a byte item needs more than the restricted unpicklers allow.
    """
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if trust:
                return super().read_metadata(*args, **kwargs)
            rank = kwargs.get("rank")
            path = self._get_metadata_path(rank)
            with self.fs.create_stream(path, "rb") as f:
                try:
                    metadata = load_metadata(f, where=str(path))
                except UntrustedPickleError as exc:
                    refused.append(exc)
                    raise
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            if trust:
                return super().load_bytes(read_item, value)
            try:
                loaded = torch.load(value, weights_only=True)
            except Exception as exc:
                refused.append(
                    UntrustedPickleError(
                        f"{folder}: item {read_item.dest_index.fqn!r} is a pickle that torch.load(weights_only=True) "
                        f"refuses ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); pass {TRUST_HINT} only "
                        "when every writer of the store is trusted"
                    )
                )
                raise refused[-1] from exc
            # Hand DCP a re-serialization of what the restricted unpickler built: its own torch.load then meets
            # nothing else.
            again = io.BytesIO()
            torch.save(loaded, again)
            again.seek(0)
            return super().load_bytes(read_item, again)

    state: dict[str, Any] = {}
    refused: list[UntrustedPickleError] = []
    try:
        _load_state_dict(state, storage_reader=Reader(folder), planner=Planner(), no_dist=True)
    except BaseException as exc:  # DCP wraps every error in its CheckpointException (a BaseException)
        if refused:
            raise refused[0] from exc
        raise
    return state


def check_dcp_folder(folder: str) -> None:
    """Refuse a local DCP folder that another loader (``dcp.load``, Lightning's sharded strategies) would run code
    from: ``.metadata`` through the allow-listed unpickler, every byte item through ``torch.load(weights_only=True)``.

    Call it before handing the folder to a loader that unpickles without limits; it reads ``.metadata`` and the byte
    items (small: non-tensor values), never the tensors.

    Raises:
        UntrustedPickleError: ``.metadata`` or a byte item needs more than the restricted unpicklers allow, or a byte
            item is stored with a transform this check cannot undo (nothing of it was run).
    """
    import os

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from lightning_async_ckpt.storage.regular import check_regular

    path = os.path.join(folder, ".metadata")
    check_regular(path)  # a FIFO is never opened
    with open(path, "rb") as f:
        metadata = load_metadata(f, where=path)
    storage = metadata.storage_data or {}
    for index, info in storage.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        where = f"{folder}: item {index.fqn!r}"
        if getattr(info, "transform_descriptors", None):
            raise UntrustedPickleError(f"{where} is stored transformed ({info.transform_descriptors}); cannot check it")
        path = os.path.realpath(os.path.join(folder, info.relative_path))
        if not path.startswith(os.path.realpath(folder) + os.sep):
            raise UntrustedPickleError(f"{where} is stored outside the folder ({info.relative_path!r}); refused")
        check_regular(path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:
            raise UntrustedPickleError(
                f"{where} is a pickle that torch.load(weights_only=True) refuses ({type(exc).__name__}); pass "
                f"{TRUST_HINT} only when every writer of the store is trusted"
            ) from exc
