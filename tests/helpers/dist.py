"""Launching a script as several torch.distributed ranks on CPU (gloo), for the multi-process tests."""

from __future__ import annotations

import os
import socket
import subprocess


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


def launch_ranks(
    argv: list[str], *, timeout: float, world_size: int = 2, fail_on_hang: bool = True
) -> list[subprocess.CompletedProcess]:
    """Run ``argv`` once per rank, wait for all; a rank that hangs past ``timeout`` fails the test (all are killed).

    With ``fail_on_hang=False`` a hang kills every rank too, but the ranks' outputs so far are returned (a killed
    rank's return code is ``-9``), so a caller running several scenarios can say which one hung.
    """
    import pytest

    port = free_port()
    procs = [
        subprocess.Popen(
            argv,
            env=rank_env(rank, port, world_size),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(world_size)
    ]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            if fail_on_hang:
                pytest.fail("a rank hung instead of finishing or failing")
            out, err = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results
