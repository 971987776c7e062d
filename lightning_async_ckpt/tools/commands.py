"""What ``ls``, ``verify`` and ``gc`` run for a location: both tiers with ``--local-dirpath`` (``tier_commands``),
accelerate's folders (``folder_commands``), else one store (``store_commands``, ``gc_command``).
"""

from __future__ import annotations

import argparse

from lightning_async_ckpt.tools.folder_commands import ls_folders, verify_folders
from lightning_async_ckpt.tools.gc_command import check_gc, gc_store
from lightning_async_ckpt.tools.store_commands import accelerate_folders_at, ls_store, verify_one
from lightning_async_ckpt.tools.tier_commands import gc_tiers, ls_tiers, verify_tiers

__all__ = ["cmd_gc", "cmd_ls", "cmd_verify"]


def cmd_ls(args: argparse.Namespace) -> int:
    """``ls``: list generations (committed or not) with step, size, age and run, also those of the version folders;
    or accelerate's folders; with ``--local-dirpath``, both tiers in one table."""
    if getattr(args, "local_dirpath", None):
        return ls_tiers(args)
    folders = accelerate_folders_at(args)
    return ls_store(args) if folders is None else ls_folders(args, folders)


def cmd_verify(args: argparse.Namespace) -> int:
    """``verify``: re-read generations (or accelerate's folders) and check sizes and checksums; 1 when any failed.
    With ``--local-dirpath``, both tiers."""
    if getattr(args, "local_dirpath", None):
        return verify_tiers(args)
    folders = accelerate_folders_at(args)
    return verify_one(args) if folders is None else verify_folders(args, folders)


def cmd_gc(args: argparse.Namespace) -> int:
    """``gc``: delete old generations, keeping the newest ``--keep-last`` committed ones and the ``--keep-best``
    best ones by the score their manifests record (the callback's ``best_model_path`` and its top k); both tiers
    with ``--local-dirpath``."""
    check_gc(args)
    return gc_tiers(args) if getattr(args, "local_dirpath", None) else gc_store(args, args.uri)
