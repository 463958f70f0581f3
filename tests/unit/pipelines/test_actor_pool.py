"""Fit checks and messages of pipelines/actor_pool.py (no Ray; the pools run in tests/test_faults.py)."""
from __future__ import annotations

import pytest

from pipelines import actor_pool
from pipelines.actor_pool import WorkerAsk, WorkersUnavailable, fit_count, shortage_message

ASK = WorkerAsk("evaluation workers", 3, num_cpus=1.0, config_hint="workers.num_workers")


@pytest.mark.parametrize("per_worker, free, fits", [
    ({"CPU": 1.0}, {"CPU": 2.0}, 2),
    ({"CPU": 1.0}, {"CPU": 0.999999999999}, 1),  # float dust from fractional releases still fits
    ({"CPU": 1.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}, 1),
    ({"CPU": 0.5}, {"CPU": 1.0}, 2),
    ({"GPU": 1.0}, {"CPU": 8.0}, 0),
])
def test_fit_count(per_worker, free, fits):
    assert fit_count(per_worker, free) == fits


def test_shortage_message_names_asked_free_and_holders():
    message = shortage_message(ASK, {"CPU": 0.0}, {"CPU": 2.0},
                               ["ServeReplica:dspark:DraftServer 'replica-1' holding 1 CPU (job 01000000)"])
    assert "asked for 3 x (1 CPU) = 3 CPU" in message
    assert "the cluster has 2 CPU, of which 0 CPU free" in message
    assert "ServeReplica:dspark:DraftServer 'replica-1' holding 1 CPU" in message
    assert "workers.num_workers" in message


def test_check_fit_starts_what_fits_and_fails_when_nothing_does(monkeypatch):
    monkeypatch.setattr(actor_pool, "resource_holders", lambda: ["Hog 'hog' holding 2 CPU"])
    monkeypatch.setattr(actor_pool, "cluster_free", lambda: ({"CPU": 2.0}, {"CPU": 4.0}))
    assert actor_pool.check_fit(ASK) == 2
    monkeypatch.setattr(actor_pool, "cluster_free", lambda: ({"CPU": 0.0}, {"CPU": 4.0}))
    with pytest.raises(WorkersUnavailable, match=r"0 CPU free\. Held by: Hog 'hog' holding 2 CPU"):
        actor_pool.check_fit(ASK)
    monkeypatch.setattr(actor_pool, "cluster_free", lambda: ({"CPU": 0.0, "GPU": 0.0}, {"CPU": 4.0}))
    with pytest.raises(WorkersUnavailable, match="Even an empty cluster could not place one"):
        actor_pool.check_fit(WorkerAsk("gpu workers", 1, num_cpus=1.0, num_gpus=1.0))
