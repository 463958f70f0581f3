"""Process-exit hooks: run a callback when the interpreter exits, and another when SIGTERM or SIGINT
arrives, after which the signal does what it did before (the previous Python handler, or its default
action: the process dies of the signal). dspark.io.tracking ends its MLflow run through these."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from typing import Callable

logger = logging.getLogger(__name__)


def install(at_exit: Callable[[], None], on_signal: Callable[[int], None], what: str) -> None:
    """atexit: at_exit(); SIGTERM/SIGINT: on_signal(signum), then the signal's previous handling.
    Signal handlers can only be set from the main thread: elsewhere only the atexit hook is installed."""
    atexit.register(at_exit)
    if threading.current_thread() is not threading.main_thread():
        logger.debug("not in the main thread: no SIGTERM/SIGINT handler for %s", what)
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        signal.signal(signum, lambda num, frame, prev=previous: _handle(num, frame, prev, on_signal))


def _handle(signum: int, frame, previous, on_signal: Callable[[int], None]) -> None:
    on_signal(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # SIG_DFL (or None: set outside Python): die of the signal
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
