"""Subprocess side of the crash matrix and the shutdown tests (run with ``sys.executable``).

Modes:
    ``serve``: a zygote. Imports Lightning once, prints ``READY``, then for every JSON scenario read from stdin
        forks a child that runs it and prints the child's exit code as ``{"rc": ...}``. Forking from this
        single-threaded, pre-imported process saves the 2-3 s import per crash point.
    ``run <scenario.json>``: run one scenario in this process (debugging a crash point by hand).
    ``exit-with-save <dirpath> <bandwidth_bps|hang> <drain_timeout_s>``: request one save into a bandwidth-capped
        (or hanging) store, then return from main without ``close()``; the interpreter-exit drain must end it
        within the bound.
    ``sigterm <dirpath>``: a Lightning fit whose upload stalls until SIGTERM arrives; prints ``IN_FLIGHT <step>``
        when the save is in flight (the parent then sends SIGTERM).

A crash scenario (JSON): ``dir`` (local folder, used through ``faulty://``), ``events`` (JSONL event log),
``max_steps``, ``every``, ``keep_last``, ``counts`` (where to write the filesystem's call counts on a normal
exit) and ``kill``: ``{"hook": name, "step": s}`` (SIGKILL inside that LightningModule hook when
``global_step == s``) or ``{"fault": {"op": ..., "path": ..., "at": k, "after": bool, "torn": bool}}`` (SIGKILL at that
filesystem call; ``torn`` first writes the start of a manifest there, as a put torn by the kill), or ``null``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_async_ckpt import AsyncCheckpointCallback, AsyncCheckpointer, CheckpointStore  # noqa: E402
from lightning_async_ckpt.testing import (  # noqa: E402
    Fault,
    FaultCall,
    register_faulty,
)
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs  # noqa: E402

register_faulty()  # this process names faulty:// URLs

# A crash test must never hang: a child that outlives this is killed by SIGALRM (exit code -14).
CHILD_ALARM_S = 60


def _die(*_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _tear(call: FaultCall) -> None:
    """SIGKILL halfway through a put on a filesystem without atomic puts: the first bytes of a manifest land."""
    with open(call.path, "wb") as f:  # faulty:// wraps the local filesystem: the path is a local one
        f.write(b'{"format": "lightning-async-ckpt", "format_vers')
        f.flush()
        os.fsync(f.fileno())
    _die()


class CrashModel(BNDropoutModel):
    """Kills its own process inside a hook at a chosen step. Overrides only hooks that keep deferral proven."""

    def __init__(self, kill_hook: str | None = None, kill_step: int = -1) -> None:
        super().__init__()
        self._kill = (kill_hook, kill_step)

    def _maybe_die(self, hook: str) -> None:
        if self._kill == (hook, self.global_step):
            _die()

    def training_step(self, batch, batch_idx):
        self._maybe_die("training_step")
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        self._maybe_die("on_before_optimizer_step")

    def on_save_checkpoint(self, checkpoint):
        self._maybe_die("on_save_checkpoint")


def run_scenario(sc: dict) -> None:
    """One Lightning training run into ``faulty://<dir>``, possibly killed at the scenario's point."""
    torch.set_num_threads(1)
    kill = sc.get("kill") or {}
    faults = []
    if "fault" in kill:
        f = kill["fault"]
        die = _tear if f.get("torn") else _die
        faults.append(Fault(op=f["op"], path=f.get("path"), at=f["at"], after=f.get("after", False), callback=die))
    callback = AsyncCheckpointCallback(
        dirpath=f"faulty://{sc['dir']}",
        storage_options={"target_protocol": "file", "faults": faults},
        every_n_train_steps=sc["every"],
        keep_last=sc.get("keep_last"),
        event_log=sc["events"],
    )
    pl.seed_everything(7)
    model = CrashModel(kill.get("hook"), kill.get("step", -1))
    trainer = pl.Trainer(max_steps=sc["max_steps"], callbacks=[callback], **trainer_kwargs())
    trainer.fit(model, make_loader())
    if sc.get("counts"):
        fs = callback.store.fs
        counts = {op: fs.count(op, ".ckpt") for op in ("open", "write", "close")}
        counts.update({op: fs.count(op) for op in ("pipe_file", "rm")})
        counts["rm_file"] = fs.count("rm_file", "manifest.json")  # retention's; writers also remove their claims
        with open(sc["counts"], "w") as f:
            json.dump(counts, f)


def serve() -> None:
    print("READY", flush=True)
    for line in sys.stdin:
        sc = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(CHILD_ALARM_S)
                log = os.open(os.path.join(sc["dir"] + ".log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
                run_scenario(sc)
                code = 0
            except BaseException:  # noqa: BLE001 - reported through the exit code and the log
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


def exit_with_save(dirpath: str, speed: str, drain_timeout_s: float) -> None:
    """Request a save into slow storage and return without close(): the atexit drain must end it within the bound.

    ``speed`` is a bandwidth cap in bytes/s, or ``hang`` for storage whose writes never return.
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    options: dict = {"target_protocol": "file"}
    if speed == "hang":
        options["faults"] = [Fault(op="write", path=".ckpt", stall=threading.Event())]
    else:
        options["bandwidth_bps"] = float(speed)
    store = CheckpointStore(f"faulty://{dirpath}", options, check_writable=False)
    ckpt = AsyncCheckpointer(store, drain_timeout_s=drain_timeout_s)
    handle = ckpt.save(1, {"w": torch.arange(64 * 1024, dtype=torch.float32)})
    handle.staged.result()
    print(f"REQUESTED outstanding={ckpt.outstanding} committed={handle.committed.done()}", flush=True)


def sigterm_run(dirpath: str) -> None:
    """A fit whose second upload stalls until SIGTERM; Lightning raises SIGTERMException and on_exception drains."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.set_num_threads(1)
    gate = threading.Event()
    # Lightning composes handlers that exist before fit: ours releases the storage stall when SIGTERM arrives.
    signal.signal(signal.SIGTERM, lambda *_: gate.set())

    def in_flight(call: FaultCall) -> None:
        print(f"IN_FLIGHT {call.path}", flush=True)

    fault = Fault(op="open", path=".ckpt", at=2, callback=in_flight, stall=gate, stall_timeout_s=60.0)
    callback = AsyncCheckpointCallback(
        dirpath=f"faulty://{dirpath}",
        storage_options={"target_protocol": "file", "faults": [fault]},
        every_n_train_steps=2,
        admission="skip",
        save_top_k=-1,  # the test reads the first save beside the one in flight
    )
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=10_000, callbacks=[callback], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader(n=1 << 16))
    print("FIT RETURNED", flush=True)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "serve":
        serve()
    elif mode == "run":
        with open(argv[1]) as f:
            run_scenario(json.load(f))
    elif mode == "exit-with-save":
        exit_with_save(argv[1], argv[2], float(argv[3]))
    elif mode == "sigterm":
        sigterm_run(argv[1])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
