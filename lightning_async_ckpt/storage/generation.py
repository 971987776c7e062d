"""What a listing returns: generation names, states and the small frozen records about them."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from lightning_async_ckpt.storage.manifest import Manifest

__all__ = [
    "GenerationInfo",
    "VERSION_RE",
    "GenerationState",
    "Listing",
    "Skipped",
    "VerifyResult",
    "generation_name",
    "parse_generation_name",
    "subfolders_holding_checkpoints",
    "version_folders",
]

_GEN_RE = re.compile(r"^step-([0-9]{8,})$")


def generation_name(step: int) -> str:
    """Folder name of the generation for ``step`` (zero-padded so names sort by step)."""
    return f"step-{step:08d}"


def parse_generation_name(name: str) -> int | None:
    """The step of a canonical generation folder name, or ``None`` (``step-000000004`` and non-ASCII digits
    are not canonical: two names for one step would make retention and listing disagree)."""
    match = _GEN_RE.match(name)
    if not match or generation_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


#: A version folder of a ``dirpath`` (``v1``, ``v2``, ...), where a re-run of a script writes (``lightning/rerun.py``).
VERSION_RE = re.compile(r"^v([1-9][0-9]{0,5})$")


def version_folders(fs: Any, root: str) -> list[int]:
    """The numbers of ``root``'s version folders (``v1`` is 1), ascending; none when ``root`` does not exist."""
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    versions = []
    for entry in entries:
        match = VERSION_RE.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
        if match and entry.get("type") in ("directory", None):
            versions.append(int(match.group(1)))
    return sorted(versions)


def subfolders_holding_checkpoints(fs: Any, root: str, *, exclude: re.Pattern[str] | None = None) -> list[str]:
    """Names of ``root``'s subfolders that hold checkpoints themselves: ``step-*`` generations, or accelerate's
    ``checkpoint_N`` folders with a manifest. Asked when ``root`` holds none, to tell a path given one level too
    high (a project or experiment folder) from an empty location; ``exclude`` drops names (version folders)."""
    names = set()
    for pattern, depth in ((f"{root}/*/step-*", 2), (f"{root}/*/checkpoint_*/manifest.json", 3)):
        for path in fs.glob(pattern):
            name = path.rstrip("/").split("/")[-depth]
            if exclude is None or not exclude.match(name):
                names.add(name)
    return sorted(names)


class GenerationState(enum.Enum):
    """What a listed generation is."""

    COMMITTED = "committed"
    UNCOMMITTED = "uncommitted"  # no manifest: in progress, or a crashed write
    REJECTED = "rejected"  # a manifest that is invalid (never recoverable)
    NEWER_FORMAT = "newer_format"  # written by a newer library version: never deleted or overwritten
    UNREADABLE = "unreadable"  # present but could not be read right now: left alone


@dataclass(frozen=True)
class GenerationInfo:
    """What a listing knows about one generation.

    Attributes:
        step: The generation's step.
        path: Its folder, as a URL of the store's filesystem.
        committed: Whether a valid manifest exists.
        manifest: The parsed manifest, when committed.
        error: Why a present manifest was rejected, if it was.
        mtime: Newest modification time seen, when the filesystem reports one.
        newer_format: The manifest was written by a newer format version (never deleted or overwritten).
        unreadable: The manifest exists but could not be read (a storage error); retention leaves it alone.
    """

    step: int
    path: str
    committed: bool
    manifest: Manifest | None = None
    error: str | None = None
    mtime: float | None = None
    newer_format: bool = False
    unreadable: bool = False

    @property
    def run_id(self) -> str | None:
        """The writer's run id, when committed."""
        return self.manifest.run_id if self.manifest else None

    @property
    def holds_step(self) -> bool:
        """Whether its manifest keeps the step from ever being written again: committed, from a newer format
        version, or unreadable right now. A rejected manifest (torn by a crash on a filesystem without atomic
        puts, or hostile) never made the step recoverable: the next writer of that step replaces it."""
        return self.committed or self.newer_format or self.unreadable

    @property
    def checkpoint_format(self) -> str | None:
        """``"torch_dcp"`` or ``"torch_save"`` when committed (see ``Manifest.checkpoint_format``), else ``None``."""
        return self.manifest.checkpoint_format if self.manifest else None

    @property
    def dcp_path(self) -> str | None:
        """For a committed DCP generation: the folder to give ``dcp.load`` or a sharded strategy, else ``None``."""
        folder = self.manifest.dcp_folder if self.manifest else None
        if folder is None:
            return None
        return f"{self.path}/{folder}" if folder else self.path

    @property
    def state(self) -> GenerationState:
        """The generation's state."""
        if self.committed:
            return GenerationState.COMMITTED
        if self.newer_format:
            return GenerationState.NEWER_FORMAT
        if self.unreadable:
            return GenerationState.UNREADABLE
        return GenerationState.REJECTED if self.error else GenerationState.UNCOMMITTED


@dataclass(frozen=True)
class Skipped:
    """An entry of the store's folder that a listing did not read as a generation, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class Listing:
    """A listing: the generations, and what was skipped (never silently)."""

    generations: list[GenerationInfo] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of :meth:`CheckpointStore.verify` for one generation.

    Attributes:
        step: The generation's step.
        ok: True when every object exists with the manifest's size and checksum.
        problems: One line per failed check.
    """

    step: int
    ok: bool
    problems: tuple[str, ...] = ()
