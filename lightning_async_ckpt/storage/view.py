"""What writing and retention need of a store beyond its place: the run it writes for and what it holds."""

from __future__ import annotations

from typing import Any, Protocol

from lightning_async_ckpt.storage.backend import Backend
from lightning_async_ckpt.storage.generation import GenerationInfo, VerifyResult
from lightning_async_ckpt.storage.ledger import Ledger
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.root import StoreRoot

__all__ = ["StoreView"]


class StoreView(Protocol):
    """A store as its writers and retention see it (the facade's members they use)."""

    location: StoreRoot
    uri: str
    fs: Any
    root: str
    backend: Backend
    is_local: bool
    direct_io: bool
    hashed_prefixes: bool
    checksum: str
    run_id: str
    ledger: Ledger

    def generation_path(self, step: int) -> str: ...

    def url(self, step: int, name: str | None = None) -> str: ...

    def invalidate_cache(self) -> None: ...

    def read_generation(self, step: int) -> GenerationInfo: ...

    def writing(self) -> frozenset[int]: ...

    def end_write(self, step: int, *, owns_folder: bool = True) -> None: ...

    def verify(self, step: int, *, manifest: Manifest | None = None) -> VerifyResult: ...

    def generations(self, include_uncommitted: bool = False) -> list[GenerationInfo]: ...
