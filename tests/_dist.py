"""Launching a script as several torch.distributed ranks on CPU (gloo), for the multi-process tests."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, port: int, world_size: int = 2) -> dict[str, str]:
    """The environment of one externally launched rank (what torchrun would set), one thread per process."""
    return dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
