"""Module-level API of the saving side: :func:`attach` and :func:`save_state`."""

from __future__ import annotations

from typing import Any

from lightning_async_ckpt.accelerate._checkpointer import AccelerateCheckpointer
from lightning_async_ckpt.accelerate._collective import bounded_collective
from lightning_async_ckpt.accelerate._fsdp import check_fsdp, is_fsdp
from lightning_async_ckpt.accelerate._layout import _ATTR, _check_supported
from lightning_async_ckpt.accelerate._replicas import agree_local_location, open_accelerate_replicas, replica_layout
from lightning_async_ckpt.accelerate._tiers import TieredAccelerateCheckpointer, check_tier_options
from lightning_async_ckpt.core.engine import CheckpointOptions, SaveHandle
from lightning_async_ckpt.errors import ConfigError, renamed


# -- module-level API --------------------------------------------------------------------------------------
def attach(
    accelerator: Any,
    uri: str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    defer: bool = True,
    collective_timeout_s: float | None = None,
    local_dirpath: str | None = None,
    local_every_n_train_steps: int | None = None,
    local_keep_last: int | None = None,
    every_n_train_steps: int | None = None,
    preemption_signal: Any = None,
    preemption_grace_s: float | None = None,
    replicas: int | None = None,
    ranks_per_node: int | None = None,
    local_every_n_steps: int | None = None,
    promote_every_n_steps: int | None = None,
    **options: Any,
) -> AccelerateCheckpointer:
    """Make ``accelerator.save_state`` asynchronous for the weights, and enable :func:`save_state` to ``uri``.

    Call it on every process, after ``accelerator.prepare``: the fences go on the prepared optimizers, and
    :attr:`AccelerateCheckpointer.step` counts their updates from here on (optimizers prepared later are fenced at
    the next save). Calling it again with no arguments (or the same ``uri``) returns the attached checkpointer.

    Args:
        accelerator: An ``accelerate.Accelerator`` (single device, DDP or FSDP2 with sharded state dicts; not FSDP1,
            DeepSpeed, Megatron-LM, XLA).
        uri: Store of the fully asynchronous path (local folder or fsspec URL such as ``s3://bucket/run``);
            ``None`` for the hook path only.
        storage_options: fsspec options for ``uri``.
        defer: ``False`` copies everything at the cut (no staging behind the optimizer-step fence).
        collective_timeout_s: With several processes, how long a checkpoint collective (``save_state``,
            ``load_state``, ``close``, accelerate's ``save_state``/``load_state``) waits for the other processes
            before it raises a ``CheckpointError`` naming the fix (a call made on the main process only). Default
            300 s; keep it below the process group's timeout and above how late a process can legitimately be.
        local_dirpath: A node-local folder (NVMe, ``/dev/shm``): two tiers. Every fully asynchronous save is
            committed there and the due ones are promoted to ``uri`` in the background
            (:class:`~lightning_async_ckpt.accelerate._tiers.TieredAccelerateCheckpointer`, ``docs/tiers.md``).
        local_every_n_train_steps: With ``local_dirpath``: ``save_state`` at a step due on neither cadence takes no cut
            (call it after every step); ``None``: every call is a local cut.
        local_keep_last: With ``local_dirpath``: retention of the local tier (``keep_last`` is ``uri``'s).
        every_n_train_steps: With ``local_dirpath``: generations at multiples of this step are promoted to
            ``uri`` (also ``final=True`` and the emergency save).
        preemption_signal: With ``local_dirpath``: a signal (``signal.SIGUSR1``, ``signal.SIGTERM``) that turns the
            next ``save_state`` into the emergency save on every process.
        preemption_grace_s: The emergency save's bound for its local commit and promotion together.
        replicas: With ``local_dirpath`` and several processes: copy each generation the main process commits
            locally to this many other processes' local tiers, on other nodes (by ``ranks_per_node``), in the
            background over separate gloo groups created here; :func:`load_state` with ``local_dirpath`` then
            restores a lost local folder from a peer (:mod:`~lightning_async_ckpt.accelerate._replicas`).
        ranks_per_node: With ``replicas``: processes per node (default: accelerate's layout, one more than the
            highest ``accelerator.local_process_index``). ``1`` when each process has a node-local folder of its own.
        local_every_n_steps: Former name of ``local_every_n_train_steps`` (a ``FutureWarning``).
        promote_every_n_steps: Former name of ``every_n_train_steps`` (a ``FutureWarning``).
        **options: :class:`~lightning_async_ckpt.core.engine.CheckpointOptions` fields (``max_outstanding``,
            ``admission`` in ``wait``/``skip``/``abort``, ``host_memory_budget``, ``keep_last`` for ``uri``, ...).

    Returns:
        The checkpointer; ``close()`` it on every process to drain.

    Raises:
        ConfigError: Unsupported distributed type, bad options, or already attached with other settings.
    """
    local_every_n_steps = renamed(
        "local_every_n_train_steps", local_every_n_train_steps, "local_every_n_steps", local_every_n_steps
    )
    promote_every_n_steps = renamed(
        "every_n_train_steps", every_n_train_steps, "promote_every_n_steps", promote_every_n_steps
    )
    tiers = {
        "local_every_n_steps": local_every_n_steps,
        "local_keep_last": local_keep_last,
        "promote_every_n_steps": promote_every_n_steps,
        "preemption_signal": preemption_signal,
        "preemption_grace_s": preemption_grace_s,
    }
    peers = {"replicas": replicas, "ranks_per_node": ranks_per_node}
    existing = getattr(accelerator, _ATTR, None)
    if existing is not None and not existing.closed:
        unchanged = storage_options is None and defer and collective_timeout_s is None and local_dirpath is None
        unchanged = unchanged and all(v is None for v in [*tiers.values(), *peers.values()])
        if (uri is None or uri == existing.uri) and not options and unchanged:
            return existing
        raise ConfigError(
            f"this accelerator already has a checkpointer attached (uri={existing.uri!r}); close() it first or "
            "call attach(accelerator) without arguments to get it"
        )
    if not callable(getattr(accelerator, "register_save_state_pre_hook", None)):
        raise ConfigError(f"attach needs an accelerate.Accelerator, got {type(accelerator).__name__}")
    _check_supported(accelerator)
    if not accelerator._optimizers and not accelerator._models:
        # The step counts the prepared optimizers' updates: attached before prepare(), every save would be
        # labelled with fewer steps than its weights took (and a resume would replay data).
        raise ConfigError(
            "attach(accelerator, ...) goes after accelerator.prepare(model, optimizer, ...): nothing is prepared "
            "yet, so the optimizer's updates would not be counted and every checkpoint would name an earlier step. "
            "Call model, optimizer, ... = accelerator.prepare(...) first, then attach"
        )
    if is_fsdp(accelerator):
        check_fsdp(accelerator)
        if local_dirpath is not None:
            raise ConfigError(
                "local_dirpath (two tiers, replicas, emergency save) is not offered with FSDP2 under Accelerate yet: "
                "attach(accelerator, uri) writes every process's shards to uri"
            )
    if not isinstance(defer, bool):
        raise ConfigError(f"defer must be True or False, got {defer!r}")
    if collective_timeout_s is not None and (
        isinstance(collective_timeout_s, bool)
        or not isinstance(collective_timeout_s, int | float)
        or not collective_timeout_s > 0
    ):
        raise ConfigError(f"collective_timeout_s must be a positive number of seconds, got {collective_timeout_s!r}")
    opts = CheckpointOptions(**options)
    if opts.admission == "coalesce":
        raise ConfigError("admission='coalesce' is not supported with Accelerate; use 'wait', 'skip' or 'abort'")
    if is_fsdp(accelerator) and (opts.admission != "wait" or opts.max_outstanding != 1):
        raise ConfigError(
            f"under FSDP2 every process takes part in every save, one at a time: admission={opts.admission!r} and "
            f"max_outstanding={opts.max_outstanding} cannot be honoured; leave them at 'wait' and 1"
        )
    if opts.serializer is not None:
        raise ConfigError("serializer cannot be set: the Accelerate integration writes accelerate's own file layout")
    if uri is not None and (not isinstance(uri, str) or not uri.strip()):
        raise ConfigError(f"uri must be None or a non-empty path or URL string, got {uri!r}")
    if local_dirpath is None:
        given = [name for name, value in {**tiers, **peers}.items() if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} need local_dirpath=<node-local folder> (the local tier)")
        checkpointer = AccelerateCheckpointer(
            accelerator, uri, storage_options=storage_options, defer=defer, options=opts
        )
    else:
        if not isinstance(local_dirpath, str) or not local_dirpath.strip() or "://" in local_dirpath:
            raise ConfigError(f"local_dirpath must be a node-local folder path, got {local_dirpath!r}")
        if uri is None:
            raise ConfigError("local_dirpath needs uri: the durable tier the local generations are promoted to")
        check_tier_options(
            local_every_n_steps=local_every_n_steps,
            local_keep_last=local_keep_last,
            promote_every_n_steps=promote_every_n_steps,
            **peers,
        )
        if ranks_per_node is not None and not replicas:
            raise ConfigError("ranks_per_node is the node layout of replicas: pass replicas=F with it")
        if replicas:
            ranks_per_node = replica_layout(accelerator, replicas, ranks_per_node)  # collective; None: one process
        checkpointer = TieredAccelerateCheckpointer(
            accelerator,
            uri,
            local_dirpath=local_dirpath,
            storage_options=storage_options,
            defer=defer,
            options=opts,
            **tiers,
        )
    bounded = bounded_collective(accelerator, collective_timeout_s)  # collective: every process is in attach()
    if bounded is not None:
        checkpointer._collective_group = bounded
    if replicas and ranks_per_node is not None and isinstance(checkpointer, TieredAccelerateCheckpointer):
        checkpointer.replicas = open_accelerate_replicas(  # collective: its gloo groups, on every process
            checkpointer.local_dirpath, replicas, ranks_per_node=ranks_per_node, keep_last=local_keep_last
        )
        # Where the main process writes (and replicas land): free of newer steps in every process's folder.
        checkpointer.local_uri = agree_local_location(
            checkpointer._collective_group, checkpointer.local_dirpath, checkpointer.step
        )
    setattr(accelerator, _ATTR, checkpointer)
    return checkpointer


def save_state(
    accelerator: Any,
    uri: str | None = None,
    step: int | None = None,
    *,
    final: bool = False,
    promote: bool | None = None,
    **options: Any,
) -> SaveHandle | None:
    """Asynchronously save everything ``accelerator.save_state`` would, as one committed generation.

    Uses the attached checkpointer (attaching one with ``options`` on first use). Collective: every process must
    call it. Close with ``attach(accelerator).close()``. accelerate's save-state pre-hooks run as
    ``accelerator.save_state`` runs them, and what they write is saved with the generation.

    Args:
        accelerator: The ``Accelerator``.
        uri: Local folder or fsspec URL; the generation is ``<uri>/step-XXXXXXXX/``. ``None`` (with
            ``ProjectConfiguration(automatic_checkpoint_naming=True)``): accelerate's own naming, the folder
            ``<project_dir>/checkpoints/checkpoint_<iteration>``, with accelerate's iteration and ``total_limit``
            (see :meth:`AccelerateCheckpointer.save_state`).
        step: The manifest's step; default: optimizer updates seen by the checkpointer.
        final: The checkpoint that ends training: copied at the cut, so nothing after the loop can reach it or
            make the guard refuse it (pass it for the last save of a run).
        promote: With two tiers (``attach(..., local_dirpath=...)``): promote this cut to ``uri`` (``True``) or not
            (``False``) whatever the cadence.
        **options: Options for :func:`attach` on first use.

    Returns:
        The save's :class:`~lightning_async_ckpt.core.engine.SaveHandle`; with two tiers and
        ``local_every_n_steps``, ``None`` at a step due on neither cadence (no cut).

    Raises:
        ConfigError: Another ``uri`` or new ``options`` while a checkpointer is attached, or ``uri=None`` without
            automatic checkpoint naming.
    """
    existing = getattr(accelerator, _ATTR, None)
    if existing is None or existing.closed:
        existing = attach(accelerator, uri, **options)
    elif (uri is not None and existing.uri != uri) or options:
        raise ConfigError(
            f"a checkpointer with uri={existing.uri!r} is attached; pass uri and options to attach() once, "
            "then call save_state(accelerator, that uri)"
        )
    if isinstance(existing, TieredAccelerateCheckpointer):
        return existing.save_state(step, final=final, promote=promote)
    if promote is not None:
        raise ConfigError("promote needs two tiers: attach(accelerator, uri, local_dirpath=...)")
    return existing.save_state(step, automatic=uri is None, final=final)
