"""CPU/GPU/memory/disk/network samples of a run, through MLflow's public system-metrics API."""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger("dspark.io.tracking")


class SystemMetrics:
    """MLflow's own system-metrics sampler for one run, through the public API: a helper thread makes the
    run its active run with `mlflow.start_run(run_id=..., log_system_metrics=True)` (MLflow samples psutil
    / pynvml into `system/...` on its own thread) and ends it with `mlflow.end_run` when stopped. Being on
    a helper thread, it never touches the caller's thread-local MLflow run and can be stopped with a
    deadline. An attached run (a worker logging into the driver's run) is ended with status RUNNING:
    the sampler stops and the driver keeps setting the final status."""

    def __init__(self, mlflow, run_id: str, owned: bool, node_id: str | None):
        self.mlflow = mlflow  # the configured module (dspark.io.tracking imports MLflow)
        self.run_id, self.owned, self.node_id = run_id, owned, node_id
        self.status = "FINISHED"
        self.started, self.stop_requested = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="dspark-mlflow-sysmetrics", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        mlflow = self.mlflow
        try:
            mlflow.set_system_metrics_node_id(self.node_id)  # process-wide: set (or clear) it for this run
            mlflow.start_run(run_id=self.run_id, log_system_metrics=True)
        except Exception as err:  # noqa: BLE001 - metrics about the machine are never worth a failed run
            logger.warning("MLflow system metrics are off: %s: %s", type(err).__name__, err)
            return
        finally:
            self.started.set()
        self.stop_requested.wait()
        with suppress_warning("stopping MLflow system metrics"):
            mlflow.end_run(status=self.status if self.owned else "RUNNING")

    def stop(self, status: str, timeout_s: float) -> None:
        self.status = status
        self.stop_requested.set()
        self.thread.join(timeout_s)


def start_system_metrics(mlflow, run_id: str, node_id: str | None, owned: bool) -> SystemMetrics:
    """Sample CPU/GPU/memory/disk/network into the run (see SystemMetrics)."""
    monitor = SystemMetrics(mlflow, run_id, owned=owned, node_id=node_id)
    monitor.started.wait(10.0)
    return monitor


def stop_system_metrics(monitor: SystemMetrics | None, timeout_s: float, status: str = "FINISHED") -> None:
    """Stop sampling without waiting on a slow server for more than timeout_s."""
    if monitor is not None:
        monitor.stop(status, timeout_s)


class suppress_warning:
    """Log (never raise) any error of the block."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if err is not None:
            logger.warning("%s failed: %s: %s", self.what, kind.__name__, err)
        return True
