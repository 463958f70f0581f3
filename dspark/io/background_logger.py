"""The bounded background queue MLflow logging calls go through, so a slow or unreachable tracking
server costs metrics, never training time (dspark.io.tracking owns the one instance)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

logger = logging.getLogger("dspark.io.tracking")

QUEUE_SIZE = 10_000  # pending logging calls; beyond this, calls are dropped (with a warning)


class BackgroundLogger:
    """A bounded FIFO of logging calls drained by one daemon thread.

    Invariant: `submit` never blocks — it enqueues, or drops the call when QUEUE_SIZE calls are
    already pending (the server is slow or down) and warns. Calls run in submission order, each
    through `_retry`, so a failure costs that call only. `flush` waits at most `timeout_s`."""

    def __init__(self, run: Callable[[str, Callable[[], Any]], Any], server: Callable[[], str],
                 maxsize: int = QUEUE_SIZE):
        self.run, self.server, self.maxsize = run, server, maxsize
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue()  # bounded by `maxsize` in submit (end_run may exceed it)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, what: str, fn: Callable[[], Any], force: bool = False) -> bool:
        """Queue fn; False (and a warning) if it was dropped. `force` ignores the bound."""
        if not force and self._queue.unfinished_tasks >= self.maxsize:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("MLflow is not keeping up (%d logging calls pending): dropped %s (%d dropped so "
                               "far); training continues", self.maxsize, what, self.dropped)
            return False
        self._ensure_thread()
        self._queue.put((what, fn))
        return True

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drain, name="dspark-mlflow-logger", daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        while True:
            what, fn = self._queue.get()
            try:
                self.run(what, fn)
            except BaseException as err:  # noqa: BLE001 - the drain thread must survive anything
                logger.warning("MLflow %s failed: %s", what, err)
            finally:
                self._queue.task_done()

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued call ran, at most timeout_s; False (with a warning) if some did not."""
        deadline = time.monotonic() + timeout_s
        # The queue's mutex with a timeout, not `with all_tasks_done`: a signal handler may run while
        # this very thread is inside queue.put holding it (a plain acquire would deadlock).
        if not self._queue.mutex.acquire(timeout=max(timeout_s, 0.0)):
            logger.warning("MLflow: logging queue busy; not waiting for its %d pending calls", self.pending())
            return False
        try:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("MLflow: %d logging calls still pending after %.1f s (tracking server %s slow "
                                   "or down); not waiting longer", self._queue.unfinished_tasks, timeout_s,
                                   self.server())
                    return False
                self._queue.all_tasks_done.wait(remaining)  # all_tasks_done's lock is the queue's mutex
        finally:
            self._queue.mutex.release()
        return True
