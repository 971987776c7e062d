"""Subprocess side of the shutdown-crash test: a pre-imported zygote that forks one child per run.

``serve [lightning]``: imports torch (and Lightning) once, prints ``READY``, then for every line ``<mode> <dir>`` read from stdin
forks a child that runs the mode and then exits *through normal interpreter finalization* (``sys.exit``, never
``os._exit``): finalization is where an abandoned save used to crash the process. The parent prints the child's
exit code as ``{"rc": ..., "log": ...}`` (negative: killed by that signal).

Modes (each leaves a save in flight that storage answers only after the shutdown gave up on it):
    ``close``: ``close(timeout=0.1)`` while the upload is stalled in ``write``; storage answers right after.
    ``exit``: no ``close()``; the interpreter-exit drain times out (``drain_timeout_s=0.1``); storage answers
        in a later exit handler, while the interpreter is finishing.
    ``sigterm``: a Lightning fit; the second save's upload stalls in ``open`` and sends SIGTERM to its own
        process; the signal releases the stall, the bandwidth-capped upload outlasts ``drain_timeout_s=0.05``.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import signal
import sys
import threading
import time

sys.path.insert(
    0, os.environ.get("LAC_ROOT") or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)

import torch  # noqa: E402

from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore  # noqa: E402
from lightning_async_ckpt.testing import (
    Fault,  # noqa: E402
    register_faulty,
)

register_faulty()  # this process names faulty:// URLs

CHILD_ALARM_S = 60


def _stalled_store(root: str, gate: threading.Event, entered: threading.Event) -> CheckpointStore:
    fault = Fault(op="write", path=".ckpt", stall=gate, callback=lambda _call: entered.set())  # the checkpoint file
    # Released, the upload of 16 MB is still inside torch.save while the interpreter finishes.
    options = {"target_protocol": "file", "faults": [fault]}
    return CheckpointStore(f"faulty://{root}", options, check_writable=False)


def close_with_timeout(root: str) -> None:
    gate, entered = threading.Event(), threading.Event()
    ckpt = AsyncCheckpointer(_stalled_store(root, gate, entered), host_memory_budget=None)
    ckpt.save(1, {"w": torch.randn(1 << 22)})
    entered.wait()
    ckpt.close(timeout=0.1)
    gate.set()  # storage answers once close gave up
    print("CLOSED", flush=True)


def exit_drain_times_out(root: str) -> None:
    gate, entered = threading.Event(), threading.Event()
    atexit.register(gate.set)  # registered before the engine: runs after its exit drain gave up
    ckpt = AsyncCheckpointer(_stalled_store(root, gate, entered), host_memory_budget=None, drain_timeout_s=0.1)
    ckpt.save(1, {"w": torch.randn(1 << 22)})
    entered.wait()
    print("RETURNING", flush=True)


def sigterm_during_fit(root: str) -> None:
    import lightning.pytorch as pl

    from lightning_async_ckpt import AsyncCheckpointCallback
    from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

    torch.set_num_threads(1)
    gate = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: gate.set())  # Lightning composes handlers that exist before fit
    fault = Fault(
        op="open",
        path=".ckpt",
        at=2,
        callback=lambda _call: os.kill(os.getpid(), signal.SIGTERM),
        stall=gate,
        stall_timeout_s=30.0,
    )
    callback = AsyncCheckpointCallback(
        dirpath=f"faulty://{root}",
        storage_options={"target_protocol": "file", "faults": [fault], "bandwidth_bps": 20_000.0},
        every_n_train_steps=2,
        admission="skip",
        drain_timeout_s=0.05,
    )
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=10_000, callbacks=[callback], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader(n=1 << 16))
    print("FIT RETURNED", flush=True)


MODES = {"close": close_with_timeout, "exit": exit_drain_times_out, "sigterm": sigterm_during_fit}


def serve(preload_lightning: bool) -> None:
    if preload_lightning:
        # Imported once here, not in every child (Lightning's import costs seconds); close/exit runs skip it, which
        # also keeps their children's finalization short.
        import lightning.pytorch  # noqa: F401

        import tests.helpers.models  # noqa: F401
    # What is imported so far is shared with the children: frozen, a child's collections and finalization do not
    # walk (and copy on write) the whole imported heap, which halves a run. It does not hide the crash: on the code
    # before the fix, close and exit runs crashed 5-8 of 8 frozen, 1-8 of 8 not frozen (2-core machine, busy).
    gc.freeze()
    print("READY", flush=True)
    for line in sys.stdin:
        mode, root = line.split()
        log = root + ".log"
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            signal.alarm(CHILD_ALARM_S)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
            MODES[mode](root)
            sys.exit(0)  # through interpreter finalization, like a real process
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "log": log, "s": time.monotonic() - t0}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(preload_lightning="lightning" in sys.argv[2:])
    else:
        MODES[sys.argv[1]](sys.argv[2])
