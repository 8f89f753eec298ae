"""Graceful stop on SIGTERM or SIGINT: finish the step, save, exit 0.

The first signal only records a request; the loop sees it after the current step (all
ranks agree through the step's loss all-reduce, so every rank stops after the same step),
saves a checkpoint and returns. The first signal also puts the default handlers back, so
a second signal ends the process at once (status 128 + signal number in a shell).

``torchrun`` starts every worker in its own session and forwards a SIGTERM or SIGINT it
receives to the workers once, then waits ``--shutdown_timeout`` seconds (30 by default)
before killing them: the save has to fit in that time.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["StopRequest"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Catches SIGTERM and SIGINT while installed and remembers the first one.

    Use as a context manager around the training loop; the previous handlers come back
    on exit. Outside the main thread (where Python cannot install handlers) it does
    nothing but `request` still works.
    """

    def __init__(self) -> None:
        """Create an uninstalled request with no signal recorded."""
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop was requested (by a signal or `request`)."""
        return self.signal_name is not None

    def request(self, name: str) -> None:
        """Ask the loop to stop after the current step, as the signal ``name`` would."""
        if self.signal_name is None:
            self.signal_name = name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signal.Signals(signum).name)
        for sig in _SIGNALS:  # a second signal: the default action, at once
            signal.signal(sig, signal.SIG_DFL)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
