"""The emergency save's signal (SLURM ``--signal=USR1@90``, Kubernetes' SIGTERM): a handler that asks for a
checkpoint now.

The handler only records the request. It chains to the Python handler it replaced (never to ``SIG_DFL``);
:meth:`PreemptionHandler.remove` restores the previous one, and if someone puts this one back afterwards it hands
the signal on and reinstalls the previous handler.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from lightning_async_ckpt.errors import ConfigError

__all__ = ["PreemptionHandler", "check_preemption"]

_log = logging.getLogger("lightning_async_ckpt")


def check_preemption(signum: Any, grace_s: Any) -> tuple[signal.Signals | None, float | None]:
    """Validate ``preemption_signal`` and ``preemption_grace_s``.

    Raises:
        ConfigError: Naming the argument and what it accepts.
    """
    if signum is not None:
        try:
            if isinstance(signum, str):  # a name, as YAML (LightningCLI) writes it: "SIGTERM", "TERM", or "15"
                name = signum.strip().upper()
                signum = (
                    int(name) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
                )
            signum = signal.Signals(signum)
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(
                "preemption_signal must be None or a signal: signal.SIGUSR1, its name 'SIGUSR1' or its number "
                f"{int(signal.SIGUSR1)}, got {signum!r}"
            ) from exc
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"preemption_signal={signum.name} cannot be caught; use SIGUSR1 or SIGTERM")
    if grace_s is not None and (isinstance(grace_s, bool) or not isinstance(grace_s, int | float) or grace_s < 0):
        raise ConfigError(f"preemption_grace_s must be None (no bound) or a number of seconds >= 0, got {grace_s!r}")
    return signum, None if grace_s is None else float(grace_s)


class PreemptionHandler:
    """Records that ``signum`` arrived; installed in ``setup``, removed in ``teardown``.

    Thread-safety: the handler runs on the main thread between bytecodes; it only sets an event.

    Args:
        signum: The signal to handle; ``None``: none (every method does nothing, :meth:`due` is always false).
    """

    def __init__(self, signum: signal.Signals | None) -> None:
        self.signum = signum
        self.requested = threading.Event()
        self._previous: Any = None
        self._installed = False

    def __getstate__(self) -> dict[str, Any]:
        # A pickled callback carries the signal to handle, not this process's handler state.
        return {"signum": self.signum}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["signum"])  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        # Configuration equality (what a pickled callback carries), like the callback's other arguments.
        return isinstance(other, PreemptionHandler) and other.signum == self.signum

    __hash__ = None  # type: ignore[assignment]

    def install(self) -> None:
        """Handle ``signum`` from now on (main thread only; elsewhere a warning says it is not handled)."""
        if self._installed or self.signum is None:
            return
        if threading.current_thread() is not threading.main_thread():
            _log.warning("preemption_signal=%s not installed: setup does not run on the main thread", self.signum.name)
            return
        self.requested.clear()
        self._previous = _unwrap_stale(signal.getsignal(self.signum))
        signal.signal(self.signum, self._handle)
        self._installed = True

    def installed_handler(self) -> Any:
        """The callable installed for ``signum`` while installed (``None`` otherwise)."""
        return self._handle if self._installed else None

    @property
    def previous(self) -> Any:
        """The handler ``install`` replaced (and chains to)."""
        return self._previous

    def remove(self) -> None:
        """Restore the handler ``install`` replaced (unless someone replaced ours since)."""
        if not self._installed or self.signum is None:
            return
        self._installed = False
        if signal.getsignal(self.signum) == self._handle:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous
        if not self._installed and self.signum is not None:
            # Reinstalled after remove() (Lightning restores the handlers it found at its own setup, which include
            # this one, after an exception): act as the previous handler, and give it its place back.
            signal.signal(self.signum, previous if previous is not None else signal.SIG_DFL)
            if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
                previous(signum, frame)
            elif previous in (None, signal.SIG_DFL):
                os.kill(os.getpid(), signum)  # the default action, as if this handler had never been installed
            return
        first = not self.requested.is_set()
        self.requested.set()
        if first and self.signum is not None:
            _log.warning("received %s: an emergency checkpoint is taken at the next batch end", self.signum.name)
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, frame)

    def take(self) -> bool:
        """Whether the signal arrived since the last call (consumes it)."""
        if self.signum is None:
            return False
        flag = self.requested.is_set()
        self.requested.clear()
        return flag


def _unwrap_stale(handler: Any) -> Any:
    """The handler a stale :class:`PreemptionHandler` stands for, when ``handler`` is one (else ``handler``).

    A fit that ended with an exception removes its handler while Lightning's is in place; Lightning then puts back
    the handlers it found, this one among them. Chaining to it from the next fit's handler would run it as "the
    previous handler" (for ``SIG_DFL``: end the process); the next fit chains to what it stood for instead.
    """
    seen: set[int] = set()
    owner = getattr(handler, "__self__", None)
    while isinstance(owner, PreemptionHandler) and not owner._installed and id(owner) not in seen:
        seen.add(id(owner))
        handler = owner._previous
        owner = getattr(handler, "__self__", None)
    return handler
