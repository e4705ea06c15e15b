"""Orderly interruption of ``stepscope run`` by SIGINT / SIGTERM.

The first signal only sets a flag: the run loop then stops admitting, aborts the requests in
flight (their partial outputs are written as ``"abort"``), closes the engine (worker threads
joined, so no C++ ``terminate`` at exit), closes the trace with a note, and the process exits
with 128 + the signal number (130 for SIGINT, 143 for SIGTERM). A second signal exits at once:
it closes the trace if nobody is closing it already (a trace is loadable even without its
closing packets) and calls ``os._exit``.

A signal the parent set to ignore (``nohup``, ``cmd &`` in a non-interactive shell: SIGINT is
``SIG_IGN``) stays ignored: no handler is installed for it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["Interrupt"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """Installs the handlers (main thread only) and remembers the first signal received.

    Args:
        on_second: called before ``os._exit`` on a second signal (e.g. close the trace);
            must not block for long.
    """

    def __init__(self, on_second: Callable[[], None] | None = None) -> None:
        self.signum: int | None = None
        self._on_second = on_second
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:  # the parent asked us to ignore it: respect that
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """128 + the first signal's number (130 SIGINT, 143 SIGTERM); 0 if none came."""
        return 0 if self.signum is None else 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            print(
                f"\nstepscope run: {signal.Signals(signum).name}: stopping; aborting the requests "
                "in flight and writing their partial outputs (again to exit at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        print(f"stepscope run: {signal.Signals(signum).name} again: exiting now", file=sys.stderr)
        try:
            if self._on_second is not None:
                self._on_second()
        finally:
            os._exit(128 + (self.signum or signum))

    def restore(self) -> None:
        """Put the previous handlers back (end of the run)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
