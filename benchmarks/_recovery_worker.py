"""One training process of ``bench recovery``: resume from the newest checkpoint, train, checkpoint, get killed.

Run by ``_bench_recovery.py`` as ``python _recovery_worker.py CONFIG_JSON`` (a fresh process, so its start-up is
measured) and, for the run that writes the first checkpoint, called in-process (:func:`run`). Every training step
appends one JSON line to ``config["events"]`` with ``os.write`` on an ``O_APPEND`` descriptor, so a ``SIGKILL``
loses nothing that was logged: ``{"event": "start", "t": ...}`` before the imports, ``"resume"`` with the step it
resumes from and the lookup's time, then ``"step"`` per step. In ``ddp_tiers`` mode (where Lightning looks the
checkpoint up inside ``fit``) ``"lookup"`` marks the start of Lightning's ``"last"`` lookup, once the process group
exists and both ranks passed a barrier.

Modes (``config["mode"]``): ``model_checkpoint`` (Lightning's ``ModelCheckpoint(save_last=True, save_top_k=0)``
to ``dirpath``, resumed from its ``last.ckpt``), ``one_tier`` (``AsyncCheckpointCallback(dirpath=...)``) and
``two_tiers`` (the same with ``local_dirpath``, ``local_every_n_train_steps``, ``local_keep_last=2``), both resumed
from ``latest_checkpoint``; ``ddp_tiers`` (one rank of a DDP run where every process is its own "node" with its own
local folder ``<local_dirpath>-rank<R>``, ``replicas=1``, resumed with ``ckpt_path="last"``: the ranks agree on a
step and a rank whose folder lacks it gets it from a peer).

The model: ``layers`` x ``Linear(width, width)`` + Adam (the state is real tensors of the configured size); a
step is a real forward/backward on a batch of 2, padded with a sleep to ``step_s`` so that the simulated training
time is fixed and the machine's two cores stay free for the checkpoint work being measured.
"""

from __future__ import annotations

import json
import os
import sys
import time

_T_START = time.time()

READ_CAP_ENV = "LAC_BENCH_READ_BPS"  # the read-capped faulty:// filesystem's cap, for every process
PROTOCOL = "slowfaulty"


def register_capped_filesystem() -> None:
    """``slowfaulty://``: ``faulty://`` whose bandwidth cap (from ``$LAC_BENCH_READ_BPS``) applies to reads too.

    ``FaultyFileSystem(bandwidth_bps=...)`` caps writes only; a remote store is slow both ways, and a checkpoint read
    by Lightning's own loader (``fsspec.open(path)``) gets no storage options, so the cap comes from the
    environment.
    """
    import fsspec

    from lightning_async_ckpt.testing import FaultyFileSystem

    class _CappedFile:
        def __init__(self, raw: object, bps: float) -> None:
            self._raw, self._bps = raw, bps

        def read(self, size: int = -1) -> bytes:
            data = self._raw.read(size)
            time.sleep(len(data) / self._bps)
            return data

        def readinto(self, buffer: memoryview) -> int:
            data = self.read(len(buffer))
            buffer[: len(data)] = data
            return len(data)

        def __getattr__(self, name: str) -> object:
            return getattr(self._raw, name)

        def __enter__(self) -> _CappedFile:
            return self

        def __exit__(self, *exc: object) -> None:
            self._raw.close()

        def __iter__(self) -> object:
            return iter(self._raw)

    class CappedFaulty(FaultyFileSystem):
        protocol = (PROTOCOL,)

        def __init__(self, *args: object, **kwargs: object) -> None:
            bps = float(os.environ.get(READ_CAP_ENV, "0")) or None
            kwargs.setdefault("bandwidth_bps", bps)
            super().__init__(*args, **kwargs)

        @classmethod
        def _strip_protocol(cls, path: object) -> object:
            if isinstance(path, str) and path.startswith(f"{PROTOCOL}://"):
                path = path[len(PROTOCOL) + 3 :]
            return super()._strip_protocol(path)

        def _open(self, path: str, mode: str = "rb", **kwargs: object) -> object:
            raw = super()._open(path, mode, **kwargs)
            return _CappedFile(raw, self.bandwidth_bps) if "r" in mode and self.bandwidth_bps else raw

        def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: object) -> bytes:
            data = super().cat_file(path, start=start, end=end, **kwargs)
            if self.bandwidth_bps:
                time.sleep(len(data) / self.bandwidth_bps)
            return data

    fsspec.register_implementation(PROTOCOL, CappedFaulty, clobber=True)


def warm_s3(dirpath: str, options: dict | None) -> None:
    """Import the S3 stack and open its client with one request (``HeadBucket``), before any lookup is timed.

    In a job whose durable tier is on S3 every restart pays this whichever tier it restores from (the lookup lists
    the durable tier first): it is start-up, like the other imports, and counted from process start only.
    """
    if not options or not dirpath.startswith("s3://"):
        return
    import s3fs

    s3fs.S3FileSystem(**options).call_s3("head_bucket", Bucket=dirpath[len("s3://") :].split("/", 1)[0])


def _emit(fd: int, event: str, **fields: object) -> None:
    os.write(fd, (json.dumps({"event": event, "t": time.time(), **fields}) + "\n").encode())


def run(config: dict) -> int:
    """Resume (if there is a checkpoint), train to ``config["max_steps"]``, checkpointing as the mode does."""
    events = config["events"].replace("{rank}", os.environ.get("RANK", "0"))
    fd = os.open(events, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _emit(fd, "start", t_process=config.get("t_process", _T_START), pid=os.getpid())
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_async_ckpt import AsyncCheckpointCallback, latest_checkpoint

    register_capped_filesystem()
    mode, dirpath, options = config["mode"], config["dirpath"], config.get("storage_options") or None
    width, layers, step_s = config["width"], config["layers"], config["step_s"]

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-6)

    class Steps(Callback):
        lightning_async_ckpt_read_only = True

        def __init__(self) -> None:
            self.t_batch = time.perf_counter()

        def setup(self, trainer: pl.Trainer, *args: object, **kwargs: object) -> None:
            _emit(fd, "setup")  # the strategy's environment exists; Lightning restores the checkpoint next

        def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
            _emit(fd, "train_start")  # restored and loaded; the first batch follows

        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            self.t_batch = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            rest = step_s - (time.perf_counter() - self.t_batch)
            if rest > 0:
                time.sleep(rest)
            _emit(fd, "step", step=trainer.global_step)

    warm_s3(dirpath, options)
    t0 = time.time()
    ddp: dict = {}
    if mode == "ddp_tiers":  # one process per "node", each with its own local folder; rank 0 writes, replicas=1
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank))
        ddp = {"num_nodes": world, "strategy": "ddp"}

        from typing_extensions import override

        class TimedLookup(AsyncCheckpointCallback):
            """Emits ``lookup`` when Lightning's ``"last"`` lookup starts, past the DDP set-up common to every store."""

            @override
            def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
                import torch.distributed as dist

                if not dist.is_initialized():
                    trainer.strategy.setup_environment()  # Lightning's own next step (the library's too, else)
                dist.barrier()  # both ranks start the lookup together
                _emit(fd, "lookup")
                return super()._find_last_checkpoints(trainer)

        callback = TimedLookup(
            dirpath=dirpath,
            every_n_train_steps=config["every"],
            keep_last=2,
            storage_options=options,
            save_on_train_end=False,
            local_dirpath=f"{config['local_dirpath']}-rank{rank}",
            local_every_n_train_steps=config["local_every"],
            local_keep_last=2,
            replicas=1,
        )
        ckpt_path = "last" if config.get("resume") else None
    elif mode == "model_checkpoint":
        callback = ModelCheckpoint(
            dirpath=dirpath,
            every_n_train_steps=config["every"],
            save_top_k=0,
            save_last=True,
            enable_version_counter=False,
        )
        import fsspec

        fs, path = fsspec.core.url_to_fs(dirpath)
        # The file itself, not "last": Lightning's "last" lookup did not find last.ckpt on s3:// here.
        ckpt_path = f"{dirpath.rstrip('/')}/last.ckpt" if fs.exists(f"{path}/last.ckpt") else None
    if mode in ("one_tier", "two_tiers"):
        tiers = {}
        if mode == "two_tiers":
            tiers = dict(
                local_dirpath=config["local_dirpath"],
                local_every_n_train_steps=config["local_every"],
                local_keep_last=2,
            )
        callback = AsyncCheckpointCallback(
            dirpath=dirpath,
            every_n_train_steps=config["every"],
            keep_last=2,
            storage_options=options,
            save_on_train_end=config.get("save_on_train_end", False),
            **tiers,
        )
        ckpt_path = latest_checkpoint(dirpath, options, local_dirpath=tiers.get("local_dirpath"))
    _emit(fd, "resume", ckpt_path=ckpt_path, lookup_s=time.time() - t0)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, width))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=config["max_steps"],
        callbacks=[Steps(), callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
        default_root_dir=config["scratch"],
        **ddp,
    )
    torch.set_num_threads(1)
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    _emit(fd, "done", step=trainer.global_step)
    os.close(fd)
    return 0


def zygote() -> None:
    """Import torch, Lightning and the library once, then fork one training process per config line on stdin.

    Prints ``READY`` once, then ``PID <pid>`` when a child starts and ``EXIT <pid> <code>`` when it ends (``-9``:
    killed). A forked child is a process of its own (``SIGKILL`` ends it and nothing else) that skips the imports.
    """
    import traceback

    import lightning.pytorch  # noqa: F401 - imported once, before any fork
    import s3fs  # noqa: F401
    import torch  # noqa: F401

    import lightning_async_ckpt  # noqa: F401

    register_capped_filesystem()
    print("READY", flush=True)
    for line in sys.stdin:
        config = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run(config)
            except BaseException:  # noqa: BLE001 - reported on stderr, the exit code says it failed
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        print(f"PID {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[1:] == ["--zygote"]:
        zygote()
    else:
        raise SystemExit(run(json.loads(sys.argv[1])))
