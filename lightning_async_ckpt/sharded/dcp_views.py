"""Views of one DCP checkpoint: a subfolder whose ``.metadata`` holds one top-level key, over the same data files.

Accelerate's FSDP2 ``load_state`` reads ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` as separate checkpoints:
:func:`metadata_view` gives each such subfolder a ``.metadata`` whose data files are reached one folder up, so no
byte of data is written twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["metadata_view"]


def metadata_view(
    metadata: Metadata, results: list[list[WriteResult]], key: str
) -> tuple[Metadata, list[list[WriteResult]]]:
    """The metadata and write results of the DCP checkpoint ``<key>/`` inside a checkpoint's folder.

    Args:
        metadata: The whole checkpoint's metadata (as DCP's planner built it, before ``storage_data`` is set).
        results: Every rank's write results, paths relative to the whole checkpoint's folder.
        key: A top-level key of the saved state dict; also the subfolder's name.

    Returns:
        The view's metadata (``storage_data`` is set from the results by the writer's ``finish``) and results.

    Raises:
        ValueError: ``key`` names nothing in the checkpoint.
    """
    head = f"{key}."
    items = {fqn[len(head) :]: md for fqn, md in metadata.state_dict_metadata.items() if fqn.startswith(head)}
    if not items:
        raise ValueError(f"the checkpoint holds nothing below {key!r}")
    planner: Any = metadata.planner_data
    if isinstance(planner, dict):
        planner = {fqn[len(head) :]: path[1:] for fqn, path in planner.items() if fqn.startswith(head)}
    view = dataclasses.replace(metadata, state_dict_metadata=items, planner_data=planner, storage_data=None)
    moved = [
        [
            dataclasses.replace(
                wr,
                index=MetadataIndex(wr.index.fqn[len(head) :], wr.index.offset, wr.index.index),
                storage_data=dataclasses.replace(wr.storage_data, relative_path="../" + wr.storage_data.relative_path),
            )
            for wr in rank
            if wr.index.fqn.startswith(head)
        ]
        for rank in results
    ]
    return view, moved
