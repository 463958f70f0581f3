"""The values dspark.io.tracking logs, shaped before they reach MLflow (no MLflow import here): numeric,
finite metrics; a metric series as (key, value, step) points; lists cut into batches of MLflow's
request limits; a dataset digest that fits MLflow's digest column."""
from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)

DIGEST_MAX = 36  # MLflow stores a dataset digest in a 36-character column
PARAM_VALUE_MAX = 6000  # MLflow's limit on a param value's length


def finite_metrics(metrics: dict) -> dict[str, float]:
    """Numeric values only (tensors/numpy scalars are converted); non-finite and non-numeric values
    are dropped with a debug message."""
    clean = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            logger.debug("skipping non-numeric metric %s=%r", key, value)
            continue
        if math.isfinite(number):
            clean[key] = number
        else:
            logger.debug("skipping non-finite metric %s=%r", key, value)
    return clean


def series_points(key: str, values: dict[int, float]) -> list[tuple[str, float, int]]:
    """{x: value} -> [(key, value, x)] in x order, None and non-finite values skipped."""
    return [(key, float(v), int(x)) for x, v in sorted(values.items()) if v is not None and math.isfinite(float(v))]


def batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def fit_digest(digest: str) -> str:
    """A digest longer than MLflow's column keeps its first 32 characters."""
    return digest if len(digest) <= DIGEST_MAX else digest[:32]
