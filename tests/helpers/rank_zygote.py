"""A pre-imported zygote that forks the ranks ``tests.helpers.dist.launch_ranks`` starts (one per pytest session).

Usage: ``python rank_zygote.py`` with the ranks' common environment (``OMP_NUM_THREADS=1``, ``PYTHONUNBUFFERED=1``).
It imports torch, torch.distributed (DCP, FSDP2, device mesh), Lightning, s3fs and this package once, freezes the
imported heap (``gc.freeze``), prints ``READY`` and then serves JSON lines on stdin, one answer line each on stdout:

    {"spawn": {"argv": [...], "env": {...}, "cwd": ..., "stdout": path, "stderr": path[, "stdin": path]}}
        -> {"pid": pid}
    {"wait": pid} -> {"rc": exit code, negative for a signal, as ``subprocess`` reports it}

A spawned child is what ``python <script> <args>`` would be from there on: its own environment, working directory,
``sys.argv`` and ``sys.path[0]`` (the script's folder), stdin from ``/dev/null`` (or the given path), stdout and
stderr into the given files (or FIFOs: ``tests/helpers/forked.py``), the script run as ``__main__``; an uncaught
exception prints its traceback and exits 1; it leaves through ``sys.exit``, so atexit handlers and interpreter
finalization run as in a fresh process. What differs: the modules above are already imported (with the zygote's
environment: Lightning's ``rank_zero_only.rank``, read from the environment at import, is set again from the
child's), and its parent is the zygote.

Each rank of a launch that way skips the imports that are most of its start-up (~8 s of CPU per rank with Lightning
on the 2-core machine, about as long as most scenarios themselves).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import sys
import threading
import traceback


def _preload() -> None:
    import lightning.pytorch  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import lightning_async_ckpt  # noqa: F401
    import lightning_async_ckpt.sharded  # noqa: F401

    try:
        import s3fs  # noqa: F401 - the S3 workers' (~1 s); optional like the package's own extra
    except ImportError:
        pass
    del torch


def _become(spec: dict, protocol: list) -> None:
    """In the child: turn into ``python <argv[1]> <argv[2:]>`` and run it; never returns (``sys.exit``)."""
    for channel in protocol:
        channel.close()
    null = os.open(spec.get("stdin", os.devnull), os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, spec["stdout"]), (2, spec["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    script = os.path.abspath(spec["argv"][1])
    sys.argv = [script, *spec["argv"][2:]]
    sys.path[0] = os.path.dirname(script)
    try:
        from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only
        from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

        rank_zero_only.rank = utils_rank_zero_only.rank = _get_rank() or 0  # what the import reads from the env
    except ImportError:
        pass
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback on stderr, status 1
        traceback.print_exc()
        code = 1
    if spec.get("fast_exit"):
        # The interpreter's own exit steps up to module teardown: join the threads (and their exit hooks), run the
        # atexit handlers, flush; then leave without tearing down the inherited heap.
        threading._shutdown()  # noqa: SLF001 - what Py_FinalizeEx calls first
        atexit._run_exitfuncs()  # noqa: SLF001
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)  # through interpreter finalization, like a real process


def serve() -> None:
    _preload()
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit("the rank zygote has threads after its imports: forking it would be unsafe")
    gc.freeze()  # the children's collections and finalization do not walk (and copy on write) the imported heap
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints of the zygote itself go to its stderr, never into the protocol
    protocol = [requests, answers]
    print("READY", file=answers, flush=True)
    for line in requests:
        request = json.loads(line)
        if "spawn" in request:
            pid = os.fork()
            if pid == 0:
                _become(request["spawn"], protocol)
            answer = {"pid": pid}
        else:
            _, status = os.waitpid(request["wait"], 0)
            answer = {"rc": os.waitstatus_to_exitcode(status)}
        print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    serve()
