"""The bounded background queue MLflow logging calls go through, so a slow or unreachable tracking
server costs metrics, never training time (dspark.io.tracking owns the one instance).

Why not MLflow's own async logging (`log_batch(..., synchronous=False)`, mlflow 3.17), measured against
a tracking server that accepts connections but never answers (MLFLOW_HTTP_REQUEST_TIMEOUT=3 s): its
calls do return at once (0.3 ms), but (1) its queue is unbounded: 20,000 pending calls held 140 MB
(this queue stops at QUEUE_SIZE; 17 MB); (2) `mlflow.flush_async_logging()` has no timeout, while the
SIGTERM handler has 0.5 s; (3) its worker pool is joined at interpreter exit, before atexit hooks:
with 50 calls pending the process took 31 s to exit, with 100 calls 61 s (each 10 calls: 2 attempts x
the HTTP timeout, 60 s in production), and an at-exit hook (ours ends a crashed run FAILED) ran 19 s
late with 30 calls pending. This queue's thread is a daemon: exit waits only for its bounded flush.
Against a refused port both warn and go on.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from dspark.io.tracking.store import tracking_uri

logger = logging.getLogger("dspark.io.tracking")

QUEUE_SIZE = 10_000  # pending logging calls; beyond this, calls are dropped (with a warning)


class BackgroundLogger:
    """A bounded FIFO of logging calls drained by one daemon thread.

    Invariant: `submit` never blocks — it enqueues, or drops the call when `maxsize` calls (the one
    running included) are pending and warns. Calls run in submission order, each through `run` (the
    caller's retry), so a failure costs that call only. `flush` waits at most `timeout_s`."""

    def __init__(self, run: Callable[[str, Callable[[], Any]], Any], maxsize: int = QUEUE_SIZE):
        self.run, self.maxsize, self.dropped = run, maxsize, 0
        self._queue: queue.Queue = queue.Queue()  # bounded in submit, counting the call in flight
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, what: str, fn: Callable[[], Any]) -> bool:
        """Queue fn; False (and a warning) if it was dropped."""
        if self._queue.unfinished_tasks >= self.maxsize:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("MLflow is not keeping up (%d logging calls pending): dropped %s (%d dropped so "
                               "far); training continues", self.maxsize, what, self.dropped)
            return False
        with self._lock:  # started lazily: a forked child has no thread
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drain, name="dspark-mlflow-logger", daemon=True)
                self._thread.start()
        self._queue.put((what, fn))
        return True

    def _drain(self) -> None:
        while True:
            what, fn = self._queue.get()
            try:
                self.run(what, fn)
            except BaseException as err:  # noqa: BLE001 - the drain thread must survive anything
                logger.warning("MLflow %s failed: %s", what, err)
            finally:
                self._queue.task_done()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued call ran, at most timeout_s; False (with a warning) if some did not."""
        deadline = time.monotonic() + timeout_s
        # The queue's mutex with a timeout, not `with all_tasks_done`: a signal handler may run while
        # this very thread is inside queue.put holding it (a plain acquire would deadlock).
        if not self._queue.mutex.acquire(timeout=max(timeout_s, 0.0)):
            logger.warning("MLflow: logging queue busy; not waiting for its pending calls")
            return False
        try:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("MLflow: %d logging calls still pending after %.1f s (tracking server %s slow "
                                   "or down); not waiting longer", self._queue.unfinished_tasks, timeout_s,
                                   tracking_uri())
                    return False
                self._queue.all_tasks_done.wait(remaining)  # all_tasks_done's lock is the queue's mutex
        finally:
            self._queue.mutex.release()
        return True
