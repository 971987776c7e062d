"""The exact guard's content fingerprints: CRC-32C per chunk on the host, a position-weighted sum on a device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from lightning_async_ckpt.storage.io import crc32c_module

__all__ = ["FINGERPRINT_CHUNK", "checksum", "combine_partials", "device_partials", "fingerprint", "fingerprints"]

#: Bytes per CRC-32C of the exact fingerprint (a chunk is the unit compared, and of the parallel work at the cut).
FINGERPRINT_CHUNK = 8 << 20
_CHUNK_WORDS = 1 << 19  # 4 MiB of int64 words per checksum chunk: bounded temporaries
_GROUP_CHUNKS = 32  # chunks reduced together on a device (a 128 MiB temporary)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def checksum(data: torch.Tensor) -> int:
    """Position-weighted sum of the 8-byte words of a ``uint8`` tensor (plus its tail bytes), modulo 2**64.

    Word ``i`` is weighted by the odd number ``2i + 1``, so changing any single word always changes the sum.
    """
    if data.device.type != "cpu":
        return combine_partials(device_partials(data).tolist())
    n = data.numel()
    whole = n - n % 8
    total = 0
    words = data[:whole].numpy().view(np.int64)
    base = np.arange(1, 2 * min(_CHUNK_WORDS, len(words)) + 1, 2, dtype=np.int64)
    tmp = np.empty_like(base)
    with np.errstate(over="ignore"):
        for off in range(0, len(words), _CHUNK_WORDS):
            chunk = words[off : off + _CHUNK_WORDS]
            np.multiply(chunk, base[: len(chunk)], out=tmp[: len(chunk)])
            total += int(tmp[: len(chunk)].sum()) + 2 * off * int(chunk.sum())
    for i, b in enumerate(data[whole:].numpy().tolist()):
        total += (whole + i + 1) * b
    return total & ((1 << 64) - 1)


def device_partials(data: torch.Tensor) -> torch.Tensor:
    """:func:`checksum`'s partial sums, computed where ``data`` lives, without a host synchronization.

    Returns an int64 tensor on ``data``'s device: per chunk of ``_CHUNK_WORDS`` words its weighted and plain sums
    (wrapping modulo 2**64 like the final sum), then the tail bytes' weighted sum. The kernels are enqueued on the
    current stream, so on CUDA they read the state at the point of the call; :func:`combine_partials` of the values
    read back later (on any thread) is the checksum.
    """
    n = data.numel()
    whole = n - n % 8
    words = data[:whole].view(torch.int64)
    base = torch.arange(1, 2 * min(_CHUNK_WORDS, words.numel()) + 1, 2, dtype=torch.int64, device=data.device)
    parts = []
    full = words.numel() // _CHUNK_WORDS * _CHUNK_WORDS
    # Whole chunks reduce a group at a time (a few kernels per group instead of two per 4 MiB chunk: launching
    # ~1,800 kernels for a 2.4 GB model cost the training thread milliseconds at the cut); the temporary stays
    # bounded by the group.
    group = _CHUNK_WORDS * _GROUP_CHUNKS
    for off in range(0, full, group):
        rows = words[off : min(off + group, full)].view(-1, _CHUNK_WORDS)
        parts.append(torch.stack(((rows * base).sum(dim=1), rows.sum(dim=1)), dim=1).flatten())
    if full < words.numel():
        chunk = words[full:]
        parts.append(torch.stack(((chunk * base[: chunk.numel()]).sum(), chunk.sum())))
    weights = torch.arange(whole + 1, n + 1, dtype=torch.int64, device=data.device)
    parts.append((data[whole:].to(torch.int64) * weights).sum().reshape(1))
    return torch.cat(parts)


def combine_partials(partials: Sequence[int]) -> int:
    """The checksum from :func:`device_partials`' values (congruent modulo 2**64, so the wrapping does not matter)."""
    total = partials[-1]
    for k in range(0, len(partials) - 1, 2):
        total += partials[k] + 2 * (k // 2) * _CHUNK_WORDS * partials[k + 1]
    return total & ((1 << 64) - 1)


def _host_chunks(data: torch.Tensor) -> list[tuple[int, int]]:
    n = data.numel()
    return [(off, min(off + FINGERPRINT_CHUNK, n)) for off in range(0, max(n, 1), FINGERPRINT_CHUNK)]


def fingerprint(data: torch.Tensor, pool: ThreadPoolExecutor | None = None) -> tuple[int, ...]:
    """The exact fingerprint of a ``uint8`` tensor: one value per :data:`FINGERPRINT_CHUNK` bytes.

    Host tensors only: CRC-32C of each chunk (the position-weighted :func:`checksum` where the ``crc32c`` package
    is missing), computed on ``pool`` when given (CRC-32C releases the GIL). Device storages are fingerprinted by
    :func:`device_partials` instead (no host synchronization at the cut).
    """
    return fingerprints([data], pool)[0]


def fingerprints(datas: Sequence[torch.Tensor], pool: ThreadPoolExecutor | None = None) -> list[tuple[int, ...]]:
    """:func:`fingerprint` of each ``uint8`` host tensor; with ``pool``, every chunk of every tensor is one task
    (a state of many storages of one chunk each is hashed in parallel too)."""
    crc = crc32c_module()  # crc32c where installed, else google-crc32c (a dependency); storage/io.py
    if crc is None:
        one: Callable[[tuple[int, int, int]], int] = lambda c: checksum(datas[c[0]][c[1] : c[2]])  # noqa: E731
    else:
        arrays = [data.numpy() for data in datas]
        one = lambda c: crc.crc32c(arrays[c[0]][c[1] : c[2]])  # noqa: E731
    chunks = [(i, *chunk) for i, data in enumerate(datas) for chunk in _host_chunks(data)]
    values = list(map(one, chunks)) if pool is None or len(chunks) == 1 else list(pool.map(one, chunks))
    out: list[list[int]] = [[] for _ in datas]
    for (i, _, _), value in zip(chunks, values, strict=True):
        out[i].append(value)
    return [tuple(sums) for sums in out]
