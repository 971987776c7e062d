"""The manifest: the JSON commit marker of one generation, versioned and validated on read."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_async_ckpt.errors import ManifestError, ManifestVersionError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "SPREAD_FOLDER",
    "Manifest",
    "ObjectEntry",
    "spread_path",
    "validate_object_name",
]

FORMAT_NAME = "lightning_async_ckpt"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# A manifest lists a few objects; anything larger is hostile or corrupt and is refused before it is parsed.
MAX_MANIFEST_BYTES = 16 << 20
# Sizes above this are not a checkpoint we could have written: a hostile or corrupt manifest.
_MAX_OBJECT_SIZE = 1 << 50
_CHECKSUM_RE = re.compile(r"^(crc32c|crc32|sha256):[0-9a-f]{8,64}$")
_BAD_NAME_CHARS = re.compile(r"[\\:\x00-\x1f]")
#: The folder of the store's root that holds objects spread over hashed key prefixes (``hashed_prefixes``).
SPREAD_FOLDER = "spread"
_SPREAD_RE = re.compile(r"^spread/[0-9a-f]/(step-[0-9]{8,})/[^/]+$")


def spread_path(generation: str, file_name: str) -> str:
    """Where an object spread over hashed prefixes lives, relative to the store's root.

    ``spread/<h>/<generation>/<file_name>``: ``<h>`` is one hex digit of the SHA-256 of the file name (16 prefixes,
    the same one for a rank's file at every step, so object stores keep the prefixes they split for earlier saves).
    """
    digit = hashlib.sha256(file_name.encode()).hexdigest()[0]
    return f"{SPREAD_FOLDER}/{digit}/{generation}/{file_name}"


def validate_object_name(name: object) -> str:
    """Check that ``name`` is a plain relative object name inside a generation.

    Args:
        name: The candidate name; ``/`` separates sub-folders.

    Returns:
        The name, unchanged.

    Raises:
        ManifestError: If the name is empty, absolute, a URL, contains ``..`` or ``.`` parts, backslashes,
            control characters, or is the manifest's own name.
    """
    if not isinstance(name, str) or not name:
        raise ManifestError(f"object name {name!r} is not a non-empty string")
    if name.startswith("/") or _BAD_NAME_CHARS.search(name):
        raise ManifestError(f"object name {name!r} must be a plain relative name (no '/', '\\', ':' prefix)")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ManifestError(f"object name {name!r} must not contain empty, '.' or '..' parts")
    if name == MANIFEST_NAME:
        raise ManifestError(f"object name {name!r} is reserved for the manifest")
    return name


@dataclass(frozen=True, kw_only=True)
class ObjectEntry:
    """One data object of a generation.

    Attributes:
        name: Relative name inside the generation.
        size: Size in bytes.
        checksum: ``"<algorithm>:<hex digest>"``.
        path: Where the bytes are, relative to the generation folder, when not at ``name`` (a writer that found
            another writer's claim on the step writes under its own prefix, so the two never overwrite each other).
        root_path: Where the bytes are, relative to the store's root, for an object spread over hashed key
            prefixes (:func:`spread_path`; outside the generation folder). Readers follow it; ``key`` and ``path``
            then name nothing in the folder.
    """

    name: str
    size: int
    checksum: str
    path: str | None = None
    root_path: str | None = None

    @property
    def key(self) -> str:
        """The object's location relative to the generation folder."""
        return self.path or self.name


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The commit marker of a generation; written last, after every data object is durable.

    Attributes:
        step: The cut's global step.
        run_id: Identifier of the run that wrote the generation.
        objects: The data objects with sizes and checksums.
        cut: What the cut was (step, epoch, time requested, ...).
        versions: Library, torch and lightning versions of the writer.
        plan: Summary of the capture plan.
        timings: Seconds spent in each phase.
        extra: Free-form JSON metadata of the integration.
        committed_at: Unix time the manifest was written.
        format_version: Manifest schema version.
    """

    step: int
    run_id: str
    objects: tuple[ObjectEntry, ...]
    cut: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    committed_at: float = 0.0
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        """Sum of the data objects' sizes."""
        return sum(obj.size for obj in self.objects)

    @property
    def checkpoint_format(self) -> str:
        """``"torch_dcp"`` for a sharded generation in torch DCP's format, else ``"torch_save"`` (one stream)."""
        fmt = self.extra.get("format")
        return fmt if isinstance(fmt, str) and fmt else "torch_save"

    @property
    def dcp_folder(self) -> str | None:
        """For a DCP generation: the folder holding DCP's ``.metadata`` and data files, relative to the generation
        folder (``""``: the generation folder itself; a writer that found another writer's claim on the step wrote
        under its own prefix). ``None`` for other formats."""
        if self.checkpoint_format != "torch_dcp":
            return None
        folder = self.extra.get("dcp_folder", "")
        return folder if isinstance(folder, str) else ""

    @property
    def ranks(self) -> dict[int, tuple[ObjectEntry, ...]]:
        """For a multi-rank generation: each writing rank's objects (empty for a single-writer generation)."""
        listed = self.extra.get("ranks")
        if not isinstance(listed, dict):
            return {}
        by_name = {obj.name: obj for obj in self.objects}
        out: dict[int, tuple[ObjectEntry, ...]] = {}
        for rank, names in listed.items():
            if isinstance(names, list) and str(rank).lstrip("-").isdigit():
                out[int(rank)] = tuple(by_name[n] for n in names if isinstance(n, str) and n in by_name)
        return dict(sorted(out.items()))

    def object(self, name: str) -> ObjectEntry:
        """Return the entry named ``name``.

        Raises:
            KeyError: If the generation has no such object.
        """
        for obj in self.objects:
            if obj.name == name:
                return obj
        raise KeyError(f"generation step {self.step} has no object {name!r}; it has {[o.name for o in self.objects]}")

    def to_json(self) -> bytes:
        """Serialize to UTF-8 JSON bytes."""
        body = asdict(self)
        body["objects"] = [
            {k: v for k, v in asdict(o).items() if k not in ("path", "root_path") or v} for o in self.objects
        ]
        body = {"format": FORMAT_NAME, **body}
        return json.dumps(body, indent=1, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | str, *, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest.

        Args:
            data: The manifest's bytes.
            where: Location used in error messages.

        Raises:
            ManifestError: If it is larger than ``MAX_MANIFEST_BYTES``, not valid JSON, has wrong types, missing fields, hostile object names,
                absurd sizes, duplicate names, or a newer format version than this library reads.
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: {len(data)} bytes is larger than any manifest ({MAX_MANIFEST_BYTES} max)")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc})") from exc
        except RecursionError as exc:
            # Hostile nesting ("[[[[...") exhausts the decoder's recursion, which is not a ValueError.
            raise ManifestError(f"{where}: JSON nested too deeply") from exc
        if not isinstance(body, dict):
            raise ManifestError(f"{where}: top level must be an object")
        if body.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: 'format' is {body.get('format')!r}, expected {FORMAT_NAME!r}")
        version = _field(body, "format_version", int, where)
        if version > FORMAT_VERSION:
            raise ManifestVersionError(
                f"{where}: format_version {version} is newer than this library reads ({FORMAT_VERSION}); "
                "upgrade lightning_async_ckpt to read it"
            )
        if version < 1:
            raise ManifestError(f"{where}: format_version {version} is invalid")
        step = _field(body, "step", int, where)
        if step < 0:
            raise ManifestError(f"{where}: step {step} is negative")
        run_id = _field(body, "run_id", str, where)
        raw_objects = _field(body, "objects", list, where)
        objects = []
        seen = set()
        for i, raw in enumerate(raw_objects):
            if not isinstance(raw, dict):
                raise ManifestError(f"{where}: objects[{i}] must be an object")
            try:
                name = validate_object_name(raw.get("name"))
            except ManifestError as exc:
                raise ManifestError(f"{where}: objects[{i}]: {exc}") from exc
            size = _field(raw, "size", int, f"{where}: objects[{i}]")
            if not 0 <= size <= _MAX_OBJECT_SIZE:
                raise ManifestError(f"{where}: objects[{i}] size {size} is out of range")
            checksum = _field(raw, "checksum", str, f"{where}: objects[{i}]")
            if not _CHECKSUM_RE.match(checksum):
                raise ManifestError(f"{where}: objects[{i}] checksum {checksum!r} is not '<crc32c|crc32|sha256>:<hex>'")
            path = raw.get("path")
            if path is not None:
                try:
                    validate_object_name(path)
                except ManifestError as exc:
                    raise ManifestError(f"{where}: objects[{i}] path: {exc}") from exc
            root_path = raw.get("root_path")
            if root_path is not None:
                # Only the spread folder, for this generation: a manifest never names another generation's objects
                # (retention removes what a manifest lists).
                spread = _SPREAD_RE.match(root_path) if isinstance(root_path, str) else None
                if spread is None or spread.group(1) != f"step-{step:08d}" or path is not None:
                    raise ManifestError(
                        f"{where}: objects[{i}] root_path {root_path!r} is not spread/<hex>/step-{step:08d}/<file>"
                    )
                validate_object_name(root_path)
            if name in seen:
                raise ManifestError(f"{where}: object {name!r} is listed twice")
            seen.add(name)
            objects.append(ObjectEntry(name=name, size=size, checksum=checksum, path=path, root_path=root_path))
        dicts = {}
        for key in ("cut", "versions", "plan", "timings", "extra"):
            value = body.get(key, {})
            if not isinstance(value, dict):
                raise ManifestError(f"{where}: {key!r} must be an object")
            dicts[key] = value
        committed_at = body.get("committed_at", 0.0)
        if isinstance(committed_at, bool) or not isinstance(committed_at, int | float):
            raise ManifestError(f"{where}: 'committed_at' must be a number")
        return cls(
            step=step,
            run_id=run_id,
            objects=tuple(objects),
            committed_at=float(committed_at),
            format_version=version,
            **dicts,
        )


def _field(body: dict, key: str, kind: type, where: str) -> Any:
    if key not in body:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = body[key]
    # bool is an int subclass; a manifest with "step": true is malformed.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ManifestError(f"{where}: field {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value
